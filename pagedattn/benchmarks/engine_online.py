"""Online latency of `pagedattn bench engine`: requests arriving as a Poisson process, streamed
through the OpenAI-compatible server (`pagedattn.serve`) on loopback.

The server is `pagedattn serve`'s app over the benchmark's engine, run by uvicorn in a thread
of this process; the client (httpx under asyncio, in the main thread) sends each request at its
arrival time (exponential gaps of mean 1/rate, seeded) as a streaming `/v1/completions` with a
token-id prompt, greedy, EOS ignored. Every server-sent event of a running request carries one
token's text (the engine steps one token at a time), so per request:
- TTFT: from sending to the first token's event;
- ITL: between successive token events (pooled over every request);
- TPOT: (last token - first token) / (tokens - 1);
- latency: from sending to the last event.
The client runs in a process of its own (spawned), as a real client would: parsing tens of
event streams in the server's process would take its GIL from the engine loop. The HTTP server
and the engine share this process, as under `pagedattn serve`. Triton compilations during the
run are counted (`jit_log.CompileLog`): each one stalls the running requests.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import multiprocessing
import queue
import random
import statistics
import threading
import time

from pagedattn.benchmarks.engine_offline import Request
from pagedattn.benchmarks.jit_log import CompileLog

CLIENT_MODULES = ("httpx",)
STARTUP_TIMEOUT_S = 60.0


def unavailable_reason() -> str | None:
    """Why the online part cannot run here (a missing module, with the pip install), or None."""
    from pagedattn.serve.command import SERVE_MODULES

    missing = [m for m in (*SERVE_MODULES, *CLIENT_MODULES) if importlib.util.find_spec(m) is None]
    if missing:
        return (f"online latency needs {', '.join(missing)} (missing here): "
                f"pip install 'pagedattn[serve]' httpx")
    return None


def run_online(engine, model_name: str, requests: list[Request], *, rate: float, seed: int) -> dict:
    """Serve `engine` on 127.0.0.1, send `requests` at Poisson arrivals of `rate` per second,
    and summarise their latencies (milliseconds, p50/p99)."""
    import uvicorn

    from pagedattn.serve.app import ServeLimits, build_app
    from pagedattn.serve.async_engine import AsyncEngine
    from pagedattn.serve.metrics import ServerMetrics

    app = build_app(AsyncEngine(engine, ServerMetrics(model_name)), model_name,
                    limits=ServeLimits(max_waiting=len(requests)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="pagedattn-bench-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start within {STARTUP_TIMEOUT_S:g} s")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        arrivals = _arrivals(len(requests), rate, seed)
        with CompileLog() as compiles:
            results, duration = _client_in_process(f"http://127.0.0.1:{port}/v1/completions", model_name,
                                                   requests, arrivals)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    return {**summarize(results, duration, rate), "jit_compiles": compiles.summary()}


def _client_in_process(url: str, model: str, requests: list[Request], arrivals: list[float]):
    """(per-request results, seconds from the first send to the last event), from a spawned client."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_client_main, args=(url, model, requests, arrivals, out), name="pagedattn-bench-client")
    proc.start()
    try:
        limit = arrivals[-1] + STARTUP_TIMEOUT_S + 60.0 * len(requests)
        deadline = time.monotonic() + limit
        while True:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"the benchmark client exited ({proc.exitcode}) without results") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the benchmark client gave no results within {limit:.0f} s") from None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _client_main(url: str, model: str, requests: list[Request], arrivals: list[float], out) -> None:
    """The client process: send every request on time, put (results, duration) on `out`."""
    start = time.perf_counter()
    results = asyncio.run(_client(url, model, requests, arrivals))
    out.put((results, time.perf_counter() - start))


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (a Poisson process of `rate`/s)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _client(url: str, model: str, requests: list[Request], arrivals: list[float]) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*(_send(client, url, model, r, t0 + a) for r, a in zip(requests, arrivals)))


async def _send(client, url: str, model: str, request: Request, at: float) -> dict:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    token_times: list[float] = []
    tokens, error = None, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        error = event["error"].get("message", "error")
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if any(c.get("text") for c in event.get("choices", ())):
                        token_times.append(now)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        error = f"{type(e).__name__}: {e}"
    return {"sent": sent, "token_times": token_times, "tokens": tokens, "error": error,
            "end": token_times[-1] if token_times else time.perf_counter()}


def summarize(results: list[dict], duration: float, rate: float) -> dict:
    """Latency percentiles (ms) over the completed requests, and the run's totals."""
    done = [r for r in results if r["error"] is None and r["token_times"]]
    ttft = [(r["token_times"][0] - r["sent"]) * 1e3 for r in done]
    latency = [(r["end"] - r["sent"]) * 1e3 for r in done]
    itl = [(b - a) * 1e3 for r in done for a, b in zip(r["token_times"], r["token_times"][1:])]
    tpot = [(r["token_times"][-1] - r["token_times"][0]) * 1e3 / (n - 1)
            for r in done if (n := (r["tokens"] or len(r["token_times"]))) > 1]
    errors = [r["error"] for r in results if r["error"] is not None]
    out = {"num_requests": len(results), "completed": len(done), "failed": len(results) - len(done),
           "request_rate": rate, "duration_s": duration,
           "output_tokens_per_s": sum(r["tokens"] or len(r["token_times"]) for r in done) / duration,
           "first_error": errors[0] if errors else None}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("latency", latency)):
        out[f"{name}_p50_ms"] = percentile(xs, 50)
        out[f"{name}_p99_ms"] = percentile(xs, 99)
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (linear between order statistics); None for no data."""
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q) - 1] if q < 100 else max(xs)
