"""GGUF loading for each family: a tiny checkpoint written as llama.cpp would, loaded by us,
against transformers' model holding the original weights.

The GGUF is written with gguf's own tensor-name map (independent of the loader's table) and
llama.cpp's conversions: q/k rows permuted for rope in the "llama" architecture, Gemma norms
stored as `1 + w`. Weights stay float32, so the comparison is as tight as the safetensors one.
"""

from __future__ import annotations

import pytest
import torch

from pagedattn.models import load_model

from .conftest import VOCAB

ATOL = 1e-4
N = 21


def _llama_cpp_permute(w, num_heads: int):
    # convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's two rotary halves.
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(ckpt, path) -> None:
    import gguf
    from tokenizers import pre_tokenizers

    hf = ckpt.reference
    config = hf.config
    kind = config.model_type
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "gemma2": gguf.MODEL_ARCH.GEMMA2}[kind]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if kind == "gemma2":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    else:
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<s>", "</s>", "ab", "<x>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 1, 3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)

    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if kind == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            array = _llama_cpp_permute(array, heads)
        if kind == "gemma2" and "norm" in name:
            array = array + 1.0
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _skip_unless_transformers_reads(path) -> None:
    """Some transformers + tokenizers pairs cannot build a tokenizer from this GGUF's metadata
    (5.17 on the GPU machine: "failed to extract enum PyMerges"); that is theirs to fix, and the
    loader then refuses with a clear error."""
    import transformers
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (TypeError, ValueError, KeyError) as e:
        pytest.skip(f"transformers {transformers.__version__} cannot read this GGUF's tokenizer: "
                    f"{str(e).splitlines()[0]}")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2_gguf"])
def test_gguf_matches_transformers(family, tiny_checkpoint, tmp_path, backend_name, device, paged_runner):
    ckpt = tiny_checkpoint(family)
    path = tmp_path / f"{family}.gguf"
    _write_gguf(ckpt, path)
    _skip_unless_transformers_reads(path)
    lm = load_model(path, dtype=torch.float32, device=device, attention_backend=backend_name)
    assert lm.spec.eos_token_ids == {257}
    assert lm.spec.architecture == type(ckpt.reference).__name__

    tokens = torch.randint(0, VOCAB, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = ckpt.reference(input_ids=torch.tensor([tokens])).logits[0]
    runner = paged_runner(lm)
    table = runner.block_table(N)
    prefill = runner.step([(tokens, 0, N - 1, table)])
    decode = runner.step([(tokens, N - 1, 1, table)])
    torch.testing.assert_close(torch.cat([prefill, decode]).cpu(), ref, atol=ATOL, rtol=1e-4)
