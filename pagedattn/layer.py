"""The model-facing layer: `Attention` (an nn.Module), `forward_context`, and the custom op.

A model calls `Attention.forward(q, k, v)`; the step's metadata and the layer's KV cache come
from the innermost `forward_context(md, kv_caches)`. The call goes through the registered
custom op `torch.ops.pagedattn.attention`, opaque to `torch.compile` (so a model compiles with
`fullgraph=True`) and capturable in CUDA graphs. The op reads the context at run time, which
is why metadata and caches are not op arguments.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.registry import get_backend
from pagedattn.attention.types import AttentionType

__all__ = ["ATTENTION_OP", "Attention", "ForwardContext", "forward_context", "get_forward_context"]


@dataclass(frozen=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: Sequence[torch.Tensor]


_contexts: list[ForwardContext] = []


@contextlib.contextmanager
def forward_context(attn_metadata: AttentionMetadata, kv_caches: Sequence[torch.Tensor]) -> Iterator[ForwardContext]:
    """Make `attn_metadata` and the per-layer `kv_caches` visible to every `Attention` layer inside."""
    ctx = ForwardContext(attn_metadata, kv_caches)
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


@torch.library.custom_op("pagedattn::attention", mutates_args=())
def _attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, layer_id: int) -> torch.Tensor:
    layer = _layers.get(layer_id)
    if layer is None:
        raise RuntimeError(f"no live pagedattn.Attention layer with id {layer_id}")
    return layer.run(query, key, value, get_forward_context())


@_attention.register_fake
def _(query, key, value, layer_id):
    width = query.shape[1] * query.shape[2] if query.dim() == 3 else query.shape[1]
    return query.new_empty(query.shape[0], width)


ATTENTION_OP = torch.ops.pagedattn.attention
"""`attention(Tensor query, Tensor? key, Tensor? value, int layer_id) -> Tensor`."""


class Attention(nn.Module):
    """Paged attention for model code: `forward(query [T, Hq*D], key [T, Hkv*D], value [T, Hkv*D]) -> [T, Hq*D]`.

    `layer_idx` selects `kv_caches[layer_idx]` of the forward context; `backend` is a registry
    name ("auto" when None). The other options are those of the backend's impl (API.md section 3);
    `k_scale`/`v_scale` are the layer's FP8 cache scales; `dtype`, the model dtype, lets backends
    that plan ahead (FlashInfer) plan this layer from its first step (`AttentionImpl.set_query_dtype`).
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
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        k_scale: float | torch.Tensor = 1.0,
        v_scale: float | torch.Tensor = 1.0,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.backend = get_backend(backend or "auto")
        self.impl = self.backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype, logits_soft_cap=logits_soft_cap, attn_type=attn_type,
        )
        if dtype is not None:
            self.impl.set_query_dtype(dtype)
        self.layer_idx = layer_idx
        self.k_scale, self.v_scale = k_scale, v_scale
        self._id = next(_ids)
        _layers[self._id] = self

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor:
        return ATTENTION_OP(query, key, value, self._id)

    def run(self, query, key, value, ctx: ForwardContext) -> torch.Tensor:
        """The op's body: this layer's impl on the context's metadata and cache."""
        if not 0 <= self.layer_idx < len(ctx.kv_caches):
            raise IndexError(f"expected layer_idx < {len(ctx.kv_caches)} caches in the forward context, got {self.layer_idx}")
        kv_cache = ctx.kv_caches[self.layer_idx]
        return self.impl.forward(query, key, value, kv_cache, ctx.attn_metadata, self.k_scale, self.v_scale)

    def extra_repr(self) -> str:
        i = self.impl
        return f"backend={self.backend.get_name()}, heads={i.num_heads}/{i.num_kv_heads}, head_size={i.head_size}, layer_idx={self.layer_idx}"
