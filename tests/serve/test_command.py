"""`pagedattn serve` from the command line: user errors are one line and exit 2 before any
model loads; a real process serves the OpenAI API on loopback and stops on SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagedattn import SamplingParams
from pagedattn.cli import main

STARTUP_TIMEOUT_S = 60.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "70000"], "expected --port in [0, 65535], got 70000"),
        (["--max-concurrent", "0"], "expected --max-concurrent >= 1, got 0"),
        (["--model", "/nope"], "expected --model to be an existing folder"),
        (["--dtype", "float8"], "invalid choice: 'float8'"),
        (["--backend", "bogus"], "backend 'bogus' cannot run"),
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process(tiny_folder, reference):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedattn", "serve", "--model", tiny_folder, "--port", str(port), "--device", "cpu",
         "--num-kv-blocks", "32", "--served-model-name", "tiny", "--api-key", "k", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}: {proc.stdout.read()}"
            assert time.monotonic() < deadline, f"serve did not answer /health within {STARTUP_TIMEOUT_S} s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=30)
        out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
        [want] = reference.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8))
        assert out.choices[0].text == want.outputs[0].text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    assert proc.returncode == 0
