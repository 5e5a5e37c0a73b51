"""Integer helpers of block arithmetic (a leaf module: imports nothing of the package)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for integers (e.g. the blocks that hold `a` tokens of `b` per block)."""
    return -(-a // b)


def cumsum(xs: Iterable[int]) -> list[int]:
    """`[0, x0, x0 + x1, ...]`: the start offsets of consecutive runs of these lengths."""
    return [0, *itertools.accumulate(xs)]
