"""The backend contract: a static backend class and its declared capabilities."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.impl import AttentionImpl
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.attention.types import AttentionType
from pagedattn.device_profile import DeviceProfile
from pagedattn.dtypes import KV_CACHE_DTYPE_NAMES
from pagedattn.kv_cache import copy_blocks, swap_blocks


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
    sinks: bool = False  # a per-head logit in every softmax's denominator (gpt-oss)
    # windows of bidirectional attention (ENCODER, ENCODER_ONLY), which may reach past the query:
    # FlashAttention's window_size=(left, right) with right > 0
    two_sided_window: bool = False
    why_not: tuple[tuple[str, str], ...] = ()  # (option, the reason it is refused), for the error

    def reason(self, option: str) -> str:
        """' (<why>)' for a refused option that has a recorded reason, else ''."""
        why = dict(self.why_not).get(option)
        return f" ({why})" if why else ""


class AttentionBackend:
    """A class of static methods naming a backend's parts (never instantiated)."""

    capabilities = Capabilities()
    kv_cache_block_dim = 1  # the dimension of `get_kv_cache_shape` that indexes blocks

    @staticmethod
    def get_name() -> str:
        raise NotImplementedError

    @classmethod
    def capabilities_on(cls, profile: DeviceProfile) -> Capabilities:
        """What the backend supports on a device of `profile` (`capabilities`, less what that
        device cannot run, with the reason)."""
        return cls.capabilities

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @classmethod
    def plan_context_lens(cls) -> tuple[int, ...]:
        """Sequence lengths at which the backend's launch plan changes (its tile classes), so an
        engine's warm-up can reach each before requests do (none: one class)."""
        return ()

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

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The shape of one layer's cache tensor (API.md section 1)."""
        for name, value, low in (("num_blocks", num_blocks, 0), ("block_size", block_size, 1),
                                 ("num_kv_heads", num_kv_heads, 1), ("head_size", head_size, 1)):
            try:
                ok = not isinstance(value, bool) and operator.index(value) >= low
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"expected {name} an int >= {low}, got {value!r}")
        return cls.kv_cache_layout(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def kv_cache_layout(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The layout behind `get_kv_cache_shape` (arguments already checked): K then V."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cache as (K, V) halves, each [num_blocks, ...] holding a block's slots as
        [block_size, Hkv, D] (NHD), in any strides that `view` as [num_blocks, block_size, Hkv, D]
        (the impl, which knows Hkv and D, makes that view)."""
        return kv_cache[0], kv_cache[1]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(cls.capabilities.head_sizes)

    @classmethod
    def swap_blocks(cls, src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, src_to_dst: torch.Tensor) -> None:
        """Copy block `src_to_dst[i, 0]` of `src` to block `src_to_dst[i, 1]` of `dst` (K and V), across devices.

        `src_to_dst`: int64 [N, 2] on the CPU.
        """
        swap_blocks(src_kv_cache, dst_kv_cache, src_to_dst, cls.kv_cache_block_dim)

    @classmethod
    def copy_blocks(cls, kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None:
        """Within each layer's cache, copy block `src_to_dists[i, 0]` to `src_to_dists[i, 1]`.

        `src_to_dists`: int64 [N, 2] on the caches' device.
        """
        copy_blocks(kv_caches, src_to_dists, cls.kv_cache_block_dim)
