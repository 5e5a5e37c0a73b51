"""How each decoder layer attends, read once from a Hugging Face config.

Models whose layers differ (Gemma 3: local layers of a sliding window and their own RoPE base
beside global ones; gpt-oss: alternating windows, sinks on every layer) build each layer's
attention from its `LayerAttentionSpec`. The window is `layer_sliding_windows`' (the one reader
of windows, which the loader's `ModelSpec.sliding_windows` and the engine's KV cache groups
come from too); the RoPE parameters are `rope_parameters`' for the layer's type.
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
    soft_cap: float | None = None
    """A tanh cap on the attention scores (`attn_logit_softcapping`)."""
    sinks: bool = False
    """A learned sink logit per query head in the softmax's denominator (gpt-oss)."""


def layer_attention_specs(config, *, sinks: bool = False) -> tuple[LayerAttentionSpec, ...]:
    """Every decoder layer's spec, in layer order. `sinks`: the family's layers have sinks (a
    fact of the architecture, not written in its config)."""
    soft_cap = getattr(config, "attn_logit_softcapping", None)
    specs = []
    for window in layer_sliding_windows(config):
        layer_type = FULL_ATTENTION if window is None else SLIDING_ATTENTION
        theta = float(rope_parameters(config, layer_type)["rope_theta"])
        specs.append(LayerAttentionSpec(layer_type, window, theta, soft_cap, sinks))
    return tuple(specs)
