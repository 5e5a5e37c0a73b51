"""The work of one case, counted once: the fewest bytes it must move and the FLOPs it must do.

Bytes: every key and value a query can see, read once (at the cache's element size: 1 for FP8,
2 for bf16), plus the queries read and the outputs written (bf16). Block tables, the FP8 scales
and the step's own K/V store are left out (under 1% in every case here). FLOPs: 4 * Hq * D per
visible (query, key) pair (Q.K and P.V, 2 FLOPs per multiply-add), the FlashAttention
convention: causal counts only the pairs a query sees, a sliding window only the keys inside it.
Query i (0-based) of a sequence with context c sits at position c + i and sees keys
max(0, c + i + 1 - W) .. c + i.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cases import Case

Q_BYTES = 2  # bf16 queries and outputs
KV_BYTES = {"bf16": 2, "fp8_e4m3": 1}


@dataclass(frozen=True)
class Work:
    bytes: float  # device-memory bytes that must move
    flops: float
    kv_bytes: float  # the K/V part of `bytes`
    pairs: int  # visible (query, key) pairs

    @property
    def intensity(self) -> float:
        """FLOPs per byte (the roofline's x axis)."""
        return self.flops / self.bytes


def visible_pairs(context_len: int, query_len: int, window: int | None) -> int:
    """(query, key) pairs of one causal sequence: sum over i of min(c + i + 1, W)."""
    c, q = context_len, query_len
    full = q * c + q * (q + 1) // 2  # sum of (c + i + 1) for i in [0, q)
    if window is None or window >= c + q:
        return full
    # queries whose key range is already W wide see exactly W keys; the rest see c + i + 1
    first_capped = max(0, window - c - 1)  # smallest i with c + i + 1 >= W
    uncapped = min(q, first_capped)
    return uncapped * c + uncapped * (uncapped + 1) // 2 + (q - uncapped) * window


def keys_read(context_len: int, query_len: int, window: int | None) -> int:
    """Keys that some query of the sequence sees: the last min(seq_len, W + query_len - 1)."""
    n = context_len + query_len
    return n if window is None else min(n, window + query_len - 1)


def work(case: Case) -> Work:
    w = case.sliding_window
    keys = sum(keys_read(c, q, w) for c, q in case.seqs)
    pairs = sum(visible_pairs(c, q, w) for c, q in case.seqs)
    kv = 2.0 * keys * case.num_kv_heads * case.head_size * KV_BYTES[case.kv_dtype]
    qo = 2.0 * case.num_tokens * case.num_heads * case.head_size * Q_BYTES
    return Work(bytes=kv + qo, flops=4.0 * case.num_heads * case.head_size * pairs, kv_bytes=kv, pairs=pairs)
