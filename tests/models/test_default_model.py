"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

from pagedattn.models import default_model_path, load_model

ATOL = 1e-3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def ours(gguf_path, backend_name, device):
    return load_model(None, dtype=torch.float32, device=device, attention_backend=backend_name)


@pytest.fixture(scope="module")
def reference(gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(ours) -> list[int]:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_spec_of_the_default_model(ours):
    spec = ours.spec
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_size) == (30, 9, 3, 64)
    assert spec.vocab_size == 49152
    assert spec.max_model_len == 8192
    assert spec.sliding_windows == (None,) * 30
    assert ours.tokenizer.convert_tokens_to_ids("<|im_end|>") in spec.eos_token_ids
    assert spec.has_chat_template


def test_gguf_config_matches_transformers(ours, gguf_path):
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = ours.model.config
    for key in ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters"]:
        assert getattr(config, key) == getattr(ref, key), key


def test_chat_template_renders(ours, prompt_ids):
    text = ours.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")


def test_logits_match_transformers(ours, reference, prompt_ids, paged_runner):
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([prompt_ids])).logits[0].float()  # [n, vocab]
    runner = paged_runner(ours, block_size=16, num_blocks=16)
    n = len(prompt_ids)
    table = runner.block_table(n + 1)
    prefill = runner.step([(prompt_ids, 0, n - 1, table)])
    decode = runner.step([(prompt_ids, n - 1, 1, table)])
    ours_logits = torch.cat([prefill, decode]).cpu()
    torch.testing.assert_close(ours_logits, ref, atol=ATOL, rtol=1e-3)
    # The greedy answer starts the same way in both.
    assert ours_logits[-1].argmax() == ref[-1].argmax()
