"""A GGUF's dequantised weights kept in the cache: the second load reads them instead of the
file, to the same model; a folder appears whole or not at all, and only when it can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pagedattn.models.cache as cache
import pagedattn.models.gguf_file as gguf_file
from pagedattn.models import load_model

from .test_gguf_families import _skip_unless_transformers_reads, _write_gguf


@pytest.fixture
def gguf_path(tiny_checkpoint, tmp_path, monkeypatch, request):
    monkeypatch.setenv("PAGEDATTN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    _write_gguf(tiny_checkpoint(getattr(request, "param", "llama")), path)
    _skip_unless_transformers_reads(path)
    return path


def _load(path):
    return load_model(path, dtype=torch.float32, device="cpu", attention_backend="torch")


def _kept(tmp_path) -> list:
    folder = tmp_path / "cache" / "gguf-weights"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _refuse_reading_the_file(monkeypatch):
    def refuse(path):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(gguf_file, "read_gguf", refuse)


@pytest.mark.parametrize("gguf_path", ["llama", "gemma2_gguf"], indirect=True)
def test_second_load_reads_the_cache_to_the_same_model(gguf_path, tmp_path, monkeypatch):
    first = _load(gguf_path)
    [kept] = _kept(tmp_path)
    assert kept.startswith("tiny-")
    with monkeypatch.context() as m:
        _refuse_reading_the_file(m)
        second = _load(gguf_path)
    assert second.spec == first.spec
    with monkeypatch.context() as m:
        _refuse_reading_the_file(m)
        kept_config, architecture, _ = cache.read_gguf_cached(gguf_path)
    file_config, file_architecture, _ = gguf_file.read_gguf(gguf_path)
    assert architecture == file_architecture
    # every attribute the models may read, as JSON has them (int dict keys become strings)
    assert kept_config.to_dict() == json.loads(file_config.to_json_string(use_diff=False))
    want, got = first.model.state_dict(), second.model.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_a_changed_file_is_read_again_and_replaces_its_old_entry(gguf_path, tmp_path):
    _load(gguf_path)
    [old] = _kept(tmp_path)
    gguf_path.touch()  # a new modification time: another version of the file
    import os

    os.utime(gguf_path, ns=(1, 1))
    _load(gguf_path)
    [new] = _kept(tmp_path)
    assert new != old and new.rsplit("-", 1)[0] == old.rsplit("-", 1)[0]


def test_nothing_is_kept_when_it_cannot_be(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "MAX_BYTES", 1024)  # too big to keep
    _load(gguf_path)
    assert _kept(tmp_path) == []
    monkeypatch.undo()
    monkeypatch.setenv("PAGEDATTN_CACHE", str(tmp_path / "blocked"))
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "gguf-weights").write_text("not a folder")  # unwritable: the load goes on
    assert _load(gguf_path).spec.architecture == "LlamaForCausalLM"
    assert sorted(p.name for p in (tmp_path / "blocked").iterdir()) == ["gguf-tokenizers", "gguf-weights"]


def test_a_load_that_stops_early_leaves_no_folder(gguf_path, tmp_path, monkeypatch):
    _, _, weights = cache.read_gguf_cached(gguf_path)
    next(weights)
    weights.close()  # the model refused a weight, say
    assert _kept(tmp_path) == []


def test_a_damaged_entry_is_rebuilt(gguf_path, tmp_path):
    want = _load(gguf_path).model.state_dict()
    [kept] = _kept(tmp_path)
    for shard in (tmp_path / "cache" / "gguf-weights" / kept).glob("*.safetensors"):
        shard.write_bytes(b"garbage")
    got = _load(gguf_path).model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert _kept(tmp_path) == [kept]


def test_a_kept_gguf_starts_without_the_slow_imports(gguf_path, tmp_path):
    """From the cache, a GGUF model answers without transformers' model index (~1,700 files read),
    transformers' config classes (torch.distributed, sympy) or torch._dynamo (the custom op's
    registration): each cost a second or more of a CPU start-up."""
    import os
    import subprocess
    import sys

    _load(gguf_path)  # keeps it
    script = (
        "import sys; from pagedattn import LLM, SamplingParams; "
        f"llm = LLM({str(gguf_path)!r}, device='cpu', backend='torch'); "
        "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False); "
        "assert out[0].outputs[0].token_ids, out; "
        "print(sorted(m for m in ('transformers.models', 'torch._dynamo', 'sympy', 'torch.distributed.tensor') "
        "if m in sys.modules))"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PAGEDATTN_CACHE": str(tmp_path / "cache"), "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
