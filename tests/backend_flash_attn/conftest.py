"""Fixtures of the flash_attn provider tests: a fake FA4 installed as `flash_attn.cute`, and a
fresh provider choice (the choice is cached per device type) around every test."""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():  # the store and our provider are Triton kernels (as tests/kernels)
    os.environ["TRITON_INTERPRET"] = "1"

import fake_fa4
from pagedattn.backends import flash_attn_providers as providers


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch):
    monkeypatch.delenv(providers.ENV_VAR, raising=False)
    providers.choose.cache_clear()
    yield
    providers.choose.cache_clear()


@pytest.fixture
def nothing_installed(monkeypatch):
    """No Dao-AILab flash_attn importable, whatever this machine has."""
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.flash_attn_interface", "flash_attn_interface"):
        monkeypatch.setitem(sys.modules, name, None)  # a None entry blocks the import


@pytest.fixture
def fake_fa4_installed(monkeypatch, tmp_path):
    """`flash_attn.cute` is the fake (a namespace `flash_attn` with a `cute` folder, as the
    flash-attn-4 wheel installs it); FA2/FA3 are not installed."""
    (tmp_path / "cute").mkdir()
    parent = types.ModuleType("flash_attn")
    parent.__path__ = [str(tmp_path)]
    parent.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    parent.__spec__.submodule_search_locations = [str(tmp_path)]
    cute = types.ModuleType("flash_attn.cute")
    cute.__spec__ = importlib.machinery.ModuleSpec("flash_attn.cute", None)
    cute.__version__ = "0.0.0"
    cute.flash_attn_varlen_func = fake_fa4.flash_attn_varlen_func
    parent.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", parent)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    fake_fa4.calls.clear()
    return cute


@pytest.fixture
def on_gpu(monkeypatch):
    """Choose as if on a CUDA GPU of compute capability (9, 0) (the H100), the smoke test
    running on the CPU. Set `.arch` on the result to pretend another GPU."""
    state = types.SimpleNamespace(arch=(9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: state.arch)
    real = providers.smoke_test
    monkeypatch.setattr(providers, "smoke_test", lambda provider: real(provider, "cpu"))
    return state
