"""KV cache groups: the layers that share block tables, and the cache tensors they share.

A model whose layers all attend alike (every layer full, or every layer the same sliding
window) has one group: one block table per sequence, one cache tensor per layer, as always.
A hybrid model (Gemma 2 and gpt-oss alternate local and global layers; Gemma 3 has five local
layers per global one) has one group per kind of layer, as vLLM's hybrid KV cache manager does:
each sequence holds a block table per group, all drawn from one pool of block ids, and a
windowed group frees the blocks that left its window while a full group keeps every block.

Memory: the layers of a kind are cut into groups of the same size `S` (vLLM's rule: the fewest
layers of any kind, or the most where that is less than 1.5 times the fewest); the pool has `S`
cache tensors, and the `j`-th layer of every group reads and writes tensor `j`. A block id names
a block of all `S` tensors and belongs to one group at a time, so a block costs `S` layers' K/V,
not the whole model's, and a windowed group's freed blocks go back to the common pool. Gemma 3
(26 layers: 22 local, 4 global) makes 7 groups of 4 layers (the last local group holds 2); a
sequence past the 1k-token window holds its full-length table in the global group and about
1k tokens in each local one, instead of 26 layers of its whole length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedattn.intmath import cdiv


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per sequence."""

    window: int | None
    """Their sliding window (None: full attention)."""
    layers: tuple[int, ...]
    """Model layer indices, in order; `layers[j]` reads and writes cache tensor `j`."""


@dataclass(frozen=True)
class KVCacheGroups:
    """A model's decoder layers in KV cache groups (full attention first, then by window)."""

    groups: tuple[KVCacheGroup, ...]
    num_layers: int

    @classmethod
    def of(cls, sliding_windows: Sequence[int | None]) -> KVCacheGroups:
        """The groups of a model whose layer `i` has the window `sliding_windows[i]` (None: full)."""
        kinds: dict[int | None, list[int]] = {}
        for i, window in enumerate(sliding_windows):
            kinds.setdefault(window, []).append(i)
        if len(kinds) == 1:
            (window, layers), = kinds.items()
            return cls((KVCacheGroup(window, tuple(layers)),), len(sliding_windows))
        fewest, most = min(map(len, kinds.values())), max(map(len, kinds.values()))
        size = most if most < 1.5 * fewest else fewest
        groups = []
        for window in sorted(kinds, key=lambda w: -1 if w is None else w):
            layers = kinds[window]
            groups += [KVCacheGroup(window, tuple(layers[a : a + size])) for a in range(0, len(layers), size)]
        return cls(tuple(groups), len(sliding_windows))

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window: what the block manager frees by."""
        return tuple(g.window for g in self.groups)

    @property
    def num_tensors(self) -> int:
        """Cache tensors of the pool: the layers of the largest group."""
        return max(len(g.layers) for g in self.groups)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """The group of each layer, by layer index."""
        owner = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                owner[layer] = g
        return tuple(owner)

    def layer_caches(self, tensors: Sequence) -> list:
        """Each layer's cache, by layer index, from the pool's `num_tensors` cache tensors (layers
        of different groups share a tensor: the same object appears several times)."""
        caches = [None] * self.num_layers
        for group in self.groups:
            for j, layer in enumerate(group.layers):
                caches[layer] = tensors[j]
        return caches

    def blocks_per_request(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of `num_tokens` slots holds at most: every block in a full group; in
        a windowed one, the blocks under its window and the largest step's tokens."""
        full = cdiv(num_tokens, block_size)
        return sum(
            full if g.window is None else min(full, cdiv(g.window - 1 + max_num_batched_tokens, block_size) + 1)
            for g in self.groups
        )
