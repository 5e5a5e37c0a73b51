"""Building blocks shared by the model families: RMSNorm, rotary embedding, weight loading.

Every model here runs over a flattened batch: `T` tokens of several sequences laid end to end,
no batch dimension and no padding. Sequence boundaries live only in the attention metadata.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.layer import Attention
from pagedattn.parallel.group import TPGroup
from pagedattn.parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Split

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
"""Checkpoint module name -> (our ColumnParallelLinear, part index), for every family here."""

ENCODER_DECODER_STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "encoder_attn.k_proj": ("encoder_attn.kv_proj", 0),
    "encoder_attn.v_proj": ("encoder_attn.kv_proj", 1),
}
"""Checkpoint module name -> (our ColumnParallelLinear, part index), for BART-style encoder-decoders."""

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation_of(config):
    """The function `config.activation_function` names (BART, Whisper)."""
    name = config.activation_function
    if name not in ACTIVATIONS:
        raise NotImplementedError(f"expected activation_function in {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


KV_SCALE_NAMES = {
    "self_attn.k_scale": ("k",),
    "self_attn.v_scale": ("v",),
    "self_attn.kv_scale": ("k", "v"),  # older checkpoints: one scale for both
    "self_attn.k_proj.k_scale": ("k",),  # ModelOpt
    "self_attn.v_proj.v_scale": ("v",),
    "self_attn.k_proj.output_scale": ("k",),  # Quark, AutoFP8
    "self_attn.v_proj.output_scale": ("v",),
}
"""Names of FP8 KV-cache scales in checkpoints (vLLM's naming, per layer: `model.layers.N.` +
name) -> which of the layer's scales they set. They are dequantisation scales (`x = stored *
scale`), as ours, so they are loaded as they are, into `self_attn.attn` of that layer."""


def head_size_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: normalise in float32, cast back, then scale by `weight` in the model dtype.

    With `residual`, first adds it (the residual stream, in the model dtype) and returns the sum
    too, so a decoder layer's `h + delta` and the next norm are one step. On CUDA one Triton
    kernel (`kernels.fused_layers.rms_norm`, same rounding) runs both. With `partial_over` (a
    tensor-parallel group), x is this rank's partial sum (a `RowParallelLinear(reduce=False)`):
    summed first, in the same kernel as the add and the norm where the group's one-shot takes it
    (`TPGroup.all_reduce_norm`)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
                partial_over: TPGroup | None = None):
        """x (and residual): [T, hidden] -> normed [T, hidden], same dtype; with `residual`,
        (normed x + residual, x + residual)."""
        if partial_over is not None and partial_over.size > 1:
            fused = partial_over.all_reduce_norm(x, self.weight, self.eps, residual)
            if fused is not None:
                return fused
            x = partial_over.all_reduce(x)
        if x.is_cuda:
            from pagedattn.kernels.fused_layers import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:  # the same math as below, one fused op
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE parameters (`rope_type`, `rope_theta`, and the type's own: `factor`, ...) of the
    layers of `layer_type` ("full_attention", "sliding_attention"; None: the config's only set).

    Reads `config.rope_parameters` (transformers >= 5; Gemma 3's holds one set per layer type) or
    the older `rope_theta` + `rope_scaling`, where Gemma 3's local layers have their own base
    (`rope_local_base_freq`) and no scaling.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        if all(isinstance(v, Mapping) for v in params.values()):  # one set per layer type
            if layer_type not in params:
                raise ValueError(f"expected rope_parameters for layer type {layer_type!r}, got {sorted(params)}")
            return dict(params[layer_type])
        return dict(params)
    if layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None) is not None:
        return {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_inv_freq(config, head_size: int, layer_type: str | None = None) -> torch.Tensor:
    """The rotary inverse frequencies `[head_size // 2]` float32 of a Hugging Face config (of the
    layers of `layer_type`, see `rope_parameters`).

    Supports the rope types in `ROPE_TYPES`; others raise `NotImplementedError`.
    """
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError(
            f"expected partial_rotary_factor 1.0, got {params['partial_rotary_factor']}"
        )
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, params, head_size)
    raise NotImplementedError(f"expected a rope_type in {list(ROPE_TYPES)}, got {rope_type!r}")


def rope_attention_factor(config, layer_type: str | None = None) -> float:
    """The factor on cos and sin of the layers of `layer_type`: YaRN's attention factor (its
    `attention_factor`, else from `factor`, `mscale` and `mscale_all_dim` as transformers
    computes it), 1.0 for the other rope types."""
    params = rope_parameters(config, layer_type)
    if params.get("rope_type", params.get("type")) != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, mscale_all_dim = float(params["factor"]), params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, params: Mapping, head_size: int) -> torch.Tensor:
    # YaRN keeps the fast dimensions (more than `beta_fast` turns over the original context),
    # divides the slow ones (fewer than `beta_slow`) by `factor`, and ramps linearly in between.
    base, factor = float(params["rope_theta"]), float(params["factor"])
    original_len = float(params["original_max_position_embeddings"])

    def dim_of(turns: float) -> float:  # the dimension that turns `turns` times over the original context
        return head_size * math.log(original_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping) -> torch.Tensor:
    # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends linearly in between
    # (by wavelength measured against the original training context).
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, gathered by `positions` (NeoX halves layout)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0) -> None:
        """scaling: a factor on cos and sin (`rope_attention_factor`: YaRN's)."""
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        self.register_buffer("cos_cache", freqs.cos() * scaling, persistent=False)  # [P, D/2] float32
        self.register_buffer("sin_cache", freqs.sin() * scaling, persistent=False)  # [P, D/2] float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [T] -> (cos, sin), each [T, 1, D/2] in `dtype` (broadcast over heads)."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (any strides but the last); cos, sin: [T, 1, D/2] -> a new [T, H, D],
    rotating (x[:D/2], x[D/2:]) pairs: (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((torch.addcmul(x1 * cos, x2, sin, value=-1), torch.addcmul(x2 * cos, x1, sin)), dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` written into x ([T, H, D], head dim contiguous) and returned: on CUDA one
    Triton kernel in place (`kernels.fused_layers.rotary_`), elsewhere `apply_rope` copied back."""
    if x.is_cuda:
        from pagedattn.kernels.fused_layers import rotary_

        return rotary_(x, cos, sin)
    return x.copy_(apply_rope(x, cos, sin))



class HeadSplitAttention(nn.Module):
    """What a decoder attention's projections share (Llama's, Gemma 2's): `qkv_proj`, q, k and v
    as one column-parallel matmul split over the `tp` ranks by heads (KV heads replicated when
    there are more ranks than them), the row-parallel `o_proj`, the `head_size`, and this rank's
    `q_size`/`kv_size` and `num_heads`/`num_kv_heads`. A family adds its `attn` and `forward`."""

    def __init__(self, config, tp: TPGroup, *, qkv_bias: bool, o_bias: bool, reduce: bool = True) -> None:
        """reduce: whether o_proj sums its output over the ranks (False: the family's next norm
        does, `RMSNorm(partial_over=...)`)."""
        super().__init__()
        self.head_size = head_size_of(config)
        q = Split.heads(config.num_attention_heads, self.head_size, tp, "num_attention_heads")
        kv = Split.heads(config.num_key_value_heads, self.head_size, tp, "num_key_value_heads", replicate=True)
        self.q_size, self.kv_size = q.local, kv.local  # this rank's heads
        self.num_heads, self.num_kv_heads = q.local // self.head_size, kv.local // self.head_size
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, (q, kv, kv), bias=qkv_bias)
        self.o_proj = RowParallelLinear(q, config.hidden_size, bias=o_bias, tp=tp, reduce=reduce)
        self.tp = tp

    def make_attention(self, scale: float, **kwargs) -> Attention:
        """The family's `attn`: this rank's heads, with `Attention`'s other arguments; its FP8
        scales calibrated over the group (`Attention.scale_group`)."""
        attn = Attention(self.num_heads, self.head_size, scale, self.num_kv_heads, **kwargs)
        attn.scale_group = self.tp  # one rank: its max is its own
        return attn


class HeadNormAttention:
    """An attention whose query and key heads are each normalised over the head dimension before
    RoPE (Qwen3, Gemma 3): `q_norm` and `k_norm`, one weight [D] each, of the family's RMSNorm.

    A mixin ahead of the family's attention (`class Qwen3Attention(HeadNormAttention,
    LlamaAttention)`), whose `qkv_proj`, `o_proj`, `attn`, `head_size`, head counts and sizes it
    uses; `head_norm_cls` names the norm (Gemma's scales by `1 + weight`)."""

    head_norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, config, layer_idx: int, sliding_window: int | None, **kwargs) -> None:
        super().__init__(config, layer_idx, sliding_window, **kwargs)
        self.q_norm = self.head_norm_cls(self.head_size, config.rms_norm_eps)
        self.k_norm = self.head_norm_cls(self.head_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, 1, D/2] of this layer's RoPE -> [T, hidden]."""
        num_tokens, d = x.shape[0], self.head_size
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = self.q_norm(q.reshape(num_tokens * self.num_heads, d))  # one row per head: [T Hq, D]
        k = self.k_norm(k.reshape(num_tokens * self.num_kv_heads, d))  # [T Hkv, D]
        qk = torch.cat((q.view(num_tokens, self.num_heads, d), k.view(num_tokens, self.num_kv_heads, d)), dim=1)
        apply_rope_(qk, cos, sin)  # [T, Hq + Hkv, D]: q and k heads in one pass, in place
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v))

def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I], gate then up (a stacked projection) -> silu(gate) * up, [T, I]; on CUDA one
    Triton kernel (`kernels.fused_layers.silu_and_mul`, same rounding)."""
    if x.is_cuda:
        from pagedattn.kernels.fused_layers import silu_and_mul as fused

        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [T, I] buffer fewer


class PackedLinear(nn.Module):
    """A CPU float32 `nn.Linear` run by oneDNN, its weight prepacked once.

    `F.linear` on the CPU runs MKL's sgemm, which takes generic code paths on some CPUs (AMD
    EPYC here: 2-3x slower at decode batch sizes than oneDNN, which uses the full vector width).
    Same math in float32. The packed weight replaces the original; a weight tied to another
    parameter (an embedding) stays shared and plain: oneDNN reads it as is, a little slower, and
    a packed copy would cost vocab x hidden floats (measured: +110 MiB for SmolLM2, within noise
    of the plain one end to end). A tensor-parallel linear's `collective` (the row-parallel
    all-reduce, the head's all-gather) runs on the packed product as on the original's.
    """

    def __init__(self, linear: nn.Linear, tied: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.weight = w if tied else torch.ops.mkldnn._reorder_linear_weight(w, None)  # opaque layout
        self.bias = linear.bias
        self.collective = getattr(linear, "collective", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] float32 -> [..., out_features] (the collective's shape, if any)."""
        y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return y if self.collective is None else self.collective(y)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


_PACKED_TYPES = (nn.Linear, ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Swap every float32 linear of a CPU model (`nn.Linear` and the tensor-parallel ones) for a
    `PackedLinear`, in place; returns how many were swapped (0 where oneDNN is unavailable). Call
    it after the weights are loaded.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[p.data_ptr()] = uses.get(p.data_ptr(), 0) + 1
    # By name, holding no module: each original weight is freed as soon as its linear is swapped.
    names = [
        name for name, m in model.named_modules()
        if type(m) in _PACKED_TYPES and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
    ]
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child_name)
        setattr(parent, child_name, PackedLinear(linear, tied=uses[linear.weight.data_ptr()] > 1))
        del linear
    _return_freed_memory()
    return len(names)


def _return_freed_memory() -> None:
    """Hand heap pages freed so far back to the OS: glibc keeps the freed weights' pages (they sit
    between live allocations), and the next packed weight would not reuse them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass


def layer_sliding_windows(config) -> tuple[int | None, ...]:
    """The sliding window of each layer (None: full attention), as transformers' config defines it.

    transformers >= 5 lists `layer_types` ("sliding_attention"/"full_attention") for Qwen2/3,
    Gemma 2/3 and gpt-oss; configs without it (Llama, Mistral) use `sliding_window` for every layer.
    """
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # transformers < 5
        if config.model_type in ("gemma2", "gpt_oss"):
            return tuple(window if i % 2 == 0 else None for i in range(num_layers))
        if config.model_type == "gemma3_text":  # every `sliding_window_pattern`-th layer is global
            pattern = config.sliding_window_pattern
            return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
        if config.model_type in ("qwen2", "qwen3"):
            if not getattr(config, "use_sliding_window", False):
                return (None,) * num_layers
            first = getattr(config, "max_window_layers", 0)
            return tuple(window if i >= first else None for i in range(num_layers))
        return (window,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"expected {num_layers} layer_types, got {len(layer_types)}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


@torch.no_grad()
def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, object]],
    stacked: Mapping[str, tuple[str, int]],
    ignore: Iterable[str] = (),
) -> None:
    """Copy checkpoint tensors (Hugging Face names) into `model`'s parameters, checking names and shapes.

    weights: (name, tensor) pairs; a tensor is a `torch.Tensor` or a lazy one (the loader's
        `SafetensorsTensor`: `.shape`, and indexing reads only what it selects), of which only
        this rank's rows are read: a tensor-parallel layer says which (`checkpoint_shard`),
        every other parameter takes the whole tensor (`tensor[...]`).
    stacked: checkpoint module name -> (our ColumnParallelLinear name, part index), e.g.
        {"q_proj": ("qkv_proj", 0)}.
    ignore: substrings of checkpoint names to skip (buffers saved by old checkpoints, tied heads).
    FP8 KV-cache scales (`KV_SCALE_NAMES`) fix the scales of the layer's `pagedattn.Attention`.
    Raises ValueError on an unknown name, a shape mismatch, or parameters left unloaded.
    """
    ignore = tuple(ignore)
    params = dict(model.named_parameters())
    expected = set()
    for name in params:
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, ColumnParallelLinear):
            expected.update((name, i) for i in range(len(module.output_sizes)))
        else:
            expected.add((name, None))
    loaded = set()
    for ckpt_name, tensor in weights:
        if any(s in ckpt_name for s in ignore):
            continue
        if _load_kv_scale(model, ckpt_name, tensor):
            continue
        name, index = ckpt_name, None
        for src, (dst, i) in stacked.items():
            if f".{src}." in ckpt_name:
                name, index = ckpt_name.replace(f".{src}.", f".{dst}."), i
                break
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor {ckpt_name!r} for {type(model).__name__}")
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        shard = module.checkpoint_shard(leaf, index) if hasattr(module, "checkpoint_shard") else None
        full_shape = shard.full_shape if shard is not None else tuple(params[name].shape)
        if tuple(tensor.shape) != full_shape:
            raise ValueError(f"checkpoint tensor {ckpt_name!r}: expected shape {full_shape}, got {tuple(tensor.shape)}")
        if shard is None:
            params[name].data.copy_(tensor[...])
        elif shard.length:
            rows = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)
            shard.dest.copy_(tensor[rows])
        loaded.add((name, index))
    missing = sorted(f"{n}[{i}]" if i is not None else n for n, i in expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing weights for {type(model).__name__}: {shown}")


def _load_kv_scale(model: nn.Module, ckpt_name: str, tensor) -> bool:
    """Set the FP8 scales `ckpt_name` names (see `KV_SCALE_NAMES`); False when it names none."""
    for suffix, which in KV_SCALE_NAMES.items():
        if not ckpt_name.endswith("." + suffix):
            continue
        path = ckpt_name[: -len(suffix)] + "self_attn.attn"
        try:
            attn = model.get_submodule(path)
        except AttributeError:
            attn = None
        if not isinstance(attn, Attention):
            raise ValueError(f"checkpoint tensor {ckpt_name!r}: expected a pagedattn.Attention at {path!r}, found none")
        attn.set_kv_scales(**{f"{w}_scale": tensor[...] for w in which})  # a safetensors slice read whole
        return True
    return False


def encoder_decoder_spec_fields(config, *, max_model_len: int, max_encoder_len: int) -> dict:
    """ModelSpec fields of an encoder-decoder whose config names its geometry BART's way
    (`decoder_layers`, `decoder_attention_heads`, `d_model`): the decoder's geometry, one cross
    layer per decoder layer, no sliding windows."""
    heads = config.decoder_attention_heads
    return dict(
        num_layers=config.decoder_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_size=config.d_model // heads,
        hidden_size=config.d_model,
        max_model_len=max_model_len,
        sliding_windows=(None,) * config.decoder_layers,
        num_cross_layers=config.decoder_layers,
        max_encoder_len=max_encoder_len,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def float_logits(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` as float32: a new tensor, or written into `out` [N, vocab] float32 (the decode
    graphs' one logits buffer, shared by every captured batch size) and returned."""
    return logits.float() if out is None else out.copy_(logits)
