"""Models of a known shape with random weights made on the device: no checkpoint, no download.

Like vLLM's `load_format="dummy"`: what a benchmark needs of a model is its shape, so the
weights are seeded uniform draws written straight into the parameters on the target device (an
8B model in bf16 never passes through host memory). `SHAPES` holds the Hugging Face configs of
the models benchmarked (SmolLM2-135M, Llama-3-8B, Qwen2-7B) and a tiny one for tests.

    loaded = load_dummy_model("llama3-8b", device="cuda", dtype=torch.bfloat16)
    engine = LLMEngine(EngineConfig(device="cuda"), loaded)
    peer = transformers_model(loaded)  # transformers' model over the same weight tensors

The tokenizer is synthetic: token i is the word `t<i>` (a word-level vocabulary of the model's
size), so prompts are token ids and every generated token adds text (what a server streams).
Weight scales: a matrix of fan-in n draws from U(-1/sqrt(n), 1/sqrt(n)), embeddings from
U(-1, 1), biases from U(-0.02, 0.02), norms stay 1: activations keep unit scale through the
layers, so logits are finite and spread (not all equal), in bf16 as in float32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedattn.models.layers import STACKED_PARAMS, StackedLinear

SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M-Instruct
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "llama3-8b": dict(  # meta-llama/Meta-Llama-3-8B
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "qwen2-7b": dict(  # Qwen/Qwen2-7B-Instruct (q/k/v biases come with the architecture)
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=None, max_window_layers=28,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "tiny-llama": dict(  # for tests: 2 layers, hidden 64
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ),
    "tiny-qwen2": dict(  # for tests: q/k/v biases
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=None, bos_token_id=1, eos_token_id=2,
    ),
    "tiny-gemma2": dict(  # for tests: a window of 8 on every other layer, a logit soft cap, 4:1 GQA
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=32, sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    ),
}
"""Shape name -> Hugging Face config fields (`architectures` names our model class)."""


def dummy_config(shape: str):
    """The transformers config of `shape` (a key of SHAPES); ValueError naming them otherwise."""
    if shape not in SHAPES:
        raise ValueError(f"expected a model shape in {sorted(SHAPES)}, got {shape!r}")
    from transformers import AutoConfig

    fields = dict(SHAPES[shape])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def synthetic_tokenizer(vocab_size: int, eos_token_id: int):
    """A word-level tokenizer: id i <-> the word `t<i>`, words joined by spaces when decoded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos_token_id}")


def load_dummy_model(
    shape: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
):
    """Our model of `shape` with seeded random weights made on `device` in `dtype`, as a
    `pagedattn.models.LoadedModel` (what `LLMEngine(config, loaded)` takes).

    max_model_len: caps the spec's context (None: the shape's own; larger is refused).
    The same (shape, dtype, device kind, seed) gives the same weights.
    """
    from pagedattn.models.loader import LoadedModel, build_model, capped, model_spec

    config = dummy_config(shape)
    architecture = config.architectures[0]
    device = torch.device(device)
    net = build_model(architecture, config, device=device, dtype=dtype, attention_backend=attention_backend,
                      kv_cache_dtype=kv_cache_dtype)
    _randomize(net, torch.Generator(device=device).manual_seed(seed))
    tokenizer = synthetic_tokenizer(config.vocab_size, config.eos_token_id)
    spec = capped(model_spec(architecture, config, tokenizer, dtype), max_model_len)
    return LoadedModel(net, tokenizer, spec)


@torch.no_grad()
def _randomize(net: nn.Module, gen: torch.Generator) -> None:
    for name, p in net.named_parameters():  # tied parameters come once
        if name.endswith("norm.weight"):
            continue  # RMSNorm scales stay 1
        if p.ndim == 1:
            p.uniform_(-0.02, 0.02, generator=gen)
        elif "embed_tokens" in name:
            p.uniform_(-1.0, 1.0, generator=gen)
        else:
            bound = 1 / math.sqrt(p.shape[1])
            p.uniform_(-bound, bound, generator=gen)


def transformers_model(loaded) -> nn.Module:
    """transformers' own model class for `loaded` (a `load_dummy_model` result, or any loaded
    Llama-family model), its parameters views of `loaded.model`'s: no weight is copied, and
    both compute with the same values.

    Build it before an engine runs `loaded` on the CPU: the engine repacks CPU linears into
    new tensors, after which these views keep the original ones alive (same values, more memory).
    The model is first built on the device with transformers' own initialisation (transient
    memory of one more copy), then each parameter is replaced by its view.
    """
    from transformers import AutoModelForCausalLM

    ours = loaded.model
    first = next(ours.parameters())
    with torch.device(first.device):
        peer = AutoModelForCausalLM.from_config(ours.config, dtype=first.dtype)
    peer.eval().requires_grad_(False)
    params = dict(ours.named_parameters(remove_duplicate=False))
    views = {name: _our_view(ours, params, name) for name, _ in peer.named_parameters(remove_duplicate=False)}
    peer.load_state_dict(views, strict=False, assign=True)
    unshared = [n for n, p in peer.named_parameters(remove_duplicate=False) if p.data_ptr() != views[n].data_ptr()]
    if unshared:
        raise ValueError(f"expected every transformers parameter to share our weights, got copies of {unshared[:4]}")
    return peer


def _our_view(ours: nn.Module, params: dict[str, nn.Parameter], hf_name: str) -> torch.Tensor:
    """Our tensor for transformers' parameter `hf_name`: the same parameter, or the shard of a
    stacked one (q/k/v in qkv_proj, gate/up in gate_up_proj)."""
    if hf_name in params:
        return params[hf_name]
    if hf_name == "lm_head.weight" and ours.config.tie_word_embeddings:  # Gemma 2 reads its embedding as the head
        return params["model.embed_tokens.weight"]
    for src, (dst, index) in STACKED_PARAMS.items():
        if f".{src}." in hf_name:
            name = hf_name.replace(f".{src}.", f".{dst}.")
            module = ours.get_submodule(name.rpartition(".")[0])
            if name in params and isinstance(module, StackedLinear):
                return module.shard(params[name], index)
    raise ValueError(f"expected a weight of ours for transformers' {hf_name!r}, found none")
