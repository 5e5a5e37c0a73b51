"""The embedded SmolLM2 through `pagedattn chat` (one load, ~10 s): its chat template, a CPU
KV pool that holds its whole 8,192-token context, its tokenizer kept for the next start-up."""

from __future__ import annotations

import io

import pytest

import pagedattn.cli.chat as chat
from pagedattn.cli import main

pytestmark = pytest.mark.slow


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_default_model_chats_with_its_full_context_in_the_pool(monkeypatch, capsys, tmp_path):
    from pagedattn.models.default import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    loaded = []
    real = chat.load_llm

    def keep(config):
        loaded.append(real(config))
        return loaded[-1]

    monkeypatch.setattr(chat, "load_llm", keep)
    monkeypatch.setenv("PAGEDATTN_CACHE", str(tmp_path))
    monkeypatch.setattr("sys.stdin", _Pipe("What is the capital of France?\nAnd of Italy?\n"))
    assert main(["chat", "--max-tokens", "12", "--device", "cpu"]) == 0
    answers = capsys.readouterr().out.splitlines()
    assert len(answers) == 2 and "Paris" in answers[0] and "Rome" in answers[1]
    [llm] = loaded
    runner = llm.engine.runner
    assert llm.engine.max_model_len == 8192
    assert runner.num_blocks * runner.block_size > 8192
    # The GGUF's tokenizer is kept, so the next start-up does not parse the metadata again.
    [kept] = (tmp_path / "gguf-tokenizers").iterdir()
    assert (kept / "tokenizer.json").is_file()
