"""Qwen3 (dense) over the paged KV cache: a Llama-family model whose attention normalises each
query and key head (RMSNorm over the head dimension, one weight per projection) before RoPE.

The head size is the config's `head_dim` (128 for every Qwen3, whatever hidden / heads is); no
q/k/v biases unless `attention_bias`; sliding windows where `config.layer_types` says so.
"""

from __future__ import annotations

from pagedattn.models.layers import HeadNormAttention
from pagedattn.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(HeadNormAttention, LlamaAttention):
    """Llama's attention with per-head q/k RMSNorm (`q_norm`, `k_norm`)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head q/k RMSNorm (`self_attn.q_norm`, `self_attn.k_norm`)."""

    attention_cls = Qwen3Attention
