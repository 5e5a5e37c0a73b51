"""A tiny Llama checkpoint with a chat template, and ways to run the command line on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import save_tiny_chat_llama

REPO = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory) -> str:
    """A folder: a random 2-layer Llama (context 128) with a byte tokenizer and a chat template."""
    return save_tiny_chat_llama(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture
def tiny_without_template(tmp_path, tiny_chat) -> Path:
    """A copy of `tiny_chat` with no chat template (neither in its tokenizer config nor a file)."""
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(tiny_chat, folder)
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def run_cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`python -m pagedattn ARGS` in a fresh interpreter with this checkout first on the path."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pagedattn", *args], env=full_env, capture_output=True, text=True,
        timeout=120, **kwargs,
    )
