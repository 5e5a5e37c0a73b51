"""Before a request is queued: its prompt as token ids, checked, and its `SequenceGroup`.

A request's `max_tokens` (and `min_tokens` under it) is clamped to what the context leaves
after its prompt (at least one token). A request that can never run (an empty prompt, ids that
are not ints or not in the vocabulary, options naming tokens outside it or more logprobs than
it has (`SamplingParams.vocab_error`), a prompt longer than the context, more sequences than a
step holds, a guided decoding spec that does not compile) is not raised: it becomes a group
finished with finish_reason "error", so the others go on. A guided request's sequence gets its
grammar matcher here (`Grammars`).

Encoder-decoder models take `{"encoder_prompt": p, "decoder_prompt": q}` (as vLLM does; the
decoder prompt may be left out) or a plain prompt, which is the encoder prompt. Each part is a
string or token ids, except an audio encoder's prompt (Whisper's): `{"input_features":
[num_mel_bins, frames]}` or `{"audio": (waveform, sampling_rate)}`, which the model's
`LogMelInput` checks and turns into features; their length in encoder positions is the
model's rule. The decoder prompt starts with the model's `decoder_start_token_id` (prepended
when it does not; a text decoder prompt is tokenized without special tokens, so no EOS ends it).
Also refused per request: an encoder prompt longer than the model's maximum, an encoder-decoder
model given no encoder prompt, a decoder-only model given one, audio for a text encoder and
text for an audio one, and encoder plus decoder prompts over the step budget (encoder-decoder
prefills are not chunked).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator

import torch

from pagedattn.engine.detokenizer import Decoder, IncrementalDetokenizer
from pagedattn.engine.grammar import GrammarError, Grammars
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.sequence import EncoderFeatures, Sequence, SequenceGroup, SeqStatus

_SEED_STRIDE = 0x9E3779B97F4A7C15  # completion k of a seeded request draws from seed + k * stride


class InputProcessor:
    """Turns (prompt, params) into a `SequenceGroup`; `seq_ids` is the engine's id source."""

    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        block_size: int,
        device: torch.device,
        seq_ids: Iterator[int],
        max_encoder_len: int = 0,
        decoder_start_token_id: int | None = None,
        max_num_batched_tokens: int | None = None,
        audio=None,
        grammars: Grammars,
    ):
        """`max_encoder_len` > 0 makes the model encoder-decoder; its prompts then need
        `decoder_start_token_id`, and `max_num_batched_tokens` bounds encoder + decoder prompt.
        `audio`: an audio encoder's `LogMelInput` (`LoadedModel.audio`), None for text encoders.
        `grammars`: the engine's guided decoding compiler."""
        if max_encoder_len and decoder_start_token_id is None:
            raise ValueError("expected a decoder_start_token_id for an encoder-decoder model, got None")
        self.max_encoder_len = max_encoder_len
        self.audio = audio
        self.decoder_start_token_id = decoder_start_token_id
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tokenizer = tokenizer
        self._decoder = Decoder(tokenizer) if tokenizer is not None else None  # shared by the detokenizers
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.device = device
        self.seq_ids = seq_ids
        self.grammars = grammars

    def make_group(
        self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str, index: int
    ) -> SequenceGroup:
        """The request's group: WAITING, or FINISHED with `group.error` set when it cannot run."""
        encoder_prompt, decoder_prompt, error = self._split(prompt)
        encoder_text, encoder_ids, features = None, None, None
        if error is None and encoder_prompt is not None:
            if self.audio is None:
                encoder_text, encoder_ids, error = self._encoder_tokens(encoder_prompt)
            else:
                features, error = self._encoder_features(encoder_prompt)
        text, token_ids = None, []
        if error is None and encoder_prompt is None:
            text, token_ids, error = self._tokenize(decoder_prompt)
        elif error is None:
            if decoder_prompt is not None:
                text, token_ids, error = self._tokenize(decoder_prompt, add_special_tokens=False)
            if token_ids[:1] != [self.decoder_start_token_id]:
                token_ids.insert(0, self.decoder_start_token_id)
        if error is None:
            error = self._check(token_ids, params)
        if error is None and len(token_ids) + params.max_tokens > self.max_model_len:
            # The context bounds the completion: a request asks no more than it can get, so the
            # pool (which holds one request of the whole context) never runs out under it alone.
            max_tokens = max(1, self.max_model_len - len(token_ids))
            params = dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
        seq = Sequence(next(self.seq_ids), token_ids, self.block_size, tuple(encoder_ids or ()), features)
        if error is None and seq.encoder_len:
            error = self._check_step_budget(seq.encoder_len + len(token_ids))
        if error is None and params.guided_decoding is not None:
            seq.grammar, error = self._grammar(params)
        group = SequenceGroup(
            request_id, text, token_ids, params, [seq], index,
            encoder_prompt=encoder_text, encoder_prompt_token_ids=encoder_ids,
        )
        if error is not None:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = "error"
            group.error = error
            return group
        group.generators = self._generators(params)
        seq.generator = group.generators[0]
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, self._decoder)
        return group

    def _split(self, prompt) -> tuple[object, object, str | None]:
        """(encoder prompt or None, decoder prompt or None, error) of a request's prompt.

        Each prompt, and each side of an encoder-decoder prompt, may also be vLLM's
        `{"prompt": text}` or `{"prompt_token_ids": ids}` (TextPrompt / TokensPrompt)."""
        prompt, error = _unwrap(prompt)
        if error:
            return None, None, error
        if not self.max_encoder_len:
            if isinstance(prompt, dict):
                return None, None, (
                    "expected a prompt string or token ids for this decoder-only model, got an encoder-decoder "
                    f"prompt (keys {sorted(prompt)})"
                )
            return None, prompt, None
        if not isinstance(prompt, dict):
            return prompt, None, None
        unknown = sorted(set(prompt) - {"encoder_prompt", "decoder_prompt"})
        if unknown:
            return None, None, f"expected prompt keys 'encoder_prompt' and 'decoder_prompt', got {unknown}"
        (encoder, error), (decoder, error2) = _unwrap(prompt.get("encoder_prompt")), _unwrap(prompt.get("decoder_prompt"))
        if error or error2:
            return None, None, error or error2
        if encoder is None:
            return None, None, "expected an encoder prompt for this encoder-decoder model, got none"
        return encoder, decoder, None

    def _tokenize(self, prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int], str | None]:
        """(text or None, token ids, error) of a text or token-id prompt."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return prompt, [], "a text prompt needs a tokenizer; this model has none (pass token ids)"
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)), None
        try:
            items = list(prompt)
        except TypeError:
            return None, [], f"expected a prompt string or a list of token ids, got {prompt!r:.80}"
        token_ids = []
        for i, t in enumerate(items):
            token = _token_id(t)
            if token is None:
                return None, [], f"expected token ids to be ints, got {t!r:.40} ({type(t).__name__}) at index {i}"
            token_ids.append(token)
        return None, token_ids, None

    def _check(self, token_ids: list[int], params: SamplingParams) -> str | None:
        if not token_ids:
            return "expected a non-empty prompt, got 0 tokens"
        if len(token_ids) > self.max_model_len:
            return f"prompt of {len(token_ids)} tokens is longer than the model's context of {self.max_model_len} tokens"
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"expected token ids in [0, {self.vocab_size}), got {bad[:5]}"
        if params.width > self.max_num_seqs:
            return f"expected n/best_of <= max_num_seqs ({self.max_num_seqs}), got {params.width}"
        return params.vocab_error(self.vocab_size)

    def _grammar(self, params: SamplingParams):
        """(the grammar matcher of the request's first completion, None) or (None, error)."""
        try:
            return self.grammars.matcher(params.guided_decoding), None
        except GrammarError as e:
            return None, str(e)

    def _encoder_tokens(self, prompt) -> tuple[str | None, list[int], str | None]:
        """(text or None, token ids, error) of a text encoder's prompt."""
        if isinstance(prompt, dict):
            return None, [], (
                "expected a text or token-id encoder prompt for this model (its encoder takes no audio), "
                f"got a dict (keys {sorted(prompt)})"
            )
        text, token_ids, error = self._tokenize(prompt)
        return text, token_ids, error or self._check_encoder(token_ids)

    def _encoder_features(self, prompt) -> tuple[EncoderFeatures | None, str | None]:
        """(features, error) of an audio encoder's prompt."""
        forms = "{'input_features': [num_mel_bins, frames]} or {'audio': (waveform, sampling_rate)}"
        if not isinstance(prompt, dict):
            got = "text" if isinstance(prompt, str) else f"{type(prompt).__name__} {prompt!r:.40}"
            return None, f"expected an audio encoder prompt for this model, {forms}, got {got}"
        if len(prompt) != 1 or not {"input_features", "audio"} >= set(prompt):
            return None, f"expected an audio encoder prompt for this model, {forms}, got keys {sorted(prompt)}"
        try:
            values = self.audio.features(prompt)
        except ValueError as e:
            return None, str(e)
        return EncoderFeatures(values, self.audio.num_positions(values.shape[1])), None

    def _check_encoder(self, token_ids: list[int]) -> str | None:
        if not token_ids:
            return "expected a non-empty encoder prompt, got 0 tokens"
        if len(token_ids) > self.max_encoder_len:
            return (
                f"encoder prompt of {len(token_ids)} tokens is longer than the model's maximum of "
                f"{self.max_encoder_len} tokens"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"expected encoder token ids in [0, {self.vocab_size}), got {bad[:5]}"
        return None

    def _check_step_budget(self, num_tokens: int) -> str | None:
        if self.max_num_batched_tokens is not None and num_tokens > self.max_num_batched_tokens:
            return (
                f"expected encoder + decoder prompt tokens <= max_num_batched_tokens ({self.max_num_batched_tokens}), "
                f"got {num_tokens}: an encoder-decoder prompt runs in one step (it is not chunked)"
            )
        return None

    def _generators(self, params: SamplingParams) -> list[torch.Generator | None]:
        if params.seed is None:
            return [None] * params.width
        return [
            torch.Generator(device=self.device).manual_seed((params.seed + k * _SEED_STRIDE) % 2**64)
            for k in range(params.width)
        ]


_SINGLE_KEYS = {"prompt", "prompt_token_ids"}  # vLLM's TextPrompt / TokensPrompt


def _unwrap(prompt) -> tuple[object, str | None]:
    """(the bare text or token ids, error) of `{"prompt": ...}` / `{"prompt_token_ids": ...}`;
    any other prompt comes back as it is."""
    if not isinstance(prompt, dict) or not prompt or not set(prompt) <= _SINGLE_KEYS:
        return prompt, None  # a bare prompt, or an encoder-decoder / audio dict
    if len(prompt) != 1:
        return None, f"expected one key, 'prompt' or 'prompt_token_ids', got {sorted(prompt)}"
    key, value = next(iter(prompt.items()))
    if key == "prompt" and not isinstance(value, str):
        return None, f"expected 'prompt' to be a string, got {type(value).__name__}"
    if key == "prompt_token_ids" and isinstance(value, str):
        return None, "expected 'prompt_token_ids' to be a list of token ids, got a string"
    return value, None


def _token_id(t) -> int | None:
    """`t` as a token id if it is an integer (int, NumPy or 0-dim torch integer), else None:
    a float or a bool is refused, never truncated."""
    if isinstance(t, bool) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None
