"""FlashInfer planning for the `flashinfer` backend: layer specs, paged-KV arrays, the per-device
workspace, wrapper pools, and `plan()` calls.

FlashInfer splits attention into `plan()` (host work: a split-KV schedule written into the
wrapper's int workspace) and `run()` (kernels). A plan fixes the layer's hyperparameters
(`sm_scale`, `window_left`, `logits_soft_cap`, head counts, dtypes), so one step needs one
planned wrapper per distinct `LayerSpec` and per part of the batch (`Role`).

Lifetimes:
- `Workspace` (one per device): THE float workspace shared by every wrapper and layer (split-KV
  partial outputs; runs are stream-ordered, so one buffer serves them all), sized by
  `split_kv_workspace_bytes` (formula below), plus pools of free wrappers per (role, spec).
  Each wrapper keeps FlashInfer's own int workspace (8 MiB device + 8 MiB pinned host): a plan
  lives there between `plan()` and `run()`, so two live plans cannot share it.
- `Plans` (one per metadata part): the wrappers planned for it. They return to the pool when
  the metadata dies, so metadata objects that are alive together never share a plan.
- CUDA-graph wrappers belong to `FlashInferState` (fixed buffers) and are never pooled.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedattn.attention.types import AttentionType
from pagedattn.intmath import cdiv

_POWER_OF_TWO_HEAD_DIMS = (64, 128, 256)


class Role(enum.Enum):
    PREFILL = "prefill"  # paged prefill wrapper, causal (bottom-right aligned), prefill view
    DECODE = "decode"  # paged decode wrapper, decode view
    CROSS_PREFILL = "cross_prefill"  # paged prefill wrapper over cross tables, not causal
    CROSS_DECODE = "cross_decode"  # paged decode wrapper over cross tables
    RAGGED = "ragged"  # ragged prefill wrapper over the step's own K/V, not causal (encoders)
    RAGGED_CAUSAL = "ragged_causal"  # ragged, causal: decoder profiling run with an empty cache


@dataclass(frozen=True)
class LayerSpec:
    """Everything FlashInfer fixes at plan time for one layer."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    window_left: int  # -1: no window; sliding_window W -> W - 1 (keys in [p - W + 1, p])
    logits_soft_cap: float  # 0.0: off
    attn_type: AttentionType
    q_dtype: torch.dtype
    kv_dtype: torch.dtype  # the cache's dtype (fp8 for fp8 caches); q_dtype when no cache

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def use_tensor_cores(self) -> bool:
        """Decode on tensor cores (FlashInfer's prefill kernels) for groups of >= 4 query heads
        per KV head, where they beat the CUDA-core decode kernel (SGLang's measured rule), and
        for head sizes other than 64/128/256, which the CUDA-core kernel is not built for."""
        return self.group_size >= 4 or self.head_dim not in _POWER_OF_TWO_HEAD_DIMS


# ----------------------------------------------------------------------------- paged KV arrays


@dataclass
class PagedKV:
    """FlashInfer's CSR description of some sequences' pages.

    Device tensors (what the kernels read; updated in place by `advance_step`):
        indptr: int32 [B+1]; indices: int32 [B*W+1] (valid prefix indptr[-1], the last slot is
        a scatter sink); last_page_len: int32 [B], in 1..block_size.
    Host tensors (pinned, what `plan()` reads, so planning never synchronises):
        indptr_host: int32 [B+1]; last_page_len_host: int32 [B]; qo_indptr_host: int32 [B+1].
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    indptr_host: torch.Tensor
    last_page_len_host: torch.Tensor
    qo_indptr_host: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.last_page_len.shape[0]


def pages_on_device(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """(indptr, indices, last_page_len) of sequences with these tables and lengths, computed on
    the device with no host synchronisation (shared by `build` and `advance_step`, so both agree).

    Args:
        block_tables: int32 [B, W]; row b must hold ceil(seq_lens[b] / block_size) blocks.
        seq_lens: int32 [B], >= 1.
        out: existing (indptr [B+1], indices [B*W+1], last_page_len [B]) to update in place.
    """
    b, w = block_tables.shape
    dev = block_tables.device
    pages = (seq_lens + (block_size - 1)) // block_size  # [B]
    if out is None:
        out = (torch.zeros(b + 1, dtype=torch.int32, device=dev),
               torch.zeros(b * w + 1, dtype=torch.int32, device=dev),
               torch.empty(b, dtype=torch.int32, device=dev))
    indptr, indices, last = out
    torch.cumsum(pages, 0, dtype=torch.int32, out=indptr[1:])
    last.copy_(seq_lens - (pages - 1).clamp_(min=0) * block_size)  # 0 for an empty sequence
    if w:
        col = torch.arange(w, device=dev, dtype=torch.int32)
        dst = indptr[:-1, None] + col  # [B, W] position of page `col` of row b
        dst = torch.where(col < pages[:, None], dst, b * w)  # pages past seq_len go to the sink
        indices.scatter_(0, dst.flatten().long(), block_tables.flatten())
    return indptr, indices, last


def pages_on_host(seq_lens: list[int], block_size: int) -> tuple[list[int], list[int]]:
    """(indptr [B+1], last_page_len [B]) as host lists: what `pages_on_device` computes."""
    indptr, last = [0], []
    for n in seq_lens:
        pages = cdiv(n, block_size)
        indptr.append(indptr[-1] + pages)
        last.append(n - max(pages - 1, 0) * block_size)
    return indptr, last


def host_int32(values: list[int]) -> torch.Tensor:
    """A pinned int32 host tensor (plan inputs: FlashInfer copies them to the device async)."""
    t = torch.tensor(values, dtype=torch.int32)
    return t.pin_memory() if torch.cuda.is_available() else t


# ----------------------------------------------------------------------------- workspace


def split_kv_workspace_bytes(spec: LayerSpec, num_sm: int, max_threads_per_sm: int,
                             graph_batch_size: int = 0, smem_per_block_optin: int = 0) -> int:
    """Bytes of float workspace FlashInfer 0.7 can ask for when planning `spec` (an upper bound).

    Only split-KV plans use the float workspace: partial outputs `tmp_v` (float32 [rows, Hq, D])
    and their log-sum-exps `tmp_s` (float32 [rows, Hq]), each 16-byte aligned
    (include/flashinfer/attention/scheduler.cuh):
    - CUDA-core decode (`DecodePlan`): rows = padded_batch_size <= max_grid_size // Hkv, with
      max_grid_size = blocks_per_sm * num_sm and blocks_per_sm <= max_threads_per_sm // 128
      (its blocks have >= 128 threads). CUDA-graph plans pad to exactly that.
    - FA2 prefill, ragged, and tensor-core decode (`PrefillPlan`): split only when the work items
      fit max_batch_size_if_split = 2 * num_sm // Hkv, so padded_batch_size <= that, and rows =
      ceil(padded_batch_size * cta_tile_q / G) with cta_tile_q <= 128. A CUDA-graph tensor-core
      decode of B sequences pads to max(2 * num_sm // Hkv, ceil(B*G / cta) + B - 1) with cta
      FlashInfer's `FA2DetermineCtaTileQ(G, D)` (mirrored in `_graph_decode_cta_tile_q`).
    - FA3 (Hopper prefill) plans allocate no float workspace.
    Outside graphs the bound does not depend on the number of tokens or sequences: the split
    count is capped by the grid. H100 (132 SMs), Hq=32, Hkv=8, D=128: 16.6 MiB.
    """
    hq, hkv, d, g = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.group_size

    def tmp(rows: int) -> int:
        return _align16(hq * rows * d * 4) + _align16(hq * rows * 4)

    decode_rows = (max_threads_per_sm // 128) * num_sm // hkv
    prefill_rows = math.ceil((2 * num_sm // hkv) * 128 / g)
    need = max(tmp(decode_rows), tmp(prefill_rows))
    if graph_batch_size and spec.use_tensor_cores:
        b, cta = graph_batch_size, _graph_decode_cta_tile_q(g, d, smem_per_block_optin)
        padded = max(2 * num_sm // hkv, math.ceil(b * g / cta) + b - 1)
        need = max(need, tmp(math.ceil(padded * cta / g)))
    return need


def _graph_decode_cta_tile_q(packed_len: int, head_dim: int, smem_per_block_optin: int) -> int:
    """FlashInfer's `FA2DetermineCtaTileQ` (include/flashinfer/utils.cuh) for sm80+, with its
    conservative 2-byte KV shared-memory probe (an unknown limit, 0, picks the larger tile)."""
    if packed_len > 64 and head_dim < 256:
        return 128
    if packed_len > 16:
        return 64
    if 16 * head_dim * 2 + 2 * head_dim * 16 * 4 * 2 > smem_per_block_optin:
        return 64
    return 16


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


class Workspace:
    """One device's float workspace and its pools of free wrappers (those of the
    `POOLED_SPECS` most recently released (role, spec) keys; older ones are dropped, so a
    process that meets many specs, a test session, does not hoard 16 MiB per wrapper)."""

    POOLED_SPECS = 16

    def __init__(self, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        self.device = device
        self.num_sm = props.multi_processor_count
        self.max_threads_per_sm = props.max_threads_per_multi_processor
        self.smem_per_block_optin = getattr(props, "shared_memory_per_block_optin", 0)
        self.buffer = torch.zeros(16, dtype=torch.uint8, device=device)  # FlashInfer: zero on first use
        self._free: OrderedDict[tuple[Role, LayerSpec], list] = OrderedDict()

    def ensure(self, spec: LayerSpec, graph_batch_size: int = 0) -> None:
        """Grow the buffer to what `spec` may need. Wrappers planned before keep the old buffer
        (their reference keeps it alive); pooled ones are dropped so new ones take the new buffer."""
        need = split_kv_workspace_bytes(spec, self.num_sm, self.max_threads_per_sm, graph_batch_size,
                                        self.smem_per_block_optin)
        if need > self.buffer.numel():
            self.buffer = torch.zeros(need, dtype=torch.uint8, device=self.device)
            self._free.clear()

    def acquire(self, role: Role, spec: LayerSpec):
        self.ensure(spec)
        free = self._free.get((role, spec))
        if free:
            return free.pop()
        return make_wrapper(role, spec, self.buffer)

    def release(self, role: Role, spec: LayerSpec, wrapper) -> None:
        if wrapper._float_workspace_buffer is not self.buffer:
            return  # planned before the buffer grew: let it go
        key = (role, spec)
        self._free.setdefault(key, []).append(wrapper)
        self._free.move_to_end(key)
        while len(self._free) > self.POOLED_SPECS:
            self._free.popitem(last=False)


_WORKSPACES: dict[torch.device, Workspace] = {}


def workspace(device: torch.device) -> Workspace:
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _WORKSPACES:
        _WORKSPACES[device] = Workspace(device)
    return _WORKSPACES[device]


def make_wrapper(role: Role, spec: LayerSpec, buffer: torch.Tensor, graph_buffers: dict | None = None):
    """A FlashInfer wrapper for `role` over the float workspace `buffer` ("NHD" pages: the
    (num_blocks, 2, block_size, Hkv, D) cache). `graph_buffers`: fixed decode buffers for CUDA graphs."""
    import flashinfer

    if role in (Role.DECODE, Role.CROSS_DECODE):
        if graph_buffers is None:
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                buffer, "NHD", use_tensor_cores=spec.use_tensor_cores)
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            buffer, "NHD", use_cuda_graph=True, use_tensor_cores=spec.use_tensor_cores,
            paged_kv_indptr_buffer=graph_buffers["indptr"],
            paged_kv_indices_buffer=graph_buffers["indices"],
            paged_kv_last_page_len_buffer=graph_buffers["last_page_len"])
    if role in (Role.PREFILL, Role.CROSS_PREFILL):
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(buffer, "NHD")
    return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(buffer, "NHD")


# ----------------------------------------------------------------------------- plans


class Plans:
    """The wrappers planned for one metadata part, keyed by (role, spec).

    `acquire(role, spec)` gives a wrapper: from the device pool, or from `graph_source` (a
    callable (role, spec) -> graph wrapper) for metadata captured in a CUDA graph. Pooled
    wrappers go back to the pool when this object dies (with its metadata).
    """

    def __init__(self, device: torch.device, graph_source: Callable | None = None):
        self.device = torch.device(device)
        self.wrappers: dict[tuple[Role, LayerSpec], object] = {}
        self._events: dict[tuple[Role, LayerSpec], torch.cuda.Event] = {}
        self._graph_source = graph_source
        self._workspace = None if graph_source else workspace(device)
        if self._workspace is not None:
            weakref.finalize(self, _release, self._workspace, self.wrappers)

    def get(self, role: Role, spec: LayerSpec):
        return self.wrappers.get((role, spec))

    def plan(self, role: Role, spec: LayerSpec, inputs: PagedKV | tuple[torch.Tensor, torch.Tensor],
             block_size: int):
        """Plan (or re-plan) the wrapper of (role, spec) for `inputs`; returns it."""
        key = (role, spec)
        wrapper = self.wrappers.get(key)
        if wrapper is None:
            wrapper = (self._graph_source(role, spec) if self._graph_source
                       else self._workspace.acquire(role, spec))
            self.wrappers[key] = wrapper
        with torch.cuda.device(self.device):
            plan_wrapper(wrapper, role, spec, inputs, block_size, self._events.get(key))
            self._events[key] = event = torch.cuda.Event()
            event.record()
        return wrapper

    def replan_all(self, inputs_for: Callable[[Role], PagedKV | None], block_size: int) -> None:
        for role, spec in list(self.wrappers):
            inputs = inputs_for(role)
            if inputs is not None:
                self.plan(role, spec, inputs, block_size)


def _release(ws: Workspace, wrappers: dict) -> None:
    for (role, spec), wrapper in wrappers.items():
        ws.release(role, spec, wrapper)


def plan_wrapper(wrapper, role: Role, spec: LayerSpec, inputs, block_size: int,
                 previous: torch.cuda.Event | None = None) -> None:
    """`wrapper.plan(...)` for `role` from host plan inputs (no device synchronisation).

    `previous`: the event recorded after this wrapper's last plan. FlashInfer's plan writes its
    pinned host buffer, then copies it to the device asynchronously; waiting for the previous
    copy first (normally long done) keeps a CPU that runs ahead from overwriting it in flight.
    """
    if previous is not None:
        previous.synchronize()
    ragged = role in (Role.RAGGED, Role.RAGGED_CAUSAL)  # K/V are the step's inputs, not the cache
    common = dict(sm_scale=spec.sm_scale, window_left=spec.window_left,
                  logits_soft_cap=spec.logits_soft_cap or None,
                  q_data_type=spec.q_dtype, kv_data_type=spec.q_dtype if ragged else spec.kv_dtype)
    hq, hkv, d = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    if role in (Role.DECODE, Role.CROSS_DECODE):
        wrapper.plan(inputs.indptr_host, inputs.indices, inputs.last_page_len_host, hq, hkv, d,
                     block_size, **common)
    elif role in (Role.PREFILL, Role.CROSS_PREFILL):
        wrapper.plan(inputs.qo_indptr_host, inputs.indptr_host, inputs.indices,
                     inputs.last_page_len_host, hq, hkv, d, block_size,
                     causal=role is Role.PREFILL, **common)
    else:
        qo_indptr, kv_indptr = inputs
        wrapper.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=role is Role.RAGGED_CAUSAL, **common)
