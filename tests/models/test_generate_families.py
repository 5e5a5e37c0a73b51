"""The engine's greedy generation equals transformers' `generate`, token for token, on a tiny
random model of every supported family, and on the real SmolLM2 weights (the embedded default
model): a chat prompt, a ~300-token prompt, and two prompts sharing a long prefix (the second
one hits the prefix cache)."""

from __future__ import annotations

import pytest
import torch

import pagedattn

from .conftest import skip_unless_runs

MAX_TOKENS = 12


def _hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _ours(llm: pagedattn.LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = pagedattn.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("family", ["llama", "llama3_rope", "mistral", "qwen2", "qwen2_sliding", "gemma2", "qwen3",
                                    "gemma3", "gpt_oss"])
def test_tiny_family_greedy_equals_transformers(tiny_checkpoint, backend_name, device, family):
    skip_unless_runs(family, backend_name)
    ckpt = tiny_checkpoint(family)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    llm = pagedattn.LLM(ckpt.folder, backend=backend_name, device=str(device), dtype="float32",
                        block_size=4, num_kv_blocks=96, enforce_eager=True)
    with torch.no_grad():
        expected = [_hf_greedy(ckpt.reference, p, MAX_TOKENS) for p in prompts]
    assert _ours(llm, prompts, MAX_TOKENS) == expected


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers(backend_name, device):
    from transformers import AutoModelForCausalLM

    from pagedattn.models.default import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:  # e.g. the GPU machine, which installs no package of ours
        pytest.skip(str(e))
    llm = pagedattn.LLM(backend=backend_name, device=str(device), dtype="float32")
    tok = llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    chat = tok.encode(text, add_special_tokens=False)
    story = ("The library keeps its keys and values in fixed-size blocks, and every sequence owns a table "
             "that maps its logical blocks to physical ones. ")
    long_prompt = tok.encode(story * 12)[:300]
    prefix = tok.encode(story * 8)[:200]
    shared = [prefix + tok.encode(" Summarise this."), prefix + tok.encode(" Translate this into French.")]
    prompts = [chat, long_prompt, *shared]
    assert len(long_prompt) == 300

    path = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [_hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    assert _ours(llm, prompts, MAX_TOKENS) == expected
