"""`ServerMetrics`: what `/metrics` reports, in Prometheus' text format (through `prometheus_client`).

Each server has a registry of its own (not the process-wide default), so several servers in
one process (tests) do not collide. Engine gauges are set by the engine loop between steps,
never read from the engine while a step runs.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from pagedattn.engine.llm_engine import EngineStats

THROUGHPUT_WINDOW_S = 10.0
"""Generated tokens/s is averaged over this many seconds."""


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r = self.registry
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=list(labels), registry=r).labels(**labels)

        self.num_waiting = gauge("pagedattn_num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_running = gauge("pagedattn_num_requests_running", "Requests in the running batch.")
        self.num_swapped = gauge("pagedattn_num_requests_swapped", "Requests preempted to the CPU swap pool.")
        self.kv_cache_usage = gauge("pagedattn_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0 to 1).")
        self.tokens_per_second = gauge(
            "pagedattn_generation_tokens_per_second", f"Generated tokens/s over the last {THROUGHPUT_WINDOW_S:g} s."
        )
        self.prompt_tokens = Counter("pagedattn_prompt_tokens", "Prompt tokens of queued requests.", registry=r)
        self.generation_tokens = Counter("pagedattn_generation_tokens", "Generated tokens.", registry=r)
        self.requests_finished = Counter(
            "pagedattn_requests_finished", "Requests finished, by finish reason.", labelnames=["reason"], registry=r
        )
        self.requests_refused = Counter(
            "pagedattn_requests_refused", "Requests answered with an error status.", labelnames=["status"], registry=r
        )
        self.preemptions = Counter(
            "pagedattn_preemptions", "Preemptions (recompute or swap) of requests that finished.", registry=r
        )
        self.request_latency = Histogram(
            "pagedattn_request_latency_seconds", "Arrival to last token, of requests that finished.", registry=r
        )
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps

    def observe_engine(self, stats: EngineStats) -> None:
        self.num_waiting.set(stats.num_waiting)
        self.num_running.set(stats.num_running)
        self.num_swapped.set(stats.num_swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)

    def observe_tokens(self, num_tokens: int) -> None:
        """Count the tokens one step generated."""
        self.generation_tokens.inc(num_tokens)
        self._window.append((time.monotonic(), num_tokens))

    def render(self) -> bytes:
        now = time.monotonic()
        while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
            self._window.popleft()
        self.tokens_per_second.set(sum(n for _, n in self._window) / THROUGHPUT_WINDOW_S)
        return generate_latest(self.registry)
