"""The `triton` backend: our Triton kernels (pagedattn.kernels) behind the contract.

Every part of a DECODER step (prefills over cached prefixes and decodes) goes through ONE
launch of the paged-attention kernel, the decodes in a decode-shaped tile of their own (on an
H100/H200, prefill-like steps run its Gluon kernel instead: `pagedattn info`); a step of fresh
prompts only reads its keys from the step's own rows (contiguous) instead of the cache.
Encoder, encoder-only and cross attention use the same kernel, non-causal, over contiguous K/V
or the cross-attention blocks. Nothing in
`forward` synchronises with the host or plans: launch parameters come from the metadata's host ints,
the split-KV scratch is allocated once per (device, heads, head size), and FP8 scales come from the
layer's `KVScales` as device scalars, so decode steps capture in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from pagedattn.attention.backend import AttentionBackend, Capabilities
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.impl import AttendCall, AttentionImpl, Source
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState


def unavailable_reasons() -> list[str]:
    if importlib.util.find_spec("triton") is None:
        return ["triton is not installed (pip install 'pagedattn[triton]')"]
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return ["needs a CUDA GPU (TRITON_INTERPRET=1 runs the kernels on the CPU, for testing)"]
    return []


class TritonBackend(AttentionBackend):
    # Head sizes are padded to the next power of two inside the kernels.
    capabilities = Capabilities(head_sizes=tuple(range(16, 257, 8)))

    @staticmethod
    def get_name() -> str:
        return "triton"

    @classmethod
    def provider(cls) -> str:
        """Our kernels; on an H100/H200 prefill-like steps take the Gluon sm_90 kernels
        (warp-specialised at head size 128), elsewhere `pagedattn info` says why not."""
        from pagedattn.kernels import hopper_prefill

        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        reason = hopper_prefill.unavailable_reason(device)
        if reason is None:
            return "triton; prefills on the Gluon sm_90 kernels (warp-specialised at head size 128)"
        return f"triton (Gluon sm_90 prefill kernel off: {reason})"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonImpl

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return TritonMetadata

    @staticmethod
    def get_builder_cls():
        return TritonMetadataBuilder

    @staticmethod
    def get_state_cls():
        return TritonState

    @classmethod
    def copy_blocks(cls, kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None:
        from pagedattn.kernels import copy_blocks

        copy_blocks(kv_caches, src_to_dists)


@dataclasses.dataclass
class TritonMetadata(AttentionMetadata):
    """The common metadata; `advance_step` runs as one kernel."""

    def _advance_device(self, input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, n) -> None:
        from pagedattn.kernels import advance_step

        advance_step(
            input_tokens, input_positions, sampled_token_ids, self.seq_lens_tensor, self.context_lens_tensor,
            self.slot_mapping, self.block_tables, block_size, n,
        )


class TritonMetadataBuilder(MetadataBuilder):
    backend = TritonBackend


class TritonState(AttentionState):
    backend = TritonBackend


class TritonImpl(AttentionImpl):
    """Every call is one launch of the paged-attention kernel: a DECODER step's prefills and
    decodes together, over the cache (or the step's rows, for encoders and profiling)."""

    backend = TritonBackend

    def _store(self, k, v, k_cache, v_cache, slots, scales, md, cross) -> None:
        from pagedattn.kernels import store_kv

        ks, vs = (scales.k, scales.v) if scales is not None else (1.0, 1.0)
        store_kv(k, v, k_cache, v_cache, slots, ks, vs)

    def _stores_in_attend(self, calls: list[AttendCall]) -> bool:
        # The one launch of the step writes its rows (saving the store launch): fresh prompts
        # read the step's rows and may write them from inside the kernel (`paged_attention`'s
        # `store`); other cache steps hand them over as `new_kv`, which decode programs write
        # before they read them (else `store_kv` runs first, inside `paged_attention`).
        return len(calls) == 1 and calls[0].source is Source.CACHE and calls[0].step_k is not None

    def _attend(self, q, out, call: AttendCall, kv_cache, scales) -> None:
        from pagedattn.kernels import NewKV, StoreTarget, paged_attention, shared_workspace

        k, v, tables, kv_start_loc = call.k, call.v, call.block_tables, call.kv_start_loc
        # A step's decodes follow its prefills (builder.py), one query each: the launch gives them
        # a decode tile of their own. Step-row calls (encoders, profiling) number other sequences.
        md = call.md
        num_decodes = 0 if call.source is Source.STEP else md.num_seqs - md.num_prefills
        store = new_kv = None
        if call.keys_are_step_rows:  # contiguous reads, no block table (H100, 4x4k: 417 vs 288 TFLOP/s)
            if call.store_slots is not None:
                store = StoreTarget(k, v, call.store_slots)
            k, v, tables, kv_start_loc = call.step_k, call.step_v, None, call.query_start_loc
        elif call.store_slots is not None:
            new_kv = NewKV(call.step_k, call.step_v, call.store_slots)
        paged_attention(
            q, k, v, out,
            query_start_loc=call.query_start_loc, seq_lens=call.kv_lens, block_tables=tables,
            max_query_len=call.max_query_len, max_seq_len=call.max_kv_len, scale=self.scale, causal=call.causal,
            sliding_window=self.sliding_window, alibi_slopes=self.alibi_slopes_on(q.device),
            soft_cap=self.logits_soft_cap, k_scale=scales.k if scales else 1.0, v_scale=scales.v if scales else 1.0,
            workspace=shared_workspace(q.device, self.num_heads, self.num_kv_heads, self.head_size),
            kv_start_loc=kv_start_loc, num_decodes=num_decodes, store=store, new_kv=new_kv,
        )

