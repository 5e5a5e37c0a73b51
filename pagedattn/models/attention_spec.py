"""How each decoder layer attends, read once from a Hugging Face config.

Models whose layers differ beyond their window (Gemma 3: local layers of a sliding window with
their own RoPE base beside global ones) build each layer from its `LayerAttentionSpec`. The
window is `layer_sliding_windows`' (the one reader of windows, which the loader's
`ModelSpec.sliding_windows` and the engine's KV cache groups come from too); the RoPE parameters
are `rope_parameters`' for the layer's type. What every layer of a family shares stays a fact of
the family: gpt-oss's sinks (`LlamaForCausalLM.attention_sinks`), Gemma's score soft cap (its
config's `attn_logit_softcapping`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedattn.models.layers import layer_sliding_windows, rope_parameters

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
"""transformers' names of the two layer types (`config.layer_types`)."""


@dataclass(frozen=True)
class LayerAttentionSpec:
    """One decoder layer's attention options."""

    layer_type: str
    """FULL_ATTENTION or SLIDING_ATTENTION: which of the config's RoPE parameter sets it uses."""
    window: int | None
    """Keys a query sees, itself included (None: every earlier key)."""
    rope_theta: float
    """The RoPE base of the layer's type."""


def layer_attention_specs(config) -> tuple[LayerAttentionSpec, ...]:
    """Every decoder layer's spec, in layer order."""
    specs = []
    for window in layer_sliding_windows(config):
        layer_type = FULL_ATTENTION if window is None else SLIDING_ATTENTION
        specs.append(LayerAttentionSpec(layer_type, window, float(rope_parameters(config, layer_type)["rope_theta"])))
    return tuple(specs)
