"""The `torch` backend: pure PyTorch paged attention, the definition of the semantics.

Each part of a step (prefills, decodes, encoder tokens) is computed densely: the part's queries
form a padded `[B, Lq]` grid, its keys/values `[B, Lk]` are gathered (through the block tables,
or from the step's own tokens) and read in float32, and one masked float32 softmax covers the
batch (`scaled_dot_product_attention`, or explicit scores with a logit soft cap).

What depends only on the step (gather indices, the additive mask, the rows of the output, the
buffers that keys/values are gathered into) is a `_Plan`, built by the first layer that needs it
and cached on the metadata, which lives one step (`advance_step` drops it); a layer then runs a
handful of ops: one gather of whole K and V blocks, one SDPA, one copy into `out`. Metadata of a CUDA graph is never
cached on: its buffers change between replays. Lengths come from device tensors and sizes from
host ints, so nothing synchronises and decode steps capture in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedattn.attention.backend import AttentionBackend, AttentionImpl, Capabilities
from pagedattn.attention.builder import SLOTS_ALL_REAL
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.types import AttentionType
from pagedattn.kv_cache import _raw, dequantize, plan_store, store_kv


def unavailable_reasons() -> list[str]:
    return []


class TorchBackend(AttentionBackend):
    capabilities = Capabilities()

    @staticmethod
    def get_name() -> str:
        return "torch"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchImpl


@dataclass(frozen=True)
class _Source:
    """Where a part's keys/values come from: `paged` (the cache, through `tables` int32 [B, W]) or
    dense rows `start_loc[b]:start_loc[b+1]` (int32 [B+1]) of the step's own K/V."""

    name: str  # for the plan cache: which queries ("query/..." or "encoder/...") over which keys
    paged: bool
    lens: torch.Tensor | None  # int32 [B] keys per sequence (paged)
    tables: torch.Tensor | None  # int32 [B, W] (paged)
    start_loc: torch.Tensor | None  # int32 [B+1] (dense)
    max_len: int


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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slopes_on: dict[torch.device, torch.Tensor] = {}

    def _forward(self, q, k, v, kv_cache, md: AttentionMetadata, k_scale, v_scale, out) -> None:
        kind = self.attn_type
        if kind is AttentionType.ENCODER_ONLY:
            src = _Source("query/query", False, None, None, md.query_start_loc, md.max_query_len)
            self._attend(md, q, out, md.query_start_loc, md.max_query_len, src, (k, v), causal=False)
            return
        if kind is AttentionType.ENCODER:
            loc = md.encoder_seq_start_loc
            src = _Source("encoder/encoder", False, None, None, loc, md.max_encoder_seq_len)
            self._attend(md, q, out, loc, md.max_encoder_seq_len, src, (k, v), causal=False)
            return
        cached = kv_cache.numel() > 0
        if kind is AttentionType.DECODER:
            if cached:
                bs, all_real = kv_cache.shape[2], md._views.get(SLOTS_ALL_REAL, False)
                plan = _cached(md, f"store:{bs}", lambda: plan_store(md.slot_mapping, bs, all_real))
                store_kv(k, v, kv_cache[0], kv_cache[1], md.slot_mapping, k_scale, v_scale, plan)
            self._decoder(q, k, v, kv_cache if cached else None, md, k_scale, v_scale, out)
            return
        if cached and k is not None and md.cross_slot_mapping is not None:
            store_kv(k, v, kv_cache[0], kv_cache[1], md.cross_slot_mapping, k_scale, v_scale)
        self._cross(q, k, v, kv_cache if cached else None, md, k_scale, v_scale, out)

    def _decoder(self, q, k, v, kv_cache, md, k_scale, v_scale, out) -> None:
        p = md.num_prefill_tokens
        for part, rows, max_q, max_kv in (
            (md.prefill_metadata, slice(None, p), md.max_query_len, md.max_prefill_seq_len),
            (md.decode_metadata, slice(p, None), 1, md.max_decode_seq_len),
        ):
            if part is None:
                continue
            if kv_cache is None:  # profiling: the part's queries attend over their own tokens
                src = _Source("query/query", False, None, None, part.query_start_loc, max_q)
                kv = (k[rows], v[rows])
            else:
                src = _Source("query/self", True, part.seq_lens_tensor, part.block_tables, None, max_kv)
                kv = (kv_cache, k_scale, v_scale)
            self._attend(part, q[rows], out[rows], part.query_start_loc, max_q, src, kv, causal=True)

    def _cross(self, q, k, v, kv_cache, md, k_scale, v_scale, out) -> None:
        if md.encoder_seq_lens_tensor is None:
            raise ValueError("ENCODER_DECODER attention needs encoder lengths: build with ScheduledSeq(encoder_len=...)")
        p = md.num_prefill_tokens
        for part, rows in ((md.prefill_metadata, slice(None, p)), (md.decode_metadata, slice(p, None))):
            if part is None:
                continue
            if kv_cache is not None:
                lens, tables = part.encoder_seq_lens_tensor, part.cross_block_tables
                src = _Source("query/cross", True, lens, tables, None, part.max_encoder_seq_len)
                kv = (kv_cache, k_scale, v_scale)
            elif part.num_prefills and k is not None:
                src = _Source("query/encoder", False, None, None, part.encoder_seq_start_loc, part.max_encoder_seq_len)
                kv = (k, v)
            else:
                raise ValueError("cross-attention decode needs the encoder K/V in the cache, got an empty kv_cache")
            self._attend(part, q[rows], out[rows], part.query_start_loc, part.max_query_len, src, kv, causal=False)

    def _attend(self, md, q, out, query_start_loc, max_query_len: int, src: _Source, kv, causal: bool) -> None:
        """Attend the part's tokens `q` [Tp, Hq, D] into `out` [Tp, Hq, D].

        `query_start_loc` int32 [B+1] splits the rows into sequences of at most `max_query_len`;
        `kv` is `(kv_cache, k_scale, v_scale)` for a paged source, else the dense `(k, v)`.
        """
        t = q.shape[0]
        if t == 0:
            return
        # Rows of what keys are gathered from: the pool's blocks (paged), or the step's K/V tokens.
        block_size, num_kv_rows = (kv[0].shape[2], kv[0].shape[1]) if src.paged else (0, kv[0].shape[0])
        key = (
            f"torch:{src.name}:{block_size}:{num_kv_rows}:{t}:{max_query_len}:{causal}:"
            f"{self.sliding_window}:{self.alibi_slopes is not None}"
        )
        plan = _cached(
            md, key, lambda: self._plan(query_start_loc, max_query_len, t, src, block_size, num_kv_rows, causal)
        )
        if plan.lk == 0:  # no sequence has a key (only graph padding): rows that see no key are 0
            out.zero_()
            return
        keys, values = _gather(plan, src, kv)  # [B, Hkv, Lk, D] float32 x2
        b, lq, hq, hkv, d = plan.b, plan.lq, self.num_heads, self.num_kv_heads, self.head_size
        g = hq // hkv
        bias = plan.bias
        if self.alibi_slopes is not None:
            bias = bias + self._slopes(q.device).view(1, hq, 1, 1) * plan.rel_pos  # [B, Hq, Lq, Lk]
        if plan.q_rows is None:
            qf = q.float().view(b, hq, 1, d)  # decode: one row per sequence
        else:
            qf = q.float().index_select(0, plan.q_rows).view(b, lq, hq, d).transpose(1, 2)  # [B, Hq, Lq, D]
        if self.logits_soft_cap is not None:
            o = self._explicit(qf, keys, values, bias)
        elif lq == 1:
            # Each KV head's G query heads as its query rows: a plain SDPA, no K/V expansion.
            o = F.scaled_dot_product_attention(
                qf.view(b, hkv, g, d), keys, values, attn_mask=bias.view(b, -1, g if bias.shape[1] > 1 else 1, plan.lk),
                scale=self.scale,
            ).reshape(b, hq, 1, d)  # (SDPA kernels may return a transposed layout)
        else:
            o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=bias, scale=self.scale, enable_gqa=g > 1)
        o = o.nan_to_num_(0.0)  # rows of padding, or that see no key, are 0 (whatever the SDPA kernel)
        if plan.out_rows is None:
            out.copy_(o.reshape(b, hq, d))
        else:
            out.copy_(o.transpose(1, 2).reshape(b * lq, hq, d).index_select(0, plan.out_rows))

    def _explicit(self, q, keys, values, bias) -> torch.Tensor:
        """Scores with the logit soft cap, then the masked softmax. q: [B, Hq, Lq, D] float32;
        keys/values: [B, Hkv, Lk, D]; bias: [B, 1|Hq, Lq, Lk]. Returns [B, Hq, Lq, D]."""
        hkv = self.num_kv_heads
        qg = q.unflatten(1, (hkv, -1))  # [B, Hkv, G, Lq, D]
        s = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)) * self.scale  # [B, Hkv, G, Lq, Lk]
        s = torch.tanh(s / self.logits_soft_cap) * self.logits_soft_cap
        s = s + (bias.unsqueeze(1) if bias.shape[1] == 1 else bias.unflatten(1, (hkv, -1)))
        p = torch.softmax(s, dim=-1)
        return torch.matmul(p, values.unsqueeze(2)).flatten(1, 2)

    def _plan(self, query_start_loc, max_query_len: int, t: int, src: _Source, block_size: int, num_kv_rows: int,
              causal: bool) -> _Plan:
        dev = query_start_loc.device
        qsl = query_start_loc.long()
        b = qsl.shape[0] - 1
        q_lens = qsl[1:] - qsl[:-1]  # [B]
        lq = max_query_len
        if src.paged:  # whole blocks: fewer, larger copies than slots
            n = min(-(-src.max_len // block_size), src.tables.shape[1])
            blocks = src.tables[:, :n].long().flatten()  # [B*n]
            kv_rows = torch.cat([blocks, blocks + num_kv_rows])  # K blocks, then V blocks
            kv_lens, lk = src.lens.long(), n * block_size
        else:
            loc = src.start_loc.long()
            kv_lens, lk = loc[1:] - loc[:-1], src.max_len
            kv_rows = (loc[:-1, None] + torch.arange(lk, device=dev)).clamp_(max=max(num_kv_rows - 1, 0)).flatten()
        q_pos = (kv_lens - q_lens)[:, None] + torch.arange(lq, device=dev)  # [B, Lq] bottom-right aligned
        k_pos = torch.arange(lk, device=dev)  # [Lk]
        visible = (k_pos < kv_lens[:, None])[:, None, :]  # [B, 1, Lk]
        if causal:
            visible = visible & (k_pos <= q_pos[..., None])  # [B, Lq, Lk]
        if self.sliding_window is not None:
            visible = visible & (k_pos > q_pos[..., None] - self.sliding_window)
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
        return _Plan(b, lq, lk, q_rows, kv_rows, bias, rel_pos, out_rows)

    def _slopes(self, device: torch.device) -> torch.Tensor:
        if device not in self._slopes_on:
            self._slopes_on[device] = self.alibi_slopes.to(device)
        return self._slopes_on[device]


def _cached(md: AttentionMetadata, key: str, build):
    """`build()`, kept on the metadata for the other layers of the step, unless the metadata is
    a CUDA graph's (its buffers are rewritten before each replay, and capture must record the work)."""
    if md.use_cuda_graph:
        return build()
    if key not in md._views:
        md._views[key] = build()
    return md._views[key]


def _gather(plan: _Plan, src: _Source, kv) -> tuple[torch.Tensor, torch.Tensor]:
    """The part's keys and values, float32 [B, Hkv, Lk, D] each (strided views of gathered rows).

    Rows are gathered into the plan's buffers: a fresh multi-MiB tensor per layer would cost
    page faults on the CPU."""
    b, lk = plan.b, plan.lk
    if src.paged:
        kv_cache, k_scale, v_scale = kv
        pool = _raw(kv_cache).flatten(0, 1).flatten(1)  # [2 * num_blocks, block_size * Hkv * D]: K blocks, V blocks
        rows = torch.index_select(pool, 0, plan.kv_rows, out=plan.buffer("kv", pool, plan.kv_rows.shape[0]))
        rows = rows.view(kv_cache.dtype).view(2, b, lk, *kv_cache.shape[3:])  # [2, B, Lk, Hkv, D]
        k, v = dequantize(rows[0], k_scale), dequantize(rows[1], v_scale)
    else:
        k, v = (torch.index_select(x, 0, plan.kv_rows, out=plan.buffer(f"kv{i}", x, plan.kv_rows.shape[0]))
                .float().view(b, lk, *x.shape[1:]) for i, x in enumerate(kv))
    return k.transpose(1, 2), v.transpose(1, 2)
