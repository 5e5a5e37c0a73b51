"""Fixtures for the engine tests: a tiny random Llama checkpoint and engines over it.

The checkpoint is built with transformers' own classes, saved as safetensors with a byte-level
tokenizer, and kept in memory as the reference: transformers' `generate` never reads our paged
cache, so equal tokens mean the engine's scheduling, block tables and sampling are right.
Weights are scaled up from transformers' initialisation so that next-token distributions are
peaked: greedy choices then do not hinge on rounding differences between batch shapes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch
from tiny_models import TINY_CONFIG, VOCAB, byte_tokenizer

TINY = dict(TINY_CONFIG, max_position_embeddings=96, tie_word_embeddings=False)


@dataclass
class Tiny:
    folder: str
    reference: torch.nn.Module  # transformers' model on the same weights, float32
    eos_token_id: int


def _save(model, folder) -> None:
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    folder = tmp_path_factory.mktemp("tiny_llama")
    _save(model, folder)
    model.generation_config.eos_token_id = None  # each test says which EOS the reference uses
    return Tiny(str(folder), model, TINY["eos_token_id"])


@pytest.fixture(scope="session")
def tiny_eos(tmp_path_factory, tiny) -> Tiny:
    """The same weights with an EOS id the model actually emits (the first greedy token of a
    fixed prompt), so EOS paths (stop, finished beams) are exercised."""
    eos = hf_generate(tiny.reference, list(range(40, 50)), 1)[-1]
    folder = tmp_path_factory.mktemp("tiny_llama_eos")
    for f in ("config.json", "generation_config.json"):
        data = json.loads(open(f"{tiny.folder}/{f}").read())
        data["eos_token_id"] = eos
        (folder / f).write_text(json.dumps(data))
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny.folder}/{f}", folder / f)
    return Tiny(str(folder), tiny.reference, eos)


@pytest.fixture(scope="session")
def loaded(tiny, device, backend_name):
    """The tiny checkpoint through our loader, shared by engines of different configs."""
    from pagedattn.models.loader import load_model

    return load_model(tiny.folder, dtype=torch.float32, device=device, attention_backend=backend_name)


@pytest.fixture(scope="session")
def loaded_eos(tiny_eos, device, backend_name):
    from pagedattn.models.loader import load_model

    return load_model(tiny_eos.folder, dtype=torch.float32, device=device, attention_backend=backend_name)


def engine_factory(default_loaded, device, backend_name, **defaults):
    """`make(model_loaded=None, **EngineConfig fields)`: an engine over `model_loaded` (else
    `default_loaded`) with these defaults, checking block integrity after every step."""
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine

    def make(model_loaded=None, **kwargs):
        kwargs = {"num_kv_blocks": 64, "device": str(device), "backend": backend_name, **defaults, **kwargs}
        return LLMEngine(EngineConfig(**kwargs), model_loaded or default_loaded, check_integrity=True)

    return make


@pytest.fixture
def make_engine(loaded, device, backend_name):
    """`make_engine(**EngineConfig fields)` over the shared tiny model."""
    return engine_factory(loaded, device, backend_name)


def random_prompts(lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def hf_generate(reference, prompt: list[int], max_tokens: int, eos_token_id: int | None = None, **kwargs):
    """transformers' continuation of `prompt` (greedy unless kwargs say otherwise); with
    `num_return_sequences`, a list of continuations with trailing padding removed."""
    ids = torch.tensor([prompt])
    out = reference.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
        pad_token_id=0, eos_token_id=eos_token_id, **kwargs,
    )
    rows = out[:, len(prompt) :].tolist()
    if "num_return_sequences" not in kwargs:
        return rows[0]
    # Beam search pads finished rows with EOS (or -1 without one).
    rows = [r[: r.index(eos_token_id) + 1] if eos_token_id in r else r for r in rows]
    return [[t for t in r if t != -1] for r in rows]
