"""`pagedattn serve` from the command line: user errors (a port in use among them) are one line
and exit 2 before any model loads; a real process serves the OpenAI API on loopback, queues what
its running batch cannot take, and stops on SIGINT."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from serve_process import ServeProcess

from pagedattn import SamplingParams
from pagedattn.cli import main

STARTUP_TIMEOUT_S = 60.0
SERVED = "tiny"
KEY = "k"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "70000"], "expected --port in [0, 65535], got 70000"),
        (["--max-waiting", "0"], "expected --max-waiting >= 1, got 0"),
        (["--model", "/nope"], "expected --model to be an existing folder"),
        (["--dtype", "float8"], "invalid choice: 'float8'"),
        (["--backend", "bogus"], "backend 'bogus' cannot run"),
        (["--chat-template", "no_such_template.jinja"], "expected --chat-template to be a template file"),
        (["--chat-template", "{% for %}"], "--chat-template"),
    ],
)
def test_user_errors_exit_2(argv, message, capsys):
    try:
        status = main(["serve", *argv])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def serve_process(tiny_folder):
    """`pagedattn serve` in its own process, 4 sequences per step over a small pool; its base URL.
    It must stop with status 0 on SIGINT."""
    server = ServeProcess(["--model", tiny_folder, "--device", "cpu", "--num-kv-blocks", "32", "--max-num-seqs", "4",
                           "--served-model-name", SERVED, "--api-key", KEY, "--log-level", "warning"])
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        yield server.url
    finally:
        server.stop()
    assert server.returncode == 0, server.output()


def test_serve_process(serve_process, reference):
    client = openai.OpenAI(base_url=f"{serve_process}/v1", api_key=KEY, max_retries=0, timeout=30)
    out = client.completions.create(model=SERVED, prompt="Hello there", max_tokens=8, temperature=0)
    [want] = reference.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8))
    assert out.choices[0].text == want.outputs[0].text


def test_port_in_use_is_one_line_before_the_model_loads(serve_process, tmp_path):
    """The port is bound before the model loads: an empty folder as --model is never read."""
    port = serve_process.rsplit(":", 1)[1]
    start = time.monotonic()
    proc = ServeProcess(["--model", str(tmp_path), "--port", port, "--device", "cpu"]).proc
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port} which cannot be bound" in lines[0], out
    assert time.monotonic() - start < 30


NUM_REQUESTS = 200
QUEUE_PROMPTS = ["a", "Hello there", "The quick brown fox jumps", "paged attention over blocks", "why?",
                 "continuous batching keeps the device busy", "0123456789" * 3, "OpenAI-compatible servers"]


def test_requests_beyond_the_batch_wait_in_the_queue(serve_process, reference):
    """200 requests at once, 4 sequences per step: every one is answered (none refused) with
    `LLM.generate`'s greedy text, and no block is held afterwards."""
    cases = [(QUEUE_PROMPTS[i % len(QUEUE_PROMPTS)], 4 + i % 3 * 2) for i in range(NUM_REQUESTS)]
    unique = sorted(set(cases))
    outs = reference.generate([p for p, _ in unique], [SamplingParams(temperature=0, max_tokens=n) for _, n in unique])
    want = {case: out.outputs[0].text for case, out in zip(unique, outs)}

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f"{serve_process}/v1", api_key=KEY, max_retries=0, timeout=120)
        async with client:
            async def one(i: int):
                prompt, n = cases[i]
                if i % 2:
                    stream = await client.completions.create(model=SERVED, prompt=prompt, max_tokens=n,
                                                             temperature=0, stream=True)
                    return "".join([c.choices[0].text async for c in stream])
                out = await client.completions.create(model=SERVED, prompt=prompt, max_tokens=n, temperature=0)
                return out.choices[0].text

            return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))

    texts = asyncio.run(run_all())
    differ = [i for i, text in enumerate(texts) if text != want[cases[i]]]
    assert not differ, f"{len(differ)} of {NUM_REQUESTS} answers differ from LLM.generate, e.g. request {differ[0]}"
    metrics = {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
               for line in httpx.get(f"{serve_process}/metrics").text.splitlines() if not line.startswith("#")}
    assert metrics["pagedattn_kv_cache_usage_ratio"] == 0.0, "blocks leaked"
    assert metrics["pagedattn_num_requests_waiting"] == metrics["pagedattn_num_requests_running"] == 0
    assert "pagedattn_requests_refused_total" not in metrics
    assert metrics["pagedattn_time_to_first_token_seconds_count"] >= NUM_REQUESTS
