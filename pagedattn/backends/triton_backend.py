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
import functools
import importlib.util
import os

import torch

from pagedattn.attention.backend import AttentionBackend, Capabilities
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.impl import AttendCall, AttentionImpl, Source
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.device_profile import DeviceProfile


def unavailable_reasons() -> list[str]:
    if importlib.util.find_spec("triton") is None:
        return ["triton is not installed (pip install 'pagedattn[triton]')"]
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return ["needs a CUDA GPU (TRITON_INTERPRET=1 runs the kernels on the CPU, for testing)"]
    return []


class TritonBackend(AttentionBackend):
    # Head sizes are padded to the next power of two inside the kernels.
    capabilities = Capabilities(head_sizes=tuple(range(16, 257, 8)), sinks=True, two_sided_window=True)

    @staticmethod
    def get_name() -> str:
        return "triton"

    @classmethod
    def capabilities_on(cls, profile: DeviceProfile) -> Capabilities:
        """FP8 e4m3 caches need sm_89 or later: Triton has no e4m3 conversions for sm_80/86
        (A100, A10, RTX 3090; `fp8e4nv not supported in this architecture`). e5m2 runs anywhere."""
        if profile.fp8_e4m3:
            return cls.capabilities
        return dataclasses.replace(
            cls.capabilities, kv_cache_dtypes=tuple(d for d in cls.capabilities.kv_cache_dtypes
                                                    if d not in ("fp8", "fp8_e4m3")),
            why_not=cls.capabilities.why_not + (
                ("kv_cache_dtype", f"FP8 e4m3 needs sm_89 or later; {profile.name} is "
                                   f"sm_{profile.capability[0]}{profile.capability[1]}: use 'fp8_e5m2'"),))

    @classmethod
    def plan_context_lens(cls) -> tuple[int, ...]:
        """Where the tile policy changes its key tiles (`paged_attention_config`)."""
        from pagedattn.kernels.paged_attention_config import LONG_KEYS, LONG_PREFILL_KEYS, SHORT_KEYS

        return (SHORT_KEYS, LONG_KEYS, LONG_PREFILL_KEYS)

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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._device_facts: dict[torch.device, tuple] = {}

    def _on_device(self, device: torch.device):
        """(the `DeviceProfile` of `device`, the split-KV workspace of this layer's shape there),
        looked up once per device."""
        found = self._device_facts.get(device)
        if found is None:
            from pagedattn.kernels import shared_workspace

            found = self._device_facts[device] = (
                DeviceProfile.of(device), shared_workspace(device, self.num_heads, self.num_kv_heads, self.head_size))
        return found

    def _store(self, k, v, k_cache, v_cache, slots, scales, md, cross) -> None:
        from pagedattn.kernels import store_kv

        ks, vs = (scales.k, scales.v) if scales is not None else (1.0, 1.0)
        store_kv(k, v, k_cache, v_cache, slots, ks, vs)

    def _stores_in_attend(self, calls: list[AttendCall]) -> bool:
        # The one launch of the step writes its rows (saving the store launch): it takes them as
        # `paged_attention`'s `write`, and its plan says who writes (decode programs before they
        # read them; a fresh prompt's producer; else `store_kv` first, inside the launch).
        return len(calls) == 1 and calls[0].source is Source.CACHE and calls[0].step_k is not None

    def _attend(self, q, out, call: AttendCall, kv_cache, scales, lse=None) -> None:
        KVWrite, launch_facts, plan_attention, run_plan = _kernels()
        k, v, tables, kv_start_loc = call.k, call.v, call.block_tables, call.kv_start_loc
        # A step's decodes follow its prefills (builder.py), one query each: the launch gives them
        # a decode tile of their own. Step-row calls (encoders, profiling) number other sequences.
        md = call.md
        num_decodes = 0 if call.source is Source.STEP else md.num_seqs - md.num_prefills
        write = None if call.store_slots is None else KVWrite(call.step_k, call.step_v, k, v, call.store_slots)
        if call.keys_are_step_rows:  # contiguous reads, no block table (H100, 4x4k: 417 vs 288 TFLOP/s)
            k, v, tables, kv_start_loc = call.step_k, call.step_v, None, call.query_start_loc
        paged = kv_start_loc is None
        profile, workspace = self._on_device(q.device)
        sinks = self.sinks_on(q.device)
        facts = launch_facts(
            profile, q, k, v, num_seqs=call.query_start_loc.shape[0] - 1,
            max_query_len=call.max_query_len, max_seq_len=call.max_kv_len, num_decodes=num_decodes,
            max_decode_query_len=1, paged=paged, causal=call.causal, window=self.window is not None,
            alibi=self.alibi_slopes is not None, soft_cap=self.logits_soft_cap is not None, lse=lse is not None,
            split_limit=workspace.splits_for(q.shape[0], self.num_heads, self.head_size), write=write,
            sinks=sinks is not None)
        run_plan(plan_attention(facts), q, k, v, out, query_start_loc=call.query_start_loc, seq_lens=call.kv_lens,
                 block_tables=tables, kv_start_loc=kv_start_loc, scale=self.scale, window=self.window,
                 alibi_slopes=self.alibi_slopes_on(q.device), soft_cap=self.logits_soft_cap, sinks=sinks,
                 k_scale=scales.k if scales else 1.0, v_scale=scales.v if scales else 1.0, lse=lse,
                 workspace=workspace, write=write)


@functools.lru_cache(maxsize=None)
def _kernels():
    """The kernel package's entry points, imported on first use (importing it imports triton)."""
    from pagedattn.kernels import KVWrite
    from pagedattn.kernels.attention_plan import plan_attention
    from pagedattn.kernels.paged_attention import launch_facts, run_plan

    return KVWrite, launch_facts, plan_attention, run_plan
