"""Gemma 2 over the paged KV cache.

What differs from Llama: RMSNorm scales by `1 + weight` in float32; four norms per block (before
and after attention and MLP); embeddings scaled by sqrt(hidden) rounded to the model dtype;
GeGLU (tanh GELU) MLP; attention scale `query_pre_attn_scalar ** -0.5` with a tanh soft cap on
the scores; local (sliding window) and global layers alternating as `config.layer_types` lists
them (transformers: even layers local); a tanh soft cap on the final logits; tied embeddings.
Tensor parallelism splits the layers as Llama's (`pagedattn.models.llama`); the soft cap is
applied to the gathered logits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.models.layers import (RotaryEmbedding, STACKED_PARAMS, HeadSplitAttention, apply_rope, float_logits,
                                     head_size_of, layer_sliding_windows, load_weights, rope_inv_freq)
from pagedattn.parallel.group import TPGroup
from pagedattn.parallel.layers import (SINGLE, ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Split,
                                       VocabParallelEmbedding)

_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class Gemma2RMSNorm(nn.Module):
    """RMSNorm computed in float32 with scale `1 + weight` (zero-initialised weight), cast back at the end."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], same dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma2Attention(HeadSplitAttention):
    def __init__(self, config, layer_idx: int, sliding_window: int | None, *,
                 attention_backend: str, kv_cache_dtype: str, tp: TPGroup) -> None:
        bias = getattr(config, "attention_bias", False)
        super().__init__(config, tp, qkv_bias=bias, o_bias=bias)
        self.attn = self.make_attention(
            config.query_pre_attn_scalar**-0.5,
            backend=attention_backend,
            layer_idx=layer_idx,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=config.attn_logit_softcapping,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, 1, D/2] -> [T, hidden]."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_size), cos, sin)  # [T, Hq, D]
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_size), cos, sin)  # [T, Hkv, D]
        out = self.attn(q.reshape(num_tokens, self.q_size), k.reshape(num_tokens, self.kv_size), v)
        return self.o_proj(out)


class Gemma2MLP(nn.Module):
    def __init__(self, config, tp: TPGroup) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in _GELU_APPROXIMATION:
            raise NotImplementedError(
                f"expected hidden_activation in {list(_GELU_APPROXIMATION)}, got {act!r}"
            )
        self.approximate = _GELU_APPROXIMATION[act]
        columns = Split.even(config.intermediate_size, tp, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, (columns, columns), bias=False)
        self.down_proj = RowParallelLinear(columns, config.hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma2DecoderLayer(nn.Module):
    attention_cls = Gemma2Attention  # Gemma 3's layer is this one around its own attention

    def __init__(self, config, layer_idx: int, sliding_window: int | None, **attn_kwargs) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, sliding_window, **attn_kwargs)
        self.mlp = Gemma2MLP(config, attn_kwargs["tp"])
        eps = config.rms_norm_eps
        self.input_layernorm = Gemma2RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = Gemma2RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = Gemma2RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = Gemma2RMSNorm(config.hidden_size, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2Model(nn.Module):
    def __init__(self, config, **attn_kwargs) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, attn_kwargs["tp"])
        # Kept as a buffer so it follows `.to(dtype)`: the scale is rounded to the model dtype.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.rotary_emb = RotaryEmbedding(
            rope_inv_freq(config, head_size_of(config)), config.max_position_embeddings
        )
        windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, i, windows[i], **attn_kwargs)
            for i in range(config.num_hidden_layers)
        )
        self.norm = Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        h = h * self.embed_scale.to(h.dtype)
        cos, sin = self.rotary_emb(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2 over a flattened batch of tokens; run it inside `pagedattn.forward_context`."""

    supports_tensor_parallel = True
    model_cls = Gemma2Model  # Gemma 3's head, logits and weights are these around its own model

    def __init__(self, config, *, attention_backend: str = "auto", kv_cache_dtype: str = "auto",
                 tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype, tp=tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> hidden states [T, hidden] in the model dtype."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> soft-capped logits float32 [N, vocab] (tied embedding head; into
        `out` when given)."""
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits.float() / cap) * cap
        return float_logits(logits, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: (Hugging Face name, tensor) pairs; a stored `lm_head.weight` is the tied embedding."""
        load_weights(self, weights, STACKED_PARAMS, ["rotary_emb.inv_freq", "lm_head.weight"])
