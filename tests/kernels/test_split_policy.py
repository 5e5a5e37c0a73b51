"""The split-KV policy (`choose_num_splits`, host ints only): FA3's wave-efficiency rule."""

from __future__ import annotations

import math

import pytest

from pagedattn.intmath import cdiv
from pagedattn.kernels.paged_attention_config import (EFFICIENCY_SLACK, FILL_SHARE,
                                                      choose_num_splits)

H100_SMS = 132


def splits(num_seqs, num_kv_heads, seq_len, *, query_len=1, block_q=4, block_n=64, sms=H100_SMS,
           max_splits=128):
    return choose_num_splits(num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_query_len=query_len,
                             max_seq_len=seq_len, block_q=block_q, block_n=block_n, num_sms=sms,
                             max_splits=max_splits)


def test_small_batches_split_to_about_one_wave():
    assert splits(1, 8, 1024) == 16  # 16 tiles of 64 keys, one each: 128 programs
    assert splits(1, 1, 16384) == 128  # FA3's cap
    assert splits(4, 8, 16384) == 4  # 128 programs
    assert splits(1, 1, 16384, max_splits=16) == 14  # within 85% of 16


def test_no_split_when_programs_fill_the_gpu_or_keys_are_few():
    assert splits(16, 8, 16384) == 1  # 128 programs >= 0.8 * 132
    assert splits(64, 8, 4096) == 1
    assert splits(1, 8, 256) == 1  # 4 tiles
    assert splits(1, 8, 16384, max_splits=1) == 1
    assert splits(2, 8, 8192, query_len=64, block_q=2) == 1  # prefill-like: 512 programs


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 5, 7, 13, 20, 33, 50, 100])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("seq_len", [300, 1024, 4096, 131072])
def test_the_rule(num_seqs, num_kv_heads, seq_len):
    s = splits(num_seqs, num_kv_heads, seq_len)
    programs, tiles = num_seqs * num_kv_heads, cdiv(seq_len, 64)
    assert 1 <= s <= min(128, tiles, H100_SMS)
    if programs >= FILL_SHARE * H100_SMS:
        assert s == 1
        return
    if s > 1:  # each extra split changes the tiles per split: none idles for nothing
        assert cdiv(tiles, s) != cdiv(tiles, s - 1)
        waves = programs * s / H100_SMS
        eligible = [c for c in range(1, min(128, tiles, H100_SMS) + 1)
                    if c == 1 or cdiv(tiles, c) != cdiv(tiles, c - 1)]
        best = max((programs * c / H100_SMS) / math.ceil(programs * c / H100_SMS) for c in eligible)
        assert waves / math.ceil(waves) >= EFFICIENCY_SLACK * best - 1e-9


def test_bench_rows_with_forced_splits_agree():
    """`pagedattn bench kernels --splits`: each raw-s<N> row runs the same step with N splits;
    a count the shared workspace cannot hold is a row that says so, not a failure."""
    import torch

    pytest.importorskip("triton")
    from pagedattn.benchmarks.kernels import cases as C
    from pagedattn.benchmarks.kernels.raw import prepare_raw
    from pagedattn.benchmarks.kernels.step import NotApplicable
    from pagedattn.benchmarks.kernels.workload import make_workload

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = C.Case("decode", "s", ((300, 1), (70, 1)), num_heads=4, num_kv_heads=2, head_size=32,
                  block_size=16)
    w = make_workload(case, device, num_sets=1)
    outs = []
    for n in (None, 1, 3, 7):
        w.sets[0].out.fill_(float("nan"))
        prepare_raw(w, n).calls[0]()
        outs.append(w.sets[0].out.float().clone())
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=2e-3, rtol=2e-3)
    with pytest.raises(NotApplicable, match="exceed the shared workspace"):
        prepare_raw(w, 100000)
