"""The model-facing layer: `Attention` (an nn.Module), `forward_context`, and the custom op.

A model calls `Attention.forward(q, k, v)`; the step's metadata and the layer's KV cache come
from the innermost `forward_context(md, kv_caches)`. The call goes through the registered
custom op `torch.ops.pagedattn.attention`, opaque to `torch.compile` (so a model compiles with
`fullgraph=True`) and capturable in CUDA graphs. The op reads the context at run time, which
is why metadata and caches are not op arguments.

Cascade (shared-prefix) attention. A step whose sequences all begin with the same cached
blocks can attend those blocks once for all its queries: the context's `shared_prefix`
metadata (`MetadataBuilder.build_shared_prefix`) names them, the layer's own metadata then
covers each sequence's suffix only, and `run` merges the two parts by their LSEs
(`merge_attn_states`). The shared part runs on `prefix_impl`, the layer's options as
cross-attention (not causal) without sinks: a sink joins one part's denominator only, the
suffix's, which runs on the layer's own impl and writes the step's K/V. Layers that cannot
split so (`cascade_refusal`: not DECODER, ALiBi, a window, a backend without cross-attention)
have no `prefix_impl`.

FP8 KV-cache scales. Each layer owns `k_scale` and `v_scale`, 0-dim float32 tensors on the
device it was built on; an FP8 cache stores `x / scale` and reads `stored * scale`. A scale
given to the constructor or by `set_kv_scales` (the loader passes a checkpoint's) is fixed.
A scale left unset is calibrated once: on the layer's first forward that holds a prefill and
writes a non-empty FP8 cache, before that step's K/V are stored, it becomes
`max(|x| of the step's keys or values) * KV_SCALE_HEADROOM / (largest finite FP8 value)`,
computed and written in place on the device (no host synchronisation), then never changes.
The headroom leaves later tokens twice the first prefill's range before they saturate.
Caches in the model dtype ignore the scales.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagedattn.attention.backend import AttentionImpl
from pagedattn.attention.merge import merge_attn_states
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.registry import get_backend
from pagedattn.attention.types import AttentionType
from pagedattn.dtypes import FP8_DTYPES

__all__ = [
    "ATTENTION_OP",
    "KV_SCALE_HEADROOM",
    "Attention",
    "ForwardContext",
    "attention_impls",
    "forward_context",
    "get_forward_context",
]

KV_SCALE_HEADROOM = 2.0
"""A calibrated FP8 scale maps the first prefill's largest |K| (|V|) to 1 / KV_SCALE_HEADROOM
of the FP8 range."""


@dataclass(frozen=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: Sequence[torch.Tensor]
    layer_metadata: Sequence[AttentionMetadata] | None = None
    shared_prefix: Sequence[AttentionMetadata | None] | None = None

    def metadata_of(self, layer_idx: int) -> AttentionMetadata:
        """The metadata layer `layer_idx` reads: its own where the context has per-layer ones."""
        return self.attn_metadata if self.layer_metadata is None else self.layer_metadata[layer_idx]

    def shared_prefix_of(self, layer_idx: int) -> AttentionMetadata | None:
        """The shared prefix layer `layer_idx` attends apart (a cascade), or None."""
        return None if self.shared_prefix is None else self.shared_prefix[layer_idx]


_contexts: list[ForwardContext] = []


@contextlib.contextmanager
def forward_context(attn_metadata: AttentionMetadata, kv_caches: Sequence[torch.Tensor], *,
                    layer_metadata: Sequence[AttentionMetadata] | None = None,
                    shared_prefix: Sequence[AttentionMetadata | None] | None = None) -> Iterator[ForwardContext]:
    """Make `attn_metadata` and the per-layer `kv_caches` visible to every `Attention` layer inside.

    `layer_metadata`: one metadata per layer index instead, for models whose layers read
    different block tables (an engine's KV cache groups: windowed layers over tables whose
    out-of-window blocks were freed, full layers over whole ones); the same step, so counts and
    lengths agree with `attn_metadata` but for a window's dropped blocks.
    `shared_prefix`: per layer index, a shared prefix's metadata (`build_shared_prefix`) that the
    layer attends once for all the step's queries, its own metadata then covering each
    sequence's suffix (a cascade, module docstring), or None for a layer that attends whole."""
    for name, per_layer in (("layer_metadata", layer_metadata), ("shared_prefix", shared_prefix)):
        if per_layer is not None and len(per_layer) != len(kv_caches):
            raise ValueError(f"expected one {name} per kv_cache ({len(kv_caches)}), got {len(per_layer)}")
    ctx = ForwardContext(attn_metadata, kv_caches, layer_metadata, shared_prefix)
    _contexts.append(ctx)
    try:
        yield ctx
    finally:
        _contexts.pop()


def get_forward_context() -> ForwardContext:
    if not _contexts:
        raise RuntimeError("pagedattn.Attention was called outside `with pagedattn.forward_context(md, kv_caches):`")
    return _contexts[-1]


_layers: weakref.WeakValueDictionary[int, Attention] = weakref.WeakValueDictionary()
_ids = itertools.count()


def _attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, layer_id: int) -> torch.Tensor:
    layer = _layers.get(layer_id)
    if layer is None:
        raise RuntimeError(f"no live pagedattn.Attention layer with id {layer_id}")
    return layer.run(query, key, value, get_forward_context())


def _attention_fake(query, key, value, layer_id):
    width = query.shape[1] * query.shape[2] if query.dim() == 3 else query.shape[1]
    return query.new_empty(query.shape[0], width)


# Registered straight with the dispatcher (as vLLM's direct_register_custom_op does), not with
# torch.library.custom_op: that one wraps the kernel in torch._disable_dynamo, whose first call
# imports torch._dynamo (with sympy: 1-4 s of a CPU start-up) even when nothing is compiled.
_LIBRARY = torch.library.Library("pagedattn", "DEF")
_LIBRARY.define("attention(Tensor query, Tensor? key, Tensor? value, int layer_id) -> Tensor")
_LIBRARY.impl("attention", _attention, "CompositeExplicitAutograd")
torch.library.register_fake("pagedattn::attention", _attention_fake, lib=_LIBRARY)


ATTENTION_OP = torch.ops.pagedattn.attention
"""`attention(Tensor query, Tensor? key, Tensor? value, int layer_id) -> Tensor`."""


class Attention(nn.Module):
    """Paged attention for model code: `forward(query [T, Hq*D], key [T, Hkv*D], value [T, Hkv*D]) -> [T, Hq*D]`.

    `layer_idx` selects `kv_caches[layer_idx]` of the forward context; `backend` is a registry
    name ("auto" when None). The other options are those of the backend's impl (API.md section 3);
    `k_scale`/`v_scale` fix the layer's FP8 cache scales (float or one-element tensor; None:
    calibrated on the first prefill, see the module docstring); `dtype`, the model dtype, lets
    backends that plan ahead (FlashInfer) plan this layer from its first step
    (`AttentionImpl.set_query_dtype`).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        backend: str | None = None,
        layer_idx: int = 0,
        alibi_slopes: list[float] | torch.Tensor | None = None,
        sliding_window: int | tuple[int, int] | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        sinks: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.backend = get_backend(backend or "auto")
        self.impl = self.backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype, logits_soft_cap=logits_soft_cap, attn_type=attn_type, sinks=sinks,
        )
        self.prefix_impl, self.cascade_refusal = _prefix_impl(
            self.backend, self.impl, num_heads, head_size, scale, num_kv_heads, kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=logits_soft_cap)
        if dtype is not None:
            self.impl.set_query_dtype(dtype)
            if self.prefix_impl is not None:
                self.prefix_impl.set_query_dtype(dtype)
        self.layer_idx = layer_idx
        # Plain attributes, not buffers: a model's `.to(dtype)` must leave them float32.
        self.k_scale = torch.ones((), dtype=torch.float32)  # 0-dim float32
        self.v_scale = torch.ones((), dtype=torch.float32)
        self.calibrating = {"k": True, "v": True}  # which scales the first FP8 prefill sets
        self.scale_group = None
        """A tensor-parallel group (`TPGroup`) whose ranks hold this layer's other heads, or
        None: a calibrated scale is then the largest over its ranks, so that every rank
        quantizes as one rank holding all the heads would (set by the model that splits it)."""
        self.set_kv_scales(k_scale, v_scale)
        self._id = next(_ids)
        _layers[self._id] = self

    @torch.no_grad()
    def set_kv_scales(
        self, k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None
    ) -> None:
        """Fix the FP8 scales given (positive, one element each; a checkpoint's, for instance),
        in place; a scale set here is never calibrated. None leaves that scale as it is."""
        for name, value, scale in (("k", k_scale, self.k_scale), ("v", v_scale, self.v_scale)):
            if value is None:
                continue
            value = torch.as_tensor(value, dtype=torch.float32)
            if value.numel() != 1 or not (torch.isfinite(value).all() and (value > 0).all()):
                raise ValueError(f"expected {name}_scale to be one finite number > 0, got {value.tolist()}")
            scale.copy_(value.reshape(()))
            self.calibrating[name] = False

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor:
        return ATTENTION_OP(query, key, value, self._id)

    def run(self, query, key, value, ctx: ForwardContext) -> torch.Tensor:
        """The op's body: this layer's impl on the context's metadata and cache."""
        if not 0 <= self.layer_idx < len(ctx.kv_caches):
            raise IndexError(f"expected layer_idx < {len(ctx.kv_caches)} caches in the forward context, got {self.layer_idx}")
        kv_cache = ctx.kv_caches[self.layer_idx]
        md = ctx.metadata_of(self.layer_idx)
        if (
            key is not None
            and (self.calibrating["k"] or self.calibrating["v"])
            and kv_cache.dtype in FP8_DTYPES
            and kv_cache.numel()
            and md.num_prefills
        ):
            self._calibrate(key, value, kv_cache.dtype)
        prefix = ctx.shared_prefix_of(self.layer_idx)
        if prefix is not None:
            return self._cascade(query, key, value, kv_cache, md, prefix)
        return self.impl.forward(query, key, value, kv_cache, md, self.k_scale, self.v_scale)

    def _cascade(self, query, key, value, kv_cache: torch.Tensor, md: AttentionMetadata,
                 prefix: AttentionMetadata) -> torch.Tensor:
        """The suffix (`md`, the layer's impl: writes the step's K/V) and the shared prefix
        (`prefix`, `prefix_impl`), each with its LSE, merged into the suffix's output."""
        if self.prefix_impl is None:
            raise ValueError(f"layer {self.layer_idx} cannot attend a shared prefix apart: {self.cascade_refusal}")
        _check_shared_prefix(self.layer_idx, md, prefix)
        # The prefix first: it writes nothing, and its checks (its blocks against the pool among them)
        # then refuse a bad prefix before the suffix writes the step's K/V.
        prefix_out, prefix_lse = self.prefix_impl.forward(query, None, None, kv_cache, prefix, self.k_scale,
                                                          self.v_scale, return_lse=True)
        out, lse = self.impl.forward(query, key, value, kv_cache, md, self.k_scale, self.v_scale, return_lse=True)
        merge_attn_states(prefix_out, prefix_lse, out, lse, out=out, out_lse=lse)
        return out

    @torch.no_grad()
    def _calibrate(self, key: torch.Tensor, value: torch.Tensor, cache_dtype: torch.dtype) -> None:
        """Set the uncalibrated scales from this step's key/value ([T, Hkv*D] or [T, Hkv, D]),
        on the device: amax * headroom / FP8 max, never below the smallest normal float32."""
        fp8_max = torch.finfo(cache_dtype).max
        for name, x, scale in (("k", key, self.k_scale), ("v", value, self.v_scale)):
            if self.calibrating[name]:
                amax = x.abs().amax().float()
                if self.scale_group is not None:
                    amax = self.scale_group.all_reduce_max(amax)
                scale.copy_((amax * (KV_SCALE_HEADROOM / fp8_max)).clamp_min(torch.finfo(torch.float32).tiny))
                self.calibrating[name] = False

    def extra_repr(self) -> str:
        i = self.impl
        return f"backend={self.backend.get_name()}, heads={i.num_heads}/{i.num_kv_heads}, head_size={i.head_size}, layer_idx={self.layer_idx}"


@contextlib.contextmanager
def kv_scale_calibration_paused(model: nn.Module) -> Iterator[None]:
    """Forwards inside leave every `Attention` layer's FP8 scales as they are, calibrated or not:
    dummy steps (an engine's warm-up) must not fix a scale from their data; the first real
    prefill after the block still calibrates."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    saved = [dict(m.calibrating) for m in layers]
    for m in layers:
        m.calibrating = {"k": False, "v": False}
    try:
        yield
    finally:
        for m, flags in zip(layers, saved):
            m.calibrating = flags


def _check_shared_prefix(layer_idx: int, md: AttentionMetadata, prefix) -> None:
    """`prefix` a shared prefix's metadata for the step of `md`: its queries the step's, its
    blocks of the step's size (host facts; the prefix impl checks the rest, its blocks against
    the pool among them)."""
    if not isinstance(prefix, AttentionMetadata):
        raise TypeError(f"layer {layer_idx}: expected a shared prefix's AttentionMetadata (`build_shared_prefix`) "
                        f"or None, got {type(prefix).__name__}")
    if not prefix.is_shared_prefix:
        raise ValueError(f"layer {layer_idx}: expected a shared prefix's metadata (`build_shared_prefix`), got a "
                         "step's (`build`)")
    if (prefix.num_tokens, prefix.block_size) != (md.num_tokens, md.block_size):
        raise ValueError(f"layer {layer_idx}: expected a shared prefix of the step's {md.num_tokens} query tokens "
                         f"and block_size {md.block_size}, got {prefix.num_tokens} and {prefix.block_size} "
                         "(build_shared_prefix(num_query_tokens=...) on the step's builder)")


def _prefix_impl(backend, impl: AttentionImpl, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None, **options) -> tuple[AttentionImpl | None, str | None]:
    """(the impl of a layer's shared-prefix part, None) when the layer can attend a shared prefix
    apart, else (None, why not): the layer's options as cross-attention, without its sinks."""
    if impl.attn_type is not AttentionType.DECODER:
        return None, f"{impl.attn_type.name} attention (a cascade splits causal self-attention)"
    if impl.alibi_slopes is not None:
        return None, "ALiBi (its bias follows each key's distance from the query; cross-attention has none)"
    if impl.window is not None:
        return None, "a sliding window (no window is defined for cross-attention; its early blocks are freed anyway)"
    try:
        prefix = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads,
                                        attn_type=AttentionType.ENCODER_DECODER, **options)
    except (NotImplementedError, ValueError) as e:
        return None, f"the shared part's cross-attention is refused: {e}"
    return prefix, None


def attention_impls(model: nn.Module) -> list[AttentionImpl]:
    """The impl of every `Attention` layer of `model`, in module order (layer order for the
    models here): what a metadata builder or CUDA-graph state that plans per layer is given."""
    return [m.impl for m in model.modules() if isinstance(m, Attention)]
