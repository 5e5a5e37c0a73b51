"""Ref-counted KV-cache blocks: prefix caching, copy-on-write forks, swapping and sliding windows.

GPU blocks (the device's KV pool) carry a reference count: one per block-table entry of a
running sequence that names them. A block whose count drops to 0 is free. With prefix
caching, a full block that was computed is registered under the chained hash of its tokens
(`Sequence.block_hash`); when freed it stays registered in an LRU list of evictable blocks,
so a later prompt with the same prefix takes it back instead of recomputing it. Allocation
takes plain free blocks first, then evicts the least recently freed cached block.

A block written by a step must be owned by one sequence: `ensure_slots` copies shared blocks
(copy-on-write after `fork`) and returns the (src, dst) pairs for `Backend.copy_blocks`.
CPU blocks (the swap pool) are ref-counted the same way, without hashing.

KV cache groups (`engine/kv_cache_groups.py`): a sequence holds one block table per group
(`seq.block_tables`, all of one length: entry `i` of each covers tokens of logical block `i`),
drawn from the one pool. A group with a sliding window frees the blocks that left it
(`SLIDING_FREED` entries) while a full-attention group keeps its own; a model whose layers
attend alike has one group. Prefix caching registers each group's block under (group, hash);
a prompt's cached prefix is the longest one that every full group holds whole and every
windowed group holds within its window of the prefix's end (vLLM's hybrid rule), so a windowed
group takes back only the blocks it will read.

Encoder-decoder models have a second pool, the cross pool (its own cache tensor per
cross-attention layer), holding each request's encoder K/V in `seq.cross_block_table`. Its
blocks are written once, on the step that runs the encoder, and only read after: forks share
them without copy-on-write and they are never hashed. They go with the sequence: freed with
it (the last sequence of a request frees them), dropped by a recompute preemption (the encoder
runs again), swapped to the CPU cross pool and back with it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator

from pagedattn.attention.types import window_start_block
from pagedattn.engine.sequence import Sequence, SeqStatus
from pagedattn.intmath import cdiv

SLIDING_FREED = -1
"""A block-table entry whose block left the sliding window and was freed. Such entries lie
below `window_start_block(...)` of every later step, which the metadata builder never reads,
so the table goes to the builder unchanged; the value only has to be no block id."""


class _Pool:
    """Reference counts and a FIFO free list of `num_blocks` blocks (the CPU swap pool)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    def allocate(self) -> int:
        block = self.free.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} freed twice"
        if self.ref_counts[block] == 0:
            self.free.append(block)


class BlockManager:
    """Owns the GPU and CPU block pools; sequences hold block ids in `seq.block_tables`, one
    table per KV cache group of `group_windows` (each group's sliding window, None: full)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        group_windows: tuple[int | None, ...] = (None,),
        num_cpu_blocks: int = 0,
        num_cross_blocks: int = 0,
        num_cpu_cross_blocks: int = 0,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"expected num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ValueError(f"expected one window (None or >= 1) per KV cache group, got {group_windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.any_window = any(w is not None for w in self.group_windows)  # mark_computed frees out-of-window blocks
        self.ref_counts = [0] * num_blocks
        # A cached block's key: (its KV cache group, the chained hash of its tokens).
        self.block_hashes: list[tuple[int, int] | None] = [None] * num_blocks
        self.block_token_ids: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[tuple[int, int], int] = {}
        self.free_plain: deque[int] = deque(range(num_blocks))  # free, not in the hash table
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free, cached; oldest first
        self.cpu = _Pool(num_cpu_blocks)
        self.cross = _Pool(num_cross_blocks)
        self.cpu_cross = _Pool(num_cpu_cross_blocks)

    # ------------------------------------------------------------------ pool

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take (evictable cached blocks included)."""
        return len(self.free_plain) + len(self.evictable)

    @property
    def num_groups(self) -> int:
        """KV cache groups: block tables per sequence."""
        return len(self.group_windows)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu.free)

    @property
    def num_free_cross_blocks(self) -> int:
        return len(self.cross.free)

    def _allocate(self) -> int:
        if self.free_plain:
            block = self.free_plain.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self._unregister(block)
        else:
            raise RuntimeError("out of KV-cache blocks: the scheduler should have checked num_free_blocks")
        self.ref_counts[block] = 1
        return block

    def _unregister(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hashes[block] = None
        self.block_token_ids[block] = None

    def _incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.evictable[block]  # only cached blocks are taken back while free
        self.ref_counts[block] += 1

    def _decref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} freed twice"
        if self.ref_counts[block] == 0:
            h = self.block_hashes[block]
            if h is not None and self.hash_to_block.get(h) == block:
                self.evictable[block] = None
            else:
                self.block_hashes[block] = None
                self.block_token_ids[block] = None
                self.free_plain.append(block)

    # ------------------------------------------------------------------ prefix cache

    def prefix_hits(self, seq: Sequence) -> list[tuple[int, ...]]:
        """Cached blocks holding a prefix of `seq`, without taking them: per block of the prefix,
        each KV cache group's block (`SLIDING_FREED` where a windowed group will not read it).

        The last token is always left to compute (its logits are needed), so a prompt made of
        whole cached blocks reuses all but its last block. An encoder-decoder sequence leaves
        two: its next step must be a prefill, the step that runs the encoder and writes its
        cross blocks. A sequence that does not read the cache (`reads_prefix_cache`: its prompt
        logprobs need every position) gets none; its blocks are still registered for others.
        """
        if not self.enable_prefix_caching or not seq.reads_prefix_cache or seq.num_computed_tokens or seq.block_tables:
            return []
        keep = 2 if seq.encoder_len else 1
        cached = [[] for _ in self.group_windows]  # per group: its cached block of each prefix block, or None
        for i in range(max(0, len(seq) - keep) // self.block_size):
            h, tokens = seq.block_hash(i), seq.block_tokens(i)
            for g, blocks in enumerate(cached):
                block = self.hash_to_block.get((g, h))
                blocks.append(None if block is None or self.block_token_ids[block] != tokens else block)
            if any(cached[g][i] is None for g, w in enumerate(self.group_windows) if w is None):
                break  # a full group reads every block: the prefix ends here
        n = self._longest_hit(cached)
        hits = []
        for i in range(n):
            hits.append(tuple(
                SLIDING_FREED if i < window_start_block(n * self.block_size, w, self.block_size) else cached[g][i]
                for g, w in enumerate(self.group_windows)
            ))
        return hits

    def _longest_hit(self, cached: list[list[int | None]]) -> int:
        """The most leading blocks that every group can take from `cached` (see `prefix_hits`):
        a full group needs all of them, a windowed one those its window of their end reaches."""
        bs = self.block_size
        n = min(len(c) if w is not None else next((i for i, b in enumerate(c) if b is None), len(c))
                for c, w in zip(cached, self.group_windows))
        runs = []  # windowed groups: (window, cached blocks in a row ending at each block)
        for c, w in zip(cached, self.group_windows):
            if w is not None:
                run = list(itertools.accumulate(c[:n], lambda r, b: 0 if b is None else r + 1, initial=0))[1:]
                runs.append((w, run))
        while n and not all(run[n - 1] >= n - window_start_block(n * bs, w, bs) for w, run in runs):
            n -= 1
        return n

    def admission_cost(self, seq: Sequence, num_tokens: int, lookahead: int = 0) -> tuple[int, int]:
        """(free blocks consumed, tokens already cached) if `seq` is admitted and then computes
        `num_tokens` tokens past its cached prefix."""
        hits = self.prefix_hits(seq)
        cached = len(hits) * self.block_size
        taken_from_free = sum(b != SLIDING_FREED and self.ref_counts[b] == 0 for row in hits for b in row)
        new = cdiv(cached + num_tokens + lookahead, self.block_size) - len(hits)
        return taken_from_free + max(new, 0) * self.num_groups, cached

    def allocate_prefix(self, seq: Sequence) -> int:
        """Take the cached prefix of a sequence with no blocks; returns the tokens it covers."""
        assert not seq.block_tables and seq.num_computed_tokens == 0, seq
        hits = self.prefix_hits(seq)
        for block in (b for row in hits for b in row if b != SLIDING_FREED):
            self._incref(block)
        seq.block_tables = [[row[g] for row in hits] for g in range(self.num_groups)]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        return seq.num_computed_tokens

    # ------------------------------------------------------------------ cross blocks

    def cross_blocks_needed(self, seq: Sequence) -> int:
        """Cross blocks that `ensure_cross_blocks(seq)` would take."""
        return 0 if seq.cross_block_table else cdiv(seq.encoder_len, self.block_size)

    def ensure_cross_blocks(self, seq: Sequence) -> None:
        """Give an encoder-decoder sequence its cross blocks (slots for every encoder token)."""
        if not seq.cross_block_table:
            seq.cross_block_table = [self.cross.allocate() for _ in range(cdiv(seq.encoder_len, self.block_size))]

    # ------------------------------------------------------------------ growing

    def min_blocks(self, num_tokens: int) -> int:
        """A lower bound of the blocks a sequence of `num_tokens` tokens holds to make progress:
        all of them in a full group, those its window reaches in a windowed one."""
        full = cdiv(num_tokens, self.block_size)
        return sum(full if w is None else min(full, cdiv(w, self.block_size)) for w in self.group_windows)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks that `ensure_slots(seq, num_tokens)` would take (new and copied ones)."""
        tables = seq.block_tables
        held = len(tables[0]) if tables else 0
        needed = cdiv(num_tokens, self.block_size)
        new = max(0, needed - held) * self.num_groups
        first, last = seq.num_computed_tokens // self.block_size, min(needed, held)
        if first < last:  # held blocks the step writes: shared ones are copied (plain loops: per sequence per step)
            ref_counts = self.ref_counts
            for table in tables:
                for b in table[first:last]:
                    if b != SLIDING_FREED and ref_counts[b] > 1:
                        new += 1
        return new

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Give `seq` blocks for its first `num_tokens` tokens in every group, every block from
        `num_computed_tokens` on owned by `seq` alone. Returns copy-on-write (src, dst) pairs."""
        bs = self.block_size
        copies = []
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.group_windows]
        needed = cdiv(num_tokens, bs)
        for table in seq.block_tables:
            for i in range(seq.num_computed_tokens // bs, min(needed, len(table))):
                block = table[i]
                if block != SLIDING_FREED and self.ref_counts[block] > 1:
                    new = self._allocate()
                    self._decref(block)
                    table[i] = new
                    copies.append((block, new))
            while len(table) < needed:
                table.append(self._allocate())
        return copies

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Record that the cache now holds `seq`'s first `num_computed_tokens` tokens: register
        newly full blocks for prefix caching and free blocks that left the sliding window."""
        assert num_computed_tokens <= len(seq), (num_computed_tokens, seq)
        seq.num_computed_tokens = num_computed_tokens
        if self.enable_prefix_caching:
            full = num_computed_tokens // self.block_size
            for i in range(seq.num_registered_blocks, full):
                h = seq.block_hash(i)
                for g, table in enumerate(seq.block_tables):
                    block, key = table[i], (g, h)
                    if block != SLIDING_FREED and self.block_hashes[block] is None and key not in self.hash_to_block:
                        self.hash_to_block[key] = block
                        self.block_hashes[block] = key
                        self.block_token_ids[block] = seq.block_tokens(i)
            seq.num_registered_blocks = max(seq.num_registered_blocks, full)
        if self.any_window:
            for table, window in zip(seq.block_tables, self.group_windows):
                if window is not None:
                    self._free_out_of_window(table, window, seq.num_computed_tokens)

    def _free_out_of_window(self, table: list[int], window: int, num_computed_tokens: int) -> None:
        # Every later step starts at context_len >= num_computed_tokens: what it cannot see,
        # the builder drops, with the same function.
        dead = window_start_block(num_computed_tokens, window, self.block_size)
        for i in range(min(dead, len(table))):
            if table[i] != SLIDING_FREED:
                self._decref(table[i])
                table[i] = SLIDING_FREED

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (copied on write by `ensure_slots`)."""
        child.block_tables = [list(table) for table in parent.block_tables]
        for block in self._held(child):
            self._incref(block)
        child.cross_block_table = list(parent.cross_block_table)
        for block in child.cross_block_table:
            self.cross.incref(block)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (GPU or CPU, by its status), cross blocks included."""
        swapped = seq.status is SeqStatus.SWAPPED
        pool_decref = self.cpu.decref if swapped else self._decref
        for table in seq.block_tables:
            for block in reversed(table):  # the tail first: evicted first
                if block != SLIDING_FREED:
                    pool_decref(block)
        seq.block_tables = []
        cross = self.cpu_cross if swapped else self.cross
        for block in reversed(seq.cross_block_table):
            cross.decref(block)
        seq.cross_block_table = []

    # ------------------------------------------------------------------ swapping

    @staticmethod
    def _held(seq: Sequence) -> Iterator[int]:
        """The blocks `seq` holds, every group's, in table order (shared ones once per entry)."""
        return (b for table in seq.block_tables for b in table if b != SLIDING_FREED)

    def _unique_blocks(self, seqs: Iterable[Sequence]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in self._held(s)))

    @staticmethod
    def _unique_cross_blocks(seqs: Iterable[Sequence]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in s.cross_block_table))

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return (
            len(self._unique_blocks(seqs)) <= self.num_free_cpu_blocks
            and len(self._unique_cross_blocks(seqs)) <= len(self.cpu_cross.free)
        )

    def swap_out(self, seqs: list[Sequence]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Move the blocks of `seqs` (one group) to the CPU pools; returns the (gpu, cpu) pairs
        of the decoder pool and of the cross pool."""
        cross = _move_shared(seqs, self.cross, self.cpu_cross)
        mapping = {b: self.cpu.allocate() for b in self._unique_blocks(seqs)}
        for cpu_block in mapping.values():
            self.cpu.ref_counts[cpu_block] = 0
        for seq in seqs:
            for table in seq.block_tables:
                for i, block in enumerate(table):
                    if block != SLIDING_FREED:
                        self._decref(block)
                        self.cpu.incref(mapping[block])
                        table[i] = mapping[block]
            seq.status = SeqStatus.SWAPPED
        return list(mapping.items()), cross

    def swap_in_cost(self, seqs: list[Sequence]) -> int:
        return len(self._unique_blocks(seqs))

    def cross_swap_in_cost(self, seqs: list[Sequence]) -> int:
        return len(self._unique_cross_blocks(seqs))

    def swap_in(self, seqs: list[Sequence]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Move the blocks of `seqs` back to fresh GPU blocks; returns the (cpu, gpu) pairs of
        the decoder pool and of the cross pool."""
        cross = _move_shared(seqs, self.cpu_cross, self.cross)
        mapping = {b: self._allocate() for b in self._unique_blocks(seqs)}
        for gpu_block in mapping.values():
            self.ref_counts[gpu_block] = 0
        for seq in seqs:
            for table in seq.block_tables:
                for i, block in enumerate(table):
                    if block != SLIDING_FREED:
                        self.cpu.decref(block)
                        self.ref_counts[mapping[block]] += 1
                        table[i] = mapping[block]
            seq.status = SeqStatus.RUNNING
            seq.num_registered_blocks = 0  # the fresh blocks may be offered to the cache again
        return list(mapping.items()), cross

    # ------------------------------------------------------------------ checks

    def check_integrity(self, seqs: Iterable[Sequence]) -> None:
        """Assert that reference counts equal the block-table entries of `seqs` (every sequence
        holding blocks), that free lists hold exactly the unreferenced blocks, and that the hash
        table and the blocks' hashes agree."""
        gpu = [0] * self.num_blocks
        cpu = [0] * self.cpu.num_blocks
        cross = [0] * self.cross.num_blocks
        cpu_cross = [0] * self.cpu_cross.num_blocks
        for seq in seqs:
            swapped = seq.status is SeqStatus.SWAPPED
            counts = cpu if swapped else gpu
            tables = seq.block_tables
            assert not tables or len(tables) == self.num_groups, f"{seq}: expected {self.num_groups} tables"
            assert len({len(t) for t in seq.block_tables}) <= 1, f"{seq}: its groups' tables differ in length"
            for block in self._held(seq):
                counts[block] += 1
            for block in seq.cross_block_table:
                (cpu_cross if swapped else cross)[block] += 1
        for name, pool, owners in (("cross", self.cross, cross), ("CPU cross", self.cpu_cross, cpu_cross)):
            assert owners == pool.ref_counts, f"{name} refcounts {pool.ref_counts} != owners {owners}"
            unreferenced = [b for b in range(pool.num_blocks) if owners[b] == 0]
            assert sorted(pool.free) == unreferenced, f"{name} free list mismatch"
        assert gpu == self.ref_counts, f"GPU refcounts {self.ref_counts} != owners {gpu}"
        assert cpu == self.cpu.ref_counts, f"CPU refcounts {self.cpu.ref_counts} != owners {cpu}"
        plain, evictable = list(self.free_plain), list(self.evictable)
        free = plain + evictable
        assert len(free) == len(set(free)), f"a block is listed free twice: {plain} {evictable}"
        assert set(free) == {b for b in range(self.num_blocks) if gpu[b] == 0}, "GPU free lists != unreferenced blocks"
        assert len(self.cpu.free) == len(set(self.cpu.free)), "a CPU block is listed free twice"
        assert set(self.cpu.free) == {b for b in range(self.cpu.num_blocks) if cpu[b] == 0}, "CPU free list mismatch"
        for key, block in self.hash_to_block.items():
            assert self.block_hashes[block] == key, f"hash table names block {block} whose key is {self.block_hashes[block]}"
            assert self.block_token_ids[block] is not None and len(self.block_token_ids[block]) == self.block_size
        for block, h in enumerate(self.block_hashes):
            assert h is None or self.hash_to_block.get(h) == block, f"block {block} has hash {h} the table does not map to it"
        for block in evictable:
            assert self.block_hashes[block] is not None, f"evictable block {block} is not cached"
        for block in plain:
            assert self.block_hashes[block] is None, f"plain free block {block} still has a hash"
        if not self.enable_prefix_caching:
            assert not self.hash_to_block, "hash table used with prefix caching off"


def _move_shared(seqs: list[Sequence], src: _Pool, dst: _Pool) -> list[tuple[int, int]]:
    """Move the cross blocks of `seqs` (one group; shared blocks once) from pool `src` to pool
    `dst`, rewriting their cross block tables; returns the (src, dst) block pairs."""
    mapping = {b: dst.allocate() for b in dict.fromkeys(b for s in seqs for b in s.cross_block_table)}
    for block in mapping.values():
        dst.ref_counts[block] = 0
    for seq in seqs:
        for i, block in enumerate(seq.cross_block_table):
            src.decref(block)
            dst.incref(mapping[block])
            seq.cross_block_table[i] = mapping[block]
    return list(mapping.items())
