"""Vocabulary types shared by every backend: attention kinds, scheduled sequences, cache dtypes."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

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
        return self.query_len > 1 or self.context_len == 0


_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_CACHE_DTYPE_NAMES = ("auto", *_KV_CACHE_DTYPES)


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Map a cache dtype name to the torch dtype of the cache tensor.

    `"auto"` is the model dtype; `"fp8"`/`"fp8_e4m3"` is `float8_e4m3fn`; `"fp8_e5m2"` is `float8_e5m2`.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return _KV_CACHE_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"expected kv_cache_dtype in {list(KV_CACHE_DTYPE_NAMES)}, got {kv_cache_dtype!r}"
        ) from None
