"""`pagedattn generate` on a tiny model: flags, stdin, JSON, errors naming their prompt, pipes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from pagedattn.cli import main
from pagedattn.cli.generate import DEFAULT_PROMPT, read_prompts

from .conftest import REPO, run_cli


class _Pipe(io.StringIO):
    """stdin as a pipe: not a terminal."""

    def isatty(self) -> bool:
        return False


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_prompts_from_stdin():
    assert read_prompts([], _Pipe("hi there\n")) == ["hi there"]
    assert read_prompts([], _Terminal("ignored")) == [DEFAULT_PROMPT]
    assert read_prompts([], _Pipe("")) == [DEFAULT_PROMPT]
    assert read_prompts(["a", "-"], _Pipe("from stdin")) == ["a", "from stdin"]
    assert read_prompts(["a"], _Pipe("unused")) == ["a"]


def test_sampling_flags(tiny_chat, capsys):
    base = ["generate", "hello", "world", "--model", tiny_chat, "--max-tokens", "6", "--json"]
    assert main(base) == 0
    greedy = _json_lines(capsys.readouterr().out)
    assert [o["prompt"] for o in greedy] == ["hello", "world"]
    assert all(len(o["outputs"][0]["token_ids"]) <= 6 and o["error"] is None for o in greedy)

    sampled = [*base, "--temperature", "1.0", "--top-p", "0.9", "--top-k", "50", "--seed", "3", "-n", "2"]
    assert main(sampled) == 0
    first = _json_lines(capsys.readouterr().out)
    assert main(sampled) == 0
    assert _json_lines(capsys.readouterr().out) == first  # --seed: reproducible
    assert all(len(o["outputs"]) == 2 for o in first)
    # Without --seed each run draws a fresh one: answers vary.
    runs = []
    for _ in range(3):
        assert main([*base, "--temperature", "1.0", "--max-tokens", "12"]) == 0
        runs.append([o["outputs"][0]["token_ids"] for o in _json_lines(capsys.readouterr().out)])
    assert runs[0] != runs[1] or runs[1] != runs[2]


def test_stop_system_and_engine_flags(tiny_chat, capsys):
    args = ["generate", "hello", "--model", tiny_chat, "--max-tokens", "20", "--json", "--dtype", "float32",
            "--kv-cache-dtype", "auto", "--max-model-len", "64", "--num-kv-blocks", "8", "--device", "cpu",
            "--backend", "torch"]
    assert main(args) == 0
    [full] = _json_lines(capsys.readouterr().out)
    text = full["outputs"][0]["text"]
    if len(text) > 4:
        assert main([*args, "--stop", text[2:4]]) == 0
        [cut] = _json_lines(capsys.readouterr().out)
        assert cut["outputs"][0]["text"] == text[: text.find(text[2:4])]
        assert cut["outputs"][0]["finish_reason"] == "stop"
    assert main([*args, "--system", "be brief"]) == 0
    [with_system] = _json_lines(capsys.readouterr().out)
    assert with_system["prompt_tokens"] == full["prompt_tokens"] + len("[system] be brief\n")


def test_streams_one_answer(tiny_chat, capsys):
    assert main(["generate", "hello", "--model", tiny_chat, "--max-tokens", "5", "--no-chat-template"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and "tokens/s]" in captured.err


def test_error_names_its_prompt(tiny_chat, capsys):
    long = "x" * 300  # 300 byte tokens: longer than the context of 128
    status = main(["generate", "short", long, "--model", tiny_chat, "--max-tokens", "4", "--no-chat-template"])
    captured = capsys.readouterr()
    assert status == 1
    assert "prompt 2 of 2 ('xxxx" in captured.err and "longer than the model's context" in captured.err
    assert "### short" in captured.out


def test_context_clamps_max_tokens(tiny_chat, capsys):
    """A prompt near the end of the context keeps what it generated and finishes with "length"."""
    prompt = "y" * 120
    assert main(["generate", prompt, "--model", tiny_chat, "--max-tokens", "300", "--json",
                 "--no-chat-template"]) == 0
    [out] = _json_lines(capsys.readouterr().out)
    assert out["outputs"][0]["finish_reason"] in ("length", "stop")
    assert out["prompt_tokens"] + len(out["outputs"][0]["token_ids"]) <= 128
    assert out["outputs"][0]["token_ids"]


def test_pool_too_small_for_the_context_is_refused(tiny_chat):
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine

    expected = r"max_model_len=128 tokens .* \(--num-kv-blocks\) to at least 9, or lower max_model_len"
    with pytest.raises(ValueError, match=expected):
        LLMEngine(EngineConfig(model=tiny_chat, device="cpu", cpu_kv_cache_gib=1e-6))


def test_stdin_pipe_and_broken_pipe(tiny_chat):
    done = run_cli("generate", "--model", tiny_chat, "--max-tokens", "3", "--json", "--no-chat-template",
                   input="piped prompt\n")
    assert done.returncode == 0, done.stderr
    assert _json_lines(done.stdout)[0]["prompt"] == "piped prompt"
    # The reader is gone before the first answer is written (`... | head` that already exited).
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedattn", "generate", "a", "b", "--model", tiny_chat, "--max-tokens", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1  # the write failed, quietly
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
