"""Layers split over a tensor-parallel group (Megatron-LM's scheme, as vLLM and nano-vllm do it).

- `ColumnParallelLinear`: each rank computes its rows of the output (q/k/v by heads, gate/up
  by intermediate columns); several checkpoint matrices may be stacked into one matmul, each
  split on its own (`Split`). No communication: the output stays split.
- `RowParallelLinear`: each rank holds its columns of the input (o_proj by heads, down_proj by
  intermediate columns), computes a partial sum and all-reduces it: one all-reduce per layer.
  The bias is rank 0's alone, so the sum counts it once. Built with `reduce=False` it returns
  the partial sum, for a next layer that sums it itself (`RMSNorm(partial_over=...)`: the
  all-reduce, the residual add and the norm in one kernel).
- `VocabParallelEmbedding`: each rank holds a contiguous range of the vocabulary (the last
  ones padded with zero rows to the same size); rows outside a rank's range embed to zero and
  an all-reduce assembles the embeddings.
- `ParallelLMHead`: the output head over the same vocabulary ranges (tied heads share the
  embedding's shard); an all-gather puts the ranks' logits side by side, padding cut off.
  All-gather rather than gather-to-rank-0: rank 0 receives the same bytes either way (what
  decides the time), it is one NCCL collective that CUDA graphs capture like the all-reduce,
  and the workers' copy of the logits costs them nothing they would otherwise do.

KV heads: each rank takes `num_kv_heads // size` of them; with more ranks than KV heads each
head is replicated on `size // num_kv_heads` consecutive ranks (vLLM's rule), so a rank's
query heads always find their KV head locally. Attention itself needs no communication.

Loading: `checkpoint_shard(leaf, index)` says which rows of a checkpoint tensor this rank
reads (`Shard`), so a loader slices only those out of a safetensors file. At size 1 every
layer is its dense counterpart (same parameters, same math).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.intmath import cdiv
from pagedattn.parallel.group import TPGroup

SINGLE = TPGroup()
"""The group of one process (no tensor parallelism)."""


@dataclass(frozen=True)
class Split:
    """This rank's part of one dimension of a checkpoint tensor of `size`: checkpoint rows
    `start : start + length` go to the first `length` of its `local` rows (`local > length`:
    zero padding)."""

    size: int
    local: int
    start: int
    length: int

    @classmethod
    def whole(cls, size: int) -> Split:
        return cls(size, size, 0, size)

    @classmethod
    def even(cls, size: int, tp: TPGroup, what: str) -> Split:
        """`size` in `tp.size` equal parts; ValueError naming `what` when it does not divide."""
        if size % tp.size:
            raise ValueError(f"expected {what} ({size}) divisible by tensor_parallel_size={tp.size}")
        local = size // tp.size
        return cls(size, local, tp.rank * local, local)

    @classmethod
    def heads(cls, num_heads: int, head_size: int, tp: TPGroup, what: str, *, replicate: bool = False) -> Split:
        """`num_heads` heads of `head_size` rows, `num_heads // size` a rank; with `replicate`
        (KV heads) and more ranks than heads, one head a rank, each on `size // num_heads`
        consecutive ranks. ValueError naming `what` when the heads cannot be shared out."""
        local = local_heads(num_heads, tp.size, what, replicate=replicate)
        first = tp.rank * num_heads // tp.size  # replicated: rank r holds head r // (size // num_heads)
        return cls(num_heads * head_size, local * head_size, first * head_size, local * head_size)

    @classmethod
    def padded(cls, size: int, tp: TPGroup) -> Split:
        """`size` in `tp.size` parts of ceil(size / tp.size), the last ones zero-padded."""
        local = cdiv(size, tp.size)
        start = min(tp.rank * local, size)
        return cls(size, local, start, min(local, size - start))


def local_heads(num_heads: int, size: int, what: str, *, replicate: bool = False) -> int:
    """Heads a rank holds: `num_heads // size`; with `replicate` and more ranks than heads, 1
    (a head replicated on `size // num_heads` ranks). ValueError, saying why, otherwise."""
    if num_heads % size == 0:
        return num_heads // size
    if replicate and size > num_heads and size % num_heads == 0:
        return 1
    also = ", or tensor_parallel_size a multiple of it (each head then replicated)" if replicate else ""
    raise ValueError(f"expected {what} ({num_heads}) divisible by tensor_parallel_size={size}{also}: every rank "
                     "needs whole heads")


@dataclass(frozen=True)
class Shard:
    """Where this rank's part of a checkpoint tensor of `full_shape` goes: rows `start : start +
    length` along `dim` are copied into `dest` (a view of a parameter)."""

    dest: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int
    start: int
    length: int


class ColumnParallelLinear(nn.Linear):
    """One matmul for several checkpoint matrices with the same input (q/k/v, gate/up), each
    split over the ranks by its own `Split` (an int: unsplit, as at size 1).

    Output rows are this rank's parts stacked in order; `shard(param, i)` is the view that part
    `i` (`output_sizes[i]` rows) is loaded into.
    """

    collective = None  # the output stays split across the ranks

    def __init__(self, in_features: int, parts: Sequence[Split | int], bias: bool) -> None:
        self.splits = tuple(Split.whole(p) if isinstance(p, int) else p for p in parts)
        self.output_sizes = tuple(s.local for s in self.splits)
        super().__init__(in_features, sum(self.output_sizes), bias=bias)

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        start = sum(self.output_sizes[:index])
        return param.narrow(0, start, self.output_sizes[index])

    def checkpoint_shard(self, leaf: str, index: int) -> Shard:
        s = self.splits[index]
        param = getattr(self, leaf)
        full = (s.size, *param.shape[1:])
        return Shard(self.shard(param.data, index).narrow(0, 0, s.length), full, 0, s.start, s.length)


class RowParallelLinear(nn.Linear):
    """y = x W^T + b with W's input columns split over the ranks (`split` of `in_features`):
    x holds this rank's columns (a column-parallel layer's output), the partial products are
    all-reduced (`reduce=False`: returned unsummed, the caller sums them). Only rank 0 holds the
    bias (zeros elsewhere), so the sum adds it once."""

    def __init__(self, split: Split | int, out_features: int, bias: bool, tp: TPGroup = SINGLE, *,
                 reduce: bool = True) -> None:
        self.split = Split.whole(split) if isinstance(split, int) else split
        super().__init__(self.split.local, out_features, bias=bias)
        self.rank = tp.rank
        self.collective = tp.all_reduce if tp.size > 1 and reduce else None
        if self.bias is not None and tp.rank != 0:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.collective is None else self.collective(y)

    def checkpoint_shard(self, leaf: str, index: None = None) -> Shard:
        if leaf == "bias":
            length = self.out_features if self.rank == 0 else 0
            return Shard(self.bias.data[:length], (self.out_features,), 0, 0, length)
        s = self.split
        return Shard(self.weight.data.narrow(1, 0, s.length), (self.out_features, s.size), 1, s.start, s.length)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows (the vocabulary) are split over the ranks in contiguous ranges."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE) -> None:
        self.split = Split.padded(num_embeddings, tp)
        super().__init__(self.split.local, embedding_dim)
        self.tp = tp
        with torch.no_grad():
            self.weight[self.split.length :].zero_()  # padding rows: never looked up, zero in a tied head's logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 [T] (ids of the whole vocabulary) -> [T, embedding_dim]."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.split.start
        inside = (local >= 0) & (local < self.split.length)
        h = F.embedding(local.masked_fill(~inside, 0), self.weight)  # [T, embedding_dim]
        return self.tp.all_reduce(h.masked_fill_(~inside.unsqueeze(1), 0))

    def checkpoint_shard(self, leaf: str, index: None = None) -> Shard:
        s = self.split
        return Shard(self.weight.data[: s.length], (s.size, self.embedding_dim), 0, s.start, s.length)


class _GatherVocab:
    """Every rank's logits side by side, the padding columns cut off: [N, local] -> [N, vocab].
    An object rather than a closure over the head, so that a CPU-packed copy of the head
    (`pack_linears_for_cpu`) can keep it without keeping the head's original weight alive."""

    def __init__(self, tp: TPGroup, vocab_size: int) -> None:
        self.tp = tp
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(logits)[:, : self.vocab_size]


class ParallelLMHead(nn.Linear):
    """The output head over the vocabulary ranges of `VocabParallelEmbedding` (whose weight a
    tied head takes): logits [N, vocab_size] in the weight's dtype on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup = SINGLE) -> None:
        self.split = Split.padded(vocab_size, tp)
        super().__init__(hidden_size, self.split.local, bias=False)
        self.vocab_size = vocab_size
        self.collective = _GatherVocab(tp, vocab_size) if tp.size > 1 else None
        with torch.no_grad():
            self.weight[self.split.length :].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        return logits if self.collective is None else self.collective(logits)

    def checkpoint_shard(self, leaf: str, index: None = None) -> Shard:
        s = self.split
        return Shard(self.weight.data[: s.length], (s.size, self.in_features), 0, s.start, s.length)
