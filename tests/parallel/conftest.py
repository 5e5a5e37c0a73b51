"""Tiny random Llama checkpoints for the tensor-parallel tests: 4 query heads of 16 and 1, 2 or
4 KV heads (at 2 ranks: one replicated, one each, two each), saved as safetensors with the byte
tokenizer, and transformers' model on the same weights as the reference."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from tiny_models import TINY_CONFIG, byte_tokenizer, clear_cut_weights_


@dataclass
class Tiny:
    folder: str
    reference: torch.nn.Module  # transformers' model, float32


def save_tiny_llama(folder, num_kv_heads: int):
    """A 2-layer Llama with `num_kv_heads` KV heads, weights scaled so that greedy choices do
    not hinge on rounding (the engine tests' recipe); returns transformers' model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(num_kv_heads)
    config = LlamaConfig(**dict(TINY_CONFIG, num_key_value_heads=num_kv_heads, max_position_embeddings=96,
                                tie_word_embeddings=False))
    model = LlamaForCausalLM(config).eval()
    clear_cut_weights_(model)
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    model.generation_config.eos_token_id = None
    return model


def save_tiny_gemma2(folder) -> None:
    """A 2-layer Gemma 2 (soft caps, a sliding window on layer 0, the tied head), 4 query and 2 KV
    heads, random weights: norm weights around 0 (Gemma scales by 1 + w), small embeddings and
    strong linears, so the blocks' outputs outweigh the token's own embedding in the residual
    stream (else the tied head repeats the last token whatever the layers compute)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(**dict(TINY_CONFIG, max_position_embeddings=96), head_dim=16, query_pre_attn_scalar=24,
                          sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    model = Gemma2ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            rand = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(0.1 * rand)
            elif "embed" in name:
                p.copy_(0.05 * rand)  # times sqrt(hidden) = 8 in the model: below the blocks' unit outputs
            else:
                p.copy_(4.0 * rand / p.shape[1] ** 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_kv(tmp_path_factory):
    """`tiny_kv(num_kv_heads) -> Tiny`, each checkpoint made once."""
    made: dict[int, Tiny] = {}

    def get(num_kv_heads: int) -> Tiny:
        if num_kv_heads not in made:
            folder = tmp_path_factory.mktemp(f"tiny_llama_kv{num_kv_heads}")
            made[num_kv_heads] = Tiny(str(folder), save_tiny_llama(folder, num_kv_heads))
        return made[num_kv_heads]

    return get


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a reaped child does not; a zombie would)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
