"""The backend contract: a static backend class, its declared capabilities, and the impl base."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.attention.types import AttentionType
from pagedattn.dtypes import KV_CACHE_DTYPE_NAMES, kv_cache_dtype

Scale = float | torch.Tensor


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, as data; `AttentionImpl` refuses anything else at construction."""

    head_sizes: tuple[int, ...] = ()  # empty: any head size
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    kv_cache_dtypes: tuple[str, ...] = KV_CACHE_DTYPE_NAMES
    attn_types: tuple[AttentionType, ...] = tuple(AttentionType)
    alibi: bool = True
    sliding_window: bool = True
    logits_soft_cap: bool = True


class AttentionBackend:
    """A class of static methods naming a backend's parts (never instantiated)."""

    capabilities = Capabilities()
    kv_cache_block_dim = 1  # the dimension of `get_kv_cache_shape` that indexes blocks

    @staticmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @classmethod
    def provider(cls) -> str:
        """The library whose kernels run this backend (for `pagedattn info`)."""
        return cls.get_name()

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return AttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[MetadataBuilder]:
        return MetadataBuilder

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return AttentionState

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(cls.capabilities.head_sizes)

    @classmethod
    def swap_blocks(cls, src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, src_to_dst: torch.Tensor) -> None:
        """Copy block `src_to_dst[i, 0]` of `src` to block `src_to_dst[i, 1]` of `dst` (K and V), across devices.

        `src_to_dst`: int64 [N, 2] on the CPU.
        """
        from pagedattn.kv_cache import swap_blocks

        swap_blocks(src_kv_cache, dst_kv_cache, src_to_dst, cls.kv_cache_block_dim)

    @classmethod
    def copy_blocks(cls, kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None:
        """Within each layer's cache, copy block `src_to_dists[i, 0]` to `src_to_dists[i, 1]`.

        `src_to_dists`: int64 [N, 2] on the caches' device.
        """
        from pagedattn.kv_cache import copy_blocks

        copy_blocks(kv_caches, src_to_dists, cls.kv_cache_block_dim)


class AttentionImpl:
    """One layer's attention. Construction validates every option against the backend's
    `Capabilities`; `forward` writes the step's K/V into the cache, then attends.

    Subclasses set `backend` and implement `_forward` on validated views.
    """

    backend: type[AttentionBackend]

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | torch.Tensor | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"expected num_heads to be a positive multiple of num_kv_heads, got {num_heads} and {num_kv_heads}"
            )
        if head_size < 1:
            raise ValueError(f"expected head_size >= 1, got {head_size}")
        if not isinstance(attn_type, AttentionType):
            raise ValueError(f"expected attn_type to be a pagedattn.AttentionType, got {attn_type!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"expected kv_cache_dtype in {list(KV_CACHE_DTYPE_NAMES)}, got {kv_cache_dtype!r}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"expected sliding_window >= 1 or None, got {sliding_window!r}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"expected logits_soft_cap > 0 or None, got {logits_soft_cap}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = _slopes(alibi_slopes, num_heads)
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self._check_semantics()
        self._check_capabilities(self.backend.capabilities)

    def _check_semantics(self) -> None:
        if self.attn_type is not AttentionType.DECODER and self.sliding_window is not None:
            raise ValueError(f"sliding_window is defined for DECODER attention only, got attn_type={self.attn_type.name}")
        if self.attn_type is AttentionType.ENCODER_DECODER and self.alibi_slopes is not None:
            raise ValueError("ALiBi is not defined for cross-attention (ENCODER_DECODER): positions do not compare")

    def _check_capabilities(self, caps: Capabilities) -> None:
        name = self.backend.get_name()
        refusals = []
        if caps.head_sizes and self.head_size not in caps.head_sizes:
            refusals.append(f"head_size={self.head_size} (supported: {list(caps.head_sizes)})")
        if self.kv_cache_dtype not in caps.kv_cache_dtypes:
            refusals.append(f"kv_cache_dtype={self.kv_cache_dtype!r} (supported: {list(caps.kv_cache_dtypes)})")
        if self.attn_type not in caps.attn_types:
            refusals.append(f"attn_type={self.attn_type.name} (supported: {[t.name for t in caps.attn_types]})")
        if self.alibi_slopes is not None and not caps.alibi:
            refusals.append("alibi_slopes")
        if self.sliding_window is not None and not caps.sliding_window:
            refusals.append("sliding_window")
        if self.logits_soft_cap is not None and not caps.logits_soft_cap:
            refusals.append("logits_soft_cap")
        if refusals:
            raise NotImplementedError(f"the {name!r} backend does not support: {', '.join(refusals)}")

    def set_query_dtype(self, dtype: torch.dtype) -> None:
        """Declare the dtype of the queries `forward` will get (the model's dtype).

        Optional. Backends that plan ahead (FlashInfer plans its kernels in `build`) plan this
        layer from the next step on; a layer never told learns it on its first forward. Refuses
        a dtype the backend cannot run, as `forward` would.
        """
        dtypes = self.backend.capabilities.dtypes
        if dtype not in dtypes:
            raise TypeError(f"the {self.backend.get_name()!r} backend expects a query dtype in {list(dtypes)}, got {dtype}")

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write `key`/`value` into `kv_cache` at the step's slots, then attend.

        Args:
            query: [T, Hq*D] or [T, Hq, D] in fp32/fp16/bf16.
            key, value: [Tk, Hkv*D] or [Tk, Hkv, D] in the query's dtype; None only for
                cross-attention reading the cache. Tk is T, or the encoder tokens for
                ENCODER_DECODER.
            kv_cache: one layer's cache of `get_kv_cache_shape(...)`, or numel 0 (profiling).
            k_scale, v_scale: FP8 scales, floats or 0-dim float32 tensors.
            output: [T, Hq*D] in the query's dtype; written in place and returned.
        Returns:
            [T, Hq*D].
        """
        q, k, v = self._check_inputs(query, key, value, kv_cache, attn_metadata)
        out = self._check_output(output, q)
        self._forward(q, k, v, kv_cache, attn_metadata, k_scale, v_scale, out.view(q.shape))
        return out

    def _forward(self, q, k, v, kv_cache, md, k_scale, v_scale, out) -> None:
        raise NotImplementedError

    def _query_tokens(self, md: AttentionMetadata) -> int:
        return md.num_encoder_tokens if self.attn_type is AttentionType.ENCODER else md.num_tokens

    def _kv_tokens(self, md: AttentionMetadata) -> int:
        return md.num_encoder_tokens if self.attn_type is AttentionType.ENCODER_DECODER else self._query_tokens(md)

    def _check_inputs(self, query, key, value, kv_cache, md):
        if not isinstance(md, AttentionMetadata):
            raise TypeError(f"expected AttentionMetadata, got {type(md).__name__}")
        dtypes = self.backend.capabilities.dtypes
        if query.dtype not in dtypes:
            raise TypeError(f"expected query dtype in {list(dtypes)}, got {query.dtype}")
        t = self._query_tokens(md)
        q = _heads_view("query", query, t, self.num_heads, self.head_size)
        if (key is None) != (value is None):
            raise ValueError("expected key and value both given or both None")
        if key is None:
            if self.attn_type is not AttentionType.ENCODER_DECODER:
                raise ValueError(f"key/value may be None only for ENCODER_DECODER, got attn_type={self.attn_type.name}")
            if kv_cache.numel() == 0:
                raise ValueError("cross-attention with key=None reads the cache, got an empty kv_cache")
            k = v = None
        else:
            tk = self._kv_tokens(md)
            k = _heads_view("key", key, tk, self.num_kv_heads, self.head_size)
            v = _heads_view("value", value, tk, self.num_kv_heads, self.head_size)
            for name, x in (("key", k), ("value", v)):
                if x.dtype != query.dtype or x.device != query.device:
                    raise TypeError(f"expected {name} {query.dtype} on {query.device}, got {x.dtype} on {x.device}")
        if kv_cache.numel() and self.attn_type in (AttentionType.DECODER, AttentionType.ENCODER_DECODER):
            self._check_kv_cache(kv_cache, query, md)
        return q, k, v

    def _check_kv_cache(self, kv_cache: torch.Tensor, query: torch.Tensor, md: AttentionMetadata) -> None:
        expected_dtype = kv_cache_dtype(self.kv_cache_dtype, query.dtype)
        if kv_cache.dtype != expected_dtype:
            raise TypeError(
                f"expected kv_cache dtype {expected_dtype} (kv_cache_dtype={self.kv_cache_dtype!r}, "
                f"query {query.dtype}), got {kv_cache.dtype}"
            )
        if kv_cache.device != query.device:
            raise ValueError(f"expected kv_cache on {query.device}, got {kv_cache.device}")
        bd = self.backend.kv_cache_block_dim
        n = kv_cache.shape[bd] if kv_cache.dim() > bd else 0
        expected = self.backend.get_kv_cache_shape(n, md.block_size, self.num_kv_heads, self.head_size)
        if tuple(kv_cache.shape) != tuple(expected):
            raise ValueError(
                f"expected kv_cache shape {tuple(expected)} (block_size={md.block_size}, Hkv={self.num_kv_heads}, "
                f"D={self.head_size}), got {tuple(kv_cache.shape)}"
            )

    def _check_output(self, output: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        if output is None:
            return q.new_empty(t, self.num_heads * self.head_size)
        if output.dtype != q.dtype or output.device != q.device:
            raise TypeError(f"expected output {q.dtype} on {q.device}, got {output.dtype} on {output.device}")
        if output.numel() != q.numel() or output.shape[0] != t or not output.is_contiguous():
            raise ValueError(
                f"expected a contiguous output of [{t}, {self.num_heads * self.head_size}], got {list(output.shape)}"
            )
        return output.view(t, self.num_heads * self.head_size)


def _heads_view(name: str, x: torch.Tensor, tokens: int, heads: int, head_size: int) -> torch.Tensor:
    """View `x` as [tokens, heads, head_size], or raise saying what was expected."""
    ok_2d = x.dim() == 2 and tuple(x.shape) == (tokens, heads * head_size)
    ok_3d = x.dim() == 3 and tuple(x.shape) == (tokens, heads, head_size)
    if not (ok_2d or ok_3d):
        raise ValueError(
            f"expected {name} of shape [{tokens}, {heads * head_size}] or [{tokens}, {heads}, {head_size}] "
            f"(tokens from the metadata), got {list(x.shape)}"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"expected {name} with a unit stride in its last dimension, got strides {x.stride()}")
    return x.unflatten(1, (heads, head_size)) if ok_2d else x


def _slopes(alibi_slopes, num_heads: int) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32)
    if slopes.shape != (num_heads,):
        raise ValueError(f"expected alibi_slopes of [{num_heads}] (one per query head), got {list(slopes.shape)}")
    return slopes
