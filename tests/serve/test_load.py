"""A bounded load test: 200 requests, 32 at a time, over a KV pool small enough to preempt; some
cancelled midway, some invalid. Every valid request gets `LLM.generate`'s greedy text, every
invalid one a 4xx, no block leaks and the server stays up."""

from __future__ import annotations

import asyncio
import gc
import statistics
import time

import httpx
import openai

from pagedattn.engine.sampling_params import SamplingParams

from .conftest import MODEL_NAME

NUM_REQUESTS = 200
CONCURRENCY = 32
DEADLINE_S = 45.0
PROMPTS = [
    "a", "Hello there", "The quick brown fox jumps", "paged attention over blocks",
    "continuous batching keeps the device busy", "0123456789" * 3, "why?", "OpenAI-compatible servers",
]
MAX_TOKENS = (8, 16, 24)
INVALID = [
    dict(max_tokens=1000),
    dict(model="nope"),
    dict(temperature=-0.5),
    dict(prompt="y" * 200),
    dict(prompt=[1, 2, 10_000]),
]


def _kind(i: int) -> str:
    return {3: "cancel", 7: "invalid"}.get(i % 10, "stream" if i % 2 else "whole")


def test_load(server, reference):
    cases = [(PROMPTS[i % len(PROMPTS)], MAX_TOKENS[i % len(MAX_TOKENS)]) for i in range(NUM_REQUESTS)]
    unique = sorted(set(cases))
    params = [SamplingParams(temperature=0, max_tokens=n) for _, n in unique]
    outputs = reference.generate([p for p, _ in unique], params)
    wanted = {case: out.outputs[0].text for case, out in zip(unique, outputs)}

    async def one(client: openai.AsyncOpenAI, i: int, gate: asyncio.Semaphore):
        prompt, n = cases[i]
        request = dict(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0)
        kind = _kind(i)
        async with gate:
            start = time.perf_counter()
            if kind == "invalid":
                try:
                    await client.completions.create(**(request | INVALID[i % len(INVALID)]))
                except openai.APIStatusError as e:
                    return kind, e.status_code, None
                return kind, 200, None
            if kind == "whole":
                out = await client.completions.create(**request)
                return kind, out.choices[0].text == wanted[prompt, n], time.perf_counter() - start
            stream = await client.completions.create(**request, stream=True)
            text = ""
            async for chunk in stream:
                text += chunk.choices[0].text
                if kind == "cancel" and len(text) >= 2:
                    await stream.close()
                    return kind, True, None
            return kind, text == wanted[prompt, n], time.perf_counter() - start

    async def run_all():
        gate = asyncio.Semaphore(CONCURRENCY)
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)
        async with client:
            requests = asyncio.gather(*(one(client, i, gate) for i in range(NUM_REQUESTS)))
            results = await asyncio.wait_for(requests, DEADLINE_S)
        # The clients' abandoned stream readers are finalized on this loop, not later by another thread.
        gc.collect()
        await asyncio.sleep(0)
        return results

    start = time.perf_counter()
    results = asyncio.run(run_all())
    elapsed = time.perf_counter() - start

    valid = [(ok, t) for kind, ok, t in results if kind in ("whole", "stream")]
    refused = [status for kind, status, _ in results if kind == "invalid"]
    cancelled = [kind for kind, _, _ in results if kind == "cancel"]
    differ = sum(not ok for ok, _ in valid)
    assert not differ, f"{differ} of {len(valid)} answers differ from LLM.generate"
    assert all(400 <= s < 500 for s in refused), refused
    server.assert_no_leak()
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    preemptions = float(metrics.split("\npagedattn_preemptions_total ")[1].split()[0])
    assert preemptions > 0, "the pool never ran short: the load test should preempt"
    latencies = sorted(t for _, t in valid)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    print(
        f"\nload: {NUM_REQUESTS} sent, {len(valid)} completed, {len(cancelled)} cancelled, {len(refused)} refused "
        f"in {elapsed:.1f} s; latency p50 {statistics.median(latencies) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms; "
        f"{preemptions:.0f} preemptions; leaked blocks 0"
    )
