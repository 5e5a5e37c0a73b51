"""The `torch` backend: pure PyTorch paged attention, the definition of the semantics.

Each part of a step (prefills, decodes, encoder tokens) is computed densely: the part's queries
form a padded `[B, Lq]` grid, its keys/values `[B, Lk]` are gathered (through the block tables,
or from the step's own tokens) and read in float32, and one masked float32 softmax covers the
batch (`scaled_dot_product_attention`, or explicit scores with a logit soft cap, attention sinks
or when the caller asks for the softmax's log-sum-exp).

What depends only on the step (gather indices, the additive mask, which keys exist, the rows
of the output, the buffers that keys/values are gathered into) is a `_Plan`, built by the first
layer that needs it and kept in `TorchMetadata.plans`, which lives one step (`advance_step`
drops it); a layer then runs a handful of ops: one gather of whole K and V blocks, one SDPA,
one copy into `out`. Metadata of a CUDA graph keeps no plan: its buffers change between
replays. Lengths come from device tensors and sizes from host ints, so nothing synchronises
and decode steps capture in CUDA graphs.

Whole-block gathers read slots past a sequence's length, which nobody may have written (NaN,
or any FP8 bit pattern): those keys and values are zeroed before the matmuls, so they never
reach a result. NaN or Inf in the inputs propagate as they would in a dense computation; a row
that sees no key at all is 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagedattn.attention.backend import AttentionBackend, Capabilities
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.impl import AttendCall, AttentionImpl, Source
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.intmath import cdiv
from pagedattn.kv_cache import dequantize, raw_bytes


def unavailable_reasons() -> list[str]:
    return []


class TorchBackend(AttentionBackend):
    capabilities = Capabilities(sinks=True, two_sided_window=True)

    @staticmethod
    def get_name() -> str:
        return "torch"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchImpl

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return TorchMetadata

    @staticmethod
    def get_builder_cls() -> type[MetadataBuilder]:
        return TorchMetadataBuilder

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return TorchState


@dataclass
class TorchMetadata(AttentionMetadata):
    """The common metadata plus the step's `_Plan`s, keyed by what they depend on."""

    plans: dict[tuple, _Plan] = field(default_factory=dict, repr=False, compare=False)

    def _part_fields(self) -> dict[str, Any]:
        return {"plans": {}}

    def plan(self, key: tuple, build) -> _Plan:
        """`build()`, kept for the step's other layers, unless this is a CUDA graph's metadata
        (its buffers are rewritten before each replay, and capture must record the work)."""
        if self.use_cuda_graph:
            return build()
        if key not in self.plans:
            self.plans[key] = build()
        return self.plans[key]


class TorchMetadataBuilder(MetadataBuilder):
    backend = TorchBackend


class TorchState(AttentionState):
    backend = TorchBackend


@dataclass(frozen=True)
class _Plan:
    """The per-step tensors of one part of a step, shared by every layer with the same options."""

    b: int
    lq: int
    lk: int
    q_rows: torch.Tensor | None  # int64 [B*Lq] query row of each grid cell; None: decode (Lq=1, row b)
    kv_rows: torch.Tensor  # int64: paged, [2*B*n] the K then V blocks in the cache viewed as
    # [2 * num_blocks, ...]; dense, [B*Lk] the K/V row of each key
    bias: torch.Tensor  # float32 [B, 1, Lq, Lk]: 0 where the query sees the key, -inf elsewhere
    tail_from: int  # first key column that may not be one of its sequence's (short sequences, block tails)
    tail_missing: torch.Tensor  # bool [B, Lk - tail_from, 1]: the gathered key is not the sequence's (zeroed)
    has_key: torch.Tensor  # bool [B, 1, Lq, 1]: the query sees at least one key (else its row is 0)
    rel_pos: torch.Tensor | None  # float32 [B, 1, Lq, Lk] key_pos - query_pos (ALiBi only)
    out_rows: torch.Tensor | None  # int64 [Tp] grid cell of each query token; None: decode
    buffers: dict = field(default_factory=dict)  # gathered K/V rows, reused by the step's layers

    def buffer(self, name: str, like: torch.Tensor, rows: int) -> torch.Tensor:
        """A `[rows, *like.shape[1:]]` buffer of `like`'s dtype for this step (layers run one at a time)."""
        key = (name, tuple(like.shape[1:]), like.dtype)
        if key not in self.buffers:
            self.buffers[key] = like.new_empty(rows, *like.shape[1:])
        return self.buffers[key]


class TorchImpl(AttentionImpl):
    backend = TorchBackend
    split_parts = True  # a decode part is a one-row grid: no padding to the prefills' length

    def _attend(self, q, out, call: AttendCall, kv_cache, scales, lse=None) -> None:
        """Attend `q` [Tc, Hq, D] into `out` [Tc, Hq, D] (and its LSE into `lse` [Tc, Hq]) over
        the call's keys, in float32."""
        paged = call.source is not Source.STEP
        if paged:
            block_size, num_kv_rows = kv_cache.shape[2], kv_cache.shape[1]
            kv = (kv_cache, scales.k if scales else None, scales.v if scales else None)
        else:
            block_size, num_kv_rows, kv = 0, call.k.shape[0], (call.k, call.v)
        t = q.shape[0]
        key = (self.attn_type, call.source, call.rows.start, block_size, num_kv_rows, t, call.max_query_len, call.causal,
               self.window, self.alibi_slopes is not None)
        md = call.md if isinstance(call.md, TorchMetadata) else None
        build = lambda: self._plan(call, t, block_size, num_kv_rows)  # noqa: E731
        plan = md.plan(key, build) if md is not None else build()
        if plan.lk == 0:  # no sequence has a key (only graph padding): rows that see no key are 0
            out.zero_()
            if lse is not None:  # and their LSE that of the sink alone
                lse.copy_(self._no_key_lse(lse))
            return
        keys, values = _gather(plan, paged, kv)  # [B, Hkv, Lk, D] float32 x2, missing keys zeroed
        b, lq, hq, hkv, d = plan.b, plan.lq, self.num_heads, self.num_kv_heads, self.head_size
        g = hq // hkv
        bias = plan.bias
        if self.alibi_slopes is not None:
            bias = bias + self.alibi_slopes_on(q.device).view(1, hq, 1, 1) * plan.rel_pos  # [B, Hq, Lq, Lk]
        if plan.q_rows is None:
            qf = q.float().view(b, hq, 1, d)  # decode: one row per sequence
        else:
            qf = q.float().index_select(0, plan.q_rows).view(b, lq, hq, d).transpose(1, 2)  # [B, Hq, Lq, D]
        row_lse = None
        if self.logits_soft_cap is not None or self.sinks is not None or lse is not None:
            o, row_lse = self._explicit(qf, keys, values, bias)
        elif lq == 1:
            # Each KV head's G query heads as its query rows: a plain SDPA, no K/V expansion.
            o = F.scaled_dot_product_attention(
                qf.view(b, hkv, g, d), keys, values, attn_mask=bias.view(b, -1, g if bias.shape[1] > 1 else 1, plan.lk),
                scale=self.scale,
            ).reshape(b, hq, 1, d)  # (SDPA kernels may return a transposed layout)
        else:
            o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=bias, scale=self.scale, enable_gqa=g > 1)
        o = torch.where(plan.has_key, o, 0.0)  # [B, Hq, Lq, D]; rows that see no key are 0, NaN stays NaN
        if plan.out_rows is None:
            out.copy_(o.reshape(b, hq, d))
            if lse is not None:
                lse.copy_(row_lse.reshape(b, hq))
        else:
            out.copy_(o.transpose(1, 2).reshape(b * lq, hq, d).index_select(0, plan.out_rows))
            if lse is not None:
                lse.copy_(row_lse.transpose(1, 2).reshape(b * lq, hq).index_select(0, plan.out_rows))

    def _no_key_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """The LSE of rows that see no key, like `lse` [Tc, Hq]: the sink's, or -inf."""
        if self.sinks is None:
            return torch.full_like(lse, float("-inf"))
        return self.sinks_on(lse.device).float().expand_as(lse)

    def _explicit(self, q, keys, values, bias) -> tuple[torch.Tensor, torch.Tensor]:
        """Explicit scores, for the logit soft cap, attention sinks and the LSE, then the masked
        softmax. q: [B, Hq, Lq, D] float32; keys/values: [B, Hkv, Lk, D]; bias: [B, 1|Hq, Lq, Lk].
        Returns (out [B, Hq, Lq, D], lse [B, Hq, Lq]): lse the natural log of each row's softmax
        denominator, -inf where the row sees no key (and has no sink).

        A sink is one more score per query head, `sinks[h]` as it is (after the soft cap, which
        it does not pass through), whose value is zero: it joins the softmax's denominator only
        (gpt-oss: the scores and the sink concatenated, softmaxed, the sink's column dropped)."""
        hkv = self.num_kv_heads
        qg = q.unflatten(1, (hkv, -1))  # [B, Hkv, G, Lq, D]
        s = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)) * self.scale  # [B, Hkv, G, Lq, Lk]
        if self.logits_soft_cap is not None:
            s = torch.tanh(s / self.logits_soft_cap) * self.logits_soft_cap
        s = s + (bias.unsqueeze(1) if bias.shape[1] == 1 else bias.unflatten(1, (hkv, -1)))
        if self.sinks is not None:
            sink = self.sinks_on(q.device).float().view(1, hkv, -1, 1, 1).expand(*s.shape[:-1], 1)
            s = torch.cat([s, sink], dim=-1)
        p = torch.softmax(s, dim=-1)
        if self.sinks is not None:
            p = p[..., :-1]
        return torch.matmul(p, values.unsqueeze(2)).flatten(1, 2), torch.logsumexp(s, dim=-1).flatten(1, 2)

    def _plan(self, call: AttendCall, t: int, block_size: int, num_kv_rows: int) -> _Plan:
        query_start_loc, causal = call.query_start_loc, call.causal
        dev = query_start_loc.device
        qsl = query_start_loc.long()
        b = qsl.shape[0] - 1
        q_lens = qsl[1:] - qsl[:-1]  # [B]
        lq = call.max_query_len
        kv_lens = call.kv_lens.long()
        if call.source is not Source.STEP:  # whole blocks: fewer, larger copies than slots
            n = min(cdiv(call.max_kv_len, block_size), call.block_tables.shape[1])
            blocks = call.block_tables[:, :n].long().flatten()  # [B*n]
            kv_rows = torch.cat([blocks, blocks + num_kv_rows])  # K blocks, then V blocks
            lk = n * block_size
        else:
            loc = call.kv_start_loc.long()
            lk = call.max_kv_len
            kv_rows = (loc[:-1, None] + torch.arange(lk, device=dev)).clamp_(max=max(num_kv_rows - 1, 0)).flatten()
        q_pos = (kv_lens - q_lens)[:, None] + torch.arange(lq, device=dev)  # [B, Lq] bottom-right aligned
        k_pos = torch.arange(lk, device=dev)  # [Lk]
        exists = k_pos < kv_lens[:, None]  # [B, Lk]
        visible = exists[:, None, :]  # [B, 1, Lk]
        # Keys of every sequence up to the shortest one exist; a graph's host lengths are stale.
        tail_from = 0 if call.md.use_cuda_graph else min(call.kv_lens_host, default=0)
        if call.source is not Source.STEP:
            tail_from = tail_from // block_size * block_size
        tail_from = min(tail_from, lk)
        if causal:
            visible = visible & (k_pos <= q_pos[..., None])  # [B, Lq, Lk]
        if self.window is not None:  # FlashAttention's (left, right), -1 unbounded
            left, right = self.window
            if left >= 0:
                visible = visible & (k_pos >= q_pos[..., None] - left)
            if right >= 0:
                visible = visible & (k_pos <= q_pos[..., None] + right)
        visible = visible.expand(b, lq, lk)
        bias = torch.zeros(b, 1, lq, lk, device=dev).masked_fill_(~visible[:, None], float("-inf"))
        rel_pos = None
        if self.alibi_slopes is not None:
            rel_pos = (k_pos - q_pos[..., None]).float()[:, None]  # [B, 1, Lq, Lk]
        q_rows = out_rows = None
        if lq > 1 or t != b:
            q_rows = (qsl[:-1, None] + torch.arange(lq, device=dev)).clamp_(max=t - 1).flatten()
            tok = torch.arange(t, device=dev)
            seq = torch.searchsorted(qsl[1:], tok, right=True)  # [Tp] sequence of each row
            out_rows = seq * lq + tok - qsl[seq]
        return _Plan(b, lq, lk, q_rows, kv_rows, bias, tail_from, ~exists[:, tail_from:, None],
                     visible.any(-1)[:, None, :, None], rel_pos, out_rows)


def _gather(plan: _Plan, paged: bool, kv) -> tuple[torch.Tensor, torch.Tensor]:
    """The part's keys and values, float32 [B, Hkv, Lk, D] each (strided views of gathered rows),
    zero where the gathered key is not one of the sequence's (its slot may hold anything, NaN or
    any FP8 bit pattern): zeroed in the gathered copy, before any arithmetic reads it.

    Rows are gathered into the plan's buffers: a fresh multi-MiB tensor per layer would cost
    page faults on the CPU."""
    b, lk, tail = plan.b, plan.lk, plan.tail_from
    if paged:
        kv_cache, k_scale, v_scale = kv
        pool = raw_bytes(kv_cache).flatten(0, 1).flatten(1)  # [2 * num_blocks, block_size * Hkv * D]: K blocks, V blocks
        rows = torch.index_select(pool, 0, plan.kv_rows, out=plan.buffer("kv", pool, plan.kv_rows.shape[0]))
        rows.view(2, b, lk, -1)[:, :, tail:].masked_fill_(plan.tail_missing, 0)  # 0 bits: 0.0 in every dtype
        rows = rows.view(kv_cache.dtype).view(2, b, lk, *kv_cache.shape[3:])  # [2, B, Lk, Hkv, D]
        k, v = dequantize(rows[0], k_scale), dequantize(rows[1], v_scale)
    else:
        k, v = (torch.index_select(x, 0, plan.kv_rows, out=plan.buffer(f"kv{i}", x, plan.kv_rows.shape[0]))
                for i, x in enumerate(kv))
        for x in (k, v):
            x.view(b, lk, -1)[:, tail:].masked_fill_(plan.tail_missing, 0)
        k, v = (x.float().view(b, lk, *x.shape[1:]) for x in (k, v))
    return k.transpose(1, 2), v.transpose(1, 2)
