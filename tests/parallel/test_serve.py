"""`pagedattn serve --tensor-parallel-size 2` on the CPU (gloo): it answers the openai client
with the greedy tokens of one rank, and SIGINT to its process group (a terminal's Ctrl-C) ends
the server and its worker."""

from __future__ import annotations

import time

import pytest
from serve_process import ServeProcess

from pagedattn import LLM, SamplingParams

from .conftest import alive

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")


def test_serve_with_two_ranks_answers_and_leaves_no_process(tiny_kv):
    folder = tiny_kv(2).folder
    server = ServeProcess(["--model", folder, "--device", "cpu", "--tensor-parallel-size", "2", "--num-kv-blocks",
                           "32", "--max-num-seqs", "4", "--served-model-name", "tiny", "--log-level", "warning"])
    try:
        server.wait_ready(180)
        workers = server.children()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0)
    finally:
        code = server.stop(60)
    assert code == 0, server.output()
    assert workers  # the worker (and multiprocessing's resource tracker)
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)]
    [want] = LLM(folder, device="cpu", num_kv_blocks=32).generate(["Hello there"],
                                                                 SamplingParams(temperature=0, max_tokens=6))
    assert got.choices[0].text == want.outputs[0].text
