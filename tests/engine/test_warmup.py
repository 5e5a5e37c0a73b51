"""The start-up warm-up's dummy steps stay inside the engine's limits and cover the shape classes."""

import pytest

from pagedattn.engine.warmup import warmup_steps

LIMITS = [
    dict(block_size=16, num_blocks=4096, max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192),
    dict(block_size=16, num_blocks=64, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=2048),
    dict(block_size=1, num_blocks=300, max_num_batched_tokens=128, max_num_seqs=4, max_model_len=256),
    dict(block_size=16, num_blocks=1, max_num_batched_tokens=16, max_num_seqs=1, max_model_len=16),
]


@pytest.mark.parametrize("limits", LIMITS)
def test_steps_fit_the_engine(limits):
    steps = warmup_steps(**limits)
    assert steps
    for seqs in steps:
        assert 1 <= len(seqs) <= limits["max_num_seqs"]
        assert sum(s.query_len for s in seqs) <= limits["max_num_batched_tokens"]
        for s in seqs:
            assert s.seq_len <= limits["max_model_len"]
            assert len(s.block_table) * limits["block_size"] >= s.seq_len
            assert all(0 <= b < limits["num_blocks"] for b in s.block_table)


def test_steps_cover_the_shape_classes():
    steps = warmup_steps(**LIMITS[0])
    longest = {max(s.query_len for s in seqs) for seqs in steps}
    assert {1, 8, 16, 17, 512, 1024} <= longest  # decode-like, each tile class, prefill-like
    assert any(len(seqs) == 1 and seqs[0].context_len >= 1000 for seqs in steps)  # a chunk that splits
    assert any(len(seqs) > 100 and seqs[0].context_len > 0 for seqs in steps)  # many chunks over pages
    assert any(seqs[0].context_len == 0 and seqs[0].query_len > 1 and len(seqs) > 1
               and all(s.query_len == 1 for s in seqs[1:]) for seqs in steps)  # a prefill beside decodes
