"""How a case is timed: CUDA-event medians over eager calls or CUDA-graph replays.

Three modes (a case's `timing`; every provider of a case is timed the same way):
- "graph": N calls captured in ONE graph, cycling through the rotating input sets, and the
  graph replayed many times; time per call = median replay time / N. Amortises the launch of
  small decode kernels as a model's captured step does, and with the sets (each a distinct
  cache, query and output) over twice the L2 size, nothing is served from L2.
- "step": one call per graph (a graph per input set), K graphs replayed back to back between
  two events; time per call = elapsed / K: what a decode step launched from a graph costs,
  gaps between graphs included.
- "events": eager calls, each between two CUDA events, the L2 flushed before each by a memset
  sized to outlast the host's enqueue of the call, so the host runs ahead and the interval
  holds device time only (prefill, chunked and mixed steps, hundreds of microseconds each).
Mixed steps are also timed as a caller sees them (`time_back_to_back`: eager calls one after
another, the host's enqueue included wherever it is slower than the device) and replayed from a
graph a call (`time_steps`), so eager and replayed costs compare in one run.
Everything is a median; no timing waits on the host inside the timed loop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from pagedattn.cuda_timing import capture, median_event_ms
from pagedattn.intmath import cdiv

MAX_SETS = 32  # rotating input sets at most (tiny steps: 32 x 4 MB > 2 x a 50 MB L2)
MAX_CALLS = 128  # calls per graph at most
GRAPH_TARGET_US = 1000.0  # device time one replay of a "graph" case aims for
REP_TARGET_S = 0.25  # device time each provider's timing loop aims for
MIN_REPS, MAX_REPS = 10, 200
FLUSH_MIN, FLUSH_MAX = 256 << 20, 2 << 30


def rotation_sets(set_bytes: float, l2_bytes: int) -> int:
    """Input sets to cycle so that one pass over them is over twice the L2 (1 when one is)."""
    return max(1, min(MAX_SETS, cdiv(int(2 * l2_bytes), max(1, int(set_bytes)))))


def rounds_for(per_call_us: float, sets: int) -> int:
    """Passes over the `sets` input sets in one graph: about GRAPH_TARGET_US of device time."""
    want = cdiv(int(GRAPH_TARGET_US), max(1, int(per_call_us * sets)))
    return max(1, min(want, MAX_CALLS // sets))


def reps_for(per_rep_us: float) -> int:
    """Timed repetitions: about REP_TARGET_S of device time, within [MIN_REPS, MAX_REPS]."""
    return min(MAX_REPS, max(MIN_REPS, int(REP_TARGET_S * 1e6 / max(per_rep_us, 1.0))))


def host_us(fn: Callable[[], object], reps: int = 5) -> float:
    """Median host time of enqueueing `fn()` (no synchronisation: kernels run asynchronously)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


class Flusher:
    """A memset over a buffer far larger than L2, before each eagerly timed call: it evicts the
    L2 and keeps the device busy while the host enqueues the call (hence sized by host time)."""

    def __init__(self, device: torch.device, write_gbs: float):
        self.buffer = torch.empty(FLUSH_MAX, dtype=torch.uint8, device=device)
        self.write_gbs = write_gbs
        self.bytes = FLUSH_MIN

    def fit(self, host_time_us: float) -> None:
        """Size the memset to last about twice `host_time_us` on the device."""
        want = int(2 * host_time_us * 1e-6 * self.write_gbs * 1e9)
        self.bytes = min(FLUSH_MAX, max(FLUSH_MIN, want))

    def __call__(self) -> None:
        self.buffer[: self.bytes].zero_()


def time_graph(calls: Sequence[Callable[[], object]]) -> tuple[float, str]:
    """("graph" mode) microseconds per call, and how it was timed. A first graph of one pass
    over the sets measures the call; the timed graph repeats the pass to ~GRAPH_TARGET_US."""
    sets = len(calls)
    graph = capture(calls)
    per_call = median_event_ms(graph.replay, 3, warmup=1) * 1e3 / sets
    rounds = rounds_for(per_call, sets)
    if rounds > 1:
        graph = capture(list(calls) * rounds)
    n = sets * rounds
    reps = reps_for(per_call * n)
    ms = median_event_ms(graph.replay, reps, warmup=2)
    return ms * 1e3 / n, f"graph of {n} calls over {sets} sets, median of {reps} replays"


def time_steps(calls: Sequence[Callable[[], object]]) -> tuple[float, str]:
    """("step" mode) microseconds per one-call graph, graphs replayed back to back."""
    graphs = [capture([call]) for call in calls]
    order = list(graphs)

    def replay_all():
        for g in order:
            g.replay()

    per_step = median_event_ms(replay_all, 3, warmup=1) * 1e3 / len(graphs)
    order = graphs * rounds_for(per_step, len(graphs))
    reps = reps_for(per_step * len(order))
    ms = median_event_ms(replay_all, reps, warmup=2)
    return ms * 1e3 / len(order), f"{len(order)} one-step graphs back to back over {len(graphs)} sets, median of {reps}"


def time_back_to_back(calls: Sequence[Callable[[], object]], count: int = 16) -> tuple[float, str]:
    """Microseconds per eager call of `count` calls issued back to back (cycling the sets)
    between two events: max(host enqueue, device time) per call, as an eager caller's step."""
    def run():
        for i in range(count):
            calls[i % len(calls)]()

    per_call = median_event_ms(run, 3, warmup=1) * 1e3 / count
    reps = reps_for(per_call * count)
    ms = median_event_ms(run, reps, warmup=1)
    return ms * 1e3 / count, f"{count} eager calls back to back, median of {reps}"


def time_events(calls: Sequence[Callable[[], object]], flusher: Flusher) -> tuple[float, str]:
    """("events" mode) microseconds per eager call, L2 flushed before each."""
    host = host_us(calls[0])
    flusher.fit(host)
    turn = iter(range(1 << 62))

    def call():
        calls[next(turn) % len(calls)]()

    reps = reps_for(median_event_ms(call, 3, warmup=0, before=flusher) * 1e3)
    ms = median_event_ms(call, reps, before=flusher)
    return ms * 1e3, f"eager, {flusher.bytes >> 20} MiB memset before each, median of {reps} (host {host:.0f} us/call)"
