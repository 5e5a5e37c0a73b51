"""`AttentionPlan`: everything a paged-attention launch decides from host facts, decided once.

A step's layers share its shape (sequences, tokens, the longest query and sequence, how many
decodes) and a model's layers share their settings (heads, head size, dtypes, options), so the
kernel variant, tiles, split count, grid and who writes the step's new K/V are the same for
every layer of a step. `plan_attention` derives them from a `LaunchFacts` (host ints and bools:
the step, the layer, the tensors' layout and the `DeviceProfile`) and is memoised on it: the
first layer of a step plans, the others (and later steps of the same shape) find the plan.
`paged_attention.run_plan` then only launches.

Who writes the new K/V (`Store`):
- `NONE`: nothing to write;
- `KERNEL`: the attention launch writes them (decode programs their own key range's rows
  before reading them; the warp-specialised Gluon kernel's producer a fresh prompt's rows);
- `FIRST`: `store_kv` runs first (programs that share a sequence's keys, FP8 pages for Gluon).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagedattn.device_profile import DeviceProfile

from ._common import INTERPRET, check, next_pow2
from .paged_attention_config import (DECODE_ROWS, PROGRAMS_PER_SM, Tile, choose_mixed_decode_tile, choose_num_splits,
                                     choose_tile, fit_tile, forced_tile, mixed_lead, split_min_tiles)
from . import hopper_prefill


# Splits from which a non-causal launch leaves the Gluon kernel (unsplit) for the portable one:
# H200, 32/8/128 bf16 over 4k paged keys, us, Gluon vs the portable kernel's best split (2026-11-27):
# 64 queries 67.7 vs 29.0 (8 splits), 128: 68.3 vs 43.8 (4), 256: 69.1 vs 75.2 (2).
GLUON_SPLITS = 4


class Store(enum.Enum):
    NONE = "none"
    KERNEL = "kernel"
    FIRST = "first"


class LaunchFacts(NamedTuple):
    """What a launch's plan depends on: host values only (hashable, so plans are memoised)."""

    profile: DeviceProfile
    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    max_decode_query_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int  # 1 for contiguous keys
    paged: bool
    causal: bool
    window: bool
    alibi: bool
    soft_cap: bool
    lse: bool
    split_limit: int  # the most splits the workspace holds for this launch (1: unsplit)
    store: int  # a launch over contiguous rows writes them into pages of this block size (`write`; 0: none)
    new_kv: bool  # a launch over pages writes the step's new rows into the pages it reads (`write`)
    gluon_layout: bool  # the tensors' layout lets the Gluon kernels run (`hopper_prefill.layout_ok`)
    gluon_store: bool  # ... and its producer write the rows (`hopper_prefill.stores_rows`)
    kv_strides: tuple  # the caches' strides (the Gluon kernels take a page's row stride as a constexpr)
    tile: tuple | None = None  # forced (tuning)
    decode_tile: tuple | None = None
    num_splits: int | None = None
    sinks: bool = False  # attention sinks (`paged_attention`'s `sinks`)


@dataclass(eq=False)
class AttentionPlan:
    """One launch, decided. `gluon` is the Hopper kernel's plan when that kernel runs; otherwise
    the portable kernel runs with `tile` (and `decode_tile` for a mixed launch's decodes)."""

    facts: LaunchFacts
    store: Store
    gluon: hopper_prefill.HopperPlan | None = None
    tile: Tile | None = None
    decode_tile: Tile | None = None
    one_tile: bool = False
    num_splits: int = 1
    min_tiles: int = 0
    num_heavy: int = 0
    num_tiles: int = 0
    num_mixed: int = 0
    mix_lead: int = 0
    grid: tuple[int, int] = (0, 1)
    search_steps: int = 8
    empty: bool = False  # no token or no sequence: nothing to attend
    bound: dict = field(default_factory=dict)  # the launches' BoundKernels, bound on first run


def search_steps(num_seqs: int) -> int:
    """Steps of the kernel's binary search for its sequence: enough for `num_seqs`, rounded up
    to a multiple of 4 (at least 8), so one compiled variant serves every batch of up to 255
    sequences (surplus steps leave the search where it is)."""
    return max(8, -(-num_seqs.bit_length() // 4) * 4)


@functools.lru_cache(maxsize=4096)
def plan_attention(f: LaunchFacts) -> AttentionPlan:
    """The plan of a launch with facts `f` (memoised: one plan per distinct launch)."""
    group = f.num_heads // f.num_kv_heads
    steps = search_steps(f.num_seqs)
    if f.num_tokens == 0 or f.num_seqs == 0:
        return AttentionPlan(f, Store.FIRST if f.store or f.new_kv else Store.NONE, empty=True, search_steps=steps)
    elem = f.q_dtype.itemsize
    kv_elem = f.kv_dtype.itemsize
    tile, num_splits, min_tiles = _portable_tile(f, group)
    # The Gluon kernel does not split keys. A non-causal launch of few programs (a cascade's
    # shared part: every query of a step over the prefix) splits them on the portable kernel
    # where that makes GLUON_SPLITS or more (docs/PERF.md, "Cascade attention").
    if (f.tile is None and f.decode_tile is None and hopper_prefill.takes(f.profile, f)
            and (f.causal or num_splits < GLUON_SPLITS)):
        gluon = hopper_prefill.plan_hopper(f, search_steps=steps)
        store = Store.NONE
        if f.store:
            store = Store.KERNEL if f.gluon_store else Store.FIRST
        elif f.new_kv:
            store = Store.FIRST
        return AttentionPlan(f, store, gluon=gluon, search_steps=steps)

    dec = None
    if 0 < f.num_decodes < f.num_seqs:
        dec = choose_mixed_decode_tile(tile, head_size=f.head_size, group=group,
                                       max_decode_query_len=f.max_decode_query_len, elem_bytes=elem,
                                       interpret=INTERPRET)
        if dec is not None and f.decode_tile is None:
            dec = fit_tile(dec, f.profile, head_size=f.head_size, group=group, q_bytes=elem, kv_bytes=kv_elem)
    if f.decode_tile is not None:
        check(len(f.decode_tile) in (2, 3), "decode_tile", "(BLOCK_N, num_stages[, BLOCK_M])", f.decode_tile)
        check(dec is not None, "decode_tile", "a launch whose decodes get their own tile (num_decodes "
              "sequences after prefill-tiled ones, within a decode tile's rows)",
              f"num_decodes={f.num_decodes} of {f.num_seqs} sequences, max_query_len={f.max_query_len}, "
              f"max_decode_query_len={f.max_decode_query_len}, the launch's tile {tile}")
        dec = forced_tile(dec, f.decode_tile[0], tile.num_warps, *f.decode_tile[1:], group=group,
                          interpret=INTERPRET)
        check(dec.block_q >= f.max_decode_query_len, "decode_tile rows",
              f">= {f.max_decode_query_len * group} (max_decode_query_len x {group} heads)", dec.block_m)
    mixed = dec is not None
    # Launches whose every sequence's queries fit one tile (as `max_query_len` bounds them) map
    # tile b to sequence b; otherwise tiles are numbered as the kernel's search expects, over the
    # sequences before the decodes in a mixed launch (which always searches: one compiled variant
    # whatever its prefills' lengths).
    one_tile = f.max_query_len <= tile.block_q and not mixed
    if f.store:
        store = Store.FIRST  # the portable kernel does not write contiguous rows into pages
    elif f.new_kv:
        # programs that share a sequence's keys (several query tiles) need the rows stored first
        store = Store.KERNEL if one_tile else Store.FIRST
    else:
        store = Store.NONE
    num_heavy = f.num_seqs - f.num_decodes if mixed else f.num_seqs
    num_tiles = f.num_seqs if one_tile else f.num_tokens // tile.block_q + num_heavy  # >= what every sequence needs
    num_mixed = f.num_decodes if mixed else 0
    return AttentionPlan(
        f, store, tile=tile, decode_tile=dec, one_tile=one_tile, num_splits=num_splits, min_tiles=min_tiles,
        num_heavy=num_heavy, num_tiles=num_tiles, num_mixed=num_mixed,
        mix_lead=mixed_lead(num_tiles) if mixed else 0,
        grid=((num_tiles + num_mixed) * f.num_kv_heads, num_splits), search_steps=steps)


def _portable_tile(f: LaunchFacts, group: int) -> tuple[Tile, int, int]:
    """The portable kernel's (tile, split count, key tiles before a sequence splits) for `f`."""
    elem, kv_elem = f.q_dtype.itemsize, f.kv_dtype.itemsize
    chosen = choose_tile(head_size=f.head_size, group=group, max_query_len=f.max_query_len, elem_bytes=elem,
                         interpret=INTERPRET, max_seq_len=f.max_seq_len, num_seqs=f.num_seqs,
                         num_kv_heads=f.num_kv_heads, num_sms=f.profile.num_sms, paged=f.paged,
                         kv_elem_bytes=kv_elem)
    if f.tile is None:
        tile = fit_tile(chosen, f.profile, head_size=f.head_size, group=group, q_bytes=elem, kv_bytes=kv_elem)
    else:
        tile = forced_tile(chosen, *f.tile, group=group, interpret=INTERPRET)
    if f.num_splits is not None:
        return tile, f.num_splits, 0  # a forced count splits every sequence
    num_splits = 1
    if f.split_limit >= 2:
        # a non-causal launch of prefill tiles (8 warps, one program an SM) aims at one wave
        per_sm = 1 if not f.causal and tile.block_m > DECODE_ROWS else PROGRAMS_PER_SM
        num_splits = choose_num_splits(
            num_seqs=f.num_seqs, num_kv_heads=f.num_kv_heads, max_query_len=f.max_query_len,
            max_seq_len=f.max_seq_len, block_q=tile.block_q, block_n=tile.block_n, num_sms=f.profile.num_sms,
            max_splits=f.split_limit, programs_per_sm=per_sm)
    min_tiles = split_min_tiles(num_seqs=f.num_seqs, num_kv_heads=f.num_kv_heads,
                                max_query_len=f.max_query_len, block_q=tile.block_q, num_sms=f.profile.num_sms)
    return tile, num_splits, min_tiles


def head_pad(head_size: int) -> int:
    """The kernels' head dimension: the next power of two, at least 16."""
    return max(16, next_pow2(head_size))
