"""`pagedattn chat` over stdin lines, and `--model` as a Hugging Face Hub id from a local cache."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

import pagedattn.cli.chat as chat
from pagedattn.cli import main

from .conftest import run_cli


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_chat_is_multi_turn(tiny_chat, monkeypatch, capsys):
    seen = []
    real = chat.chat_prompt

    def spy(tokenizer, messages, template=None):
        seen.append([dict(m) for m in messages])
        return real(tokenizer, messages, template)

    monkeypatch.setattr(chat, "chat_prompt", spy)
    monkeypatch.setattr("sys.stdin", _Pipe("hello\nand then?\n/reset\n\nagain\n/exit\nnever read\n"))
    assert main(["chat", "--model", tiny_chat, "--max-tokens", "4", "--system", "be brief"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 3  # three answers, one line each (streamed, then a newline)
    assert [[m["role"] for m in turn] for turn in seen] == [
        ["system", "user"],
        ["system", "user", "assistant", "user"],
        ["system", "user"],  # after /reset
    ]
    assert seen[1][1]["content"] == "hello" and seen[1][3]["content"] == "and then?"
    assert seen[1][2]["content"] == out.splitlines()[0]


def test_chat_refuses_a_model_without_template(tiny_without_template, monkeypatch, capsys):
    folder = tiny_without_template
    monkeypatch.setattr("sys.stdin", _Pipe("hi\n"))
    assert main(["chat", "--model", str(folder)]) == 2
    assert "chat template" in capsys.readouterr().err


def _cache_with(tiny_chat: str, cache: Path, repo_id: str) -> None:
    """Lay `tiny_chat` out as huggingface_hub's cache holds a downloaded repository."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_chat, repo / "snapshots" / commit)


def test_hub_id_from_the_offline_cache(tiny_chat, tmp_path):
    cache = tmp_path / "hf" / "hub"
    _cache_with(tiny_chat, cache, "tiny-org/tiny-chat")
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(cache)}
    done = run_cli("generate", "hi", "--model", "tiny-org/tiny-chat", "--max-tokens", "3", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert '"prompt": "hi"' in done.stdout
    missing = run_cli("generate", "hi", "--model", "tiny-org/not-cached", env=env)
    assert missing.returncode == 2
    assert "not found in the cache" in missing.stderr and "HF_HUB_OFFLINE=1" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
