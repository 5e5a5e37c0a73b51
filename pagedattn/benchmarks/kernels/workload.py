"""A case made real on the GPU: block tables over shuffled pages, and the rotating input sets.

Every provider of a case reads these same tensors (a backend whose cache layout differs gets a
copy of the same values). Each input set holds its own cache pool, query, step K/V and output,
so cycling through sets keeps a small step from being served out of L2. The step's own K/V are
already written at their slots when the set is made, so every provider's store rewrites the
values that are there, and the dense copies for SDPA hold the same keys as the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import pagedattn
from pagedattn.dtypes import kv_cache_dtype
from pagedattn.intmath import cdiv

from .cases import Case

DTYPE = torch.bfloat16
FP8_SCALE = 0.5  # k_scale = v_scale: randn / 0.5 stays far inside e4m3's +-448
_FILL_CHUNK = 1 << 26  # elements drawn at once when quantising a pool to FP8


@dataclass
class InputSet:
    """One copy of a step's inputs.

    cache: [2, num_blocks, block_size, Hkv, D] in the KV dtype (K = cache[0], V = cache[1]);
        None for ragged cases, whose keys are `key`/`value` themselves.
    query: [T, Hq, D] bf16. key, value: [T, Hkv, D] bf16, the step's new K/V.
    out: [T, Hq, D] bf16, written by whichever provider runs this set.
    """

    cache: torch.Tensor | None
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor


@dataclass
class Workload:
    """Case `case` on `device`: the step's metadata tensors and its input sets.

    block_tables: [B, W] int32 (rows padded with block 0 past a sequence's pages).
    seq_lens: [B] int32. query_start_loc: [B+1] int32. slot_mapping: [T] int64.
    k_scale, v_scale: 0-dim float32 device tensors (FP8 only; 1.0 otherwise).
    alibi_slopes: [Hq] float32 or None.
    """

    case: Case
    device: torch.device
    kv_dtype: torch.dtype
    num_blocks: int
    block_tables: torch.Tensor
    tables: list[list[int]]
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    alibi_slopes: torch.Tensor | None
    sets: list[InputSet]

    @property
    def scale(self) -> float:
        return self.case.head_size ** -0.5

    @property
    def scale_value(self) -> float:
        return FP8_SCALE if self.case.fp8 else 1.0

    def scheduled(self) -> list:
        """The step as the contract's `ScheduledSeq`s."""
        return [pagedattn.ScheduledSeq(c + q, q, t) for (c, q), t in zip(self.case.seqs, self.tables)]

    def dense(self, index: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [B, Hq, S, D], k [B, Hkv, L, D], v [B, Hkv, L, D]) bf16 copies of set `index`
        for dense attention; needs every sequence of the same (context_len, query_len)."""
        c = self.case
        assert c.uniform, f"expected one (context_len, query_len) for all sequences, got {set(c.seqs)}"
        s = self.sets[index]
        b, (ctx, q_len) = c.num_seqs, c.seqs[0]
        n = ctx + q_len
        q = s.query.view(b, q_len, c.num_heads, c.head_size).transpose(1, 2)
        if s.cache is None:
            k, v = (x.view(b, n, c.num_kv_heads, c.head_size) for x in (s.key, s.value))
        else:
            k, v = (s.cache[i][self.block_tables.long()].flatten(1, 2)[:, :n] for i in (0, 1))  # [B, L, Hkv, D]
        return q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def _fill(pool: torch.Tensor, gen: torch.Generator) -> None:
    """Random values in `pool` (bf16, or FP8 holding randn / FP8_SCALE): never zeros."""
    if pool.dtype == DTYPE:
        pool.normal_(generator=gen)
        return
    flat = pool.view(-1)
    fmax = torch.finfo(pool.dtype).max
    for a in range(0, flat.numel(), _FILL_CHUNK):
        part = flat[a:a + _FILL_CHUNK]
        x = torch.randn(part.numel(), device=pool.device, generator=gen)
        part.copy_((x / FP8_SCALE).clamp_(-fmax, fmax).to(pool.dtype))


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a store writes for `x` into a cache of `dtype` (API.md: saturate(x / scale))."""
    if dtype == DTYPE:
        return x
    fmax = torch.finfo(dtype).max
    return (x.float() / FP8_SCALE).clamp(-fmax, fmax).to(dtype)


def make_workload(case: Case, device: torch.device, num_sets: int, seed: int = 0) -> Workload:
    """Case `case` on `device` with `num_sets` input sets (block tables shared by all)."""
    gen_host = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    hq, hkv, d, bs = case.num_heads, case.num_kv_heads, case.head_size, case.block_size
    lens = case.seq_lens
    pages = [cdiv(n, bs) for n in lens] if case.paged else [0] * len(lens)
    num_blocks = sum(pages)
    perm = torch.randperm(num_blocks, generator=gen_host).tolist()  # shuffled pages
    tables, at = [], 0
    for n in pages:
        tables.append(perm[at:at + n])
        at += n
    width = max(1, max(pages))
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    q_lens = torch.tensor([q for _, q in case.seqs])
    ctx = torch.tensor([c for c, _ in case.seqs])
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), q_lens)  # [T]
    pos = ctx[seq_of] + torch.arange(case.num_tokens) - qsl[:-1].long()[seq_of]
    if case.paged:
        slots = bt[seq_of, pos // bs].long() * bs + pos % bs
    else:
        slots = torch.full((case.num_tokens,), -1, dtype=torch.int64)
    kv_dtype = kv_cache_dtype("auto" if case.kv_dtype == "bf16" else case.kv_dtype, DTYPE)
    scale = torch.full((), FP8_SCALE if case.fp8 else 1.0, dtype=torch.float32, device=device)
    slopes = None
    if case.alibi:
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], device=device)
    slot_mapping = slots.to(device)
    t = case.num_tokens

    sets = []
    for _ in range(num_sets):
        key = torch.randn(t, hkv, d, device=device, dtype=DTYPE, generator=gen)
        value = torch.randn(t, hkv, d, device=device, dtype=DTYPE, generator=gen)
        cache = None
        if case.paged:
            cache = torch.empty(2, num_blocks, bs, hkv, d, device=device, dtype=kv_dtype)
            _fill(cache, gen)
            for i, x in enumerate((key, value)):  # as bytes: index_put has no FP8 kernels
                cache[i].view(-1, hkv, d).view(torch.uint8)[slot_mapping] = _stored(x, kv_dtype).view(torch.uint8)
        sets.append(InputSet(cache, torch.randn(t, hq, d, device=device, dtype=DTYPE, generator=gen),
                             key, value, torch.empty(t, hq, d, device=device, dtype=DTYPE)))
    return Workload(case, device, kv_dtype, num_blocks, bt.to(device), tables,
                    torch.tensor(lens, dtype=torch.int32, device=device), qsl.to(device), slot_mapping,
                    scale, scale.clone(), slopes, sets)


def backend_cache(backend, s: InputSet, w: Workload) -> torch.Tensor:
    """`s.cache` in `backend`'s layout (`get_kv_cache_shape`): a view of the same memory where
    the layout is (2, num_blocks, ...) (torch, triton, flash_attn, xformers), else a copy."""
    c = w.case
    shape = backend.get_kv_cache_shape(w.num_blocks, c.block_size, c.num_kv_heads, c.head_size)
    if backend.kv_cache_block_dim == 1:
        return s.cache.view(shape)
    cache = torch.empty(shape, dtype=s.cache.dtype, device=s.cache.device)
    blocks_first = cache.view(w.num_blocks, 2, *s.cache.shape[2:])
    for i in (0, 1):
        blocks_first[:, i].copy_(s.cache[i])
    return cache
