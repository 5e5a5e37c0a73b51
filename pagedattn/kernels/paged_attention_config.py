"""Tile choice and split-KV planning for `paged_attention` (host ints only).

Everything here is a pure function of host-side integers (head size, GQA group, the largest
query length, batch size, KV heads, SM count), so a launch planned at CUDA-graph capture is the
launch replayed later; correctness never depends on the choice, only speed.

Two regimes, chosen by the step's largest query length:
- decode-like (`next_pow2(max_query_len * group) <= DECODE_ROWS` rows): one program covers a few
  query tokens times the `group` query heads sharing a KV head, padded to >= 16 rows for
  `tl.dot`; it streams the keys memory-bound, so tiles favour many loads in flight.
- prefill-like: 128 rows of `BLOCK_Q` tokens x `group` heads against 64-key tiles (128 for
  long prompts), the usual FlashAttention-2 shape for Hopper without wgmma-specific code.
A prefill-like launch whose last sequences are decodes (a mixed step) gives those a decode tile
of their own in the same launch (`choose_mixed_decode_tile`), with the prefill tile's warps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedattn.intmath import cdiv

from ._common import next_pow2

# The split rule, fitted on the H100 (docs/PERF.md, "Split-KV policy, measured"): a decode
# program (16 query rows, 4 warps, ~96 KiB of staged K/V) streams its keys latency-bound, so a
# launch wants about PROGRAMS_PER_SM resident programs per SM; fewer split each sequence's keys.
PROGRAMS_PER_SM = 2
POLICY_MAX_SPLITS = 64  # beyond this the reduction costs more than the split gains (forced counts may go higher)
MIN_TILES_TO_SPLIT = 5  # at most 4 key tiles (256 keys at BLOCK_N 64): never worth a reduction
# A launch of at least PROGRAMS_PER_SM programs an SM is not split. (Two splits between 3 and 6
# programs an SM won 4-17% on the H100 with 64-key tiles, 2026-11-23; with today's 128-key tiles
# one split is as fast or faster on both GPUs, 2026-11-27 on c21ae2d, 32/8/128 B=64, us for one
# and two splits: H100 L=4k 361.7 / 366.8, L=16k 1417 / 1413; H200 L=4k 253.8 / 261.0.)


@dataclass(frozen=True)
class Tile:
    """One program's shape: the portable kernel's tiles, and a Gluon kernel's (whose rows follow
    its warpgroups)."""

    block_q: int       # query tokens per program
    block_m: int       # rows of the packed [block_m, D] query tile (block_q * group, padded)
    block_n: int       # keys per inner-loop step
    num_warps: int
    num_stages: int


# head_pad -> (block_m, block_n, num_warps, num_stages) for 16-bit queries, fitted on the H100
# (docs/PERF.md, "Prefill tiles"): 128 rows throughout (head size 256 ran 1.7-2.3x faster in
# 128 rows than in 64), and 128-key tiles for long prompts, where fewer, longer key tiles win.
_PREFILL_TILES = {
    32: (128, 64, 4, 3),
    64: (128, 64, 4, 3),
    128: (128, 64, 8, 3),
    256: (128, 64, 8, 2),
}
_LONG_PREFILL_TILES = {64: (128, 128, 4, 3), 128: (128, 128, 8, 3)}
LONG_PREFILL_KEYS = 4096
# (head_pad, paged) -> the longest sequence from which the long tile wins (contiguous keys at
# head size 64 ran 13% slower in it even at 16k, so that pair has none)
_LONG_PREFILL_FROM = {(64, True): LONG_PREFILL_KEYS, (128, True): LONG_PREFILL_KEYS,
                      (128, False): 2 * LONG_PREFILL_KEYS}
DECODE_ROWS = 64  # query rows (tokens x group, padded) up to which a launch is decode-like
# head_pad -> (block_n, num_warps, num_stages) for decode-like steps.
_DECODE_TILES = {
    32: (64, 4, 3),
    64: (64, 4, 3),
    128: (64, 4, 3),
    256: (32, 4, 2),
}


# Decode-like tiles of up to 32 rows and head sizes up to 128, by the longest sequence: fitted on
# the H100 (docs/PERF.md, "Decode tiles by context length"), (block_n, num_warps, num_stages).
SHORT_KEYS = 256  # up to this many keys: 32-key tiles (a program's few tiles, more programs resident)
LONG_KEYS = 4096  # from this many keys (from 512 in a launch of >= PROGRAMS_PER_SM programs an SM): 128
_SHORT_TILE, _MID_TILE, _LONG_TILE = (32, 4, 2), (64, 4, 2), (128, 4, 2)


def _decode_tile(key: int, block_m: int, max_seq_len: int, programs: int, num_sms: int,
                 kv_elem_bytes: int) -> tuple[int, int, int]:
    if key > 128 or block_m > 32 or max_seq_len <= 0:
        return _DECODE_TILES[key]
    if max_seq_len <= SHORT_KEYS:
        return _SHORT_TILE
    if max_seq_len >= LONG_KEYS or (max_seq_len >= 2 * SHORT_KEYS and programs >= PROGRAMS_PER_SM * num_sms):
        return _LONG_TILE
    # A 64-key FP8 tile holds half a 16-bit tile's bytes: a launch of a wave or more (so not split)
    # keeps too few loads in flight with it. 8/1/128 B=256 L=1k FP8, 64 vs 128 keys, us
    # (2026-11-27, c21ae2d): H100 45.3 vs 35.4, H200 44.5 vs 33.3 (3 stages).
    if kv_elem_bytes == 1 and programs >= num_sms:
        return _LONG_TILE
    return _MID_TILE


def _prefill_tile(key: int, max_seq_len: int, paged: bool) -> tuple[int, int, int, int]:
    start = _LONG_PREFILL_FROM.get((key, paged))
    return _LONG_PREFILL_TILES[key] if start is not None and max_seq_len >= start else _PREFILL_TILES[key]


def choose_tile(*, head_size: int, group: int, max_query_len: int, elem_bytes: int, interpret: bool,
                max_seq_len: int = 0, num_seqs: int = 1, num_kv_heads: int = 1, num_sms: int = 1,
                paged: bool = True, kv_elem_bytes: int = 2) -> Tile:
    """The tile for one launch; `elem_bytes` is the query element size (4 shrinks tiles).
    Decode-like launches pick their key tile by `max_seq_len` (0: unknown, the fixed table),
    their size (`num_seqs` x `num_kv_heads` programs on `num_sms`) and the cache's element size
    (`kv_elem_bytes`); prefill-like ones by `max_seq_len` and whether the keys are paged or
    contiguous rows."""
    head_pad = max(16, next_pow2(head_size))
    key = min(max(head_pad, 32), 256)
    rows = next_pow2(max(1, max_query_len) * group)
    if rows <= DECODE_ROWS:
        block_m = max(16, rows, next_pow2(group))
        block_n, num_warps, num_stages = _decode_tile(key, block_m, max_seq_len, num_seqs * num_kv_heads, num_sms,
                                                        kv_elem_bytes)
    else:
        block_m, block_n, num_warps, num_stages = _prefill_tile(key, max_seq_len, paged)
    block_m = max(block_m, next_pow2(group))  # at least one token's heads per program
    if elem_bytes == 4 and not interpret:
        # float32 operands double shared memory; keep the pipeline within ~160 KiB.
        block_m = min(block_m, max(64, next_pow2(group)))
        block_n = 32
        num_stages = 1 if head_pad >= 256 else 2
    if interpret:
        num_warps, num_stages = 1, 1
    block_q = max(1, block_m // group)
    return Tile(block_q, block_m, block_n, num_warps, num_stages)


# Mixed launches (a prefill chunk beside many decodes, e.g. a 2k chunk over 2k keys and 64
# decodes of 2k at 32/8/128): the decodes, the launch's last sequences, get programs of a decode
# tile in the same launch. It runs with the prefill tile's warps (8 at head size 128) and one CTA
# an SM (the prefill body's 216-255 registers x 256 threads, sm_90 compile), so a decode program
# alone must keep enough keys in flight. head_pad -> (block_n, num_stages) of those programs.
# 5 stages give two K/V buffers a loop (sm_90 compile: the block-table load takes a stage of its
# own, and a tile read into registers frees its buffer); ~140 KB of shared memory at head size
# 128. Measured once (H100, that step): 568 us against 654 with every sequence in the prefill
# tile; not fitted further (on an H100 the Gluon kernel takes such steps: docs/PERF.md).
MIXED_DECODE_TILES = {
    32: (128, 5),
    64: (128, 5),
    128: (128, 5),
    256: (64, 5),
}
# Where the decode programs sit in a mixed launch's grid: after this fraction of the prefill's
# query tiles (longest first), the rest of the tiles and the decodes interleave evenly. 0: the
# decodes' memory-bound streaming overlaps the prefill's matmuls from the start; 1: every
# prefill tile first. Measured on the step above: 568 us at 0, 566 at 1 (within noise).
MIXED_PREFILL_LEAD = 0.0


def choose_mixed_decode_tile(tile: Tile, *, head_size: int, group: int, max_decode_query_len: int,
                             elem_bytes: int, interpret: bool) -> Tile | None:
    """The tile of a mixed launch's decode programs (each up to `max_decode_query_len` query
    tokens), beside prefill programs of `tile`; None unless `tile` is prefill-shaped (more than
    DECODE_ROWS rows: a decode-like launch keeps one tile, and one compiled variant) and the
    decodes are decode-like and fit fewer rows than `tile`'s."""
    rows = next_pow2(max(1, max_decode_query_len) * group)
    block_m = max(16, rows)
    if tile.block_m <= DECODE_ROWS or rows > DECODE_ROWS or block_m >= tile.block_m:
        return None
    head_pad = max(16, next_pow2(head_size))
    block_n, num_stages = MIXED_DECODE_TILES[min(max(head_pad, 32), 256)]
    if elem_bytes == 4 and not interpret:  # float32 operands: as `choose_tile` keeps them
        block_n, num_stages = 32, 1 if head_pad >= 256 else 2
    if interpret:
        num_stages = 1
    return Tile(max(1, block_m // group), block_m, block_n, tile.num_warps, num_stages)


def mixed_lead(num_tiles: int) -> int:
    """Query tiles of a mixed launch's prefill part that precede its first decode program."""
    return min(num_tiles, round(MIXED_PREFILL_LEAD * num_tiles))


def forced_tile(tile: Tile, block_n: int, num_warps: int, num_stages: int,
                block_m: int | None = None, *, group: int, interpret: bool) -> Tile:
    """`tile` with a caller's (BLOCK_N, num_warps, num_stages[, BLOCK_M rows]) for tuning runs;
    refused with the reason when Triton could not launch it (under the interpreter warps and
    stages stay 1). Without `block_m` the rows stay the policy's."""
    block_m = tile.block_m if block_m is None else block_m
    for name, value, ok, expect in (
            ("block_n", block_n, _pow2_in(block_n, 16, 256), "a power of two in 16..256"),
            ("block_m", block_m, _pow2_in(block_m, max(16, next_pow2(group)), 256),
             f"a power of two in {max(16, next_pow2(group))}..256 (one token's {group} heads at least)"),
            ("num_warps", num_warps, num_warps in (1, 2, 4, 8, 16), "1, 2, 4, 8 or 16"),
            ("num_stages", num_stages, 1 <= num_stages <= 8, "1..8")):
        if not ok:
            raise ValueError(f"expected tile {name} {expect}, got {value}")
    if interpret:
        num_warps, num_stages = 1, 1
    return Tile(max(1, block_m // group), block_m, block_n, num_warps, num_stages)


# Shared memory of a portable-kernel program, an upper bound (sm_80-sm_90, Triton 3.6-3.9): the
# query tile, the key and value tiles (double-buffered where the pipeliner stages them), P for the
# second product, and the compiler's scratch. Checked against the compiled kernels' `shared` for
# sm_80/86/89/90 (tests/kernels/test_compile_targets.py); e.g. a forced 128x64 tile at head size
# 256 over bf16 on sm_86: 147,456 B compiled, 212,992 B by this bound (the policy plans 64x32 there).
SMEM_SLACK = 4096


def smem_bytes(tile: Tile, *, head_size: int, q_bytes: int, kv_bytes: int) -> int:
    """An upper bound of the shared memory one program of `tile` holds."""
    head = max(16, next_pow2(head_size))
    buffers = min(tile.num_stages, 2)
    return (tile.block_m * head * q_bytes + buffers * 2 * tile.block_n * head * kv_bytes
            + tile.block_m * tile.block_n * q_bytes + SMEM_SLACK)


def fit_tile(tile: Tile, profile, *, head_size: int, group: int, q_bytes: int, kv_bytes: int) -> Tile:
    """`tile`, shrunk until `smem_bytes` fits what a program may hold on a device of `profile`
    (a `DeviceProfile`): fewer keys a step (down to 32), one stage, fewer rows (down to one
    token's heads, 16 at least), then 16 keys. A100: head size 256 prefills take 32-key tiles;
    A10/L4/L40S/RTX 3090/4090 (99 KiB): also one stage and 64 rows; H100/H200: unchanged."""
    min_rows = max(16, next_pow2(group))
    while smem_bytes(tile, head_size=head_size, q_bytes=q_bytes, kv_bytes=kv_bytes) > profile.smem_per_block:
        if tile.block_n > 32:
            tile = dataclasses.replace(tile, block_n=tile.block_n // 2)
        elif tile.num_stages > 1:
            tile = dataclasses.replace(tile, num_stages=1)
        elif tile.block_m > min_rows:
            block_m = tile.block_m // 2
            tile = dataclasses.replace(tile, block_m=block_m, block_q=max(1, block_m // group))
        elif tile.block_n > 16:
            tile = dataclasses.replace(tile, block_n=16)
        else:
            raise ValueError(f"no tile of head size {head_size} fits {profile.smem_per_block} B of shared memory "
                             f"on {profile.name} (the smallest needs "
                             f"{smem_bytes(tile, head_size=head_size, q_bytes=q_bytes, kv_bytes=kv_bytes)} B)")
    return tile


def _pow2_in(x: int, lo: int, hi: int) -> bool:
    return lo <= x <= hi and x & (x - 1) == 0


def choose_num_splits(*, num_seqs: int, num_kv_heads: int, max_query_len: int,
                      max_seq_len: int, block_q: int, block_n: int, num_sms: int,
                      max_splits: int, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """FlashDecoding split count for a launch of `num_seqs x query tiles x num_kv_heads` programs.

    No split when the longest sequence has fewer key tiles than `split_min_tiles`. With fewer
    programs than target = `programs_per_sm` x SMs: the largest power of two <= target // programs,
    at most POLICY_MAX_SPLITS, the key tiles and `max_splits` (the workspace's room). Otherwise 1.
    A non-causal launch of prefill tiles (a cascade's shared part) aims at one program an SM: H200,
    64 queries of 32/8/128 over 4k keys, 29.0 us in 8 splits, 40.9 in 16 (docs/PERF.md).
    On an H100 or H200 (132 SMs) with 64-key tiles: 32/8/128 B=1 -> 32 splits (16 at 1k keys:
    one tile each), B=16 -> 2, B=64 -> 1; 8/1/128 B=1 -> 64, B=16 -> 16, B=64 -> 4, B=256 -> 1.
    An A100 (108 SMs) splits a little less, an L40S (142) a little more: the rule counts SMs.
    """
    programs = _programs(num_seqs, num_kv_heads, max_query_len, block_q)
    tiles = cdiv(max(1, max_seq_len), block_n)
    if max_splits <= 1 or tiles < split_min_tiles(num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                                                  max_query_len=max_query_len, block_q=block_q, num_sms=num_sms):
        return 1
    target = programs_per_sm * num_sms
    if programs >= target:
        return 1
    want = max(1, min(target // programs, POLICY_MAX_SPLITS, tiles, max_splits))
    return 1 << (want.bit_length() - 1)


def split_min_tiles(*, num_seqs: int, num_kv_heads: int, max_query_len: int, block_q: int, num_sms: int) -> int:
    """Key tiles a sequence needs before the policy splits it: MIN_TILES_TO_SPLIT while the
    launch is short of programs, twice that otherwise (a forced count). The kernel applies it per
    sequence, so a launch planned for long sequences (a CUDA graph, captured for any length)
    leaves its short ones unsplit."""
    programs = _programs(num_seqs, num_kv_heads, max_query_len, block_q)
    return MIN_TILES_TO_SPLIT if programs < PROGRAMS_PER_SM * num_sms else 2 * MIN_TILES_TO_SPLIT


def _programs(num_seqs: int, num_kv_heads: int, max_query_len: int, block_q: int) -> int:
    """Programs of one split of a launch: query tiles x KV heads."""
    return num_seqs * cdiv(max(1, max_query_len), block_q) * num_kv_heads
