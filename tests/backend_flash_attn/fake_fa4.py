"""A stand-in for FA4's `flash_attn.cute.flash_attn_varlen_func` on the CPU: its signature's
forward arguments, its asserts on them and its return values, computed densely in float32.

What it mirrors of FA4 4.0.0b36 (`flash_attn/cute/interface.py`): q [total_q, Hq, D] with
`cu_seqlens_q`, or [B, Sq, Hq, D] without; k/v contiguous [total_k, Hkv, D] with `cu_seqlens_k`,
paged [num_pages, page, Hkv, D] with `page_table` (never with `cu_seqlens_k`) and
`seqused_k`, or batched [B, S, Hkv, D]; float16/bfloat16 only; int32 lengths; a window of
(left, right) with None unbounded, both negative meaning none, `causal` forcing right = 0;
softcap 0 off; `learnable_sink` [Hq] (one more logit per head in the softmax's denominator,
float16/bfloat16/float32); bottom-right causal alignment; returns (out, lse) with lse None unless
`return_lse`, [Hq, total_q] (varlen q) or [B, Hq, Sq] (batched q). `calls` records each call's
keyword arguments, for the tests of the adapter's mapping.
"""

from __future__ import annotations

import math

import torch

calls: list[dict] = []


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None,
                           mask_mod=None, block_sparse_tensors=None, aux_tensors=None, aux_scalars=None,
                           return_lse=False, **rest):
    calls.append(dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, page_table=page_table,
                      softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                      learnable_sink=learnable_sink, return_lse=return_lse, q_shape=tuple(q.shape)))
    if learnable_sink is not None:
        assert learnable_sink.shape == (q.shape[-2],)
        assert learnable_sink.dtype in (torch.float16, torch.bfloat16, torch.float32), \
            "learnable_sink must be float16, bfloat16, or float32"
    assert v.dtype in (torch.float16, torch.bfloat16), "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"
    assert q.dtype == k.dtype == v.dtype, "q, k, v, and qv must have the same dtype"
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_k):
        assert t is None or (t.dtype == torch.int32 and t.stride(0) == 1)
    if page_table is not None:
        assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
        assert page_table.dtype == torch.int32
    varlen_q = cu_seqlens_q is not None
    if varlen_q:
        assert q.dim() == 3
        q_starts = cu_seqlens_q.tolist()
    else:
        assert q.dim() == 4
        batch, sq = q.shape[:2]
        q_starts = [b * sq for b in range(batch + 1)]
        q = q.reshape(batch * sq, *q.shape[2:])
    num_seqs = len(q_starts) - 1
    hq, d = q.shape[1:]
    hkv = v.shape[-2]
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(d)
    left, right = window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((hq, q.shape[0]), float("-inf"), device=q.device)
    for b in range(num_seqs):
        if page_table is not None:
            n = int(seqused_k[b]) if seqused_k is not None else page_table.shape[1] * k.shape[1]
            keys = k[page_table[b].long()].flatten(0, 1)[:n]
            values = v[page_table[b].long()].flatten(0, 1)[:n]
        elif cu_seqlens_k is not None:
            a, e = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
            keys, values = k[a:e], v[a:e]
        else:
            n = int(seqused_k[b]) if seqused_k is not None else k.shape[1]
            keys, values = k[b, :n], v[b, :n]
        rows = slice(q_starts[b], q_starts[b + 1])
        qb = q[rows].float()
        lq, lk = qb.shape[0], keys.shape[0]
        keys = keys.float().repeat_interleave(hq // hkv, 1)
        values = values.float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", qb, keys) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        rel = (torch.arange(lk, device=q.device)[None, :]
               - (torch.arange(lq, device=q.device) + lk - lq)[:, None])  # key - query position
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if right is not None:
            keep &= rel <= right
        if left is not None:
            keep &= rel >= -left
        s = s.masked_fill(~keep, float("-inf"))
        m = torch.logsumexp(s, -1)  # [Hq, Lq]
        if learnable_sink is not None:
            m = torch.logaddexp(m, learnable_sink.float()[:, None].expand_as(m))
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)
        out[rows] = torch.einsum("hqk,khd->qhd", p, values)
        lse[:, rows] = m
    out = out.to(q.dtype)
    if not varlen_q:
        out = out.view(batch, sq, hq, d)
        lse = lse.view(hq, batch, sq).permute(1, 0, 2).contiguous()
    return out, (lse if return_lse else None)
