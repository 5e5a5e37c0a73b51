"""The `flash_attn` backend: the seed documents' FlashAttention backend, over FlashAttention's
functional API.

The cache is `(2, num_blocks, block_size, Hkv, D)` (K and V pages, NHD), the layout
`flash_attn_with_kvcache` and `flash_attn_varlen_func(block_table=...)` read. Per call of the
shared forward:
- a prefill part: `flash_attn_varlen_func`, over the step's own K/V (ragged) when every prefill
  of the step is a fresh prompt, else through `block_table` (chunks over a cached prefix,
  prefix-cache hits), bottom-right causal;
- a decode part: `flash_attn_with_kvcache` over the block tables, one query per sequence;
- encoder, encoder-only and cross attention: the same two functions, not causal; profiling
  runs with an empty cache: `flash_attn_varlen_func` over the step's rows.
Sliding window W is FlashAttention's `window_size=(W - 1, 0)`; FP8 caches pass their scales
as `k_descale`/`v_descale` (vLLM's FlashAttention fork names them so).

Provider: `pagedattn.flash_attn_interface` (FlashAttention's API on our Triton kernels), on
every machine our kernels run on. Dao-AILab's `flash_attn` (FA2/FA3/FA4) is not used yet:
its wheels do not match this project's torch/CUDA, and its paged and FP8 limits differ per
version; `provider()` and `pagedattn info` say so.
"""

from __future__ import annotations

import functools
import logging

from pagedattn.attention.backend import AttentionBackend, Capabilities
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.impl import AttendCall, AttentionImpl, Source
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.backends import triton_backend

logger = logging.getLogger(__name__)


def unavailable_reasons() -> list[str]:
    return triton_backend.unavailable_reasons()  # the provider is our Triton kernels


class FlashAttnBackend(AttentionBackend):
    capabilities = triton_backend.TritonBackend.capabilities  # the provider's: our kernels

    @staticmethod
    def get_name() -> str:
        return "flash_attn"

    @classmethod
    def provider(cls) -> str:
        return "pagedattn.flash_attn_interface (our Triton kernels; Dao-AILab flash_attn not used yet)"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttnImpl

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return triton_backend.TritonMetadata  # the common fields, advance_step as one kernel

    @staticmethod
    def get_builder_cls() -> type[MetadataBuilder]:
        return FlashAttnMetadataBuilder

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return FlashAttnState

    @classmethod
    def copy_blocks(cls, kv_caches, src_to_dists) -> None:
        triton_backend.TritonBackend.copy_blocks(kv_caches, src_to_dists)


class FlashAttnMetadataBuilder(MetadataBuilder):
    backend = FlashAttnBackend


class FlashAttnState(AttentionState):
    backend = FlashAttnBackend


class FlashAttnImpl(AttentionImpl):
    backend = FlashAttnBackend
    split_parts = True  # prefills through flash_attn_varlen_func, decodes through flash_attn_with_kvcache

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _log_provider()

    def _store(self, k, v, k_cache, v_cache, slots, scales, md, cross) -> None:
        from pagedattn.kernels import store_kv

        ks, vs = (scales.k, scales.v) if scales is not None else (1.0, 1.0)
        store_kv(k, v, k_cache, v_cache, slots, ks, vs)

    def _options(self, causal: bool, scales, device) -> dict:
        window = (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)
        options = dict(softmax_scale=self.scale, causal=causal, window_size=window,
                       softcap=self.logits_soft_cap or 0.0, alibi_slopes=self.alibi_slopes_on(device))
        if scales is not None:
            options.update(k_descale=scales.k, v_descale=scales.v)
        return options

    def _attend(self, q, out, call: AttendCall, kv_cache, scales) -> None:
        from pagedattn import flash_attn_interface as fa

        md = call.md
        options = self._options(call.causal, scales, q.device)
        if call.source is Source.STEP:
            fa.flash_attn_varlen_func(q, call.k, call.v, call.query_start_loc, call.kv_start_loc, call.max_query_len,
                                      call.max_kv_len, out=out, **options)
            return
        if not call.is_prefill_part:  # one query per sequence, through the block tables
            fa.flash_attn_with_kvcache(q.unsqueeze(1), call.k, call.v, cache_seqlens=call.kv_lens,
                                       block_table=call.block_tables, out=out.unsqueeze(1), **options)
            return
        if call.source is Source.CACHE and md.fresh_prefills:  # ragged: the prompts' keys are the step's
            options.pop("k_descale", None), options.pop("v_descale", None)
            fa.flash_attn_varlen_func(q, call.step_k, call.step_v, call.query_start_loc, call.query_start_loc,
                                      call.max_query_len, call.max_query_len, out=out, **options)
            return
        cross = call.source is Source.CROSS_CACHE
        cu_seqlens_k = md.encoder_seq_start_loc if cross else md.seq_start_loc
        fa.flash_attn_varlen_func(q, call.k, call.v, call.query_start_loc, cu_seqlens_k, call.max_query_len,
                                  call.max_kv_len, block_table=call.block_tables, out=out, **options)


@functools.cache
def _log_provider() -> None:
    logger.info("flash_attn backend: provider %s", FlashAttnBackend.provider())
