"""Vocabulary types shared by every backend: attention kinds and scheduled sequences."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

PAD_SLOT_ID = -1
"""A `slot_mapping` entry that means "padding: write nothing"."""


class AttentionType(enum.Enum):
    DECODER = "decoder"
    """Causal self-attention through the paged cache."""
    ENCODER = "encoder"
    """An encoder-decoder model's encoder: bidirectional over each sequence's `encoder_len` tokens, no cache."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional over the step's query tokens, no cache."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention: decoder queries over the encoder's keys/values (cached), not causal."""


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step, as the scheduler hands it to a metadata builder.

    `seq_len = context_len + query_len`; token `p` lives in slot
    `block_table[p // block_size] * block_size + p % block_size`.
    `encoder_len`/`cross_block_table` describe the encoder tokens of an encoder-decoder model.
    """

    seq_len: int
    query_len: int
    block_table: Sequence[int] = field(default=())
    encoder_len: int = 0
    cross_block_table: Sequence[int] = field(default=())

    def __post_init__(self) -> None:
        if not 1 <= self.query_len <= self.seq_len:
            raise ValueError(
                f"expected 1 <= query_len <= seq_len, got query_len={self.query_len}, seq_len={self.seq_len}"
            )
        if self.encoder_len < 0:
            raise ValueError(f"expected encoder_len >= 0, got {self.encoder_len}")

    @property
    def context_len(self) -> int:
        return self.seq_len - self.query_len

    @property
    def is_prefill(self) -> bool:
        return is_prefill(self.seq_len, self.query_len)


def is_prefill(seq_len: int, query_len: int) -> bool:
    """The one prefill rule: a sequence computing several tokens, or its first. A function too,
    so the scheduler asks it of a step before making its `ScheduledSeq`."""
    return query_len > 1 or seq_len == query_len


def window_start_block(context_len: int, sliding_window: int | None, block_size: int) -> int:
    """Leading blocks of a sequence that no query of a step starting at position `context_len`
    can see through a sliding window of `sliding_window` keys (0 without a window).

    The one owner of this fact: the builder drops these blocks from the step's tables, and an
    engine may free them (their entries in the block table are then never read).
    """
    if sliding_window is None:
        return 0
    return max(0, context_len - sliding_window + 1) // block_size
