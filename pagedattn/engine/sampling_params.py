"""Per-request generation options, validated at construction."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

GREEDY_EPS = 1e-5  # a temperature below it is greedy
# Options beam search cannot honour, with their neutral values (after normalisation).
_BEAM_NEUTRAL = {"stop_token_ids": [], "min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                 "repetition_penalty": 1.0, "min_p": 0.0, "logit_bias": None, "logprobs": None}


@dataclass
class GuidedDecodingParams:
    """What a completion's text must match (vLLM's guided decoding, through xgrammar). Exactly
    one of:

    json: a JSON schema (a dict, or its JSON text): the text is one JSON value valid under it.
    json_object: True: the text is one JSON object (any; OpenAI's `json_object` format).
    regex: the text matches this regular expression (xgrammar's syntax: ECMAScript-like).
    choice: the text is exactly one of these strings.
    grammar: the text is a sentence of this context-free grammar: xgrammar's EBNF (GBNF, rules
        `name ::= ...`, starting at `root`), or Lark's syntax when it has no `::=` (as vLLM).
    structural_tag: an xgrammar structural tag (its JSON text or a dict), e.g. tool calls.

    backend: None, "auto" or "xgrammar" (the only one). disable_any_whitespace: JSON with xgrammar's
    fixed separators (", " and ": ") instead of any whitespace between tokens.
    Whether a schema or grammar compiles is known when the engine takes the request: one that
    does not fails that request (finish_reason "error"), not the engine.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict | None = None
    backend: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [name for name in _GUIDE_KINDS if _is_set(getattr(self, name))]
        if len(kinds) != 1:
            raise ValueError(f"expected exactly one of {', '.join(_GUIDE_KINDS)} in guided decoding, got "
                             f"{', '.join(kinds) if kinds else 'none'}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    json.loads(value)
                except ValueError as e:
                    raise ValueError(
                        f"expected {name} to be a dict or its JSON text, got text that is not JSON: {e}"
                    ) from None
            elif value is not None and not isinstance(value, dict):
                raise ValueError(f"expected {name} to be a dict or its JSON text, got {type(value).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"expected {name} to be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not hasattr(self.choice, "__iter__"):
                raise ValueError(f"expected choice to be a list of strings, got {self.choice!r:.80}")
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    f"expected choice to be a non-empty list of non-empty strings, got {self.choice!r:.80}"
                )
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be a bool, got {getattr(self, name)!r}")
        if self.backend not in (None, "xgrammar", "auto"):
            raise ValueError(
                f"expected guided decoding backend None or 'xgrammar' (the only one), got {self.backend!r}"
            )

    @property
    def kind(self) -> str:
        """The field that is set: "json", "json_object", "regex", "choice", "grammar" or "structural_tag"."""
        return next(name for name in _GUIDE_KINDS if _is_set(getattr(self, name)))


_GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def _is_set(value) -> bool:
    return value is not None and value is not False


@dataclass
class SamplingParams:
    """How to generate one request's completions.

    temperature: 0 is greedy; otherwise logits are divided by it before top-k/top-p sampling.
    top_k: -1 (or 0) keeps every token; top_p: nucleus mass in (0, 1].
    n: completions returned; best_of: completions generated (>= n), the n with the highest
        cumulative log-probability are returned.
    seed: a per-request torch.Generator seed (each completion i draws from its own stream),
        so sampling is reproducible whatever the batch around it.
    stop: strings that end a completion (excluded from its text).
    stop_token_ids: token ids that end a completion, as EOS does: the token is kept in
        `token_ids`, its text is left out of `text` (vLLM's `include_stop_str_in_output=False`).
    min_tokens: EOS (unless `ignore_eos`) and `stop_token_ids` are masked until this many tokens
        were generated, and stop strings only count in the text of later tokens (as vLLM V1).
    presence_penalty, frequency_penalty: in [-2, 2], over the completion's generated tokens
        (OpenAI's): logit -= frequency_penalty * count + presence_penalty * (count > 0).
    repetition_penalty: > 0, over the prompt's and the generated tokens (transformers' / vLLM's):
        a positive logit of a token seen is divided by it, a negative one multiplied.
    min_p: in [0, 1]: after temperature, tokens with probability < min_p * the largest are dropped.
    logit_bias: {token id: bias}, added to the logits first (after a guided mask); biases are clamped to
        [-100, 100] (as vLLM), keys may be ints or decimal strings (JSON's).
    logprobs: per generated token, return {token id: Logprob} of the drawn token and the
        `logprobs` most likely ones (-1: the whole vocabulary); prompt_logprobs: the same for each
        prompt token but the first (None). Log-probabilities are the model's (log_softmax of the
        logits before bias, penalties and temperature; after a guided mask), as `cumulative_logprob`
        and vLLM's default.
        Prompt logprobs need every prompt position computed: such requests never read the prefix
        cache (as vLLM).
    guided_decoding: a `GuidedDecodingParams`: each completion's text must match it (its own
        grammar state per completion, `n`/`best_of` included). Tokens the grammar does not allow
        next are masked (-inf) before anything else, so log-probabilities of guided requests are
        over the allowed tokens (as vLLM V1's). When the grammar ends it allows only EOS, and
        the EOS ends the completion (finish_reason "stop") even with `ignore_eos`; if `min_tokens`
        masks that EOS, the completion ends there all the same. Steps holding guided rows are
        never run ahead (async scheduling) or several at once (multi-step): each mask needs the
        token before it.
    Processing order (vLLM V1's): the guided mask, logit_bias, the min_tokens mask, penalties, then
    greedy argmax, or temperature, min_p, top-k/top-p and a draw.
    use_beam_search: beam search of width `best_of or n`, scored like transformers'
        `num_beams` search (log-probabilities summed, divided by the number of generated tokens,
        `length_penalty=1.0`, `early_stopping=False`) over unscaled log-probabilities; it is
        deterministic, so top_k/top_p/seed are refused and temperature is not applied;
        stop strings are not supported with it, nor are stop_token_ids, min_tokens, penalties,
        min_p, logit_bias, logprobs (prompt_logprobs are) and guided decoding.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    use_beam_search: bool = False
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, self.n)
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"expected temperature >= 0 (a finite number), got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"expected 0 < top_p <= 1, got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"expected top_k == -1 (all tokens) or top_k >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"expected seed to be an int or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"expected stop to be a non-empty string or a list of them, got {self.stop!r}")
        for name in ("ignore_eos", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be a bool, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2 <= value <= 2:
                raise ValueError(f"expected -2 <= {name} <= 2, got {value!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"expected repetition_penalty > 0 (a finite number), got {self.repetition_penalty!r}")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"expected 0 <= min_p <= 1, got {self.min_p!r}")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"expected min_tokens <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < -1):
                raise ValueError(f"expected {name} to be None, -1 (the whole vocabulary) or an int >= 0, got {value!r}")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError(f"expected guided_decoding to be a GuidedDecodingParams or None, got "
                             f"{type(self.guided_decoding).__name__}")
        if self.use_beam_search:
            if self.guided_decoding is not None:
                raise ValueError(
                    f"expected guided_decoding=None with use_beam_search (beams are scored on the model's whole "
                    f"next-token distribution and fork every step; guided beams are not supported), got "
                    f"guided_decoding with {self.guided_decoding.kind}"
                )
            if self.top_k not in (-1, 0) or self.top_p != 1.0:
                raise ValueError(
                    f"expected top_k=-1 and top_p=1.0 with use_beam_search (beam search is deterministic), "
                    f"got top_k={self.top_k}, top_p={self.top_p}"
                )
            if self.stop:
                raise ValueError(f"expected stop=None with use_beam_search (not supported), got {self.stop}")
            if self.seed is not None:
                raise ValueError(f"expected seed=None with use_beam_search (beam search is deterministic), got {self.seed}")
            # Beams are scored on the model's unscaled log-probabilities and stop on EOS only.
            used = [name for name, neutral in _BEAM_NEUTRAL.items() if getattr(self, name) != neutral]
            if used:
                raise ValueError(
                    f"expected {', '.join(f'{n}={_BEAM_NEUTRAL[n]!r}' for n in used)} with use_beam_search "
                    f"(beams are scored on the model's unscaled log-probabilities and end on EOS only), got "
                    + ", ".join(f"{n}={getattr(self, n)!r}" for n in used)
                )
        if self.top_k == 0:
            self.top_k = -1

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    def vocab_error(self, vocab_size: int) -> str | None:
        """Why these options cannot run on a model of `vocab_size` tokens (the engine fails the
        request with it), or None."""
        for name, ids in (("logit_bias", list(self.logit_bias or ())), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                return f"expected {name} token ids in [0, {vocab_size}), got {bad[:5]}"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                return f"expected {name} <= the vocabulary size ({vocab_size}) or -1, got {value}"
        return None

    @property
    def width(self) -> int:
        """Sequences generated: the beam width, or `best_of` samples."""
        return self.best_of if self.best_of is not None else self.n


def _is_finite(x) -> bool:
    """A real number that is neither NaN nor infinite (NaN compares False, so it would pass
    every range check and act as greedy)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"expected {name} to be an int >= {low}, got {value!r}")


def _token_ids(name: str, ids) -> list[int]:
    """`ids` as a list of distinct token ids (ints >= 0), in order; None is []."""
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"expected {name} to be a list of token ids, got {ids!r:.80}")
    ids = list(ids)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"expected {name} to hold token ids (ints >= 0), got {t!r}")
    return list(dict.fromkeys(ids))


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias clamped to [-100, 100]}; keys may be decimal strings (JSON objects have no int keys)."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"expected logit_bias to be a dict of token id -> bias, got {bias!r:.80}")
    out = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str):
            try:
                token = int(key)
            except ValueError:
                token = None
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"expected logit_bias keys to be token ids (ints >= 0), got {key!r}")
        if not _is_finite(value):
            raise ValueError(f"expected logit_bias values to be finite numbers, got {value!r} for token {token}")
        out[token] = min(100.0, max(-100.0, float(value)))
    return out or None
