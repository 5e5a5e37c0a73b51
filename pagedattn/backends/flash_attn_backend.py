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
The layer's window is FlashAttention's `window_size` (a sliding window W is `(W - 1, 0)`; an
encoder's two-sided `(left, right)` as given); FP8 caches pass their scales as
`k_descale`/`v_descale` (vLLM's FlashAttention fork names them so); attention sinks as FA4's
`learnable_sink` (FA3 and FA2 have none: refused at construction). The LSE (`forward(...,
return_lse=True)`) is the provider's `softmax_lse` ([Hq, T] from the varlen call, [B, Hq, 1]
from the decode call), copied into the caller's [T, Hq] rows.

Provider (`flash_attn_providers`): Dao-AILab's flash_attn (FA3, FA4 or FA2) where one imports
and runs on the device, else `pagedattn.flash_attn_interface` (our Triton kernels, every device
they run on); PAGEDATTN_FLASH_ATTN_PROVIDER=ours|fa4|fa3|fa2 pins one. `capabilities` are the
provider's for this machine's device (CUDA when present), so a layer that provider cannot run
(FA4: float32, an FP8 cache, ALiBi, head sizes it does not build) is refused at construction
with the reason; builders and graph states refuse block sizes it does not take (FA2: multiples
of 256). Tensors on another device (CPU tensors on a CUDA machine) run on that device's
provider. `provider()`, `pagedattn info` and one INFO log line say which runs and why not the
others.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from pagedattn.attention.backend import AttentionBackend, Capabilities
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.impl import AttendCall, AttentionImpl, Source
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.backends import flash_attn_providers as providers
from pagedattn.backends import triton_backend

logger = logging.getLogger(__name__)


def unavailable_reasons() -> list[str]:
    reasons = triton_backend.unavailable_reasons()  # our kernels run wherever Dao-AILab's do not
    if os.environ.get(providers.ENV_VAR):  # a pinned provider must run (unpinned, none is loaded here)
        choice = providers.choose(providers.machine_device_type())
        if choice.provider is None:
            reasons.append(choice.describe())
    return reasons


class _ProviderCapabilities:
    """The capabilities of this machine's provider, found when first read (finding it may import
    and run a flash_attn), not when the module is imported."""

    def __get__(self, obj, owner) -> Capabilities:
        return providers.require(providers.machine_device_type()).capabilities


class FlashAttnBackend(AttentionBackend):
    capabilities = _ProviderCapabilities()

    # its launches fall back to our kernels: their plan's lengths
    plan_context_lens = triton_backend.TritonBackend.plan_context_lens

    @staticmethod
    def get_name() -> str:
        return "flash_attn"

    @classmethod
    def provider(cls) -> str:
        return providers.choose(providers.machine_device_type()).describe()

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


def _check_block_size(block_size: int, device) -> None:
    provider = providers.require(torch.device(device).type)
    if block_size % provider.block_size_multiple:
        raise NotImplementedError(
            f"the 'flash_attn' backend's provider {provider.label} expects a block size that is a multiple of "
            f"{provider.block_size_multiple}, got {block_size} (pin {providers.ENV_VAR}=ours to run any block size)")


class FlashAttnMetadataBuilder(MetadataBuilder):
    backend = FlashAttnBackend

    def __init__(self, block_size: int, device, *, sliding_window: int | None = None):
        super().__init__(block_size, device, sliding_window=sliding_window)
        _check_block_size(block_size, self.device)


class FlashAttnState(AttentionState):
    backend = FlashAttnBackend

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, block_size: int, device):
        super().__init__(max_batch_size, max_blocks_per_seq, block_size, device)
        _check_block_size(block_size, device)


class FlashAttnImpl(AttentionImpl):
    backend = FlashAttnBackend
    split_parts = True  # prefills through flash_attn_varlen_func, decodes through flash_attn_with_kvcache

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _log_provider()

    def _check_capabilities(self, caps) -> None:
        try:
            super()._check_capabilities(caps)
        except NotImplementedError as e:
            provider = providers.require(providers.machine_device_type())
            if provider.name == "ours":
                raise
            raise NotImplementedError(f"{e}; its provider here is {provider.label}: {provider.limits} "
                                      f"(pin {providers.ENV_VAR}=ours to run it on our kernels)") from None

    _store = triton_backend.TritonImpl._store  # our store kernel, whichever provider attends

    def _options(self, causal: bool, scales, device) -> dict:
        options = dict(softmax_scale=self.scale, causal=causal, window_size=self.window or (-1, -1),
                       softcap=self.logits_soft_cap or 0.0, alibi_slopes=self.alibi_slopes_on(device))
        if scales is not None:
            options.update(k_descale=scales.k, v_descale=scales.v)
        if self.sinks is not None:
            options.update(learnable_sink=self.sinks_on(device))
        return options

    def _attend(self, q, out, call: AttendCall, kv_cache, scales, lse=None) -> None:
        fa = providers.require(q.device.type).api
        md = call.md
        options = self._options(call.causal, scales, q.device)
        if call.source is Source.STEP:
            res = fa.flash_attn_varlen_func(q, call.k, call.v, call.query_start_loc, call.kv_start_loc,
                                            call.max_query_len, call.max_kv_len, out=out,
                                            return_attn_probs=lse is not None, **options)
        elif not call.is_prefill_part:  # one query per sequence, through the block tables
            res = fa.flash_attn_with_kvcache(q.unsqueeze(1), call.k, call.v, cache_seqlens=call.kv_lens,
                                             block_table=call.block_tables, out=out.unsqueeze(1),
                                             return_softmax_lse=lse is not None, **options)
        elif call.keys_are_step_rows:  # ragged: the prompts' keys are the step's
            options.pop("k_descale", None), options.pop("v_descale", None)
            res = fa.flash_attn_varlen_func(q, call.step_k, call.step_v, call.query_start_loc, call.query_start_loc,
                                            call.max_query_len, call.max_query_len, out=out,
                                            return_attn_probs=lse is not None, **options)
        else:
            cross = call.source is Source.CROSS_CACHE
            cu_seqlens_k = md.encoder_seq_start_loc if cross else md.seq_start_loc
            res = fa.flash_attn_varlen_func(q, call.k, call.v, call.query_start_loc, cu_seqlens_k,
                                            call.max_query_len, call.max_kv_len, block_table=call.block_tables,
                                            out=out, return_attn_probs=lse is not None, **options)
        if lse is not None:
            _copy_lse(lse, res[1])


def _copy_lse(lse: torch.Tensor, softmax_lse: torch.Tensor) -> None:
    """A provider's `softmax_lse` (varlen [Hq, Tc]; decode [Tc, Hq, 1]) into `lse` [Tc, Hq], a
    row that sees no key as -inf (FlashAttention 2 writes +inf there)."""
    src = softmax_lse.t() if softmax_lse.dim() == 2 else softmax_lse[..., 0]
    lse.copy_(src)
    lse.masked_fill_(lse == float("inf"), float("-inf"))


@functools.cache
def _log_provider() -> None:
    logger.info("flash_attn backend: provider %s; CUDA graphs: %s", FlashAttnBackend.provider(),
                providers.require(providers.machine_device_type()).cuda_graphs)
