"""The `torch` backend: pure PyTorch paged attention, the definition of the semantics.

Each part of a step (prefills, decodes, encoder tokens) is computed densely: the part's queries
are gathered into a padded `[B, Lq]` grid, its keys/values into `[B, Lk]` (through the block
tables, or from the step's own tokens), and one masked float32 softmax covers the batch.
Lengths come from device tensors and sizes from host ints, so nothing synchronises and decode
steps capture in CUDA graphs.
"""

from __future__ import annotations

import torch

from pagedattn.attention.backend import AttentionBackend, AttentionImpl, Capabilities
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.types import AttentionType
from pagedattn.kv_cache import dequantize, store_kv


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


class TorchImpl(AttentionImpl):
    backend = TorchBackend

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slopes_on: dict[torch.device, torch.Tensor] = {}

    def _forward(self, q, k, v, kv_cache, md: AttentionMetadata, k_scale, v_scale, out) -> None:
        kind = self.attn_type
        if kind is AttentionType.ENCODER_ONLY:
            self._attend(q, out, md.query_start_loc, md.max_query_len, _Dense(k, v, md.query_start_loc, md.max_query_len), causal=False)
            return
        if kind is AttentionType.ENCODER:
            loc = md.encoder_seq_start_loc
            self._attend(q, out, loc, md.max_encoder_seq_len, _Dense(k, v, loc, md.max_encoder_seq_len), causal=False)
            return
        cached = kv_cache.numel() > 0
        if kind is AttentionType.DECODER:
            if cached:
                store_kv(k, v, kv_cache[0], kv_cache[1], md.slot_mapping, k_scale, v_scale)
            self._decoder(q, k, v, kv_cache if cached else None, md, k_scale, v_scale, out)
            return
        if cached and k is not None and md.cross_slot_mapping is not None:
            store_kv(k, v, kv_cache[0], kv_cache[1], md.cross_slot_mapping, k_scale, v_scale)
        self._cross(q, k, v, kv_cache if cached else None, md, k_scale, v_scale, out)

    def _decoder(self, q, k, v, kv_cache, md, k_scale, v_scale, out) -> None:
        p = md.num_prefill_tokens
        if (pre := md.prefill_metadata) is not None:
            if kv_cache is None:  # profiling: the prompt attends over its own tokens
                kv = _Dense(k[:p], v[:p], pre.query_start_loc, pre.max_query_len)
            else:
                kv = _Paged(kv_cache, pre.block_tables, pre.seq_lens_tensor, pre.max_prefill_seq_len, k_scale, v_scale)
            self._attend(q[:p], out[:p], pre.query_start_loc, pre.max_query_len, kv, causal=True)
        if (dec := md.decode_metadata) is not None:
            if kv_cache is None:
                kv = _Dense(k[p:], v[p:], dec.query_start_loc, 1)
            else:
                kv = _Paged(kv_cache, dec.block_tables, dec.seq_lens_tensor, dec.max_decode_seq_len, k_scale, v_scale)
            self._attend(q[p:], out[p:], dec.query_start_loc, 1, kv, causal=True)

    def _cross(self, q, k, v, kv_cache, md, k_scale, v_scale, out) -> None:
        if md.encoder_seq_lens_tensor is None:
            raise ValueError("ENCODER_DECODER attention needs encoder lengths: build with ScheduledSeq(encoder_len=...)")
        p = md.num_prefill_tokens
        for part, rows in ((md.prefill_metadata, slice(None, p)), (md.decode_metadata, slice(p, None))):
            if part is None:
                continue
            if kv_cache is not None:
                kv = _Paged(
                    kv_cache, part.cross_block_tables, part.encoder_seq_lens_tensor,
                    part.max_encoder_seq_len, k_scale, v_scale,
                )
            elif part.num_prefills and k is not None:
                kv = _Dense(k, v, part.encoder_seq_start_loc, part.max_encoder_seq_len)
            else:
                raise ValueError("cross-attention decode needs the encoder K/V in the cache, got an empty kv_cache")
            self._attend(q[rows], out[rows], part.query_start_loc, part.max_query_len, kv, causal=False)

    def _attend(self, q, out, query_start_loc, max_query_len: int, kv, causal: bool) -> None:
        """Attend the part's tokens `q` [Tp, Hq, D] into `out` [Tp, Hq, D].

        `query_start_loc` int32 [B+1] splits the rows into sequences of at most `max_query_len`.
        """
        t = q.shape[0]
        if t == 0:
            return
        dev = q.device
        qsl = query_start_loc.long()
        b = qsl.shape[0] - 1
        q_lens = qsl[1:] - qsl[:-1]  # [B]
        if max_query_len == 1:  # decode: one row per sequence
            q_grid = q.unsqueeze(1)  # [B, 1, Hq, D]
        else:
            rows = qsl[:-1, None] + torch.arange(max_query_len, device=dev)  # [B, Lq]
            q_grid = q[rows.clamp_(max=t - 1)]  # [B, Lq, Hq, D]
        keys, values, kv_lens = kv.gather(b)  # [B, Lk, Hkv, D] float32 x2, int64 [B]
        lq, lk = q_grid.shape[1], keys.shape[1]
        q_pos = (kv_lens - q_lens)[:, None] + torch.arange(lq, device=dev)  # [B, Lq] bottom-right aligned
        k_pos = torch.arange(lk, device=dev)  # [Lk]
        mask = (k_pos < kv_lens[:, None])[:, None, :]  # [B, 1, Lk]
        if causal:
            mask = mask & (k_pos <= q_pos[..., None])  # [B, Lq, Lk]
        if self.sliding_window is not None:
            mask = mask & (k_pos > q_pos[..., None] - self.sliding_window)

        g = self.num_heads // self.num_kv_heads
        qf = q_grid.float().unflatten(2, (self.num_kv_heads, g))  # [B, Lq, Hkv, G, D]
        s = torch.einsum("bqhgd,bkhd->bhgqk", qf, keys) * self.scale  # [B, Hkv, G, Lq, Lk]
        if self.logits_soft_cap is not None:
            s = torch.tanh(s / self.logits_soft_cap) * self.logits_soft_cap
        if self.alibi_slopes is not None:
            slopes = self._slopes(dev).view(1, self.num_kv_heads, g, 1, 1)
            s = s + slopes * (k_pos - q_pos[..., None]).unsqueeze(1).unsqueeze(1)
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # rows of padding see no key
        o = torch.einsum("bhgqk,bkhd->bqhgd", p, values).flatten(2, 3)  # [B, Lq, Hq, D]
        if lq == 1:
            out.copy_(o[:, 0])
            return
        tok = torch.arange(t, device=dev)
        seq = torch.searchsorted(qsl[1:], tok, right=True)  # [Tp] sequence of each row
        out.copy_(o[seq, tok - qsl[seq]])

    def _slopes(self, device: torch.device) -> torch.Tensor:
        if device not in self._slopes_on:
            self._slopes_on[device] = self.alibi_slopes.to(device)
        return self._slopes_on[device]


class _Paged:
    """Keys/values of each sequence read through its block table (dequantised to float32)."""

    def __init__(self, kv_cache, block_tables, lens, max_len: int, k_scale, v_scale):
        self.kv_cache, self.block_tables, self.lens, self.max_len = kv_cache, block_tables, lens, max_len
        self.k_scale, self.v_scale = k_scale, v_scale

    def gather(self, b: int):
        block_size = self.kv_cache.shape[2]
        n = min(-(-self.max_len // block_size), self.block_tables.shape[1])
        tables = self.block_tables[:, :n].long()  # [B, n]
        k = self.kv_cache[0][tables].flatten(1, 2)  # [B, n*bs, Hkv, D]
        v = self.kv_cache[1][tables].flatten(1, 2)
        return dequantize(k, self.k_scale), dequantize(v, self.v_scale), self.lens.long()


class _Dense:
    """Keys/values of sequence b are rows `start_loc[b]:start_loc[b+1]` of contiguous tensors."""

    def __init__(self, k, v, start_loc, max_len: int):
        self.k, self.v, self.start_loc, self.max_len = k, v, start_loc, max_len

    def gather(self, b: int):
        loc = self.start_loc.long()
        lens = loc[1:] - loc[:-1]
        total = self.k.shape[0]
        rows = (loc[:-1, None] + torch.arange(self.max_len, device=loc.device)).clamp_(max=max(total - 1, 0))
        return self.k[rows].float(), self.v[rows].float(), lens
