"""pagedattn's attention inside Hugging Face transformers, through its own extension point
(`AttentionInterface`): no transformers code is patched.

    import pagedattn.integrations.transformers as pa_hf
    name = pa_hf.register()            # "pagedattn_triton" on a GPU, "pagedattn_torch" on the CPU
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    model.generate(...)                # DynamicCache: each step's keys as ragged rows
    model.generate_batch(...)          # transformers 5.0-5.18: its paged cache, our attention

`register(backend)` registers one attention function under `pagedattn_<backend>` and, for
transformers' continuous batching, under `paged|pagedattn_<backend>` (what `generate_batch`
switches a model to, in 5.0-5.18), with FlashAttention's mask (a 2D padding mask or None: our
kernels mask causally and by window themselves). Every call is causal attention over ragged
rows (`ragged.RaggedAttention`): for `generate`, the batch's rows less their padding; for
`generate_batch`, the rows transformers' paged cache gathers for each request (the cache
write and read stay transformers'). Sliding windows (`sliding_window`, per layer: Gemma 2
alternates) and logit soft caps (`softcap`) are honoured; GQA/MQA and any head size the backend
runs (triton: 16-256 in steps of 8) work.

Refused with a `ValueError` naming the reason: attention dropout in training, non-causal
(encoder) attention, attention sinks, value heads narrower than query heads, a query with a
zero dimension, a mask other than the 2D padding mask this registration installs (bool or
integer [B, kv_len] on the query's device, the query length <= kv_len <= the key length),
packed (padding-free) inputs outside `generate_batch` (FlashAttention's `cu_seq_lens_*` /
`max_length_*`, or a batch of one whose `position_ids` restart); and, through the backend's own
checks, head sizes, windows or soft caps it cannot run.

Host reads (which synchronise with the GPU) happen once per step, not per layer: the padding
mask's rows and the packed check are kept for the step's mask and position ids, which every
layer receives (`ragged.SameTensors`).

Transformers' gates (why this is the path):
- `generate_batch` accepts, from 5.19 on, only `paged|eager`, `sdpa` or an implementation
  whose name holds "flash"; and a "flash" name must load through `lazy_import_flash_attention`
  at `from_pretrained`, which accepts only the flash-attn packages or a `kernels` Hub
  repository (`kernels` 0.18.2+ for transformers 5.24). So from 5.19 on, `generate_batch`
  cannot run a registered attention function: `generate_batch_unavailable_reason()` says so
  and `generate` still runs on our kernels.
- The decode fast path (`flash_attn_with_kvcache` over a block table) is taken only for
  FlashAttention names (FA3 in 5.10-5.18, FA2/FA3 from 5.19, on CUDA), so under our name every
  `generate_batch` step, decodes included, is one varlen call over the keys transformers'
  cache gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.integrations.ragged import BACKENDS, RaggedAttention, SameTensors

__all__ = ["MIN_TRANSFORMERS", "generate_batch_unavailable_reason", "register"]

MIN_TRANSFORMERS = "5.1"
"""The oldest transformers this runs on: 5.0 moved continuous batching to `paged|<name>`
implementations that receive the paged cache (the contract `generate_batch` runs here)."""

_PAGED = "paged|"
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""FlashAttention's padding-free keywords: several sequences in one row."""


def register(backend: str = "auto") -> str:
    """Register pagedattn's attention with transformers; returns the `attn_implementation` name.

    backend: "auto" (triton on a CUDA machine, torch on the CPU, or `PAGEDATTN_BACKEND`), "triton"
    (our kernels: CUDA, or the CPU under `TRITON_INTERPRET=1`) or "torch" (the PyTorch reference).
    Raises TypeError for a backend that is not a str, ValueError for a name outside those (or
    "auto" resolving outside them) or for transformers older than `MIN_TRANSFORMERS`, and
    `pagedattn.BackendUnavailableError` for a backend that cannot run here. Calling it again is
    harmless (the same name, registered again).
    """
    names = ["auto", *BACKENDS]
    if not isinstance(backend, str):
        raise TypeError(f"register: expected backend a str in {names}, got {type(backend).__name__} {backend!r}")
    if backend not in names:
        raise ValueError(f"register: expected backend in {names}, got {backend!r}")
    import transformers
    from packaging.version import Version
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ValueError(f"expected transformers >= {MIN_TRANSFORMERS} (pip install 'pagedattn[hf]'), "
                         f"got {transformers.__version__}")
    from pagedattn.attention.registry import get_backend

    resolved = get_backend(backend).get_name()
    if resolved not in BACKENDS:  # "auto" under PAGEDATTN_BACKEND
        raise ValueError(f"register: expected backend in {names}, got {backend!r} (resolved to {resolved!r})")
    name = f"pagedattn_{resolved}"
    attention = _attention_function(resolved)
    # FlashAttention's mask function: None, or the 2D padding mask the ragged rows are cut with
    mask = ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    for key in (name, _PAGED + name):
        AttentionInterface.register(key, attention)
        AttentionMaskInterface.register(key, mask)
    return name


def generate_batch_unavailable_reason() -> str | None:
    """None when `model.generate_batch` runs on the registered attention with the installed
    transformers, else why not (its continuous batching admits no registered function)."""
    import transformers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _PAGED + "sdpa" in ALL_ATTENTION_FUNCTIONS.valid_keys():
        return None  # 5.0-5.18: generate_batch switches a model to paged|<its implementation>
    return (f"transformers {transformers.__version__} runs generate_batch only with 'paged|eager', 'sdpa' or a "
            "FlashAttention implementation loaded from the flash-attn packages or a `kernels` Hub repository; "
            "transformers 5.0-5.18 run it on a registered attention function")


def _attention_function(backend: str):
    """transformers' attention function signature over one backend; a `RaggedAttention` per
    distinct layer shape and options (layers with the same ones share it)."""
    layers: dict[tuple, RaggedAttention] = {}

    def pagedattn_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            sliding_window: int | None = None, softcap: float | None = None,
                            is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """query: [B, Hq, Sq, D]; key, value: [B, Hkv, Sk, D]. Returns ([B, Sq, Hq, D], None)."""
        _check_shapes(query, key, value, paged=kwargs.get("cache") is not None)
        _refuse(module, query, value, dropout, is_causal, kwargs)
        num_heads, head_size, num_kv_heads = query.shape[1], query.shape[-1], key.shape[1]
        if scaling is not None and not isinstance(scaling, (int, float)):
            raise TypeError(f"pagedattn attention in transformers: expected scaling a float or None, "
                            f"got {type(scaling).__name__}")
        scale = head_size**-0.5 if scaling is None else float(scaling)
        options = (num_heads, head_size, num_kv_heads, scale, sliding_window, softcap)
        attend = layers.get(options)
        if attend is None:
            attend = layers[options] = RaggedAttention(
                backend, num_heads=num_heads, head_size=head_size, num_kv_heads=num_kv_heads, scale=scale,
                sliding_window=sliding_window, soft_cap=softcap)
        if kwargs.get("cache") is not None:
            return _paged(attend, module, query, key, value, sliding_window, kwargs), None
        return _padded(attend, query, key, value, attention_mask, kwargs.get("position_ids")), None

    return pagedattn_attention


def _check_shapes(query, key, value, *, paged: bool) -> None:
    """query: [B, Hq, Sq, D]; key, value: [B, Hkv, Sk, D] with Sk >= Sq (the queries are the last
    keys), or, in `generate_batch`, Sk == Sq (the step's new tokens; the cache holds the rest)."""
    def bad(name: str, expected: str, got: str):
        raise ValueError(f"pagedattn attention in transformers: expected {name} {expected}, got {got}")

    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pagedattn attention in transformers: expected {name} a torch.Tensor, "
                            f"got {type(t).__name__}")
        if t.dim() != 4:
            bad(f"{name}.shape", "[B, H, S, D]", str(list(t.shape)))
    b, _, q_len, head_size = query.shape
    if key.shape[0] != b or key.shape[3] != head_size:
        bad("key.shape", f"[{b}, Hkv, Sk, {head_size}] (query's batch and head size)", str(list(key.shape)))
    if value.shape[:3] != key.shape[:3]:
        bad("value.shape[:3]", f"key's {list(key.shape[:3])}", str(list(value.shape[:3])))
    if paged and key.shape[2] != q_len:
        bad("key.shape[2]", f"the query length {q_len} (generate_batch's new tokens)", str(key.shape[2]))
    if key.shape[2] < q_len:
        bad("key.shape[2]", f">= the query length {q_len} (the queries are the last keys)", str(key.shape[2]))


def _refuse(module, query, value, dropout, is_causal, kwargs) -> None:
    def no(what: str, why: str):
        raise ValueError(f"pagedattn attention in transformers: {what} is not supported ({why})")

    if dropout:
        no(f"dropout={dropout}", "inference only: attention dropout runs in training; call model.eval()")
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        no("non-causal attention", "our kernels serve decoders: causal, bottom-right aligned attention")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        no("attention sinks (s_aux)", "the kernels have no sink logit")
    if value.shape[-1] != query.shape[-1]:
        no(f"value head size {value.shape[-1]} with query head size {query.shape[-1]}",
           "keys, values and queries share one head size")
    if kwargs.get("block_table") is not None:
        no("block_table", "transformers takes its block-table decode path only for FlashAttention names")
    if 0 in query.shape:
        no(f"a query of shape {list(query.shape)}", "expected [B, Hq, Sq, D] without a zero dimension, "
           "as FlashAttention does")
    if kwargs.get("cache") is None:
        packed = [k for k in _PACKED_KWARGS if kwargs.get(k) is not None]
        if packed:
            no("packed (padding-free) input", f"{', '.join(packed)} outside generate_batch")


def _paged(attend, module, query, key, value, sliding_window, kwargs) -> torch.Tensor:
    """transformers 5.0-5.18's continuous batching: one [1, H, T, D] batch of ragged rows; the
    function updates the paged cache and attends over the keys it gathers, as transformers'
    own paged functions do. `max_seqlen_q`/`max_seqlen_k` are host ints in every one of those
    versions (the batch's lengths, computed on the host as it is scheduled), so reading them
    synchronises nothing; `cu_seq_lens_q`/`_k` are int32 device tensors, the same objects for
    every layer of a step (the torch backend reads them once per step: `ragged.SameTensors`)."""
    k, v = kwargs["cache"].update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])  # [Tk, Hkv, D]
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):  # models with sliding and full layers: one entry per layer type
        layer_type = "sliding_attention" if sliding_window else "full_attention"
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    out = attend(q, k.contiguous(), v.contiguous(), kwargs["cu_seq_lens_q"].to(torch.int32), cu_k.to(torch.int32),
                 int(kwargs["max_seqlen_q"]), int(max_k))
    return out.unsqueeze(0)  # [1, T, Hq, D]


@dataclass(frozen=True)
class _Rows:
    """The rows of a left-padded batch that are not padding, derived from its 2D mask once per
    step (reading them synchronises; the step's layers share the mask tensor)."""

    q_index: tuple[torch.Tensor, torch.Tensor]  # (batch, query position) int64 [Tq] each, row-major
    k_index: tuple[torch.Tensor, torch.Tensor]  # (batch, key position) int64 [Tk] each
    cu_q: torch.Tensor  # int32 [B+1]
    cu_k: torch.Tensor  # int32 [B+1]
    max_q: int
    max_k: int

    @classmethod
    def of(cls, attention_mask: torch.Tensor, q_len: int) -> _Rows:
        valid_k = attention_mask.bool()  # [B, kv_len]
        valid_q = valid_k[:, -q_len:]  # the queries are each sequence's last keys
        lens_q, lens_k = valid_q.sum(1, dtype=torch.int32), valid_k.sum(1, dtype=torch.int32)
        max_q, max_k = torch.stack((lens_q.max(), lens_k.max())).tolist() if len(lens_q) else (0, 0)
        return cls(valid_q.nonzero(as_tuple=True), valid_k.nonzero(as_tuple=True),
                   torch.nn.functional.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0)),
                   torch.nn.functional.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0)), max_q, max_k)


_MASK_ROWS = SameTensors()  # the step's attention_mask -> its _Rows
_PACKED = SameTensors()  # the step's position_ids -> whether they restart within the row


def _padded(attend, query, key, value, attention_mask, position_ids) -> torch.Tensor:
    """A padded batch (`generate`): rows without padding, attended as ragged rows. Padding is on
    the left (as transformers assumes for FlashAttention), so each sequence's valid keys are
    its last ones and its queries the last of those."""
    b, num_heads, q_len, head_size = query.shape
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, H, D]
    dev = query.device
    if attention_mask is None:
        k_len = k.shape[1]
        if b == 1 and q_len > 1 and _flat_positions(position_ids, q_len) and _PACKED.get(
                (position_ids,), None, lambda: _restarts(position_ids)):
            raise ValueError("pagedattn attention in transformers: packed (padding-free) input is not supported "
                             "(position_ids restart within the row: several sequences in one, which FlashAttention "
                             "attends separately; pass them as a padded batch with an attention_mask)")
        out = attend(q.reshape(b * q_len, num_heads, head_size), k.reshape(b * k_len, *k.shape[2:]),
                     v.reshape(b * k_len, *v.shape[2:]),
                     torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32, device=dev),
                     torch.arange(0, b * k_len + 1, k_len, dtype=torch.int32, device=dev), q_len, k_len)
        return out.view(b, q_len, num_heads, head_size)
    _check_mask(attention_mask, b, q_len, k.shape[1], dev)
    rows = _MASK_ROWS.get((attention_mask,), (q_len, attention_mask.shape), lambda: _Rows.of(attention_mask, q_len))
    out_rows = attend(q[rows.q_index], k[rows.k_index], v[rows.k_index], rows.cu_q, rows.cu_k, rows.max_q, rows.max_k)
    out = q.new_zeros(b, q_len, num_heads, head_size)
    out[rows.q_index] = out_rows
    return out


def _check_mask(attention_mask, b: int, q_len: int, k_len: int, device) -> None:
    def bad(expected: str, got: str):
        raise ValueError(f"pagedattn attention in transformers: expected attention_mask None or {expected} "
                         f"(FlashAttention's 2D padding mask, which register() installs), got {got}")

    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"pagedattn attention in transformers: expected attention_mask None or a torch.Tensor, "
                        f"got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != b:
        bad(f"a 2D padding mask [{b}, kv_len]", f"shape {list(attention_mask.shape)}")
    if not q_len <= attention_mask.shape[1] <= k_len:  # fewer: a static cache holds more slots than were written
        bad(f"kv_len between the query length {q_len} and the key length {k_len}", f"{attention_mask.shape[1]}")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        bad("a bool or integer mask (1: a token, 0: padding)", f"{attention_mask.dtype} (an additive float mask?)")
    if attention_mask.device != device:
        bad(f"a mask on the query's device {device}", f"one on {attention_mask.device}")


def _flat_positions(position_ids, q_len: int) -> bool:
    """Whether position_ids are one row of the queries' positions ([1, Sq] or [Sq]), the form in
    which transformers' FlashAttention path recognises packed sequences."""
    return isinstance(position_ids, torch.Tensor) and tuple(position_ids.shape) in ((1, q_len), (q_len,))


def _restarts(position_ids: torch.Tensor) -> bool:
    """Whether a row of positions holds more than one increasing run (packed sequences)."""
    ids = position_ids.reshape(-1)
    return bool((ids - ids[0] != torch.arange(len(ids), device=ids.device)).any())
