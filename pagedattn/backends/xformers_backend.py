"""The `xformers` backend: the seed documents' xFormers backend.

The cache is `(2, num_blocks, block_size * Hkv * D)`: K and V, each block's slots flattened
in NHD order, so the K half is also xFormers' paged key tensor `[1, num_blocks * block_size,
Hkv, D]` with no copy. The shared forward stores K/V (our store kernel) and hands each part of
a step (`split_parts`) to `_attend`, which runs it on one of two providers:

- xFormers' `memory_efficient_attention_forward` (from xFormers or from MSLK, whichever runs
  here: `xformers_fmha`), with the biases of `xformers_bias`: fresh prompts (block-diagonal
  causal, local for a sliding window, per-sequence tensor biases for ALiBi) and encoder,
  encoder-only and cross attention over the step's K/V through FA3, FA2 or cutlassF (the first
  that takes the call); chunks over a cached prefix, decodes and cross attention over the cache
  through the paged biases and `triton_splitKF`. A part goes there only when the operator says
  it takes these inputs (its `not_supported_reasons`, asked once per step and part) and the part
  needs nothing the operator lacks (an FP8 cache, a sliding window or ALiBi over the paged
  cache, the persistent buffers of a CUDA graph);
- otherwise our paged-attention kernel (`pagedattn.kernels.paged_attention`), as the `triton`
  backend runs it, for the same attention.

xFormers' operators run on CUDA only; on a CPU every part runs on our kernels (Triton,
interpreted). `provider()`, `pagedattn info` and one INFO log line say which runs here and why.
On the H100 (torch 2.11 + CUDA 13) xFormers 0.0.35's own extension does not load (built for torch
2.10 + CUDA 12.8, Python 3.10), and MSLK 1.1.0 runs FA2 (fa2F@2.5.7), cutlassF and
triton_splitKF (its FA3 and CuTe operators are not built). tests/backend_xformers checks the
biases on the CPU against xFormers' own `materialize()` and the dense oracle, and the routing of
each part on CUDA.

A logit soft cap (which the seeds' backend refused: `memory_efficient_attention` has none),
attention sinks and windows of bidirectional attention (its operators have neither) run every
part on our kernels, and so do calls that ask for the LSE (`memory_efficient_attention_forward`
returns none), so the backend computes the same attention whatever the provider.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from pagedattn.attention import registry
from pagedattn.attention.backend import AttentionBackend
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.impl import AttendCall, AttentionImpl, Source
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.attention.types import AttentionType
from pagedattn.backends import triton_backend, xformers_fmha

logger = logging.getLogger(__name__)


def unavailable_reasons() -> list[str]:
    reasons = triton_backend.unavailable_reasons()  # our kernels run every part xFormers does not
    if registry.pinned_provider("xformers"):  # a pinned fmha must run (unpinned, none is loaded here)
        try:
            xformers_fmha.choose(_device_type())
        except xformers_fmha.ProviderUnavailableError as e:
            reasons.append(str(e))
    return reasons


def _device_type() -> str:
    """The device type the provider is chosen for: cuda when present."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class XFormersBackend(AttentionBackend):
    capabilities = triton_backend.TritonBackend.capabilities  # every part can run on our kernels

    # its launches fall back to our kernels: their plan's lengths
    plan_context_lens = triton_backend.TritonBackend.plan_context_lens

    @staticmethod
    def get_name() -> str:
        return "xformers"

    @classmethod
    def provider(cls) -> str:
        return xformers_fmha.choose(_device_type()).describe()

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return XFormersImpl

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return XFormersMetadata

    @staticmethod
    def get_builder_cls() -> type[MetadataBuilder]:
        return XFormersMetadataBuilder

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return XFormersState

    @staticmethod
    def kv_cache_layout(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size * num_kv_heads * head_size)

    @classmethod
    def copy_blocks(cls, kv_caches, src_to_dists) -> None:
        triton_backend.TritonBackend.copy_blocks(kv_caches, src_to_dists)


@dataclasses.dataclass
class XFormersMetadata(triton_backend.TritonMetadata):
    """The common metadata (advance_step as one kernel) and the step's xFormers plans per part
    and layer options (built by the first layer that needs one)."""

    xformers_plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def _part_fields(self) -> dict:
        return {"xformers_plans": {}}


class XFormersMetadataBuilder(MetadataBuilder):
    backend = XFormersBackend


class XFormersState(AttentionState):
    backend = XFormersBackend


@dataclasses.dataclass(frozen=True)
class _XPlan:
    """How xFormers runs one part of a step: its operator and bias (or one bias per sequence,
    ALiBi), or why it does not (`op` None: our kernels run the part)."""

    op: type | None
    bias: object = None
    per_seq: tuple = ()  # ALiBi: (bias, query rows, key rows) per sequence
    why_not: str = ""


class XFormersImpl(triton_backend.TritonImpl):
    """The triton backend's store and kernel, with the parts xFormers' operators take run there."""

    backend = XFormersBackend
    split_parts = True  # prefills and decodes take different biases and operators

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _log_provider()

    def _attend(self, q, out, call: AttendCall, kv_cache, scales, lse=None) -> None:
        fmha = xformers_fmha.choose(q.device.type)
        if fmha.module is not None and lse is None:  # the LSE: our kernel (see the module docstring)
            plan = self._plan(fmha, q, call, scales)
            if plan.op is not None:
                self._attend_xformers(fmha, q, out, call, plan)
                return
        super()._attend(q, out, call, kv_cache, scales, lse)  # our paged-attention kernel

    # ------------------------------------------------------------------ xFormers' operators

    def _plan(self, fmha: xformers_fmha.Fmha, q, call: AttendCall, scales) -> _XPlan:
        md = call.md
        key = (self.attn_type, call.source, call.causal, call.rows.start, q.dtype, self.window,
               self.num_heads, self.num_kv_heads, self.head_size, scales is not None,
               self.logits_soft_cap is not None, self.sinks is not None,
               id(self) if self.alibi_slopes is not None else None)  # ALiBi: each layer its own slopes
        plans = md.xformers_plans if isinstance(md, XFormersMetadata) else {}
        if key not in plans:
            plans[key] = self._make_plan(fmha, q, call, scales)
        return plans[key]

    def _keys(self, call: AttendCall) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The call's keys/values as xFormers reads them, [Tk, Hkv, D] each, and whether they are
        the paged cache (all blocks: [num_blocks * block_size, Hkv, D])."""
        if call.source is Source.STEP:
            return call.k, call.v, False
        if call.keys_are_step_rows:
            return call.step_k, call.step_v, False
        return call.k.flatten(0, 1), call.v.flatten(0, 1), True

    def _make_plan(self, fmha: xformers_fmha.Fmha, q, call: AttendCall, scales) -> _XPlan:
        from pagedattn.backends import xformers_bias

        md, xb = call.md, fmha.module.attn_bias
        if md.use_cuda_graph:
            return _XPlan(None, why_not="a CUDA graph's metadata: xFormers' biases hold host lengths")
        if self.logits_soft_cap is not None:
            return _XPlan(None, why_not="a logit soft cap: xFormers' operators have none")
        if self.sinks is not None:
            return _XPlan(None, why_not="attention sinks: xFormers' operators have none")
        if self.window is not None and not call.causal:
            return _XPlan(None, why_not="a window of bidirectional attention: xFormers' biases here are causal")
        sliding_window = None if self.window is None else self.window[0] + 1  # causal: (W - 1, 0)
        k, v, paged = self._keys(call)
        q_lens = call.kv_lens_host if self.attn_type is AttentionType.ENCODER else md.query_lens
        if min(call.kv_lens_host, default=0) == 0:
            return _XPlan(None, why_not="a sequence with no key")
        role = "paged" if paged else "step"
        if not fmha.runs(role):
            return _XPlan(None, why_not=f"no operator {xformers_fmha.WHERE[role]} runs here")
        if paged:
            if scales is not None or self.window is not None or self.alibi_slopes is not None:
                return _XPlan(None, why_not="FP8 cache, sliding window or ALiBi over the paged cache")
            bias = xformers_bias.paged(xb, q_lens, call.kv_lens_host, call.block_tables, md.block_size,
                                       causal=call.causal)
            return self._first_taker(fmha, role, q, k, v, bias)
        if self.alibi_slopes is None:
            bias = xformers_bias.block_diagonal(xb, q_lens, call.kv_lens_host, causal=call.causal,
                                                sliding_window=sliding_window,
                                                device=q.device)
            return self._first_taker(fmha, role, q, k, v, bias)
        if not call.causal:
            return _XPlan(None, why_not="ALiBi without causality")
        per_seq, start = [], 0
        biases = xformers_bias.alibi(xb, self.alibi_slopes_on(q.device), q_lens, num_kv_heads=self.num_kv_heads,
                                     sliding_window=sliding_window, dtype=q.dtype)
        for b, n in zip(biases, q_lens):
            per_seq.append((b, slice(start, start + n), slice(start, start + n)))
            start += n
        for op in fmha.ops[role]:  # the first operator that takes every sequence's bias
            if not any(self._refusal(fmha, op, q[r], k[c], v[c], b) for b, r, c in per_seq):
                return _XPlan(op, per_seq=tuple(per_seq))
        b, r, c = per_seq[0]
        first = self._first_taker(fmha, role, q[r], k[c], v[c], b)  # why the first sequence is refused
        return first if first.op is None else _XPlan(None, why_not="no operator takes every sequence's ALiBi bias")

    def _first_taker(self, fmha: xformers_fmha.Fmha, role: str, q, k, v, bias) -> _XPlan:
        """The plan of the first of `role`'s operators that takes these inputs, or why none does."""
        refusals = []
        for op in fmha.ops[role]:
            why = self._refusal(fmha, op, q, k, v, bias)
            if not why:
                return _XPlan(op, bias)
            refusals.append(f"{op.NAME}: {why}")
        return _XPlan(None, why_not="; ".join(refusals))

    def _bmghk(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[N, heads, D] as xFormers' grouped layout [1, N, Hkv, G, D] (K/V broadcast over G)."""
        g = self.num_heads // self.num_kv_heads
        if heads == self.num_heads:
            return x.view(1, x.shape[0], self.num_kv_heads, g, self.head_size)
        return x.view(1, x.shape[0], self.num_kv_heads, 1, self.head_size).expand(-1, -1, -1, g, -1)

    def _refusal(self, fmha: xformers_fmha.Fmha, op, q, k, v, bias) -> str:
        inp = fmha.module.Inputs(self._bmghk(q, self.num_heads), self._bmghk(k, self.num_kv_heads),
                                 self._bmghk(v, self.num_kv_heads), attn_bias=bias, scale=self.scale)
        return "; ".join(op.not_supported_reasons(inp))

    def _attend_xformers(self, fmha: xformers_fmha.Fmha, q, out, call: AttendCall, plan: _XPlan) -> None:
        """`q` [Tc, Hq, D] over the plan's keys through xFormers into `out` [Tc, Hq, D].
        xFormers returns a new tensor (it takes no `out`), copied into `out`."""
        k, v, _ = self._keys(call)
        parts = plan.per_seq or ((plan.bias, slice(0, q.shape[0]), slice(0, k.shape[0])),)
        for bias, q_rows, kv_rows in parts:
            o = fmha.module.memory_efficient_attention_forward(
                self._bmghk(q[q_rows], self.num_heads), self._bmghk(k[kv_rows], self.num_kv_heads),
                self._bmghk(v[kv_rows], self.num_kv_heads), attn_bias=bias, scale=self.scale, op=plan.op)
            out[q_rows].copy_(o.view(-1, self.num_heads, self.head_size))


@functools.cache
def _log_provider() -> None:
    logger.info("xformers backend: provider %s", XFormersBackend.provider())
