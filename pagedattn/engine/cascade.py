"""Cascade (shared-prefix) attention: which steps attend their sequences' common prefix once.

Many requests over one long system prompt hold the same cached blocks first in their tables
(prefix caching, or forks of one prompt). Attended per sequence, a decode step reads those
blocks once for each of them; a cascade step reads them once for all: one query batch of every
query token of the step over the shared blocks (not causal: every query lies after them), each
sequence's suffix apart, merged by their LSEs (`pagedattn.layer`, "Cascade"). FlashInfer's
`MultiLevelCascadeAttentionWrapper` and vLLM's cascade path do the same.

`CascadePolicy` is the one owner of the decision, made on rank 0 and carried in the step's
`StepPlan` (`cascade_blocks`), so tensor-parallel ranks build the same metadata:
- on unless turned off (`cascade_attention=False`, `--no-cascade-attention`), and only where a
  layer can split (`Attention.prefix_impl`: DECODER attention without ALiBi or a window);
- the step has at least `min_seqs` sequences (vLLM: 8) whose tables in every full-attention KV
  cache group begin with the same blocks, at least `min_prefix_tokens` of them (vLLM: 256);
- the prefix is cut so that every query lies after it and each sequence keeps its kind: a
  decode keeps at least one key of its own (`common_prefix_blocks`). Windowed groups' layers
  attend whole (their early blocks are freed anyway).
Decode steps replay cascade graphs of their own (`engine/decode_graphs.py`) where the backend's
graph state can hold a shared part; where it cannot (FlashInfer), a step that would replay a
graph attends whole instead: an eager step's host work costs more than the shared reads save
(docs/PERF.md). Prefill and mixed steps run eagerly anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedattn.attention.types import ScheduledSeq

MIN_PREFIX_TOKENS = 256
MIN_SEQS = 8


def prefix_cap(seqs: Sequence[ScheduledSeq], block_size: int) -> int:
    """The most leading blocks a step's shared part may take: whole blocks before every query,
    less one key for a decode whose context ends on a block's end (its suffix must keep a key,
    or it would read as a prefill)."""
    if not seqs:
        return 0
    return min((s.context_len - (0 if s.is_prefill else 1)) // block_size for s in seqs)


def common_run(tables: Sequence[Sequence[int]], limit: int) -> int:
    """The number of leading block ids, at most `limit`, that every table of `tables` holds
    alike (the same block at the same position)."""
    if not tables or limit <= 0:
        return 0
    first = tables[0]
    n = min(limit, len(first))
    for table in tables[1:]:
        n = min(n, len(table))
        if table[:n] == first[:n]:  # the usual case, at C speed
            continue
        i = 0
        while i < n and table[i] == first[i]:
            i += 1
        n = i
        if n == 0:
            break
    return n


def common_prefix_blocks(seqs: Sequence[ScheduledSeq], block_size: int) -> int:
    """The leading blocks that every sequence of a step holds alike in its block table, all of
    them before every query (`prefix_cap`): what a cascade step attends once."""
    return common_run([s.block_table for s in seqs], prefix_cap(seqs, block_size))


@dataclass(frozen=True)
class CascadePolicy:
    """When a step attends its common prefix apart (module docstring). `refusal`: why no layer
    of the model can (the policy is then off), or None."""

    enabled: bool = True
    min_prefix_tokens: int = MIN_PREFIX_TOKENS
    min_seqs: int = MIN_SEQS
    refusal: str | None = None

    @property
    def active(self) -> bool:
        """Whether any step may be cascaded: on, and some layer can split."""
        return self.enabled and self.refusal is None

    def prefix_blocks(self, seqs: Sequence[ScheduledSeq], group_tables: Sequence[Sequence[Sequence[int]]],
                      windows: Sequence[int | None], block_size: int) -> int:
        """The blocks of the step's shared prefix to attend apart, 0 to attend whole. `seqs`: the
        step's sequences over KV cache group 0's tables, `group_tables[i]` sequence i's tables of
        groups 1.. (`StepPlan`); `windows`: each group's window (None: full attention)."""
        if not self.active or len(seqs) < self.min_seqs:
            return 0
        n = prefix_cap(seqs, block_size)
        for g, window in enumerate(windows):
            if window is not None:
                continue
            tables = [s.block_table for s in seqs] if g == 0 else [t[g - 1] for t in group_tables]
            n = common_run(tables, n)
            if n * block_size < self.min_prefix_tokens:
                return 0
        return n if any(w is None for w in windows) else 0
