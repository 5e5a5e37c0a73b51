"""The `xformers` backend: the seed documents' xFormers backend.

The cache is `(2, num_blocks, block_size * Hkv * D)`: K and V, each block's slots flattened
in NHD order, so the K half is also xFormers' paged key tensor `[1, num_blocks * block_size,
Hkv, D]` with no copy. The shared forward stores K/V (our store kernel) and hands each part of
a step (`split_parts`) to `_attend`, which runs it on one of two providers:

- xFormers' `memory_efficient_attention_forward`, with the biases of `xformers_bias`:
  fresh prompts (block-diagonal causal, local for a sliding window, per-sequence tensor
  biases for ALiBi) and encoder, encoder-only and cross attention over the step's K/V through
  `cutlassF`; chunks over a cached prefix, decodes and cross attention over the cache through
  the paged biases and `triton_splitKF`. A part goes there only when xFormers' operator says
  it takes these inputs (its `not_supported_reasons`, asked once per step and part) and the
  part needs nothing the operator lacks (an FP8 cache, a sliding window or ALiBi over the
  paged cache, the persistent buffers of a CUDA graph);
- otherwise our paged-attention kernel (`pagedattn.kernels.paged_attention`), as the `triton`
  backend runs it, for the same attention.

xFormers' operators run on CUDA only; on a CPU every part runs on our kernels (Triton,
interpreted). `provider()`, `pagedattn info` and one INFO log line say which runs here and why.
Each operator is run once on a tiny case (`smoke_test`) before any part goes to it: on the
H100 (xFormers 0.0.35, torch 2.11 + CUDA 13) the C++ extension does not load (it needs
libcudart.so.12), and the two operators that do load (`cutlassF-pt`, `triton_splitKF`) refused
that case, so the backend suite passed there with every part on our kernels. NOT TESTED YET:
the operator path (`_attend_xformers`) on a GPU where an operator runs;
tests/backend_xformers checks its biases on the CPU against xFormers' own `materialize()` and
the dense oracle.

A logit soft cap (which the seeds' backend refused: `memory_efficient_attention` has none) runs
every part on our kernels, so the backend computes the same attention whatever the provider.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging

import torch

from pagedattn.attention.backend import AttentionBackend
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.impl import AttendCall, AttentionImpl, Source
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.attention.types import AttentionType
from pagedattn.backends import triton_backend

logger = logging.getLogger(__name__)


def unavailable_reasons() -> list[str]:
    return triton_backend.unavailable_reasons()  # our kernels run every part xFormers does not


OPERATORS = ("cutlass", "triton_splitk")  # xformers.ops.fmha modules: over the step's K/V; over the paged cache


@functools.cache
def operator_reasons(device_type: str) -> dict[str, str]:
    """Why each xFormers operator we use (by its `xformers.ops.fmha` module name) cannot run on
    devices of `device_type` here ("" when it runs). On CUDA, an operator that loads is also run once on a tiny case and checked against
    a dense reference: an operator can load and still fail to compile under this Triton."""
    if importlib.util.find_spec("xformers") is None:
        return dict.fromkeys(OPERATORS, "xformers is not installed (pip install 'pagedattn[xformers]')")
    if device_type != "cuda":
        return dict.fromkeys(OPERATORS, f"xFormers has no {device_type} kernels")
    try:
        from xformers.ops import fmha
    except Exception as e:  # a wheel built for another torch can fail in many ways
        return dict.fromkeys(OPERATORS, f"xformers.ops.fmha does not import: {type(e).__name__}: {e}")
    reasons = {}
    for name in OPERATORS:
        op = getattr(fmha, name).FwOp
        reasons[name] = smoke_test(op) if op.is_available() else (
            f"{op.NAME} does not load (XFORMERS_MORE_DETAILS=1 says why)")
    return reasons


def smoke_test(op, device: torch.device = torch.device("cuda")) -> str:
    """Run `op` once on 1 query over 40 keys (the paged cache of one 64-slot block for the
    split-K operator) on `device` and compare with a dense reference; "" when it agrees, else
    why not (never raises: whatever goes wrong is the operator's reason)."""
    from xformers.ops import fmha

    from pagedattn.backends import xformers_bias

    try:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, n, 1, 1, 128, device=device, dtype=torch.bfloat16, generator=g)
                   for n in (1, 64, 64))
        if op is fmha.triton_splitk.FwOp:
            table = torch.zeros(1, 1, dtype=torch.int32, device=device)
            bias = xformers_bias.paged([1], [40], table, 64, causal=True)
        else:
            bias = xformers_bias.block_diagonal([1], [40], causal=False, sliding_window=None, device=device)
            k, v = k[:, :40], v[:, :40]
        out = fmha.memory_efficient_attention_forward(q, k, v, attn_bias=bias, scale=0.1, op=op)
    except Exception as e:  # noqa: BLE001 - why it fails is the answer
        detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())  # its reasons follow line 1
        return f"{op.NAME} loads but does not run here: {type(e).__name__}: {detail[:400]}"
    keys, values = k[0, :40, 0, 0].float(), v[0, :40, 0, 0].float()
    ref = ((q[0, 0, 0, 0].float() @ keys.T) * 0.1).softmax(-1) @ values
    err = ((out.flatten().float() - ref).norm() / ref.norm()).item()
    return "" if err < 2e-2 else f"{op.NAME} runs but disagrees with a dense reference (rel L2 {err:.3g})"


def xformers_reasons(device_type: str) -> tuple[str, ...]:
    """Why none of xFormers' operators can run on devices of `device_type` here (empty: some can)."""
    reasons = operator_reasons(device_type)
    return () if not all(reasons.values()) else tuple(dict.fromkeys(reasons.values()))


class XFormersBackend(AttentionBackend):
    capabilities = triton_backend.TritonBackend.capabilities  # every part can run on our kernels

    @staticmethod
    def get_name() -> str:
        return "xformers"

    @classmethod
    def provider(cls) -> str:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        why = xformers_reasons(device)
        if why:
            return f"pagedattn.kernels (our Triton kernels) for every part on {device}: {'; '.join(why)}"
        runs = [name for name, reason in operator_reasons(device).items() if not reason]
        not_run = "; ".join(reason for reason in operator_reasons(device).values() if reason)
        return (f"xFormers memory_efficient_attention ({', '.join(runs)}: cutlassF over the step's K/V, "
                f"triton_splitKF over the paged cache, block sizes a multiple of 64) for the parts it takes, "
                f"pagedattn.kernels for the rest" + (f" ({not_run})" if not_run else ""))

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

    def _attend(self, q, out, call: AttendCall, kv_cache, scales) -> None:
        if not xformers_reasons(q.device.type):
            plan = self._plan(q, call, scales)
            if plan.op is not None:
                self._attend_xformers(q, out, call, plan)
                return
        super()._attend(q, out, call, kv_cache, scales)  # our paged-attention kernel

    # ------------------------------------------------------------------ xFormers' operators

    def _plan(self, q, call: AttendCall, scales) -> _XPlan:
        md = call.md
        key = (self.attn_type, call.source, call.causal, call.rows.start, q.dtype, self.sliding_window,
               self.num_heads, self.num_kv_heads, self.head_size, scales is not None,
               id(self) if self.alibi_slopes is not None else None)  # ALiBi: each layer its own slopes
        plans = md.xformers_plans if isinstance(md, XFormersMetadata) else {}
        if key not in plans:
            plans[key] = self._make_plan(q, call, scales)
        return plans[key]

    def _keys(self, call: AttendCall) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The call's keys/values as xFormers reads them, [Tk, Hkv, D] each, and whether they are
        the paged cache (all blocks: [num_blocks * block_size, Hkv, D])."""
        if call.source is Source.STEP:
            return call.k, call.v, False
        if call.keys_are_step_rows:
            return call.step_k, call.step_v, False
        return call.k.flatten(0, 1), call.v.flatten(0, 1), True

    def _make_plan(self, q, call: AttendCall, scales) -> _XPlan:
        from xformers.ops import fmha

        from pagedattn.backends import xformers_bias

        md = call.md
        if md.use_cuda_graph:
            return _XPlan(None, why_not="a CUDA graph's metadata: xFormers' biases hold host lengths")
        if self.logits_soft_cap is not None:
            return _XPlan(None, why_not="a logit soft cap: xFormers' operators have none")
        k, v, paged = self._keys(call)
        q_lens = call.kv_lens_host if self.attn_type is AttentionType.ENCODER else md.query_lens
        if min(call.kv_lens_host, default=0) == 0:
            return _XPlan(None, why_not="a sequence with no key")
        if paged:
            if scales is not None or self.sliding_window is not None or self.alibi_slopes is not None:
                return _XPlan(None, why_not="FP8 cache, sliding window or ALiBi over the paged cache")
            name = "triton_splitk"
            bias = xformers_bias.paged(q_lens, call.kv_lens_host, call.block_tables, md.block_size, causal=call.causal)
        elif self.alibi_slopes is not None:
            if not call.causal:
                return _XPlan(None, why_not="ALiBi without causality")
            op = fmha.cutlass.FwOp
            per_seq, start = [], 0
            for b, n in zip(xformers_bias.alibi(self.alibi_slopes_on(q.device), q_lens,
                                                sliding_window=self.sliding_window, dtype=q.dtype), q_lens):
                per_seq.append((b, slice(start, start + n), slice(start, start + n)))
                start += n
            why = operator_reasons(q.device.type)["cutlass"] or self._refusal(
                op, q[per_seq[0][1]], k[per_seq[0][2]], v[per_seq[0][2]], per_seq[0][0])
            return _XPlan(None, why_not=why) if why else _XPlan(op, per_seq=tuple(per_seq))
        else:
            name = "cutlass"
            bias = xformers_bias.block_diagonal(q_lens, call.kv_lens_host, causal=call.causal,
                                                sliding_window=self.sliding_window if call.causal else None,
                                                device=q.device)
        op = getattr(fmha, name).FwOp
        why = operator_reasons(q.device.type)[name] or self._refusal(op, q, k, v, bias)
        return _XPlan(None, why_not=why) if why else _XPlan(op, bias)

    def _bmghk(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[N, heads, D] as xFormers' grouped layout [1, N, Hkv, G, D] (K/V broadcast over G)."""
        g = self.num_heads // self.num_kv_heads
        if heads == self.num_heads:
            return x.view(1, x.shape[0], self.num_kv_heads, g, self.head_size)
        return x.view(1, x.shape[0], self.num_kv_heads, 1, self.head_size).expand(-1, -1, -1, g, -1)

    def _refusal(self, op, q, k, v, bias) -> str:
        from xformers.ops.fmha.common import Inputs

        inp = Inputs(self._bmghk(q, self.num_heads), self._bmghk(k, self.num_kv_heads),
                     self._bmghk(v, self.num_kv_heads), attn_bias=bias, scale=self.scale)
        return "; ".join(op.not_supported_reasons(inp))

    def _attend_xformers(self, q, out, call: AttendCall, plan: _XPlan) -> None:
        """`q` [Tc, Hq, D] over the plan's keys through xFormers into `out` [Tc, Hq, D].
        xFormers returns a new tensor (it takes no `out`), copied into `out`."""
        from xformers.ops import fmha

        k, v, _ = self._keys(call)
        parts = plan.per_seq or ((plan.bias, slice(0, q.shape[0]), slice(0, k.shape[0])),)
        for bias, q_rows, kv_rows in parts:
            o = fmha.memory_efficient_attention_forward(
                self._bmghk(q[q_rows], self.num_heads), self._bmghk(k[kv_rows], self.num_kv_heads),
                self._bmghk(v[kv_rows], self.num_kv_heads), attn_bias=bias, scale=self.scale, op=plan.op)
            out[q_rows].copy_(o.view(-1, self.num_heads, self.head_size))


@functools.cache
def _log_provider() -> None:
    logger.info("xformers backend: provider %s", XFormersBackend.provider())
