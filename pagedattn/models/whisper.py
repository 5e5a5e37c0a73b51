"""Whisper (`WhisperForConditionalGeneration`) over the paged KV cache: an audio encoder-decoder.

The encoder runs on log-mel features `[num_mel_bins, frames]` of each prefill's request: two
convolutions with GELU (kernel 3; stride 1, then 2, so `encoder_len(frames)` positions, half the
frames rounded up), plus the checkpoint's sinusoidal `embed_positions`, then bidirectional
self-attention (`AttentionType.ENCODER`) over each request's positions. The decoder is BART's
shape (causal self-attention through the decoder pool, cross-attention through the cross pool,
written on the prefill step and read after, see `pagedattn.models.bart`) with Whisper's details:
pre-norm blocks and a final layer norm in both stacks; learned decoder positions from 0, token
embeddings not scaled (transformers reads `scale_embedding` but never applies it); `k_proj`
without a bias; the query scaled by head_size**-0.5 before the product, as transformers does
(the attention itself then scales by 1); `proj_out` tied to the decoder's token embeddings.

Unlike transformers, which refuses features of any length but the full window (30 s: 3000
frames), the encoder runs on the frames it is given, up to that window. `LogMelInput` is the
request side: features given, or made from a waveform by transformers' `WhisperFeatureExtractor`
(the model folder's `preprocessor_config.json`), which pads to the window as transformers does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.attention.types import AttentionType
from pagedattn.layer import Attention
from pagedattn.models.layers import (ENCODER_DECODER_STACKED, activation_of, encoder_decoder_spec_fields,
                                     float_logits, load_weights)
from pagedattn.parallel.layers import ColumnParallelLinear

CONV_STRIDE = 2
"""Frames per encoder position: conv1 has stride 1, conv2 stride 2."""


def encoder_len(num_frames: int) -> int:
    """Encoder positions of `num_frames` log-mel frames: conv2 (kernel 3, stride 2, padding 1)
    makes one of every two frames, the last one of an odd count included."""
    return (num_frames - 1) // CONV_STRIDE + 1


class LogMelInput:
    """How a request gives Whisper its encoder input, checked before it queues.

    num_mel_bins: the features' rows. max_source_positions: the encoder's positions, so at most
    `max_frames` = 2 * max_source_positions frames. feature_extractor: transformers'
    `WhisperFeatureExtractor` of the model folder, or None (then only features are taken).
    """

    def __init__(self, num_mel_bins: int, max_source_positions: int, feature_extractor=None) -> None:
        self.num_mel_bins = num_mel_bins
        self.max_frames = max_source_positions * CONV_STRIDE
        self.feature_extractor = feature_extractor
        if feature_extractor is not None:
            if feature_extractor.feature_size != num_mel_bins:
                raise ValueError(
                    f"preprocessor_config.json: expected feature_size {num_mel_bins} (the model's num_mel_bins), "
                    f"got {feature_extractor.feature_size}"
                )
            if feature_extractor.nb_max_frames > self.max_frames:
                raise ValueError(
                    f"preprocessor_config.json: expected windows of at most {self.max_frames} frames "
                    f"(2 * max_source_positions), got {feature_extractor.nb_max_frames}"
                )

    @classmethod
    def from_folder(cls, config, folder: Path | None) -> LogMelInput:
        """The front end of a checkpoint folder: its feature extractor when the folder has a
        `preprocessor_config.json`, else none (features only)."""
        extractor = None
        if folder is not None and (folder / "preprocessor_config.json").is_file():
            from transformers import WhisperFeatureExtractor

            extractor = WhisperFeatureExtractor.from_pretrained(folder)
        return cls(config.num_mel_bins, config.max_source_positions, extractor)

    @property
    def sampling_rate(self) -> int | None:
        """The waveforms' sampling rate in Hz (None: no feature extractor, no audio)."""
        return None if self.feature_extractor is None else self.feature_extractor.sampling_rate

    @staticmethod
    def num_positions(num_frames: int) -> int:
        return encoder_len(num_frames)

    def features(self, prompt: dict) -> torch.Tensor:
        """The float32 CPU features `[num_mel_bins, frames]` (a copy) of an encoder prompt
        `{"input_features": [num_mel_bins, frames] or [1, num_mel_bins, frames]}` (a tensor or
        an array) or `{"audio": (waveform [samples], sampling_rate)}`. Raises ValueError saying
        what was expected."""
        if "input_features" in prompt:
            return self._checked(prompt["input_features"])
        return self._checked(self._extract(prompt["audio"]))

    def _checked(self, features) -> torch.Tensor:
        if not isinstance(features, (torch.Tensor, np.ndarray)):
            raise ValueError(f"expected input_features as a tensor or an array, got {type(features).__name__}")
        x = torch.as_tensor(features).detach()
        if not x.is_floating_point():
            raise ValueError(f"expected floating-point input_features, got {x.dtype}")
        if x.dim() == 3 and x.shape[0] == 1:  # a feature extractor's batch of one
            x = x[0]
        if x.dim() != 2 or x.shape[0] != self.num_mel_bins or x.shape[1] == 0:
            raise ValueError(
                f"expected input_features of shape [{self.num_mel_bins} mel bins, frames], got {list(x.shape)}"
            )
        if x.shape[1] > self.max_frames:
            raise ValueError(
                f"expected at most {self.max_frames} frames of input_features (the encoder's "
                f"{self.max_frames // CONV_STRIDE} positions), got {x.shape[1]}"
            )
        x = x.to("cpu", torch.float32, copy=True).contiguous()
        if not torch.isfinite(x).all():
            raise ValueError("expected finite input_features, got NaN or infinite values")
        return x

    def _extract(self, audio) -> np.ndarray:
        fe = self.feature_extractor
        if fe is None:
            raise ValueError(
                "audio needs the model folder's preprocessor_config.json (WhisperFeatureExtractor), found none; "
                "pass {'input_features': ...} instead"
            )
        if not isinstance(audio, (tuple, list)) or len(audio) != 2:
            raise ValueError(f"expected audio as (waveform, sampling_rate), got {type(audio).__name__}")
        waveform, rate = audio
        if rate != fe.sampling_rate:
            raise ValueError(f"expected audio sampled at {fe.sampling_rate} Hz (it is not resampled), got {rate!r} Hz")
        try:
            wave = np.asarray(waveform, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"expected a waveform of numbers, got {type(waveform).__name__}") from None
        if wave.ndim != 1 or wave.size == 0:
            raise ValueError(f"expected a non-empty mono waveform [samples], got shape {list(wave.shape)}")
        if wave.size > fe.n_samples:
            raise ValueError(
                f"expected audio of at most {fe.n_samples / rate:g} s ({fe.n_samples} samples, one window), "
                f"got {wave.size / rate:g} s"
            )
        if not np.isfinite(wave).all():
            raise ValueError("expected a finite waveform, got NaN or infinite samples")
        return fe(wave, sampling_rate=rate, return_tensors="np")["input_features"][0]


class WhisperAttention(nn.Module):
    """Self-attention (ENCODER, or DECODER through its cache) or cross-attention over the
    encoder output (ENCODER_DECODER, K/V in the cross pool). The query is scaled before the
    product, as transformers does; `attn` is built with scale 1."""

    def __init__(self, d_model: int, num_heads: int, attn: Attention, cross: bool) -> None:
        super().__init__()
        self.scaling = (d_model // num_heads) ** -0.5
        self.cross = cross
        if cross:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = ColumnParallelLinear(d_model, (d_model, d_model), bias=True)  # k's bias shard stays 0
        else:
            self.qkv_proj = ColumnParallelLinear(d_model, (d_model, d_model, d_model), bias=True)
        self.out_proj = nn.Linear(d_model, d_model)
        self.attn = attn

    def forward(self, x: torch.Tensor, encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, d_model]; cross-attention's encoder_hidden: [Te, d_model] when the step ran the
        encoder (its K/V are written to the cross pool), else None (read from it) -> [T, d_model]."""
        if not self.cross:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(x), None, None
            if encoder_hidden is not None:
                k, v = self.kv_proj(encoder_hidden).chunk(2, dim=-1)
        return self.out_proj(self.attn(q * self.scaling, k, v))


class WhisperEncoderLayer(nn.Module):
    """Pre-norm: h + self_attn(norm(h)), then h + fc2(act(fc1(norm(h))))."""

    def __init__(self, config, attn: Attention, num_heads: int, ffn_dim: int) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn = WhisperAttention(d, num_heads, attn, cross=False)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d)
        self.activation = activation_of(config)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [Te, d_model] -> [Te, d_model]."""
        h = h + self.self_attn(self.self_attn_layer_norm(h))
        h = self.feed_forward(h)
        if h.dtype == torch.float16:  # transformers clamps the encoder's float16 activations
            limit = torch.finfo(h.dtype).max - 1000
            h = h.clamp(-limit, limit)
        return h

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(self.activation(self.fc1(self.final_layer_norm(h))))


class WhisperDecoderLayer(WhisperEncoderLayer):
    """An encoder layer with pre-norm cross-attention between self-attention and the feed-forward."""

    def __init__(self, config, self_attn: Attention, cross_attn: Attention) -> None:
        heads = config.decoder_attention_heads
        super().__init__(config, self_attn, heads, config.decoder_ffn_dim)
        self.encoder_attn = WhisperAttention(config.d_model, heads, cross_attn, cross=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, h: torch.Tensor, encoder_hidden: torch.Tensor | None) -> torch.Tensor:
        """h: [T, d_model]; encoder_hidden: [Te, d_model] or None -> [T, d_model]."""
        h = h + self.self_attn(self.self_attn_layer_norm(h))
        h = h + self.encoder_attn(self.encoder_attn_layer_norm(h), encoder_hidden)
        return self.feed_forward(h)


class WhisperEncoder(nn.Module):
    def __init__(self, config, attns: list[Attention]) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=CONV_STRIDE, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)  # the checkpoint's sinusoids
        self.layers = nn.ModuleList(
            WhisperEncoderLayer(config, a, config.encoder_attention_heads, config.encoder_ffn_dim) for a in attns
        )
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        """features: each prefill's float [num_mel_bins, frames_i] (any float dtype, on the
        model's device); positions: int64 [Te], 0..encoder_len(frames_i)-1 for each in turn
        -> encoder output [Te, d_model]."""
        dtype = self.conv1.weight.dtype
        # Per request: a convolution must not run across two requests' frames.
        embeds = [F.gelu(self.conv2(F.gelu(self.conv1(f.to(dtype).unsqueeze(0)))))[0].T for f in features]
        h = torch.cat(embeds)
        if h.shape[0] != positions.shape[0]:
            raise ValueError(f"expected {h.shape[0]} encoder positions for these features, got {positions.shape[0]}")
        h = h + self.embed_positions(positions)
        for layer in self.layers:
            h = layer(h)
        return self.layer_norm(h)


class WhisperDecoder(nn.Module):
    def __init__(self, config, self_attns: list[Attention], cross_attns: list[Attention]) -> None:
        super().__init__()
        d = config.d_model
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions = nn.Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(WhisperDecoderLayer(config, s, c) for s, c in zip(self_attns, cross_attns))
        self.layer_norm = nn.LayerNorm(d)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, encoder_hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """Decoder tokens int64 [T] each; encoder_hidden [Te, d_model] or None -> [T, d_model]."""
        h = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            h = layer(h, encoder_hidden)
        return self.layer_norm(h)


class WhisperModel(nn.Module):
    def __init__(self, config, *, attention_backend: str, kv_cache_dtype: str) -> None:
        super().__init__()
        d, n_dec = config.d_model, config.decoder_layers
        if d % config.decoder_attention_heads or d % config.encoder_attention_heads:
            raise ValueError(
                f"expected d_model ({d}) divisible by the attention heads, got {config.encoder_attention_heads} "
                f"(encoder) and {config.decoder_attention_heads} (decoder)"
            )

        def attention(num_heads: int, layer_idx: int, attn_type: AttentionType, cache_dtype: str) -> Attention:
            # Scale 1: WhisperAttention scales the query itself.
            return Attention(num_heads, d // num_heads, 1.0, backend=attention_backend, layer_idx=layer_idx,
                             attn_type=attn_type, kv_cache_dtype=cache_dtype)

        # Cache indices as BART's: decoder self-attention 0..n-1, cross-attention n..2n-1.
        heads = config.decoder_attention_heads
        enc = [attention(config.encoder_attention_heads, 0, AttentionType.ENCODER, "auto")
               for _ in range(config.encoder_layers)]
        dec = [attention(heads, i, AttentionType.DECODER, kv_cache_dtype) for i in range(n_dec)]
        cross = [attention(heads, n_dec + i, AttentionType.ENCODER_DECODER, kv_cache_dtype) for i in range(n_dec)]
        self.encoder = WhisperEncoder(config, enc)
        self.decoder = WhisperDecoder(config, dec, cross)


class WhisperForConditionalGeneration(nn.Module):
    """Whisper over a flattened batch: run it inside `pagedattn.forward_context(md, kv_caches)`
    with the decoder layers' caches then the cross layers' (`spec_fields` says how many)."""

    def __init__(self, config, *, attention_backend: str = "auto", kv_cache_dtype: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.model = WhisperModel(config, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype)
        self.proj_out = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.proj_out.weight = self.model.decoder.embed_tokens.weight

    @staticmethod
    def spec_fields(config) -> dict:
        """ModelSpec fields in Whisper's config names: the decoder's geometry, the encoder's
        positions as its maximum length."""
        return encoder_decoder_spec_fields(config, max_model_len=config.max_target_positions, max_encoder_len=config.max_source_positions)

    @staticmethod
    def audio_input(config, folder: Path | None) -> LogMelInput:
        """The request side of the encoder (see `LogMelInput.from_folder`)."""
        return LogMelInput.from_folder(config, folder)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_features: list[torch.Tensor] | None = None,
        encoder_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: the decoder's int64 [T]; encoder_features: the log-mel
        features [num_mel_bins, frames_i] of the step's prefills in the order of the metadata's
        `encoder_seq_start_loc`, and encoder_positions int64 [Te] (0..encoder_len(frames_i)-1
        each), or both None when the step has no prefill -> decoder hidden states [T, d_model]."""
        encoder_hidden = None
        if encoder_features is not None:
            encoder_hidden = self.model.encoder(encoder_features, encoder_positions)
        return self.model.decoder(input_ids, positions, encoder_hidden)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, d_model] -> logits float32 [N, vocab] (into `out` when given)."""
        return float_logits(self.proj_out(hidden), out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: (Hugging Face name, tensor) pairs, e.g. `model.encoder.conv1.weight`. Tied:
        a saved `proj_out.weight` (a copy of the token embeddings) is skipped."""
        ignore = ["proj_out.weight"] if self.config.tie_word_embeddings else []
        load_weights(self, _with_zero_k_bias(weights), ENCODER_DECODER_STACKED, ignore)


def _with_zero_k_bias(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, and a zero bias after every `k_proj.weight`: Whisper's k_proj
    has none, and its shard of our stacked bias must be loaded too."""
    for name, tensor in weights:
        yield name, tensor
        if name.endswith(".k_proj.weight"):
            yield name[: -len("weight")] + "bias", torch.zeros(tensor.shape[0])
