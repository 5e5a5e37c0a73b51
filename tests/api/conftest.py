"""One tiny Llama with a chat template behind `pagedattn.LLM`, shared by the API tests."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_chat_llama


@pytest.fixture(scope="session")
def tiny_chat_folder(tmp_path_factory) -> str:
    return save_tiny_chat_llama(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="session")
def llm(tiny_chat_folder):
    from pagedattn import LLM

    return LLM(tiny_chat_folder, device="cpu", backend="torch")
