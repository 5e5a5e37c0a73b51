"""The Llama family: Llama 2/3, SmolLM2, Mistral and Qwen2, over the paged KV cache.

Differences inside the family are config switches: Qwen2 has q/k/v biases and per-layer sliding
windows (`use_sliding_window`, `max_window_layers`), Mistral one window for every layer, Llama 3
"llama3" rope scaling. The module tree mirrors Hugging Face's names except that q/k/v and
gate/up run as one stacked matmul each (`qkv_proj`, `gate_up_proj`). Families built on it
(qwen3.py, gpt_oss.py) name their own attention or MLP class and attention sinks.

Tensor parallelism (`tp`, `pagedattn.parallel.layers`): q/k/v split by heads (KV heads
replicated when there are more ranks than them), gate/up by intermediate columns, o_proj and
down_proj row-parallel (one all-reduce each, summed by the norm after them: all-reduce, residual
add and RMSNorm in one kernel where the one-shot takes the message), the embedding and output
head by vocabulary ranges. A rank's `Attention` sees its own head counts; the KV cache it is
given holds those.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedattn.models.layers import (RMSNorm, RotaryEmbedding, STACKED_PARAMS, HeadSplitAttention, apply_rope_,
                                     float_logits, head_size_of, layer_sliding_windows, load_weights,
                                     rope_attention_factor, rope_inv_freq, silu_and_mul)
from pagedattn.parallel.group import TPGroup
from pagedattn.parallel.layers import (SINGLE, ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Split,
                                       VocabParallelEmbedding)


class LlamaAttention(HeadSplitAttention):
    def __init__(
        self,
        config,
        layer_idx: int,
        sliding_window: int | None,
        *,
        qkv_bias: bool,
        o_bias: bool,
        attention_backend: str,
        kv_cache_dtype: str,
        tp: TPGroup,
        sinks: bool = False,
    ) -> None:
        super().__init__(config, tp, qkv_bias=qkv_bias, o_bias=o_bias, reduce=False)  # the next norm sums
        # gpt-oss: a learned sink logit per query head [Hq], which the attention reads at each call
        # (a model with sinks refuses tensor parallelism: `supports_tensor_parallel`)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if sinks else None
        self.attn = self.make_attention(
            self.head_size**-0.5,
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
        out = self.attn(q, k, v)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        columns = Split.even(intermediate_size, tp, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (columns, columns), bias=bias)
        self.down_proj = RowParallelLinear(columns, hidden_size, bias=bias, tp=tp, reduce=False)  # the next norm sums

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, sliding_window: int | None, *,
                 attention_cls: type[LlamaAttention] = LlamaAttention, mlp_cls: type[nn.Module] | None = None,
                 **attn_kwargs) -> None:
        """mlp_cls: a family's own MLP, built from the config (None: Llama's, split over `tp`);
        under tensor parallelism it returns its partial sum, as the attention does (the norms
        after them sum over `tp`)."""
        super().__init__()
        self.tp = attn_kwargs["tp"]
        self.self_attn = attention_cls(config, layer_idx, sliding_window, **attn_kwargs)
        self.mlp = mlp_cls(config) if mlp_cls is not None else LlamaMLP(
            config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False), tp=attn_kwargs["tp"]
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is `residual + delta` (the embeddings alone before the first layer:
        residual None); each norm adds the pending delta first. Returns the next (delta, residual)."""
        if residual is None:
            x, residual = self.input_layernorm(delta), delta
        else:
            x, residual = self.input_layernorm(delta, residual, partial_over=self.tp)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin), residual, partial_over=self.tp)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, **attn_kwargs) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, attn_kwargs["tp"])
        self.rotary_emb = RotaryEmbedding(
            rope_inv_freq(config, head_size_of(config)), config.max_position_embeddings, rope_attention_factor(config)
        )
        windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, windows[i], **attn_kwargs)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = attn_kwargs["tp"]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin)
        return self.norm(h) if residual is None else self.norm(h, residual, partial_over=self.tp)[0]


class LlamaForCausalLM(nn.Module):
    """A decoder-only Llama-family model over a flattened batch of tokens.

    Run it inside `pagedattn.forward_context(attn_metadata, kv_caches)`: every layer's attention
    reads the step's metadata and `kv_caches[layer_idx]` from there. `tp`: this rank's
    tensor-parallel group (every rank runs the same steps; see the module docstring).
    """

    qkv_bias_default = False
    supports_tensor_parallel = True
    attention_cls = LlamaAttention  # a family's attention with the same weights and more (Qwen3's q/k norms)
    mlp_cls: type[nn.Module] | None = None  # a family's MLP, built from the config (gpt-oss's experts)
    attention_sinks = False  # gpt-oss

    def __init__(self, config, *, attention_backend: str = "auto", kv_cache_dtype: str = "auto",
                 tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        attention_bias = getattr(config, "attention_bias", False)
        self.model = LlamaModel(
            config,
            qkv_bias=attention_bias or self.qkv_bias_default,
            o_bias=attention_bias,
            attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype,
            tp=tp,
            attention_cls=self.attention_cls,
            mlp_cls=self.mlp_cls,
            sinks=self.attention_sinks,
        )
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> hidden states [T, hidden] in the model dtype."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> logits float32 [N, vocab] (into `out` when given), on every rank."""
        return float_logits(self.lm_head(hidden), out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: (Hugging Face name, tensor) pairs, e.g. `model.layers.0.self_attn.q_proj.weight`."""
        ignore = ["rotary_emb.inv_freq"]
        if self.config.tie_word_embeddings:
            ignore.append("lm_head.weight")
        load_weights(self, weights, STACKED_PARAMS, ignore)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with one sliding window for every layer (`config.sliding_window`, may be None)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases; sliding windows only where `config.layer_types` says so."""

    qkv_bias_default = True
