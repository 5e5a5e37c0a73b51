"""gpt-oss over the paged KV cache: attention with sinks, alternating windows, and a mixture of
experts.

Attention: q/k/v/o with biases, YaRN RoPE (NeoX halves, cos/sin scaled by YaRN's attention
factor), a learned sink logit per query head (`self_attn.sinks`, passed to `pagedattn.Attention`
as `sinks=`), sliding-window and full layers as `config.layer_types` lists them. MLP: a router
(linear with bias, softmax over its top-k logits) picks `num_experts_per_tok` of
`num_local_experts` experts per token; each expert is a clamped SwiGLU (gate and up interleaved
in one `[hidden, 2I]` matrix, `(up + 1) * gate * sigmoid(alpha * gate)`) with biases, in the
checkpoint's own layout (`mlp.experts.gate_up_proj [E, hidden, 2I]`, `down_proj [E, I, hidden]`).
The experts run as a PyTorch loop: correct, not fast.

Checkpoints: bf16/float32 weights (transformers' dequantised ones). The released MXFP4 weights
(`*_blocks`, `*_scales`) are refused with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedattn.layer import Attention
from pagedattn.models.attention_spec import layer_attention_specs
from pagedattn.models.layers import (RMSNorm, RotaryEmbedding, STACKED_PARAMS, StackedLinear, apply_rope_,
                                     float_logits, head_size_of, load_weights, rope_attention_factor,
                                     rope_inv_freq)


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_idx: int, sliding_window: int | None, *, attention_backend: str,
                 kv_cache_dtype: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = head_size_of(config)
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        bias = config.attention_bias
        self.qkv_proj = StackedLinear(config.hidden_size, (self.q_size, self.kv_size, self.kv_size), bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))  # [Hq], read by the attention at each call
        self.attn = Attention(
            self.num_heads,
            self.head_size,
            self.head_size**-0.5,
            self.num_kv_heads,
            backend=attention_backend,
            layer_idx=layer_idx,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            sinks=self.sinks,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, 1, D/2] -> [T, hidden]."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_size)
        apply_rope_(qk, cos, sin)  # q and k heads in one pass, in place
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        return self.o_proj(self.attn(q, k, v))


class GptOssExperts(nn.Module):
    """`num_local_experts` clamped-SwiGLU MLPs in the checkpoint's layout (gate and up interleaved)."""

    def __init__(self, config) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))  # [E, hidden, 2I]: gate, up, gate, up, ...
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))  # [E, I, hidden]
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` on x [N, hidden] -> [N, hidden]."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [N, 2I]
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
        return ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[e] + self.down_proj_bias[e]

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights: [T, E], each token's routing weight per expert (0: not routed)
        -> the weighted sum of its experts' outputs [T, hidden]."""
        out = torch.zeros_like(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # A graph cannot size its work by the routing (a host read): every expert runs on
            # every row and the unrouted ones add exact zeros. Decode graphs hold few rows.
            for e in range(weights.shape[1]):
                out += (self.expert(e, x) * weights[:, e : e + 1]).to(x.dtype)
            return out
        routed = weights > 0  # [T, E]
        for e in routed.any(dim=0).nonzero().flatten().tolist():  # the experts some token chose, in order
            rows = routed[:, e].nonzero().flatten()
            out.index_add_(0, rows, (self.expert(e, x[rows]) * weights[rows, e : e + 1]).to(x.dtype))
        return out


class GptOssMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        top, chosen = self.router(x).topk(self.top_k, dim=-1)  # [T, k] logits and expert ids
        weights = torch.zeros(x.shape[0], self.experts.gate_up_proj.shape[0], dtype=top.dtype, device=x.device)
        weights.scatter_(1, chosen, torch.softmax(top, dim=-1))  # [T, E]
        return self.experts(x, weights)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, sliding_window: int | None, **attn_kwargs) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_idx, sliding_window, **attn_kwargs)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As `LlamaDecoderLayer.forward`: the residual stream is `residual + delta`."""
        if residual is None:
            x, residual = self.input_layernorm(delta), delta
        else:
            x, residual = self.input_layernorm(delta, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin), residual)
        return self.mlp(x), residual


class GptOssModel(nn.Module):
    def __init__(self, config, **attn_kwargs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(rope_inv_freq(config, head_size_of(config)), config.max_position_embeddings,
                                          rope_attention_factor(config))
        specs = layer_attention_specs(config, sinks=True)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(config, i, spec.window, **attn_kwargs) for i, spec in enumerate(specs)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]


class GptOssForCausalLM(nn.Module):
    """gpt-oss over a flattened batch of tokens; run it inside `pagedattn.forward_context`."""

    def __init__(self, config, *, attention_backend: str = "auto", kv_cache_dtype: str = "auto") -> None:
        super().__init__()
        quant = getattr(config, "quantization_config", None) or {}
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if method is not None:
            raise NotImplementedError(
                f"expected gpt-oss with bf16 or float32 weights, got {method!r}-quantised ones (the released "
                "MXFP4 experts); use a dequantised checkpoint (transformers can save one: load it with "
                "`Mxfp4Config(dequantize=True)` and `save_pretrained`)"
            )
        self.config = config
        self.model = GptOssModel(config, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> hidden states [T, hidden] in the model dtype."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> logits float32 [N, vocab] (into `out` when given)."""
        return float_logits(self.lm_head(hidden), out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: (Hugging Face name, tensor) pairs, e.g. `model.layers.0.mlp.experts.gate_up_proj`."""
        ignore = ["rotary_emb.inv_freq"] + (["lm_head.weight"] if self.config.tie_word_embeddings else [])
        load_weights(self, weights, STACKED_PARAMS, ignore)
