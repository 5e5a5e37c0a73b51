"""The block manager under thousands of random operations, against a model of the cache.

Every operation is followed by `check_integrity()`. A fake KV cache (one token id per slot)
is written where a step would write, copied where the manager asks for copy-on-write, swap
and back; reading each live sequence through its block table must give back its tokens, so
prefix-cache hits, forks and swaps are checked for content, not only for bookkeeping.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedattn.engine.block_manager import SLIDING_FREED, BlockManager
from pagedattn.engine.sequence import Sequence, SeqStatus
from pagedattn.intmath import cdiv


class Driver:
    """windows: each KV cache group's sliding window (None: full attention)."""

    def __init__(self, num_blocks=24, block_size=4, prefix=True, windows=(None,), cpu_blocks=16, seed=0):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, group_windows=windows,
                               num_cpu_blocks=cpu_blocks)
        self.bs = block_size
        self.windows = windows
        self.gpu = [[None] * block_size for _ in range(num_blocks)]
        self.cpu = [[None] * block_size for _ in range(cpu_blocks)]
        self.seqs: list[Sequence] = []
        self.rng = random.Random(seed)
        self.ids = 0
        self.prefixes = [[self.rng.randrange(50) for _ in range(3 * block_size)] for _ in range(3)]

    def check(self):
        self.bm.check_integrity(self.seqs)
        for s in self.seqs:
            if s.status is not SeqStatus.RUNNING:
                continue
            for table, window in zip(s.block_tables, self.windows):
                first = 0 if window is None else max(0, s.num_computed_tokens - window + 1)
                for p in range(first, s.num_computed_tokens):
                    block = table[p // self.bs]
                    assert block != SLIDING_FREED, (s, p)
                    assert self.gpu[block][p % self.bs] == s.token_ids[p], (s, p)

    def compute(self, seq, upto):
        """A step computing `seq` up to `upto` tokens, if the pool allows; True when it ran."""
        if self.bm.blocks_needed(seq, upto) > self.bm.num_free_blocks:
            return False
        for src, dst in self.bm.ensure_slots(seq, upto):
            self.gpu[dst] = list(self.gpu[src])
        for table in seq.block_tables:
            for p in range(seq.num_computed_tokens, upto):
                self.gpu[table[p // self.bs]][p % self.bs] = seq.token_ids[p]
        self.bm.mark_computed(seq, upto)
        return True

    def op_new(self):
        prefix = self.rng.choice(self.prefixes)[: self.rng.randrange(1, 3 * self.bs)]
        seq = Sequence(self.ids, prefix + [self.rng.randrange(50) for _ in range(self.rng.randrange(3))], self.bs)
        self.ids += 1
        self.bm.allocate_prefix(seq)
        seq.status = SeqStatus.RUNNING
        self.seqs.append(seq)
        if not self.compute(seq, len(seq) - self.rng.randrange(2)):
            self.free(seq)

    def running(self):
        return [s for s in self.seqs if s.status is SeqStatus.RUNNING]

    def op_append(self):
        if running := self.running():
            seq = self.rng.choice(running)
            seq.append_token(self.rng.randrange(50), 0.0)
            if not self.compute(seq, len(seq)):
                seq.token_ids.pop()

    def op_fork(self):
        if running := self.running():
            parent = self.rng.choice(running)
            child = parent.fork(self.ids)
            self.ids += 1
            self.bm.fork(parent, child)
            self.seqs.append(child)

    def free(self, seq):
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        self.seqs.remove(seq)

    def op_free(self):
        if self.seqs:
            self.free(self.rng.choice(self.seqs))

    def op_swap_out(self):
        if running := self.running():
            seq = self.rng.choice(running)
            if self.bm.can_swap_out([seq]):
                for g, c in self.bm.swap_out([seq])[0]:
                    self.cpu[c] = list(self.gpu[g])

    def op_swap_in(self):
        swapped = [s for s in self.seqs if s.status is SeqStatus.SWAPPED]
        if swapped:
            seq = self.rng.choice(swapped)
            if self.bm.swap_in_cost([seq]) <= self.bm.num_free_blocks:
                for c, g in self.bm.swap_in([seq])[0]:
                    self.gpu[g] = list(self.cpu[c])

    def op_recompute(self):
        if running := self.running():
            seq = self.rng.choice(running)
            self.bm.free(seq)
            seq.reset_for_recompute()
            self.bm.allocate_prefix(seq)
            seq.status = SeqStatus.RUNNING
            if not self.compute(seq, len(seq)):
                self.free(seq)

    OPS = ("op_new", "op_append", "op_append", "op_fork", "op_free", "op_swap_out", "op_swap_in", "op_recompute")

    def run(self, ops):
        for name in ops:
            getattr(self, name)()
            self.check()


CONFIGS = {
    "prefix_cache": dict(),
    "no_prefix_cache": dict(prefix=False),
    "block_size_1": dict(block_size=1, num_blocks=40),
    "sliding_window": dict(windows=(5,)),
    "tiny_pool": dict(num_blocks=6, cpu_blocks=4),
    # KV cache groups: a full group beside windowed ones, sharing the pool
    "hybrid": dict(windows=(None, 5), num_blocks=40),
    "hybrid_windows": dict(windows=(None, 3, 9), num_blocks=48, block_size=2),
    "windows_only": dict(windows=(3, 6), num_blocks=30),
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_random_operations(config):
    driver = Driver(seed=1, **CONFIGS[config])
    rng = random.Random(2)
    driver.run(rng.choice(Driver.OPS) for _ in range(3000))
    for seq in list(driver.seqs):
        driver.free(seq)
    driver.check()
    assert driver.bm.num_free_blocks == driver.bm.num_blocks


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.sampled_from(Driver.OPS), max_size=120), seed=st.integers(0, 2**16),
       prefix=st.booleans(), block_size=st.sampled_from([1, 2, 4]),
       windows=st.sampled_from([(None,), (5,), (None, 3), (None, 2, 7)]))
def test_random_operations_hypothesis(ops, seed, prefix, block_size, windows):
    Driver(num_blocks=12 * len(windows), block_size=block_size, prefix=prefix, windows=windows, cpu_blocks=6,
           seed=seed).run(ops)


def test_prefix_hit_reuses_blocks_and_leaves_the_last_token():
    bm = BlockManager(10, 4)
    a = Sequence(0, list(range(12)), 4)
    bm.allocate_prefix(a)
    bm.ensure_slots(a, 12)
    bm.mark_computed(a, 12)
    b = Sequence(1, list(range(12)), 4)  # whole blocks cached: the last block is recomputed
    assert bm.allocate_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    c = Sequence(2, list(range(10)) + [99, 98, 97], 4)
    assert bm.allocate_prefix(c) == 8
    bm.free(a)
    bm.check_integrity([b, c])
    # Freed cached blocks stay evictable and are taken last (LRU).
    assert a.block_table == [] and len(bm.evictable) == 1
    assert bm.num_free_blocks == 8


def test_copy_on_write_after_fork():
    bm = BlockManager(10, 4)
    parent = Sequence(0, list(range(6)), 4)
    bm.allocate_prefix(parent)
    bm.ensure_slots(parent, 6)
    bm.mark_computed(parent, 6)
    child = parent.fork(1)
    bm.fork(parent, child)
    for s in (parent, child):
        s.append_token(7, 0.0)
    assert bm.blocks_needed(child, 7) == 1
    copies = bm.ensure_slots(child, 7)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert bm.ensure_slots(parent, 7) == []  # the parent owns its block alone now
    assert child.block_table[0] == parent.block_table[0]
    bm.check_integrity([parent, child])


def test_sliding_window_frees_blocks():
    bm = BlockManager(10, 4, group_windows=(4,))
    seq = Sequence(0, list(range(20)), 4)
    bm.allocate_prefix(seq)
    bm.ensure_slots(seq, 20)
    bm.mark_computed(seq, 20)
    # The next query (position 20) sees positions 17..20: blocks 0..3 (positions < 16) are dead.
    assert seq.block_table[:4] == [SLIDING_FREED] * 4
    assert bm.num_free_blocks == 10 - cdiv(20, 4) + 4
    bm.check_integrity([seq])


def test_window_group_frees_its_blocks_and_the_full_group_keeps_its_own():
    bm = BlockManager(20, 4, group_windows=(None, 4))
    seq = Sequence(0, list(range(20)), 4)
    bm.allocate_prefix(seq)
    bm.ensure_slots(seq, 20)
    bm.mark_computed(seq, 20)
    full, windowed = seq.block_tables
    assert SLIDING_FREED not in full and len(full) == 5
    assert windowed[:4] == [SLIDING_FREED] * 4 and windowed[4] != SLIDING_FREED
    assert not set(full) & set(windowed)
    assert bm.num_free_blocks == 20 - 5 - 1
    bm.check_integrity([seq])


def _computed(bm: BlockManager, tokens: list[int]) -> tuple[Sequence, list[list[int]]]:
    """A sequence of `tokens` computed whole, and its tables before the window freed any block."""
    seq = Sequence(0, tokens, bm.block_size)
    bm.allocate_prefix(seq)
    bm.ensure_slots(seq, len(tokens))
    tables = [list(t) for t in seq.block_tables]
    bm.mark_computed(seq, len(tokens))
    return seq, tables


def test_hybrid_prefix_hit_takes_the_windowed_group_only_within_its_window():
    """A later prompt takes the full group's whole prefix and, of the windowed group's blocks,
    those the window of the prefix's end reaches; the windowed group's older blocks stay cached."""
    bm = BlockManager(40, 4, group_windows=(None, 5))
    a, (full, windowed) = _computed(bm, list(range(24)))
    b = Sequence(1, list(range(22)) + [99, 98], 4)
    hits = bm.prefix_hits(b)
    assert len(hits) == 5  # blocks 0..4 (20 tokens): the next step starts at position 20
    assert [row[0] for row in hits] == full[:5]
    # the window of position 20 reaches back to 16: block 4 only
    assert [row[1] for row in hits] == [SLIDING_FREED] * 4 + [windowed[4]]
    bm.free(a)
    assert bm.allocate_prefix(b) == 20
    bm.check_integrity([b])


def test_hybrid_prefix_hit_stops_where_the_windowed_group_lost_its_blocks():
    bm = BlockManager(40, 4, group_windows=(None, 5))
    a, (full, windowed) = _computed(bm, list(range(24)))
    bm.free(a)
    # Take the windowed group's block 5 from the cache: a prefix of 6 blocks (its next step at 24
    # sees from position 20, block 5) cannot be taken; one of 5 blocks (from 16: block 4) can.
    bm.evictable.pop(windowed[5])
    bm._unregister(windowed[5])
    bm.free_plain.append(windowed[5])
    bm.check_integrity([])
    b = Sequence(1, list(range(24)) + [7], 4)
    hits = bm.prefix_hits(b)
    assert [row[0] for row in hits] == full[:5]
    assert [row[1] for row in hits] == [SLIDING_FREED] * 4 + [windowed[4]]
