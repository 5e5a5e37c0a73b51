"""Device time of CUDA work, read from CUDA events: `median_event_ms` (a callable's median over
calls queued back to back, one synchronisation at the end) and `capture` (calls in one CUDA
graph, so that replays time the kernels without their launch gaps, as a captured decode step
runs them). The engine's decode-graph timing, the tensor-parallel all-reduce timing and the
kernel benchmarks all time through these two."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def median_event_ms(fn: Callable[[], object], reps: int, warmup: int = 3,
                    before: Callable[[], object] | None = None) -> float:
    """Median of `reps` CUDA-event intervals around `fn()` (after `before()`, untimed), all
    queued before one synchronisation at the end, on the current device and stream."""
    if reps < 1:
        raise ValueError(f"expected reps >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def capture(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """One graph running `calls` in order; each is first run once on a side stream (compiles
    kernels and allocates lazily made scratch outside the graph, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph
