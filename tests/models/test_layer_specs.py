"""Per-layer attention specs and RoPE parameters read from configs, the Gemma 3 image-text
checkpoint's language model, and what the new families refuse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedattn.models.attention_spec import FULL_ATTENTION, SLIDING_ATTENTION, LayerAttentionSpec, layer_attention_specs
from pagedattn.models.layers import rope_attention_factor, rope_inv_freq

from .conftest import FAMILIES, TINY, VOCAB, skip_unless_runs


def _config(family: str):
    import transformers

    cls_name, overrides = FAMILIES[family]
    return getattr(transformers, cls_name)(**(TINY | overrides))


def test_gemma3_layers_have_a_window_and_rope_base_per_kind():
    specs = layer_attention_specs(_config("gemma3"))
    assert specs == (
        LayerAttentionSpec(SLIDING_ATTENTION, 8, 10000.0),
        LayerAttentionSpec(SLIDING_ATTENTION, 8, 10000.0),
        LayerAttentionSpec(FULL_ATTENTION, None, 1000000.0),
    )


def test_gemma3_legacy_config_reads_the_pattern_and_local_base():
    """transformers 4's Gemma 3 config: `sliding_window_pattern`, `rope_local_base_freq`, `rope_theta`
    with `rope_scaling` for the global layers only."""
    config = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=7, sliding_window=16,
                             sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
                             rope_scaling={"rope_type": "linear", "factor": 8.0})
    specs = layer_attention_specs(config)
    assert [s.window for s in specs] == [16] * 5 + [None, 16]
    assert [s.rope_theta for s in specs] == [1e4] * 5 + [1e6, 1e4]
    local, full = rope_inv_freq(config, 8, SLIDING_ATTENTION), rope_inv_freq(config, 8, FULL_ATTENTION)
    torch.testing.assert_close(full, 1.0 / (1e6 ** (torch.arange(0, 8, 2).float() / 8)) / 8.0)
    torch.testing.assert_close(local, 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8)))


def test_gpt_oss_layers_alternate_and_have_sinks(backend_name, device):
    from pagedattn.models.gpt_oss import GptOssForCausalLM

    config = _config("gpt_oss")
    assert layer_attention_specs(config) == (LayerAttentionSpec(SLIDING_ATTENTION, 8, 150000.0),
                                             LayerAttentionSpec(FULL_ATTENTION, None, 150000.0))
    skip_unless_runs("gpt_oss", backend_name)
    with torch.device(device):
        model = GptOssForCausalLM(config, attention_backend=backend_name)
    for layer in model.model.layers:
        assert layer.self_attn.attn.impl.sinks is layer.self_attn.sinks  # the parameter, read at each call


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_matches_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _config("gpt_oss")
    config.rope_parameters["truncate"] = truncate
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(config, 16), inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(config) == pytest.approx(factor)
    assert factor > 1.0  # the scaling shows


def test_gpt_oss_mxfp4_checkpoint_is_refused():
    from pagedattn.models.gpt_oss import GptOssForCausalLM

    config = _config("gpt_oss")
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    with pytest.raises(NotImplementedError, match="mxfp4"):
        GptOssForCausalLM(config, attention_backend="torch")


def test_gemma3_bidirectional_is_refused():
    from pagedattn.models.gemma3 import Gemma3ForCausalLM

    config = _config("gemma3")
    config.use_bidirectional_attention = True
    with pytest.raises(NotImplementedError, match="bidirectional"):
        Gemma3ForCausalLM(config, attention_backend="torch")


@pytest.fixture(scope="module")
def gemma3_image_text(tmp_path_factory):
    """A tiny Gemma 3 image-text checkpoint (a one-layer vision tower beside the language model)."""
    import transformers
    from tiny_models import byte_tokenizer

    text = TINY | FAMILIES["gemma3"][1]
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # Gemma's norms scale by 1 + weight: around 0, as in conftest
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if "norm" in name else 0.15))
    folder = tmp_path_factory.mktemp("gemma3_image_text")
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    return str(folder), model


def test_gemma3_image_text_checkpoint_runs_its_language_model(gemma3_image_text, backend_name, device, paged_runner):
    from pagedattn.models import load_model

    folder, reference = gemma3_image_text
    lm = load_model(folder, dtype=torch.float32, device=device, attention_backend=backend_name)
    assert lm.spec.architecture == "Gemma3ForConditionalGeneration"
    assert (lm.spec.num_layers, lm.spec.vocab_size, lm.spec.sliding_windows) == (3, VOCAB, (8, 8, None))
    assert not any("vision" in name for name, _ in lm.model.named_parameters())
    tokens = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = paged_runner(lm)
    ours = runner.step([(tokens, 0, len(tokens), runner.block_table(len(tokens)))]).cpu()
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
