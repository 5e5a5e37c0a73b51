"""Gemma 3 (text) over the paged KV cache: `Gemma3ForCausalLM` (the 1B and text-only checkpoints)
and the language model of `Gemma3ForConditionalGeneration` (4B-27B image-text checkpoints: the
vision tower and projector are not loaded, so prompts are text only).

What differs from Gemma 2 (whose norms, MLP, layer and head it reuses): each query and key head
is normalised (Gemma's RMSNorm, scale `1 + weight`) before RoPE; local layers (a sliding window,
five of every six in the released models) and global layers rotate with their own RoPE
parameters (local: `rope_local_base_freq`, 10k; global: `rope_theta`, 1M, with `rope_scaling`
where given); soft caps only where the config sets them (none in the released models).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedattn.models.attention_spec import layer_attention_specs
from pagedattn.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2RMSNorm
from pagedattn.models.layers import (
    HeadNormAttention,
    RotaryEmbedding,
    head_size_of,
    rope_attention_factor,
    rope_inv_freq,
)
from pagedattn.parallel.layers import VocabParallelEmbedding

# Weight-name prefixes of the image-text checkpoints: (transformers 4's, transformers 5's) text
# model, and the parts a text-only model does not load.
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3Attention(HeadNormAttention, Gemma2Attention):
    """Gemma 2's attention with per-head q/k norms (`q_norm`, `k_norm`, Gemma's RMSNorm)."""

    head_norm_cls = Gemma2RMSNorm


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(nn.Module):
    def __init__(self, config, **attn_kwargs) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, attn_kwargs["tp"])
        # Kept as a buffer so it follows `.to(dtype)`: the scale is rounded to the model dtype.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        specs = layer_attention_specs(config)
        self.layer_types = [s.layer_type for s in specs]
        head_size = head_size_of(config)
        self.rotary_emb = nn.ModuleDict({  # one table per layer type (local, global)
            t: RotaryEmbedding(rope_inv_freq(config, head_size, t), config.max_position_embeddings,
                               rope_attention_factor(config, t))
            for t in dict.fromkeys(self.layer_types)
        })
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, spec.window, **attn_kwargs) for i, spec in enumerate(specs)
        )
        self.norm = Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        h = h * self.embed_scale.to(h.dtype)
        rope = {t: emb(positions, h.dtype) for t, emb in self.rotary_emb.items()}  # type -> (cos, sin)
        for layer, layer_type in zip(self.layers, self.layer_types):
            h = layer(h, *rope[layer_type])
        return self.norm(h)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 over a flattened batch of tokens; run it inside `pagedattn.forward_context`."""

    model_cls = Gemma3Model

    def __init__(self, config, **kwargs) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError(
                "expected a causal Gemma 3 (use_bidirectional_attention false), got a bidirectional one "
                "(an embedding model such as EmbeddingGemma): pagedattn generates text only"
            )
        if not getattr(config, "tie_word_embeddings", True):
            raise NotImplementedError("expected Gemma 3 with tied embeddings (tie_word_embeddings true), got false")
        super().__init__(config, **kwargs)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 image-text checkpoint, built from its `text_config`."""

    @staticmethod
    def language_config(config):
        """The part of the checkpoint's config that this class is built from (the loader asks)."""
        return config.text_config

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: the checkpoint's (name, tensor) pairs; the text model's are loaded under
        `model.`, the vision tower's and projector's skipped."""
        super().load_weights(
            (_text_name(name), tensor) for name, tensor in weights if not name.startswith(_VISION_PREFIXES)
        )


def _text_name(name: str) -> str:
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name  # `language_model.lm_head.weight`, the tied head: ignored as Gemma 2's is
