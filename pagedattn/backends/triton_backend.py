"""The `triton` backend: our Triton kernels (pagedattn.kernels) behind the contract.

Every part of a DECODER step (prefills over cached prefixes and decodes) goes through ONE
launch of the paged-attention kernel; encoder, encoder-only and cross attention use the same
kernel, non-causal, over contiguous K/V or the cross-attention blocks. Nothing in `forward`
synchronises with the host or plans: launch parameters come from the metadata's host ints,
the split-KV scratch is allocated once per (device, heads, head size), and FP8 scales given as
floats become cached device scalars, so decode steps capture in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from pagedattn.attention.backend import AttentionBackend, AttentionImpl, Capabilities
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.attention.types import AttentionType

# Split-KV pays only while (sequences x KV heads) leaves the GPU short of programs; the
# kernel's policy stops splitting at 2 programs per SM, which bounds the tokens the scratch holds.
MAX_SPLITS = 16


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

    def advance_step(self, input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, num_queries):
        from pagedattn.kernels import advance_step

        self._check_advance(input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, num_queries)
        advance_step(
            input_tokens, input_positions, sampled_token_ids, self.seq_lens_tensor, self.context_lens_tensor,
            self.slot_mapping, self.block_tables, block_size, num_queries,
        )
        steps = torch.arange(1, num_seqs + 1, device=self.seq_start_loc.device, dtype=torch.int32)
        self.seq_start_loc[1:] += steps.clamp_(max=num_queries)
        self._advance_host(num_queries)


class TritonMetadataBuilder(MetadataBuilder):
    metadata_cls = TritonMetadata


class TritonState(AttentionState):
    metadata_cls = TritonMetadata


class TritonImpl(AttentionImpl):
    backend = TritonBackend

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._device_slopes: dict[torch.device, torch.Tensor] = {}
        self._scalars: dict[tuple[torch.device, float], torch.Tensor] = {}

    def _forward(self, q, k, v, kv_cache, md: AttentionMetadata, k_scale, v_scale, out) -> None:
        from pagedattn.kernels import store_kv

        kind, dev = self.attn_type, q.device
        ks, vs = self._scalar(k_scale, dev), self._scalar(v_scale, dev)
        cached = kv_cache.numel() > 0
        if kind is AttentionType.ENCODER_ONLY:
            lens = _lengths(md.query_start_loc)
            self._launch(q, k, v, out, md.query_start_loc, lens, None, md.max_query_len, md.max_query_len,
                         causal=False, ks=ks, vs=vs, kv_start_loc=md.query_start_loc)
            return
        if kind is AttentionType.ENCODER:
            loc, p = md.encoder_seq_start_loc, md.num_prefills
            self._launch(q, k, v, out, loc, md.encoder_seq_lens_tensor[:p], None, md.max_encoder_seq_len,
                         md.max_encoder_seq_len, causal=False, ks=ks, vs=vs, kv_start_loc=loc)
            return
        if kind is AttentionType.DECODER:
            max_seq_len = max(md.max_prefill_seq_len, md.max_decode_seq_len)
            if not cached:  # profiling: every sequence attends over its own tokens
                lens = _lengths(md.query_start_loc)
                self._launch(q, k, v, out, md.query_start_loc, lens, None, md.max_query_len, md.max_query_len,
                             causal=True, ks=ks, vs=vs, kv_start_loc=md.query_start_loc)
                return
            store_kv(k, v, kv_cache[0], kv_cache[1], md.slot_mapping, ks, vs)
            self._launch(q, kv_cache[0], kv_cache[1], out, md.query_start_loc, md.seq_lens_tensor, md.block_tables,
                         md.max_query_len, max_seq_len, causal=True, ks=ks, vs=vs)
            return
        # ENCODER_DECODER: decoder queries over the encoder's K/V, not causal.
        if md.encoder_seq_lens_tensor is None:
            raise ValueError("ENCODER_DECODER attention needs encoder lengths: build with ScheduledSeq(encoder_len=...)")
        if cached:
            if k is not None and md.cross_slot_mapping is not None:
                store_kv(k, v, kv_cache[0], kv_cache[1], md.cross_slot_mapping, ks, vs)
            self._launch(q, kv_cache[0], kv_cache[1], out, md.query_start_loc, md.encoder_seq_lens_tensor,
                         md.cross_block_tables, md.max_query_len, md.max_encoder_seq_len, causal=False, ks=ks, vs=vs)
        elif md.num_decode_tokens == 0:
            p = md.num_prefills
            self._launch(q, k, v, out, md.query_start_loc, md.encoder_seq_lens_tensor[:p], None, md.max_query_len,
                         md.max_encoder_seq_len, causal=False, ks=ks, vs=vs, kv_start_loc=md.encoder_seq_start_loc)
        else:
            raise ValueError("cross-attention decode needs the encoder K/V in the cache, got an empty kv_cache")

    def _launch(self, q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, max_query_len: int,
                max_seq_len: int, *, causal: bool, ks, vs, kv_start_loc=None) -> None:
        from pagedattn.kernels import paged_attention

        if q.shape[0] == 0:
            return
        paged_attention(
            q, k_cache, v_cache, out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
            max_query_len=max_query_len, max_seq_len=max_seq_len, scale=self.scale, causal=causal,
            sliding_window=self.sliding_window, alibi_slopes=self._slopes(q.device),
            soft_cap=self.logits_soft_cap, k_scale=ks, v_scale=vs,
            workspace=_workspace(q.device, self.num_heads, self.head_size, self.num_kv_heads),
            kv_start_loc=kv_start_loc,
        )

    def _slopes(self, device: torch.device) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        if device not in self._device_slopes:
            self._device_slopes[device] = self.alibi_slopes.to(device)
        return self._device_slopes[device]

    def _scalar(self, scale, device: torch.device) -> torch.Tensor:
        """FP8 scales as 0-dim float32 device tensors; floats are converted once and cached."""
        if isinstance(scale, torch.Tensor):
            return scale.to(device=device, dtype=torch.float32) if scale.device != device else scale.float()
        key = (device, float(scale))
        if key not in self._scalars:
            self._scalars[key] = torch.full((), float(scale), dtype=torch.float32, device=device)
        return self._scalars[key]


def _lengths(start_loc: torch.Tensor) -> torch.Tensor:
    return start_loc[1:] - start_loc[:-1]


_workspaces: dict[tuple, object] = {}


def _workspace(device: torch.device, num_heads: int, head_size: int, num_kv_heads: int):
    """The split-KV scratch shared by every layer of this shape on `device`, allocated once."""
    from pagedattn.kernels import SplitKVWorkspace
    from pagedattn.kernels._common import num_sms

    key = (device, num_heads, head_size, num_kv_heads)
    if key not in _workspaces:
        max_tokens = -(-2 * num_sms(device) // num_kv_heads)
        _workspaces[key] = SplitKVWorkspace.allocate(max_tokens, num_heads, head_size, MAX_SPLITS, device)
    return _workspaces[key]
