"""BART (`BartForConditionalGeneration`) over the paged KV cache: an encoder-decoder model.

One step runs the encoder over the encoder prompts of its prefills (`AttentionType.ENCODER`:
bidirectional within each prompt, no cache), then the decoder over its query tokens: causal
self-attention through the decoder pool (`DECODER`) and cross-attention over the encoder output
(`ENCODER_DECODER`), whose K/V are written into the cross pool when the encoder ran in this step
and read back from it on every later step (key = value = None).

What BART is: learned positions offset by 2 (`embed_positions(p + 2)`), token embeddings shared
by encoder, decoder and LM head and scaled by sqrt(d_model) when `scale_embedding`; a layer norm
after the embeddings; post-norm blocks (residual add, then layer norm) with biases everywhere;
GELU feed-forward (`activation_function`); `final_logits_bias` added to the logits. The module
tree mirrors Hugging Face's names except that self-attention q/k/v and cross-attention k/v run
as one stacked matmul each (`qkv_proj`, `kv_proj`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedattn.attention.types import AttentionType
from pagedattn.layer import Attention
from pagedattn.models.layers import (ENCODER_DECODER_STACKED, activation_of, encoder_decoder_spec_fields,
                                     float_logits, load_weights)
from pagedattn.parallel.layers import ColumnParallelLinear

POSITION_OFFSET = 2
"""BART's learned position tables start at index 2 (fairseq reserved 0 and 1 for padding)."""



class BartSelfAttention(nn.Module):
    """Self-attention of the encoder (ENCODER) or the decoder (DECODER, through its cache)."""

    def __init__(self, d_model: int, attn: Attention) -> None:
        super().__init__()
        self.qkv_proj = ColumnParallelLinear(d_model, (d_model, d_model, d_model), bias=True)
        self.out_proj = nn.Linear(d_model, d_model)
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, d_model] -> [T, d_model]."""
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v))


class BartCrossAttention(nn.Module):
    """Decoder queries over the encoder output, whose K/V live in the cross pool."""

    def __init__(self, d_model: int, attn: Attention) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = ColumnParallelLinear(d_model, (d_model, d_model), bias=True)
        self.out_proj = nn.Linear(d_model, d_model)
        self.attn = attn

    def forward(self, x: torch.Tensor, encoder_hidden: torch.Tensor | None) -> torch.Tensor:
        """x: [T, d_model]; encoder_hidden: [Te, d_model] when the step ran the encoder (its K/V
        are written to the cross pool), else None (read from it) -> [T, d_model]."""
        k = v = None
        if encoder_hidden is not None:
            k, v = self.kv_proj(encoder_hidden).chunk(2, dim=-1)
        return self.out_proj(self.attn(self.q_proj(x), k, v))


class BartEncoderLayer(nn.Module):
    """Post-norm: self-attention, then the feed-forward (fc1, activation, fc2), each added and normed."""

    def __init__(self, config, attn: Attention, ffn_dim: int) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn = BartSelfAttention(d, attn)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d)
        self.activation = activation_of(config)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, d_model] -> [T, d_model]."""
        h = self.self_attn_layer_norm(h + self.self_attn(h))
        return self.feed_forward(h)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.final_layer_norm(h + self.fc2(self.activation(self.fc1(h))))


class BartDecoderLayer(BartEncoderLayer):
    """An encoder layer with cross-attention between self-attention and the feed-forward."""

    def __init__(self, config, self_attn: Attention, cross_attn: Attention) -> None:
        super().__init__(config, self_attn, config.decoder_ffn_dim)
        self.encoder_attn = BartCrossAttention(config.d_model, cross_attn)
        self.encoder_attn_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, h: torch.Tensor, encoder_hidden: torch.Tensor | None) -> torch.Tensor:
        """h: [T, d_model]; encoder_hidden: [Te, d_model] or None -> [T, d_model]."""
        h = self.self_attn_layer_norm(h + self.self_attn(h))
        h = self.encoder_attn_layer_norm(h + self.encoder_attn(h, encoder_hidden))
        return self.feed_forward(h)


class BartEmbeddings(nn.Module):
    """Scaled token embeddings plus learned positions (offset by 2), then a layer norm.

    Token embeddings are BartModel's `shared` ones when `shared` is given (tied embeddings), else
    this module's own `embed_tokens` (transformers >= 5 unties them with `tie_word_embeddings`)."""

    def __init__(self, config, shared: nn.Embedding | None) -> None:
        super().__init__()
        if shared is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
            self.token_embedding = [self.embed_tokens]
        else:
            self.token_embedding = [shared]  # in a list: registered once, by BartModel
        self.scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.d_model)
        self.layernorm_embedding = nn.LayerNorm(config.d_model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> [T, d_model]."""
        h = self.token_embedding[0](input_ids) * self.scale + self.embed_positions(positions + POSITION_OFFSET)
        return self.layernorm_embedding(h)


class BartEncoder(BartEmbeddings):
    def __init__(self, config, shared: nn.Embedding | None, attns: list[Attention]) -> None:
        super().__init__(config, shared)
        self.layers = nn.ModuleList(BartEncoderLayer(config, a, config.encoder_ffn_dim) for a in attns)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step's encoder tokens, int64 [Te] each -> encoder output [Te, d_model]."""
        h = super().forward(input_ids, positions)
        for layer in self.layers:
            h = layer(h)
        return h


class BartDecoder(BartEmbeddings):
    def __init__(
        self, config, shared: nn.Embedding | None, self_attns: list[Attention], cross_attns: list[Attention]
    ) -> None:
        super().__init__(config, shared)
        self.layers = nn.ModuleList(BartDecoderLayer(config, s, c) for s, c in zip(self_attns, cross_attns))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, encoder_hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """Decoder tokens int64 [T] each; encoder_hidden [Te, d_model] or None -> [T, d_model]."""
        h = super().forward(input_ids, positions)
        for layer in self.layers:
            h = layer(h, encoder_hidden)
        return h


class BartModel(nn.Module):
    def __init__(self, config, *, attention_backend: str, kv_cache_dtype: str) -> None:
        super().__init__()
        d, n_dec = config.d_model, config.decoder_layers
        heads = config.decoder_attention_heads
        if d % heads or d % config.encoder_attention_heads:
            raise ValueError(
                f"expected d_model ({d}) divisible by the attention heads, got {config.encoder_attention_heads} "
                f"(encoder) and {heads} (decoder)"
            )

        def attention(num_heads: int, layer_idx: int, attn_type: AttentionType, cache_dtype: str) -> Attention:
            head_size = d // num_heads
            return Attention(num_heads, head_size, head_size**-0.5, backend=attention_backend, layer_idx=layer_idx,
                             attn_type=attn_type, kv_cache_dtype=cache_dtype)

        # Cache indices: decoder self-attention layers 0..n-1, cross-attention layers n..2n-1.
        # The encoder's attention has no cache (its index is never read).
        # Tied: one table for encoder, decoder and LM head. Untied: each has its own.
        shared = nn.Embedding(config.vocab_size, d) if config.tie_word_embeddings else None
        self.shared = shared
        enc = [attention(config.encoder_attention_heads, 0, AttentionType.ENCODER, "auto")
               for _ in range(config.encoder_layers)]
        dec = [attention(heads, i, AttentionType.DECODER, kv_cache_dtype) for i in range(n_dec)]
        cross = [attention(heads, n_dec + i, AttentionType.ENCODER_DECODER, kv_cache_dtype) for i in range(n_dec)]
        self.encoder = BartEncoder(config, shared, enc)
        self.decoder = BartDecoder(config, shared, dec, cross)


class BartForConditionalGeneration(nn.Module):
    """BART over a flattened batch: run it inside `pagedattn.forward_context(md, kv_caches)`
    with the decoder layers' caches then the cross layers' (`spec_fields` says how many)."""

    def __init__(self, config, *, attention_backend: str = "auto", kv_cache_dtype: str = "auto") -> None:
        super().__init__()
        for name in ("add_final_layer_norm", "normalize_before"):  # mBART's pre-norm switches
            if getattr(config, name, False):
                raise NotImplementedError(f"expected {name}=False (BART is post-norm), got True")
        self.config = config
        self.model = BartModel(config, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.shared.weight
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))

    @staticmethod
    def spec_fields(config) -> dict:
        """ModelSpec fields in BART's config names (the loader's defaults read decoder-only names)."""
        return encoder_decoder_spec_fields(config, max_model_len=config.max_position_embeddings, max_encoder_len=config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: the decoder's int64 [T]; encoder_input_ids, encoder_positions:
        int64 [Te], the encoder prompts of the step's prefills laid out as the metadata's
        `encoder_seq_start_loc` says, or None when the step has no prefill
        -> decoder hidden states [T, d_model] in the model dtype."""
        encoder_hidden = None
        if encoder_input_ids is not None:
            encoder_hidden = self.model.encoder(encoder_input_ids, encoder_positions)
        return self.model.decoder(input_ids, positions, encoder_hidden)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, d_model] -> logits float32 [N, vocab] (into `out` when given)."""
        return float_logits(self.lm_head(hidden) + self.final_logits_bias, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: (Hugging Face name, tensor) pairs, e.g. `model.decoder.layers.0.encoder_attn.k_proj.weight`.
        `final_logits_bias` is optional (transformers does not require it either). Tied: copies
        of the shared embedding (older checkpoints save them) are skipped; untied: the shared
        table, which nothing reads, is."""
        if self.config.tie_word_embeddings:
            ignore = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]
        else:
            ignore = ["model.shared.weight"]
        load_weights(self, self._take_logits_bias(weights), ENCODER_DECODER_STACKED, ignore)

    def _take_logits_bias(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name != "final_logits_bias":
                yield name, tensor
                continue
            if tensor.shape != self.final_logits_bias.shape:
                raise ValueError(
                    f"checkpoint tensor 'final_logits_bias': expected shape {tuple(self.final_logits_bias.shape)}, "
                    f"got {tuple(tensor.shape)}"
                )
            with torch.no_grad():
                self.final_logits_bias.copy_(tensor[...])
