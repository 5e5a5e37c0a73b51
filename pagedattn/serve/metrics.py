"""`ServerMetrics`: what `/metrics` reports, in Prometheus' text format (through `prometheus_client`),
and the throughput line the server logs while busy.

Each server has a registry of its own (not the process-wide default), so several servers in
one process (tests) do not collide. Engine gauges are set by the engine loop between steps,
never read from the engine while a step runs. Latencies are the server's view: from the moment
a handler queues a request to the end of the step that gave its first token (time to first
token), and between two steps that gave a request tokens (inter-token latency), as vLLM's
`time_to_first_token_seconds` and `inter_token_latency_seconds`.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedattn.engine.llm_engine import EngineStats

THROUGHPUT_WINDOW_S = 10.0
"""Generated tokens/s is averaged over this many seconds."""

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
"""vLLM's buckets (inter-token latency with two finer ones below 10 ms, where small models decode)."""


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
        self.prompt_tokens = Counter("pagedattn_prompt_tokens", "Prompt tokens of requests past their prefill.",
                                     registry=r)
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
        self.time_to_first_token = Histogram(
            "pagedattn_time_to_first_token_seconds", "From a request's arrival to its first token.",
            buckets=TTFT_BUCKETS_S, registry=r,
        )
        self.inter_token_latency = Histogram(
            "pagedattn_inter_token_latency_seconds", "Between two steps that gave a request tokens.",
            buckets=ITL_BUCKETS_S, registry=r,
        )
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self._totals = [0, 0]  # prompt tokens, generated tokens (the counters' values)
        self._last_log = (time.monotonic(), 0, 0)  # (time, prompt tokens, generated tokens)
        self._logged_idle = True

    def observe_engine(self, stats: EngineStats) -> None:
        self.num_waiting.set(stats.num_waiting)
        self.num_running.set(stats.num_running)
        self.num_swapped.set(stats.num_swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)

    def observe_prompt(self, num_tokens: int) -> None:
        """Count the prompt of a request whose prefill is done."""
        self.prompt_tokens.inc(num_tokens)
        self._totals[0] += num_tokens

    def observe_tokens(self, num_tokens: int) -> None:
        """Count the tokens one step generated."""
        self.generation_tokens.inc(num_tokens)
        self._totals[1] += num_tokens
        self._window.append((time.monotonic(), num_tokens))

    def throughput_line(self, stats: EngineStats, *, busy: bool) -> str | None:
        """vLLM's periodic log line over the time since the last call, or None when the server
        was idle then and the last line already said so."""
        now, (prompt, generated) = time.monotonic(), self._totals
        then, prompt_then, generated_then = self._last_log
        self._last_log = (now, prompt, generated)
        idle = not busy and prompt == prompt_then and generated == generated_then
        if idle and self._logged_idle:
            return None
        self._logged_idle = idle
        seconds = max(now - then, 1e-9)
        return (
            f"Avg prompt throughput: {(prompt - prompt_then) / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {(generated - generated_then) / seconds:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, Swapped: {stats.num_swapped} reqs, "
            f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%"
        )

    def render(self) -> bytes:
        now = time.monotonic()
        while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
            self._window.popleft()
        self.tokens_per_second.set(sum(n for _, n in self._window) / THROUGHPUT_WINDOW_S)
        return generate_latest(self.registry)
