"""The one paged-batch builder of the tests: a KV pool, block tables, history and a step's inputs.

A batch is described in the API's vocabulary: `(context_len, query_len)` per sequence,
prefills first. The builder hands out the pool's physical blocks in a random order (keeping
spare blocks that nothing may touch), fills every slot with finite junk, scatters each
sequence's history K/V with the test's own loop (never the library's store op), and keeps
dense float64 copies of what the cache holds, which are all the oracle ever reads. The cache
layout is the one `Backend.get_kv_cache_shape` declares (API.md section 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

import pagedattn
from oracle import FP8_DTYPES, dense_attention_with_lse, fp8_dequantize, fp8_quantize

Lens = Sequence[tuple[int, int]]  # (context_len, query_len) per sequence


# ----------------------------------------------------------------------------- cache layout


class CacheLayout:
    """Where K and V of one slot live in one layer's cache tensor, read off the shape that
    `backend.get_kv_cache_shape` returns (API.md section 1):

    kv_first    (torch, triton, flash_attn): (2, num_blocks, block_size, Hkv, D)
    block_first (flashinfer):                (num_blocks, 2, block_size, Hkv, D)
    flat        (xformers):                  (2, num_blocks, block_size * Hkv * D); each block
                is taken as [block_size, Hkv, D] flattened (the NHD order the others share).
    """

    def __init__(self, backend, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self.kind = self._kind_of(backend)
        nb, bs, h, d = num_blocks, block_size, num_kv_heads, head_size
        expected = {"kv_first": (2, nb, bs, h, d), "block_first": (nb, 2, bs, h, d),
                    "flat": (2, nb, bs * h * d)}[self.kind]
        self.shape = tuple(backend.get_kv_cache_shape(nb, bs, h, d))
        assert self.shape == expected, (
            f"{backend.get_name()}.get_kv_cache_shape({nb}, {bs}, {h}, {d}): expected "
            f"{expected}, got {self.shape}")

    @staticmethod
    def _kind_of(backend) -> str:
        # distinct sizes, so the position of each in the shape names the layout
        nb, bs, h, d = 7, 5, 3, 11
        known = {(2, nb, bs, h, d): "kv_first", (nb, 2, bs, h, d): "block_first",
                 (2, nb, bs * h * d): "flat"}
        shape = tuple(backend.get_kv_cache_shape(nb, bs, h, d))
        assert shape in known, (
            f"{backend.get_name()}.get_kv_cache_shape({nb}, {bs}, {h}, {d}): expected one of "
            f"{sorted(known)}, got {shape}")
        return known[shape]

    def kv(self, cache: torch.Tensor, which: int) -> torch.Tensor:
        """K (which=0) or V (which=1) as a [num_blocks, block_size, Hkv, D] view."""
        if self.kind == "kv_first":
            return cache[which]
        if self.kind == "block_first":
            return cache[:, which]
        return cache[which].view(self.num_blocks, self.block_size, self.num_kv_heads,
                                 self.head_size)

    def slot(self, cache: torch.Tensor, which: int, slot: int) -> torch.Tensor:
        """[Hkv, D] view of one slot of K or V."""
        return self.kv(cache, which)[slot // self.block_size, slot % self.block_size]

    def block(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([block_size, Hkv, D], [block_size, Hkv, D]) views of block `block`, K and V."""
        return self.kv(cache, 0)[block], self.kv(cache, 1)[block]


# ----------------------------------------------------------------------------- pool helpers


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """A bitwise view, so comparisons are exact (no NaN != NaN, no -0 == 0)."""
    return t.contiguous().view(torch.uint8)


def make_garbage_cache(shape: Sequence[int], cache_dtype: torch.dtype, device,
                       generator: torch.Generator) -> torch.Tensor:
    """A pool full of finite stale values, as blocks freed by earlier sequences hold."""
    junk = torch.randn(tuple(shape), generator=generator) * 50.0
    if cache_dtype in FP8_DTYPES:
        fmax = torch.finfo(cache_dtype).max
        junk = junk.clamp(-fmax, fmax)
    return junk.to(cache_dtype).to(device)


def slot_of(block_table: Sequence[int], pos: int, block_size: int) -> int:
    return block_table[pos // block_size] * block_size + pos % block_size


def write_tokens(layout: CacheLayout, cache: torch.Tensor, which: int,
                 block_table: Sequence[int], start: int, values: torch.Tensor) -> None:
    """The test's own scatter: token `start + i` of a sequence gets values[i] ([Hkv, D])."""
    view = layout.kv(cache, which)
    bs, pos, i = layout.block_size, start, 0
    while i < values.shape[0]:
        off = pos % bs
        n = min(bs - off, values.shape[0] - i)
        view[block_table[pos // bs], off:off + n] = values[i:i + n].to(cache.device)
        pos, i = pos + n, i + n


def cache_values(x: torch.Tensor, cache_dtype: torch.dtype, scale: float):
    """(what the cache stores for x, what a backend reads back as float64)."""
    if cache_dtype in FP8_DTYPES:
        stored = fp8_quantize(x, scale, cache_dtype)
        return stored, fp8_dequantize(stored, scale)
    stored = x.to(cache_dtype)
    return stored, stored.to(torch.float64)


def allocate_tables(needed: Sequence[int], spare: int, generator: torch.Generator):
    """Block tables over a shuffled pool: (num_blocks, tables, spare block ids)."""
    num_blocks = sum(needed) + spare
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at:at + n])
        at += n
    return num_blocks, tables, perm[at:]


def is_prefill(context_len: int, query_len: int) -> bool:
    """API.md section 2, restated here so the tests do not take it from the code under test."""
    return query_len > 1 or context_len == 0


# ----------------------------------------------------------------------------- the batch


@dataclass
class PagedBatch:
    """One step over a paged pool; every tensor on `device` unless it says float64."""

    lens: tuple[tuple[int, int], ...]   # (context_len, query_len) per sequence
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype                  # the model dtype of query/key/value
    cache_dtype: torch.dtype
    device: torch.device
    layout: CacheLayout
    block_tables: list[list[int]]
    spare_blocks: list[int]
    kv_cache: torch.Tensor              # the pool, in `layout`
    query: torch.Tensor                 # [T, Hq, D] dtype
    key: torch.Tensor                   # [T, Hkv, D] dtype: the step's new tokens
    value: torch.Tensor                 # [T, Hkv, D] dtype
    k_scale: float
    v_scale: float
    hist_k: list[torch.Tensor]          # per sequence [context_len, Hkv, D] float64 CPU, as read
    hist_v: list[torch.Tensor]
    step_written: bool                  # the step's own K/V are in the pool too

    @property
    def num_tokens(self) -> int:
        return sum(q for _, q in self.lens)

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in self.lens]

    @property
    def fp8(self) -> bool:
        return self.cache_dtype in FP8_DTYPES

    def row_ranges(self) -> list[tuple[int, int]]:
        """(first, last + 1) query row of each sequence."""
        out, at = [], 0
        for _, q in self.lens:
            out.append((at, at + q))
            at += q
        return out

    def step_slots(self) -> list[int]:
        """Slot of every query token of the step, in batch order."""
        return [slot_of(t, p, self.block_size) for t, (c, q) in zip(self.block_tables, self.lens)
                for p in range(c, c + q)]

    def scheduled(self) -> list[pagedattn.ScheduledSeq]:
        return [pagedattn.ScheduledSeq(c + q, q, list(t))
                for (c, q), t in zip(self.lens, self.block_tables)]

    def new_kv(self, from_cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's K and V [T, Hkv, D] float64 CPU: as the cache reads them back after the
        store (`from_cache`), or as given (a backend may attend to the inputs directly)."""
        k, v = self.key.cpu(), self.value.cpu()
        if not from_cache:
            return k.double(), v.double()
        return (cache_values(k, self.cache_dtype, self.k_scale)[1],
                cache_values(v, self.cache_dtype, self.v_scale)[1])

    def reference(self, *, scale: float, new_from_cache: bool = True,
                  **options) -> tuple[torch.Tensor, torch.Tensor]:
        """The oracle on the dense copies: (out [T, Hq, D], lse [T, Hq]) float64 CPU; `options`
        are `dense_attention_with_lse`'s (sliding_window, logits_soft_cap, alibi_slopes)."""
        new_k, new_v = self.new_kv(new_from_cache)
        q = self.query.cpu()
        outs, lses = [], []
        for i, (a, b) in enumerate(self.row_ranges()):
            k = torch.cat([self.hist_k[i], new_k[a:b]])
            v = torch.cat([self.hist_v[i], new_v[a:b]])
            o, lse = dense_attention_with_lse(q[a:b], k, v, scale=scale, **options)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


def make_paged_batch(backend, lens: Lens, *, num_heads: int, num_kv_heads: int,
                     head_size: int, block_size: int, dtype: torch.dtype, device="cpu",
                     kv_cache_dtype: str = "auto", seed: int = 0, data_seed: int | None = None,
                     spare_blocks: int = 5, slack_blocks: int = 0, lookahead: int = 0,
                     magnitude: float = 1.0, k_scale: float | None = None,
                     v_scale: float | None = None, write_step: bool = False) -> PagedBatch:
    """Builds a pool in `backend`'s cache layout holding each sequence's history (see module doc).

    `seed` draws the block tables; `data_seed` (default: `seed`) the values, so two batches can
    share tables (one metadata) but hold different layers' data. Sequences at odd indices get
    `slack_blocks` blocks beyond their need, as an engine that allocates ahead hands over;
    `lookahead` tokens of room are left past every seq_len (multi-step decoding). FP8 scales
    default to the data's range (its largest value lands at half the format's range).
    `write_step` also scatters the step's own K/V, for kernels that attend without storing.
    """
    lens = tuple((int(c), int(q)) for c, q in lens)
    kinds = [is_prefill(c, q) for c, q in lens]
    assert kinds == sorted(kinds, reverse=True), f"prefills must come first, got {lens}"
    assert all(q >= 1 and c >= 0 for c, q in lens), f"expected query_len >= 1, got {lens}"
    device = torch.device(device)
    num_blocks, tables, spare = allocate_tables(
        [math.ceil((c + q + lookahead) / block_size) + (slack_blocks if i % 2 else 0)
         for i, (c, q) in enumerate(lens)], spare_blocks, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed if data_seed is None else data_seed + 7919)
    hq, hkv, d = num_heads, num_kv_heads, head_size
    cache_dtype = pagedattn.kv_cache_dtype(kv_cache_dtype, dtype)
    layout = CacheLayout(backend, num_blocks, block_size, hkv, d)
    cache = make_garbage_cache(layout.shape, cache_dtype, device, g)

    # every sequence's full K/V (history + this step), rounded to the model dtype
    full_k = [(torch.randn(c + q, hkv, d, generator=g) * magnitude).to(dtype) for c, q in lens]
    full_v = [(torch.randn(c + q, hkv, d, generator=g) * magnitude).to(dtype) for c, q in lens]
    if cache_dtype in FP8_DTYPES:
        half = 0.5 * torch.finfo(cache_dtype).max
        k_scale = k_scale or float(max(float(k.abs().max()) for k in full_k)) / half
        v_scale = v_scale or float(max(float(v.abs().max()) for v in full_v)) / half
    k_scale, v_scale = k_scale or 1.0, v_scale or 1.0

    hist_k, hist_v = [], []
    for table, (c, _), k, v in zip(tables, lens, full_k, full_v):
        for which, x, scale, hist in ((0, k, k_scale, hist_k), (1, v, v_scale, hist_v)):
            written = x if write_step else x[:c]
            stored, seen = cache_values(written, cache_dtype, scale)
            write_tokens(layout, cache, which, table, 0, stored)
            hist.append(seen[:c])

    query = torch.randn(sum(q for _, q in lens), hq, d, generator=g).to(dtype)
    key = torch.cat([k[c:] for (c, _), k in zip(lens, full_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(lens, full_v)])
    return PagedBatch(
        lens=lens, num_heads=hq, num_kv_heads=hkv, head_size=d, block_size=block_size,
        dtype=dtype, cache_dtype=cache_dtype, device=device, layout=layout, block_tables=tables,
        spare_blocks=spare, kv_cache=cache, query=query.to(device), key=key.to(device),
        value=value.to(device), k_scale=k_scale, v_scale=v_scale, hist_k=hist_k, hist_v=hist_v,
        step_written=write_step)
