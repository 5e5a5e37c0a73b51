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

Encoder-decoder models have a second pool, the cross pool (its own cache tensor per
cross-attention layer), holding each request's encoder K/V in `seq.cross_block_table`. Its
blocks are written once, on the step that runs the encoder, and only read after: forks share
them without copy-on-write and they are never hashed. They go with the sequence: freed with
it (the last sequence of a request frees them), dropped by a recompute preemption (the encoder
runs again), swapped to the CPU cross pool and back with it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

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
    """Owns the GPU and CPU block pools; sequences hold block ids in `seq.block_table`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        num_cpu_blocks: int = 0,
        num_cross_blocks: int = 0,
        num_cpu_cross_blocks: int = 0,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"expected num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_token_ids: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
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

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq`, without taking them.

        The last token is always left to compute (its logits are needed), so a prompt made of
        whole cached blocks reuses all but its last block. An encoder-decoder sequence leaves
        two: its next step must be a prefill, the step that runs the encoder and writes its
        cross blocks. A sequence that does not read the cache (`reads_prefix_cache`: its prompt
        logprobs need every position) gets none; its blocks are still registered for others.
        """
        if not self.enable_prefix_caching or not seq.reads_prefix_cache or seq.num_computed_tokens or seq.block_table:
            return []
        hits = []
        keep = 2 if seq.encoder_len else 1
        for i in range(max(0, len(seq) - keep) // self.block_size):
            block = self.hash_to_block.get(seq.block_hash(i))
            if block is None or self.block_token_ids[block] != seq.block_tokens(i):
                break
            hits.append(block)
        return hits

    def admission_cost(self, seq: Sequence, num_tokens: int, lookahead: int = 0) -> tuple[int, int]:
        """(free blocks consumed, tokens already cached) if `seq` is admitted and then computes
        `num_tokens` tokens past its cached prefix."""
        hits = self.prefix_hits(seq)
        cached = len(hits) * self.block_size
        taken_from_free = sum(self.ref_counts[b] == 0 for b in hits)
        new = cdiv(cached + num_tokens + lookahead, self.block_size) - len(hits)
        return taken_from_free + max(new, 0), cached

    def allocate_prefix(self, seq: Sequence) -> int:
        """Take the cached prefix of a sequence with no blocks; returns the tokens it covers."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        hits = self.prefix_hits(seq)
        for block in hits:
            self._incref(block)
        seq.block_table = list(hits)
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

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks that `ensure_slots(seq, num_tokens)` would take (new and copied ones)."""
        new = max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))
        first = seq.num_computed_tokens // self.block_size
        last = min(cdiv(num_tokens, self.block_size), len(seq.block_table))
        cow = sum(
            1 for i in range(first, last) if seq.block_table[i] != SLIDING_FREED and self.ref_counts[seq.block_table[i]] > 1
        )
        return new + cow

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Give `seq` blocks for its first `num_tokens` tokens, every block from
        `num_computed_tokens` on owned by `seq` alone. Returns copy-on-write (src, dst) pairs."""
        bs = self.block_size
        copies = []
        for i in range(seq.num_computed_tokens // bs, min(cdiv(num_tokens, bs), len(seq.block_table))):
            block = seq.block_table[i]
            if block != SLIDING_FREED and self.ref_counts[block] > 1:
                new = self._allocate()
                self._decref(block)
                seq.block_table[i] = new
                copies.append((block, new))
        while len(seq.block_table) < cdiv(num_tokens, bs):
            seq.block_table.append(self._allocate())
        return copies

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Record that the cache now holds `seq`'s first `num_computed_tokens` tokens: register
        newly full blocks for prefix caching and free blocks that left the sliding window."""
        assert num_computed_tokens <= len(seq), (num_computed_tokens, seq)
        seq.num_computed_tokens = num_computed_tokens
        if self.enable_prefix_caching:
            full = num_computed_tokens // self.block_size
            for i in range(seq.num_registered_blocks, full):
                block = seq.block_table[i]
                h = seq.block_hash(i)
                if block != SLIDING_FREED and self.block_hashes[block] is None and h not in self.hash_to_block:
                    self.hash_to_block[h] = block
                    self.block_hashes[block] = h
                    self.block_token_ids[block] = seq.block_tokens(i)
            seq.num_registered_blocks = max(seq.num_registered_blocks, full)
        if self.sliding_window is not None:
            self._free_out_of_window(seq)

    def _free_out_of_window(self, seq: Sequence) -> None:
        # Every later step starts at context_len >= num_computed_tokens: what it cannot see,
        # the builder drops, with the same function.
        dead = window_start_block(seq.num_computed_tokens, self.sliding_window, self.block_size)
        for i in range(min(dead, len(seq.block_table))):
            if seq.block_table[i] != SLIDING_FREED:
                self._decref(seq.block_table[i])
                seq.block_table[i] = SLIDING_FREED

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (copied on write by `ensure_slots`)."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            if block != SLIDING_FREED:
                self._incref(block)
        child.cross_block_table = list(parent.cross_block_table)
        for block in child.cross_block_table:
            self.cross.incref(block)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (GPU or CPU, by its status), cross blocks included."""
        swapped = seq.status is SeqStatus.SWAPPED
        pool_decref = self.cpu.decref if swapped else self._decref
        for block in reversed(seq.block_table):
            if block != SLIDING_FREED:
                pool_decref(block)
        seq.block_table = []
        cross = self.cpu_cross if swapped else self.cross
        for block in reversed(seq.cross_block_table):
            cross.decref(block)
        seq.cross_block_table = []

    # ------------------------------------------------------------------ swapping

    @staticmethod
    def _unique_blocks(seqs: Iterable[Sequence]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in s.block_table if b != SLIDING_FREED))

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
            for i, block in enumerate(seq.block_table):
                if block != SLIDING_FREED:
                    self._decref(block)
                    self.cpu.incref(mapping[block])
                    seq.block_table[i] = mapping[block]
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
            for i, block in enumerate(seq.block_table):
                if block != SLIDING_FREED:
                    self.cpu.decref(block)
                    self.ref_counts[mapping[block]] += 1
                    seq.block_table[i] = mapping[block]
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
            for block in seq.block_table:
                if block != SLIDING_FREED:
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
        for h, block in self.hash_to_block.items():
            assert self.block_hashes[block] == h, f"hash table names block {block} whose hash is {self.block_hashes[block]}"
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
