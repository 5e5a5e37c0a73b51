"""Qwen3 (dense) over the paged KV cache: a Llama-family model whose attention normalises each
query and key head (RMSNorm over the head dimension, one weight per projection) before RoPE.

The head size is the config's `head_dim` (128 for every Qwen3, whatever hidden / heads is); no
q/k/v biases unless `attention_bias`; sliding windows where `config.layer_types` says so.
"""

from __future__ import annotations

import torch

from pagedattn.models.layers import RMSNorm, apply_rope_
from pagedattn.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, sliding_window: int | None, **kwargs) -> None:
        super().__init__(config, layer_idx, sliding_window, **kwargs)
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, 1, D/2] -> [T, hidden]."""
        num_tokens, d = x.shape[0], self.head_size
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = self.q_norm(q.reshape(num_tokens * self.num_heads, d))  # one row per head: [T Hq, D]
        k = self.k_norm(k.reshape(num_tokens * self.num_kv_heads, d))  # [T Hkv, D]
        qk = torch.cat((q.view(num_tokens, self.num_heads, d), k.view(num_tokens, self.num_kv_heads, d)), dim=1)
        apply_rope_(qk, cos, sin)  # [T, Hq + Hkv, D]: q and k heads in one pass, in place
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = self.attn(q.flatten(1), k.flatten(1), v)
        return self.o_proj(out)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head q/k RMSNorm (`self_attn.q_norm`, `self_attn.k_norm`)."""

    attention_cls = Qwen3Attention
