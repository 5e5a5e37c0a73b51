"""The tile policy (`choose_tile`, host ints only): decode key tiles by context length, prefill
tiles by head size and prompt length, fitted on the H100 against FlashInfer (docs/PERF.md,
"Decode tiles by context length", "Prefill tiles")."""

from __future__ import annotations

import pytest

from pagedattn.kernels.paged_attention_config import (LONG_KEYS, LONG_PREFILL_KEYS, SHORT_KEYS, choose_tile,
                                                      split_min_tiles)

H100_SMS = 132


def tile(max_seq_len, num_seqs=64, num_kv_heads=8, *, group=4, head_size=128, query_len=1, elem_bytes=2,
         kv_elem_bytes=2):
    t = choose_tile(head_size=head_size, group=group, max_query_len=query_len, elem_bytes=elem_bytes,
                    interpret=False, max_seq_len=max_seq_len, num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                    num_sms=H100_SMS, kv_elem_bytes=kv_elem_bytes)
    return t.block_n, t.num_warps, t.num_stages


def test_the_measured_h100_cells():
    assert tile(128) == tile(SHORT_KEYS) == (32, 4, 2)  # engine-like short contexts
    assert tile(1024, num_seqs=1) == tile(1024, num_seqs=16) == (64, 4, 2)  # few programs
    assert tile(1024, num_seqs=64) == tile(512, num_seqs=256) == (128, 4, 2)  # >= 2 programs an SM
    assert tile(LONG_KEYS, num_seqs=1) == tile(16384, num_seqs=1, num_kv_heads=1) == (128, 4, 2)


def test_fp8_launches_of_a_wave_take_long_tiles():
    """8/1 B=256 L=1k over FP8: 45.3 us in 64 keys, 35.4 in 128 (H100, 2026-11-27)."""
    assert tile(1024, num_seqs=256, num_kv_heads=1, group=8) == (64, 4, 2)  # 16-bit: unchanged
    assert tile(1024, num_seqs=256, num_kv_heads=1, group=8, kv_elem_bytes=1) == (128, 4, 2)
    assert tile(1024, num_seqs=16, num_kv_heads=8, kv_elem_bytes=1) == (64, 4, 2)  # split: unchanged


def prefill(max_seq_len, head_size=128, paged=True):
    t = choose_tile(head_size=head_size, group=4, max_query_len=max_seq_len, elem_bytes=2, interpret=False,
                    max_seq_len=max_seq_len, num_seqs=1, num_kv_heads=8, num_sms=H100_SMS, paged=paged)
    return t.block_m, t.block_n, t.num_warps, t.num_stages


def test_the_measured_prefill_tiles():
    assert prefill(1024) == prefill(1024, paged=False) == (128, 64, 8, 3)
    assert prefill(LONG_PREFILL_KEYS) == (128, 128, 8, 3)  # paged, 4k: 3% faster; 16k: 13%
    assert prefill(LONG_PREFILL_KEYS, paged=False) == (128, 64, 8, 3)  # contiguous 4k: 6% slower in 128
    assert prefill(2 * LONG_PREFILL_KEYS, paged=False) == (128, 128, 8, 3)
    assert prefill(16384, head_size=64) == (128, 128, 4, 3)
    assert prefill(16384, head_size=64, paged=False) == (128, 64, 4, 3)  # 13% slower in 128-key tiles
    assert prefill(1024, head_size=256) == prefill(16384, head_size=256) == (128, 64, 8, 2)  # not 64 rows


def test_unknown_length_and_unmeasured_shapes_keep_the_fixed_table():
    assert tile(0) == (64, 4, 3)  # max_seq_len unknown
    assert tile(128, head_size=256) == (32, 4, 2)  # head size 256: its own entry
    assert tile(16384, head_size=256) == (32, 4, 2)
    assert tile(16384, query_len=16) == (64, 4, 3)  # 64 rows: the fixed decode entry


@pytest.mark.parametrize("max_seq_len", [1, 100, 256, 257, 511, 512, 1000, 4095, 4096, 131072])
@pytest.mark.parametrize("num_seqs", [1, 16, 33, 64, 256])
def test_longer_contexts_never_get_shorter_tiles(max_seq_len, num_seqs):
    assert tile(max_seq_len, num_seqs)[0] <= tile(2 * max_seq_len, num_seqs)[0]


def test_a_graph_planned_for_any_length_splits_only_long_sequences():
    """The kernel splits a sequence only from `split_min_tiles` key tiles: 5 while the launch is
    short of programs (B=1), 10 from PROGRAMS_PER_SM programs an SM on (B=64 x 8 KV heads on 132 SMs:
    only a forced count splits there)."""
    assert split_min_tiles(num_seqs=1, num_kv_heads=8, max_query_len=1, block_q=4, num_sms=H100_SMS) == 5
    assert split_min_tiles(num_seqs=64, num_kv_heads=8, max_query_len=1, block_q=4, num_sms=H100_SMS) == 10
