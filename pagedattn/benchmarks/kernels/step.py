"""What a provider hands the timer: one callable per input set, and where its output lands."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class NotApplicable(Exception):
    """This provider has no meaning for this case (e.g. dense SDPA over ragged lengths); the
    row says why instead of a time."""


@dataclass
class Step:
    """A provider's step on a workload.

    calls: calls[i]() runs the whole step (store included where `store` says so) on input set i.
    output: returns set 0's output as [T, Hq, D] (valid after calls[0]() ran).
    store: how the step's K/V reach the cache ("write": `paged_attention`'s, "store_kv",
        "append_paged_kv_cache", "impl.forward", or "-" when nothing is stored).
    eager_only: the step cannot be captured in a CUDA graph (it is timed eagerly, said in the row).
    keep: objects that must outlive the timing (plans, graph states, dense copies).
    """

    calls: list[Callable[[], object]]
    output: Callable[[], torch.Tensor]
    store: str
    note: str = ""
    eager_only: bool = False
    keep: list = field(default_factory=list)
