"""The split-KV policy (`choose_num_splits`, host ints only): about PROGRAMS_PER_SM programs per
SM, fitted on the H100's forced-split grid (docs/PERF.md)."""

from __future__ import annotations

import pytest

from pagedattn.intmath import cdiv
from pagedattn.kernels.paged_attention_config import (MIN_TILES_TO_SPLIT, POLICY_MAX_SPLITS, PROGRAMS_PER_SM,
                                                      choose_num_splits)

H100_SMS = 132


def splits(num_seqs, num_kv_heads, seq_len, *, query_len=1, block_q=4, block_n=64, sms=H100_SMS,
           max_splits=128):
    return choose_num_splits(num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_query_len=query_len,
                             max_seq_len=seq_len, block_q=block_q, block_n=block_n, num_sms=sms,
                             max_splits=max_splits)


def test_the_measured_h100_grid():
    """The best forced count of each cell of `bench kernels --grid decode --splits` (PERF.md)."""
    assert splits(1, 8, 1024) == 16  # 16 tiles of 64 keys, one each
    assert splits(1, 8, 4096) == splits(1, 8, 16384) == 32
    assert splits(1, 1, 1024) == 16 and splits(1, 1, 16384) == 64
    assert splits(16, 1, 4096) == 16 and splits(64, 1, 4096) == 4
    assert splits(16, 8, 4096) == 2  # 128 programs
    # 512 programs: one split (H100 361.7 us vs 366.8 in two, H200 253.8 vs 261.0; 2026-11-27)
    assert splits(64, 8, 4096) == 1
    assert splits(256, 1, 4096) == 1 and splits(256, 8, 4096) == 1


def test_no_split_when_keys_are_few_or_there_is_no_room():
    assert splits(1, 8, 256) == 1  # 4 tiles
    assert splits(1, 8, 16384, max_splits=1) == 1
    assert splits(1, 1, 16384, max_splits=12) == 8  # a power of two within the room
    assert splits(2, 8, 8192, query_len=64, block_q=2) == 1  # prefill-like: 512 programs


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 5, 7, 13, 20, 33, 50, 64, 100, 300])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("seq_len", [300, 1024, 4096, 131072])
@pytest.mark.parametrize("sms", [H100_SMS, 78, 1])
def test_the_rule(num_seqs, num_kv_heads, seq_len, sms):
    s = splits(num_seqs, num_kv_heads, seq_len, sms=sms)
    programs, tiles = num_seqs * num_kv_heads, cdiv(seq_len, 64)
    assert s & (s - 1) == 0 and 1 <= s <= min(POLICY_MAX_SPLITS, max(tiles, 1))
    if tiles < MIN_TILES_TO_SPLIT:
        assert s == 1
    elif programs < PROGRAMS_PER_SM * sms:
        assert s * programs > min(PROGRAMS_PER_SM * sms, POLICY_MAX_SPLITS * programs, tiles * programs) / 4
        assert s * programs <= PROGRAMS_PER_SM * sms  # never past the target
    else:
        assert s == 1


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


def test_bench_raw_rows_of_a_mixed_step_agree():
    """The raw row of a mixed case names its decodes to the launch (`num_decodes`, as the
    `triton` backend does): the mixed launch, with the policy's tile, forced splits or a forced
    tile, gives what the launch without decode tiles gives."""
    import torch

    pytest.importorskip("triton")
    from pagedattn.benchmarks.kernels import cases as C
    from pagedattn.benchmarks.kernels.raw import prepare_raw
    from pagedattn.benchmarks.kernels.workload import make_workload
    from pagedattn.kernels import paged_attention

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = C.Case("mixed", "m", ((40, 90), (0, 70), (300, 1), (65, 1)), num_heads=4, num_kv_heads=2, head_size=32,
                  block_size=16)
    assert case.num_seqs - case.num_prefills == 2
    w = make_workload(case, device, num_sets=1)
    s = w.sets[0]
    prepare_raw(w).calls[0]()  # stores the step's K/V
    expected = torch.full_like(s.out, float("nan"))
    paged_attention(s.query, s.cache[0], s.cache[1], expected, query_start_loc=w.query_start_loc,
                    seq_lens=w.seq_lens, block_tables=w.block_tables, max_query_len=case.max_query_len,
                    max_seq_len=max(case.seq_lens), scale=w.scale, causal=True)
    for kwargs in ({}, {"num_splits": 1}, {"tile": (32, 4, 2)}):
        s.out.fill_(float("nan"))
        prepare_raw(w, **kwargs).calls[0]()
        # other key tiles sum in another order: a bf16 output may differ by its last bit (2^-8 at 1.0)
        torch.testing.assert_close(s.out.float(), expected.float(), atol=8e-3, rtol=8e-3)


def test_a_non_causal_launch_of_few_programs_splits_rather_than_take_the_gluon_kernel(monkeypatch):
    """A cascade's shared part on an H100 (Llama-3-8B heads): 64 queries of one sequence over 4k
    paged keys, not causal: 16 programs unsplit, so the plan splits them on the portable kernel
    (the Gluon kernel has no splits); the same launch, causal, stays on the Gluon kernel."""
    import torch

    pytest.importorskip("triton")
    from pagedattn.device_profile import PRESETS
    from pagedattn.kernels import attention_plan, hopper_prefill

    monkeypatch.setattr(hopper_prefill, "takes", lambda profile, f: True)  # as on an H100, whatever runs here
    monkeypatch.setattr(attention_plan, "INTERPRET", False)
    facts = attention_plan.LaunchFacts(
        PRESETS["h100"], num_tokens=64, num_seqs=1, max_query_len=64, max_seq_len=4096, num_decodes=0,
        max_decode_query_len=1, num_heads=32, num_kv_heads=8, head_size=128, q_dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16, block_size=16, paged=True, causal=False, window=False, alibi=False,
        soft_cap=False, lse=True, split_limit=18, store=0, new_kv=False, gluon_layout=True, gluon_store=False,
        kv_strides=(16384, 1024, 128, 1) * 2)
    plan = attention_plan.plan_attention(facts)
    assert plan.gluon is None and plan.num_splits == 8 and plan.grid[1] == 8  # 16 x 8 programs: one wave
    assert attention_plan.plan_attention(facts._replace(num_tokens=128, max_query_len=128)).num_splits == 4
    assert attention_plan.plan_attention(facts._replace(causal=True)).gluon is not None
    # 256 queries: two splits would be fewer than GLUON_SPLITS (Gluon unsplit was faster there)
    assert attention_plan.plan_attention(facts._replace(num_tokens=256, max_query_len=256)).gluon is not None
    # a step's many queries over the prefix (a long prompt's chunk beside it): programs enough, Gluon
    assert attention_plan.plan_attention(facts._replace(num_tokens=2112, max_query_len=2112, split_limit=1)).gluon
