"""Scheduler unit tests on fake requests (no model): budget, chunking, FCFS, preemption order."""

from __future__ import annotations

from pagedattn.engine.block_manager import BlockManager
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.scheduler import Scheduler
from pagedattn.engine.sequence import Sequence, SequenceGroup


def make(num_blocks=64, block_size=4, tokens=16, seqs=8, chunked=True, mode="auto", cpu_blocks=32, prefix=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, num_cpu_blocks=cpu_blocks)
    return Scheduler(bm, max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=1024,
                     enable_chunked_prefill=chunked, preemption_mode=mode)


_ids = iter(range(10**6))


def add(sched, length, first=0, params=None) -> SequenceGroup:
    i = next(_ids)
    seq = Sequence(i, list(range(first, first + length)), sched.block_size)
    group = SequenceGroup(str(i), None, seq.token_ids, params or SamplingParams(max_tokens=100), [seq], i)
    sched.add(group)
    return group


def step(sched):
    """Schedule, then play the model: computed chunks, one new token per sampled chunk."""
    out = sched.schedule()
    for c in out.chunks:
        sched.bm.mark_computed(c.seq, c.seq.num_computed_tokens + c.num_tokens)
        if c.sample:
            c.seq.append_token(1000 + c.seq.seq_id, 0.0)
    sched.bm.check_integrity(sched.all_seqs())
    return out


def plan(out):
    return [(c.group.request_id, c.num_tokens, c.sample) for c in out.chunks]


def test_token_budget_and_chunked_prefill():
    s = make(tokens=16)
    a, b, c = add(s, 10), add(s, 10, 100), add(s, 3, 200)
    out = step(s)
    assert plan(out) == [(a.request_id, 10, True), (b.request_id, 6, False)]
    out = step(s)  # a decodes; b finishes its prompt; c fits in what is left
    assert plan(out) == [(b.request_id, 4, True), (c.request_id, 3, True), (a.request_id, 1, True)]
    assert out.num_batched_tokens == 8


def test_no_chunking_schedules_whole_prompts_in_order():
    s = make(tokens=16, chunked=False)
    a, b, c = add(s, 10), add(s, 10, 100), add(s, 3, 200)
    out = step(s)
    # b does not fit whole; first come first served, so c waits behind it.
    assert plan(out) == [(a.request_id, 10, True)]
    out = step(s)
    assert plan(out) == [(b.request_id, 10, True), (c.request_id, 3, True), (a.request_id, 1, True)]


def test_decodes_keep_their_tokens_behind_a_long_prefill():
    s = make(tokens=8, seqs=4)
    a, b = add(s, 2), add(s, 2, 100)
    step(s)
    long = add(s, 40, 200)
    long.arrival_index = -1  # older than a and b (as a preempted request would be)
    for _ in range(3):
        out = step(s)
        # long comes first, yet its chunk leaves a and b their decode token.
        assert plan(out) == [(long.request_id, 6, False), (a.request_id, 1, True), (b.request_id, 1, True)]


def test_max_num_seqs():
    s = make(tokens=64, seqs=2)
    groups = [add(s, 3, 10 * i) for i in range(4)]
    out = step(s)
    assert [g for g, _, _ in plan(out)] == [groups[0].request_id, groups[1].request_id]


def test_preemption_takes_the_newest_group_by_recompute():
    s = make(num_blocks=6, block_size=4, tokens=64, mode="recompute")
    a, b, c = add(s, 8), add(s, 7, 100), add(s, 6, 200)
    out = step(s)  # 2 + 2 + 2 blocks: the pool is full
    assert len(out.chunks) == 3
    out = step(s)  # a needs a third block: c, the newest, is preempted
    assert out.preempted == [c]
    assert list(s.waiting) == [c] and c.seqs[0].num_computed_tokens == 0 and c.seqs[0].block_table == []
    assert [g for g, _, _ in plan(out)] == [a.request_id, b.request_id]
    assert len(c.seqs[0]) == 7  # its sampled token stays: it is recomputed with the prompt


def test_preemption_by_swap_and_swap_in():
    s = make(num_blocks=6, block_size=4, tokens=64, mode="swap")
    a, _, c = add(s, 8), add(s, 7, 100), add(s, 6, 200)
    step(s)
    out = step(s)
    assert out.preempted == [c] and list(s.swapped) == [c] and len(out.swap_out) == 2
    s.finish_seq(a.seqs[0], "stop")
    s.remove_finished()
    out = step(s)
    assert len(out.swap_in) == 2 and c in s.running and not s.swapped
    assert (c.request_id, 1, True) in plan(out)


def test_prompt_bigger_than_the_pool_is_an_error():
    s = make(num_blocks=4, block_size=4, tokens=64)
    big, small = add(s, 20), add(s, 5, 100)
    out = step(s)
    assert out.ended == [big] and big.error and big.is_finished
    assert [g for g, _, _ in plan(out)] == [small.request_id]


def test_prefix_cache_hit_skips_cached_tokens():
    s = make(tokens=64)
    a = add(s, 13)
    step(s)
    b = add(s, 13)  # the same prompt: its 3 full blocks are cached
    out = step(s)
    assert (b.request_id, 1, True) in plan(out)
    assert b.seqs[0].block_table[:3] == a.seqs[0].block_table[:3]


def test_beam_groups_sample_in_lockstep():
    s = make(tokens=5, seqs=5)
    group = add(s, 3, params=SamplingParams(n=3, use_beam_search=True, max_tokens=10))
    step(s)
    parent = group.seqs[0]
    for k in range(1, 3):
        child = parent.fork(next(_ids))
        s.bm.fork(parent, child)
        group.seqs.append(child)
    filler = add(s, 4, 100)
    out = step(s)
    beams = [c for c in out.chunks if c.group is group]
    assert len(beams) == 3 and all(c.sample for c in beams)
    assert sum(c.num_tokens for c in out.chunks if c.group is filler) == 2


def test_chunks_carry_the_scheduled_seq_the_builder_gets():
    from pagedattn.attention.types import ScheduledSeq

    s = make(tokens=16, block_size=4)
    a, b = add(s, 10), add(s, 10, 100)
    out = step(s)  # a whole, b chunked
    assert [c.scheduled for c in out.chunks] == [
        ScheduledSeq(10, 10, tuple(a.seqs[0].block_table)),
        ScheduledSeq(6, 6, tuple(b.seqs[0].block_table)),
    ]
    assert not out.is_decode_only
    out = step(s)  # b's last 4 prompt tokens (a prefill over a cached prefix), then a's decode
    assert [(c.scheduled.context_len, c.scheduled.query_len, c.scheduled.is_prefill) for c in out.chunks] == [
        (6, 4, True),
        (10, 1, False),
    ]
    out = step(s)
    assert out.is_decode_only and all(not c.scheduled.is_prefill for c in out.chunks)
