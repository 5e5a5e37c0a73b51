"""Models of a known shape with random weights made on the device: no checkpoint, no download.

Like vLLM's `load_format="dummy"`: what a benchmark needs of a model is its shape, so the
weights are seeded uniform draws made on the target device (an 8B model in bf16 never passes
through host memory). `SHAPES` holds the Hugging Face configs of the models benchmarked
(SmolLM2-135M, Llama-3-8B, Llama-3-70B, Qwen2-7B) and a tiny one for tests.

Each checkpoint tensor (Hugging Face's names and shapes) is drawn whole, in a fixed order, and
handed to the model's `load_weights` like a checkpoint's: a tensor-parallel rank keeps its shard
of each, so every tensor-parallel size computes with the same weights (one tensor at a time
is whole in memory: the 70B shape's largest, the embedding, is 2.1 GB in bf16).

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
from collections.abc import Iterator

import torch
from torch import nn

from pagedattn.models.layers import STACKED_PARAMS
from pagedattn.parallel.group import TPGroup
from pagedattn.parallel.layers import SINGLE, ColumnParallelLinear

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
    "llama3-70b": dict(  # meta-llama/Meta-Llama-3-70B: 141 GB of bf16 weights
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
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


def dummy_config(shape: str, num_layers: int | None = None):
    """The transformers config of `shape` (a key of SHAPES), cut to its first `num_layers`
    layers when given; ValueError naming the shapes otherwise."""
    if shape not in SHAPES:
        raise ValueError(f"expected a model shape in {sorted(SHAPES)}, got {shape!r}")
    fields = dict(SHAPES[shape])
    if num_layers is not None:
        if not isinstance(num_layers, int) or not 1 <= num_layers <= fields["num_hidden_layers"]:
            raise ValueError(f"expected num_layers in [1, {fields['num_hidden_layers']}] for {shape}, "
                             f"got {num_layers!r}")
        fields["num_hidden_layers"] = num_layers
    from transformers import AutoConfig

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
    num_layers: int | None = None,
    tp: TPGroup = SINGLE,
):
    """Our model of `shape` with seeded random weights made on `device` in `dtype`, as a
    `pagedattn.models.LoadedModel` (what `LLMEngine(config, loaded)` takes).

    max_model_len: caps the spec's context (None: the shape's own; larger is refused).
    num_layers: the shape's first layers only (a model that would not fit the devices).
    tp: this rank's tensor-parallel group: the model is its shard of the same weights.
    The same (shape, dtype, device kind, seed, num_layers) gives the same weights at any `tp`.
    """
    from pagedattn.models.loader import LoadedModel, build_model, capped, model_spec

    config = dummy_config(shape, num_layers)
    architecture = config.architectures[0]
    device = torch.device(device)
    net = build_model(architecture, config, device=device, dtype=dtype, attention_backend=attention_backend,
                      kv_cache_dtype=kv_cache_dtype, tp=tp)
    net.load_weights(_random_weights(net, torch.Generator(device=device).manual_seed(seed)))
    tokenizer = synthetic_tokenizer(config.vocab_size, config.eos_token_id)
    spec = capped(model_spec(architecture, config, tokenizer, dtype), max_model_len)
    return LoadedModel(net, tokenizer, spec)


_CHECKPOINT_NAMES = {dst_index: src for src, dst_index in STACKED_PARAMS.items()}
"""(our stacked linear, part index) -> the checkpoint module it loads, e.g. ("qkv_proj", 0) -> "q_proj"."""


def _random_weights(net: nn.Module, gen: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, whole tensor) of every checkpoint tensor `net` loads, each drawn on
    the generator's device in `net`'s dtype, in an order that does not depend on the
    tensor-parallel size (parameters in module order, a stacked one's parts in order)."""
    for name, p in net.named_parameters():  # tied parameters come once
        module_name, _, leaf = name.rpartition(".")
        module = net.get_submodule(module_name)
        if isinstance(module, ColumnParallelLinear):
            parent, _, stacked = module_name.rpartition(".")
            for index in range(len(module.splits)):
                shape = module.checkpoint_shard(leaf, index).full_shape
                yield f"{parent}.{_CHECKPOINT_NAMES[stacked, index]}.{leaf}", _draw(name, shape, p.dtype, gen)
        elif name.endswith("norm.weight"):
            yield name, p.detach()  # norm scales keep their initial values (1, or Gemma's 0 for 1 + w)
        else:
            shape = module.checkpoint_shard(leaf).full_shape if hasattr(module, "checkpoint_shard") else p.shape
            yield name, _draw(name, shape, p.dtype, gen)


@torch.no_grad()
def _draw(name: str, shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=gen.device)
    if t.ndim == 1:
        return t.uniform_(-0.02, 0.02, generator=gen)
    if "embed_tokens" in name:
        return t.uniform_(-1.0, 1.0, generator=gen)
    bound = 1 / math.sqrt(t.shape[1])  # the whole matrix's fan-in, also for a row-parallel shard
    return t.uniform_(-bound, bound, generator=gen)


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
            if name in params and isinstance(module, ColumnParallelLinear):
                return module.shard(params[name], index)
    raise ValueError(f"expected a weight of ours for transformers' {hf_name!r}, found none")
