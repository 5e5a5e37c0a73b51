"""Dense float64 oracle and paged-batch builder for the kernel tests (never uses kernel code).

The builder scatters each sequence's blocks over a random permutation of the physical blocks
and fills every unused slot with noise, so a kernel that reads outside its sequence fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    query: torch.Tensor          # [T, Hq, D]
    k_cache: torch.Tensor        # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor       # [B] int32
    block_tables: torch.Tensor   # [B, W] int32
    query_lens: list[int]
    seq_len_list: list[int]
    block_size: int


def make_paged_batch(seqs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int,
                     head_size: int, block_size: int, dtype: torch.dtype,
                     cache_dtype: torch.dtype | None = None, device="cpu", seed: int = 0,
                     extra_blocks: int = 3) -> PagedBatch:
    """seqs: (query_len, seq_len) per sequence, prefills and decodes in any order."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [-(-s // block_size) for _, s in seqs]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    width = max(1, max(blocks_per_seq))
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[used:used + n].to(torch.int32)
        # garbage (but in-range) entries past the sequence's end
        tables[b, n:] = perm[-1].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    num_tokens = sum(q for q, _ in seqs)
    query = torch.randn(num_tokens, num_heads, head_size, generator=g)
    qsl = [0]
    for q, _ in seqs:
        qsl.append(qsl[-1] + q)
    return PagedBatch(
        query=query.to(dtype).to(device),
        k_cache=k.to(cache_dtype).to(device), v_cache=v.to(cache_dtype).to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_lens=[q for q, _ in seqs], seq_len_list=[s for _, s in seqs],
        block_size=block_size)


def gather_sequence(cache: torch.Tensor, table: torch.Tensor, seq_len: int,
                    block_size: int) -> torch.Tensor:
    """[seq_len, Hkv, D] float64 of one sequence, walking its block table position by position."""
    pos = torch.arange(seq_len, device=cache.device)
    blocks = table.to(cache.device).long()[pos // block_size]
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # fp8: index bytes
    return raw[blocks, pos % block_size].view(cache.dtype).double()


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    causal: bool = True, sliding_window: int | None = None,
                    alibi_slopes: torch.Tensor | None = None, soft_cap: float | None = None):
    """One sequence. q [S, Hq, D], k/v [L, Hkv, D] -> float64 (out [S, Hq, D], lse [S, Hq]),
    on q's device."""
    q, k, v = q.double(), k.double().to(q.device), v.double().to(q.device)
    dev = dict(dtype=torch.float64, device=q.device)
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)                     # [L, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("shd,lhd->hsl", q, k) * scale            # [Hq, S, L]
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    q_pos = torch.arange(seq_len - num_q, seq_len, **dev)   # bottom-right aligned
    k_pos = torch.arange(seq_len, **dev)
    if alibi_slopes is not None:
        s = s + alibi_slopes.to(**dev)[:, None, None] * (k_pos[None, :] - q_pos[:, None])
    keep = torch.ones(num_q, seq_len, dtype=torch.bool, device=q.device)
    if causal:
        keep &= k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        keep &= k_pos[None, :] > q_pos[:, None] - sliding_window
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)                          # [Hq, S]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hsl,lhd->shd", p, v)
    return out, lse.transpose(0, 1)


def reference_paged(batch: PagedBatch, *, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, **kw):
    """Oracle for the whole batch: (out [T, Hq, D], lse [T, Hq]) float64."""
    outs, lses = [], []
    tables = batch.block_tables
    for b, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_len_list)):
        start = sum(batch.query_lens[:b])
        k = gather_sequence(batch.k_cache, tables[b], seq_len, batch.block_size) * k_scale
        v = gather_sequence(batch.v_cache, tables[b], seq_len, batch.block_size) * v_scale
        o, l = dense_attention(batch.query[start:start + q_len], k, v, scale=scale, **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs).cpu(), torch.cat(lses).cpu()


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))
