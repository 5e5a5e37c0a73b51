"""A tiny Llama checkpoint with a chat template, and ways to run the command line on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import TINY_CONFIG, byte_tokenizer

REPO = Path(__file__).resolve().parents[2]
# A minimal chat template: turns as "<role>: text" lines, the assistant's turn opened at the end.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory) -> str:
    """A folder: a random 2-layer Llama (context 128) with a byte tokenizer and a chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).eval()
    folder = tmp_path_factory.mktemp("tiny_chat")
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


def run_cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`python -m pagedattn ARGS` in a fresh interpreter with this checkout first on the path."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pagedattn", *args], env=full_env, capture_output=True, text=True,
        timeout=120, **kwargs,
    )
