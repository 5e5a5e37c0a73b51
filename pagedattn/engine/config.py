"""The engine's one validated configuration (the keyword arguments of `pagedattn.LLM`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedattn.dtypes import KV_CACHE_DTYPE_NAMES
from pagedattn.engine.cascade import MIN_PREFIX_TOKENS, MIN_SEQS

PREEMPTION_MODES = ("auto", "recompute", "swap")
DTYPE_NAMES = ("auto", "float32", "float", "bfloat16", "float16", "half")
DEFAULT_CHUNKED_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
"""The per-step token budget with chunked prefill, by device type: a GPU runs 8k prompt tokens
in one step at full speed (vLLM V1's default too), where the CPU's steps grow with every token."""
CPU_KV_CACHE_GIB = 0.5
"""KV pool budget on the CPU, where free memory says nothing useful (`num_kv_blocks` overrides it).

The pool is allocated (and zeroed, so resident) once; this bound keeps it modest next to the
model while holding the default model's whole context (SmolLM2-135M in float32: 0.5 GiB of
weights, 45 KiB of K/V per token, so 11.6k tokens against its 8,192)."""


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine, checked once here; nothing below the engine sees this object.

    `max_model_len` caps the model's context (None: the model's own); the KV pool must hold
    one request of that many tokens.
    `tokenizer` loads the tokenizer (and its chat template) from another folder, `.gguf` file
    or Hub id than `model` (None: the model's own).
    `async_scheduling` plans and queues a decode step while the one before it runs, so the
    host's work of a step (scheduling, inputs, reading and applying the draws) overlaps the
    device's (None: on CUDA with `num_scheduler_steps=1`; the CPU computes as it queues, so
    there it only adds a wasted row when a sequence stops).
    `tensor_parallel_size` shards the model over that many processes, one a GPU (rank r on
    cuda:r, or torchrun's LOCAL_RANK), or on the CPU over gloo (`pagedattn.engine.distributed`).
    `cascade_attention` attends a shared prefix once per step where at least
    `cascade_min_seqs` sequences begin with at least `cascade_min_prefix_tokens` tokens of the
    same cached blocks (`engine/cascade.py`; None: on CUDA; on the CPU the `torch` backend
    computes as many scores either way, and the split and merge cost more than the reads save).
    `preemption_mode`, `cpu_kv_cache_gib` and the cascade's thresholds are engine-level extras
    not exposed by `LLM`: "auto" swaps groups of several sequences (n > 1, beam search) when the
    CPU pool has room and recomputes single sequences, like vLLM; "recompute"/"swap" force one mode.
    """

    model: str | None = None
    tokenizer: str | None = None
    backend: str = "auto"
    device: str = "auto"
    dtype: str | torch.dtype = "auto"
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_scheduler_steps: int = 1
    async_scheduling: bool | None = None
    enforce_eager: bool = False
    swap_space_gib: float = 4
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    cascade_attention: bool | None = None
    preemption_mode: str = "auto"
    cpu_kv_cache_gib: float = CPU_KV_CACHE_GIB
    cascade_min_prefix_tokens: int = MIN_PREFIX_TOKENS
    cascade_min_seqs: int = MIN_SEQS

    def __post_init__(self) -> None:
        _int_at_least("block_size", self.block_size, 1)
        _int_at_least("max_num_seqs", self.max_num_seqs, 1)
        _int_at_least("num_scheduler_steps", self.num_scheduler_steps, 1)
        _int_at_least("seed", self.seed, None)
        _int_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        _int_at_least("cascade_min_prefix_tokens", self.cascade_min_prefix_tokens, 1)
        _int_at_least("cascade_min_seqs", self.cascade_min_seqs, 1)
        if self.max_num_batched_tokens is not None:
            _int_at_least("max_num_batched_tokens", self.max_num_batched_tokens, self.max_num_seqs)
        if self.num_kv_blocks is not None:
            _int_at_least("num_kv_blocks", self.num_kv_blocks, 1)
        if self.max_model_len is not None:
            _int_at_least("max_model_len", self.max_model_len, 1)
        for name in ("async_scheduling", "cascade_attention"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be None or a bool, got {getattr(self, name)!r}")
        if self.async_scheduling and self.num_scheduler_steps > 1:
            raise ValueError("expected async_scheduling or num_scheduler_steps > 1, got both (each hides the "
                             "host's work of a step its own way)")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be a bool, got {getattr(self, name)!r}")
        for name in ("model", "tokenizer"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                object.__setattr__(self, name, str(getattr(self, name)))
        if not isinstance(self.backend, str):
            raise ValueError(f"expected backend to be a backend name, got {self.backend!r}")
        if not (isinstance(self.device, (str, torch.device))):
            raise ValueError(f"expected device 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device != "auto":
            _check_device(self.device)
        if self.tensor_parallel_size > 1:
            _check_parallel_device(self.device, self.tensor_parallel_size)
        if not isinstance(self.dtype, torch.dtype) and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"expected dtype in {list(DTYPE_NAMES)} or a torch.dtype, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"expected kv_cache_dtype in {list(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}")
        if not _is_number(self.swap_space_gib) or self.swap_space_gib < 0:
            raise ValueError(f"expected swap_space_gib >= 0, got {self.swap_space_gib!r}")
        if not _is_number(self.cpu_kv_cache_gib) or self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"expected cpu_kv_cache_gib > 0, got {self.cpu_kv_cache_gib!r}")
        u = self.gpu_memory_utilization
        if not _is_number(u) or not 0 < u <= 1:
            raise ValueError(f"expected 0 < gpu_memory_utilization <= 1, got {u!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"expected preemption_mode in {list(PREEMPTION_MODES)}, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.swap_space_gib == 0:
            raise ValueError("expected swap_space_gib > 0 with preemption_mode='swap', got 0")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def rank_device(self, local_rank: int) -> torch.device:
        """The device of the tensor-parallel rank with this index on its host: cuda:local_rank,
        or the CPU."""
        if self.resolved_device().type == "cuda":
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def backend_name(self, device: torch.device) -> str:
        """The attention backend to ask the registry for: "auto" is "torch" on the CPU."""
        return "torch" if self.backend == "auto" and device.type == "cpu" else self.backend

    def resolved_async_scheduling(self, device: torch.device) -> bool:
        if self.async_scheduling is None:
            return device.type == "cuda" and self.num_scheduler_steps == 1
        return self.async_scheduling

    def resolved_cascade_attention(self, device: torch.device) -> bool:
        if self.cascade_attention is None:
            return device.type == "cuda"
        return self.cascade_attention

    def batched_tokens(self, max_model_len: int, device: torch.device) -> int:
        """The per-step token budget: the configured one, else a default (by device type) that
        fits any prompt when prompts cannot be chunked."""
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    "expected max_num_batched_tokens >= the model's context length "
                    f"({max_model_len}) without chunked prefill, got {self.max_num_batched_tokens}"
                )
            return self.max_num_batched_tokens
        default = DEFAULT_CHUNKED_BATCHED_TOKENS["cuda" if device.type == "cuda" else "cpu"]
        if self.enable_chunked_prefill:
            return max(default, self.max_num_seqs)
        return max(default, max_model_len, self.max_num_seqs)


def _check_device(device: str | torch.device) -> None:
    """Refuse a device that this machine does not have, before any model is loaded."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"expected device 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ValueError(f"expected device 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"expected device 'cpu' or 'auto' (no CUDA device is available here), got {device!r}")
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"expected a CUDA device index < {count}, got {device!r}")


def _check_parallel_device(device: str | torch.device, size: int) -> None:
    """Refuse a device that tensor parallelism cannot use: a GPU index (rank r takes cuda:r) or
    fewer GPUs than ranks (unless torchrun started the ranks, maybe on several hosts)."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if dev.type == "cuda" and dev.index is not None:
        raise ValueError(f"expected device 'auto', 'cuda' or 'cpu' with tensor_parallel_size={size} (rank r runs on "
                         f"cuda:r), got {device!r}")
    if dev.type == "cuda" and "WORLD_SIZE" not in os.environ and torch.cuda.device_count() < size:
        raise ValueError(f"expected at least tensor_parallel_size={size} CUDA devices, got "
                         f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES names the usable ones)")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int_at_least(name: str, value, low: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        bound = "an int" if low is None else f"an int >= {low}"
        raise ValueError(f"expected {name} to be {bound}, got {value!r}")
