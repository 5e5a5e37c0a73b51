"""Fixtures for the server tests: a tiny random Llama with a byte tokenizer and a chat template,
and `pagedattn serve`'s app run by uvicorn in a background thread on a free loopback port."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch
from tiny_models import save_tiny_chat_llama

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 20.0
@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> str:
    """A tiny random Llama (context 128) whose greedy choices are clear-cut (scaled weights)."""
    return save_tiny_chat_llama(tmp_path_factory.mktemp("serve_tiny_llama"), clear_cut=True)


@pytest.fixture(scope="session")
def loaded(tiny_folder, device):
    from pagedattn.models.loader import load_model

    return load_model(tiny_folder, dtype=torch.float32, device=device, attention_backend="torch")


ENGINE_DEFAULTS = dict(num_kv_blocks=48, block_size=16, max_num_seqs=32, backend="torch")


@pytest.fixture(scope="session")
def reference(tiny_folder, device):
    """`LLM` over the same checkpoint: the greedy texts the server must answer."""
    from pagedattn import LLM

    return LLM(tiny_folder, device=str(device), **ENGINE_DEFAULTS)


class Server:
    """A running server: its engine (to check blocks) and its base URL on 127.0.0.1."""

    def __init__(self, engine, async_engine, url: str):
        self.engine = engine
        self.async_engine = async_engine
        self.url = url

    def client(self, api_key: str = "none", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30, **kwargs)

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until every request is done and the loop is parked (aborts are applied by then)."""
        deadline = time.monotonic() + timeout_s
        while not self.async_engine.is_idle:
            assert time.monotonic() < deadline, f"server still busy after {timeout_s} s"
            time.sleep(0.02)

    def assert_no_leak(self) -> None:
        self.wait_idle()
        bm = self.engine.block_manager
        bm.check_integrity(self.engine.scheduler.all_seqs())
        assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"


@contextmanager
def run_server(loaded, device, *, api_key=None, engine_kwargs=None, log_interval_s=10.0, chat_template=None,
               **limits):
    """Serve `loaded` with uvicorn in a daemon thread; stops it (bounded wait) on exit.
    `engine_kwargs` override `ENGINE_DEFAULTS`; `limits` are `ServeLimits`'; `chat_template` the
    server's `--chat-template` text."""
    import uvicorn

    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.serve.app import ServeLimits, build_app
    from pagedattn.serve.async_engine import AsyncEngine
    from pagedattn.serve.metrics import ServerMetrics

    config = EngineConfig(device=str(device), **(ENGINE_DEFAULTS | (engine_kwargs or {})))
    engine = LLMEngine(config, loaded, check_integrity=True)
    async_engine = AsyncEngine(engine, ServerMetrics(MODEL_NAME), log_interval_s=log_interval_s)
    app = build_app(async_engine, MODEL_NAME, api_key=api_key, limits=ServeLimits(**limits), chat_template=chat_template)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during start-up"
        assert time.monotonic() < deadline, f"server not started after {STARTUP_TIMEOUT_S} s"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Server(engine, async_engine, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive(), "uvicorn did not stop within 10 s"


@pytest.fixture(scope="module")
def server(loaded, device):
    with run_server(loaded, device, max_tokens=64) as s:
        yield s
