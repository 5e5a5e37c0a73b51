"""Read a llama.cpp GGUF file: a transformers config from its metadata, and its tensors under
Hugging Face names, dequantised to float32 with llama.cpp's conversions undone."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from pagedattn.models import ARCHITECTURES, UnsupportedModelError

# GGUF `general.architecture` (transformers' model_type) -> our architecture.
GGUF_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
# GGUF metadata key (after "<arch>.") -> transformers config attribute.
_GGUF_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_GGUF_TOKEN_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "padding_token_id": "pad_token_id",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
# Gemma 2 has four norms per block; llama.cpp calls the pre-MLP one `ffn_norm` in both families.
_GGUF_NORM_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_gguf(path) -> tuple[object, str, Iterator[tuple[str, torch.Tensor]]]:
    """(transformers config, architecture name, lazy (Hugging Face name, float32 tensor) pairs) of a GGUF file.

    The file is parsed once for both (parsing takes seconds: the tokenizer's token lists).
    Raises UnsupportedModelError for an architecture outside `ARCHITECTURES`.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    config = _gguf_config(reader)
    # The metadata (the tokenizer's token lists: hundreds of MiB of small arrays) is no longer
    # needed: free it before the model's weights are allocated.
    reader.fields.clear()
    return config, GGUF_MODEL_TYPES[config.model_type], _gguf_weights(reader, config)


def _gguf_value(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _gguf_config(reader):
    """A transformers config from GGUF metadata, with the keys transformers' GGUF loader reads."""
    from transformers import AutoConfig

    arch = _gguf_value(reader, "general.architecture")
    if arch not in GGUF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"expected a GGUF of architecture {sorted(GGUF_MODEL_TYPES)} "
            f"({sorted(ARCHITECTURES)}), got {arch!r}"
        )
    keys = dict(_GGUF_CONFIG_KEYS)
    if arch in ("llama", "mistral"):
        keys["rope.dimension_count"] = "head_dim"
    kwargs = {name: _gguf_value(reader, f"{arch}.{key}") for key, name in keys.items()}
    kwargs.update({name: _gguf_value(reader, f"tokenizer.ggml.{key}") for key, name in _GGUF_TOKEN_KEYS.items()})
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    if "vocab_size" not in kwargs:
        kwargs["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    kwargs["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    config = AutoConfig.for_model(arch, **kwargs)
    if arch == "gemma2":
        # GGUF has no query_pre_attn_scalar; llama.cpp scales queries by head_dim ** -0.5, except
        # in the 46-layer (27B) model, which uses (hidden / heads) ** -0.5.
        wide = config.num_hidden_layers == 46
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if wide else config.head_dim
    return config


def _gguf_weights(reader, config) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) pairs of a GGUF file, undoing llama.cpp's conversions."""
    import numpy as np
    from gguf.quants import dequantize

    arch = config.model_type
    norm_names = _GGUF_NORM_NAMES["gemma2" if arch == "gemma2" else "llama"]
    for tensor in reader.tensors:
        name = _gguf_to_hf_name(tensor.name, norm_names)
        array = dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            weight = _unpermute_rope_rows(weight, heads)
        if arch == "gemma2" and name.endswith("norm.weight"):
            weight = weight - 1.0  # llama.cpp stores Gemma's `1 + w`; our norm adds the 1
        yield name, weight


def _gguf_to_hf_name(name: str, norm_names: dict[str, str]) -> str:
    stem, _, kind = name.rpartition(".")
    if stem in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[stem]}.{kind}"
    match = _GGUF_LAYER_RE.fullmatch(name)
    if match:
        block, part, kind = match.groups()
        hf = _GGUF_LAYER_NAMES.get(part) or norm_names.get(part)
        if hf is not None:
            return f"model.layers.{block}.{hf}.{kind}"
    if stem == "rope_freqs":
        raise NotImplementedError(
            "GGUF rope_freqs (llama.cpp's Llama 3.1 rope scaling) is not supported; "
            "load the Hugging Face folder instead"
        )
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (rotary pairs interleaved per head) back to Hugging Face's
    (the two rotary halves of each head apart). weight: [num_heads * D, ...] (a bias too)."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)
