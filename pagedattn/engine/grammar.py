"""Guided decoding's grammars (xgrammar): compiled once per spec, matched per completion, masked per step.

`Grammars` is the engine's compiler, made on the first guided request from the engine's
tokenizer (`TokenizerInfo.from_huggingface`; vocabulary: the model's logits width, stop tokens:
its EOS ids). xgrammar's compiler caches compiled grammars by spec, bounded by
`CACHE_LIMIT_BYTES`, and is safe to call from several threads (the server compiles a request's
spec before queueing it, so a bad schema is a 400 before any stream starts).

Each completion of a guided request holds a `GrammarMatcher` (`Sequence.grammar`): the prompt's
sequence gets one when the engine takes the request, forks (`n`, `best_of`) copy it, and it
accepts every token its completion appends (`OutputProcessor`). Its state follows the
completion's tokens, not the KV cache, so a preempted sequence (recomputed or swapped) keeps it
as it is. Before each draw, `GrammarMask` fills one bitmask row per guided row on the host and
sets the logits of the tokens it does not allow to -inf, on the device, for those rows only.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagedattn.engine.sampling_params import GuidedDecodingParams

CACHE_LIMIT_BYTES = 512 << 20
"""The compiled grammars xgrammar keeps (vLLM's default bound), least recently used dropped first."""

_JSON_OBJECT = '{"type": "object"}'  # OpenAI's json_object format: any JSON object (as vLLM's)


class GrammarError(ValueError):
    """A guided request that cannot run: its spec does not compile, or the model cannot be guided
    (no tokenizer, xgrammar missing). The engine fails that request with it."""


class Grammars:
    """Compiles `GuidedDecodingParams` for one model; xgrammar is imported on first use.

    tokenizer: the engine's Hugging Face tokenizer (None: no request can be guided);
    vocab_size: the model's logits width; eos_token_ids: the tokens that end a grammar's text.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._compiler = None
        self._error: str | None = None  # why no compiler can be made, once known

    def compile(self, spec: GuidedDecodingParams):
        """`spec`'s xgrammar `CompiledGrammar` (from the compiler's cache when it was compiled
        before); `GrammarError` saying why when it cannot be."""
        compiler = self._get_compiler()
        try:
            return _compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad specs as RuntimeError
            raise GrammarError(f"xgrammar cannot compile the guided decoding {spec.kind}: {_reason(e)}") from None

    def matcher(self, spec: GuidedDecodingParams):
        """A new xgrammar `GrammarMatcher` of `spec` at the start of the text; `GrammarError`."""
        compiled = self.compile(spec)
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None and self._error is None:
                self._error = self._make_compiler()
            if self._error is not None:
                raise GrammarError(self._error)
            return self._compiler

    def _make_compiler(self) -> str | None:
        """Make the compiler; the reason when it cannot be made."""
        if self.tokenizer is None:
            return "guided decoding needs the model's tokenizer; this model has none"
        try:
            import xgrammar
        except ImportError:
            return "guided decoding needs xgrammar, which is not installed: pip install 'pagedattn[guided]'"
        try:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
            )
        except Exception as e:  # noqa: BLE001 - any tokenizer xgrammar cannot read: no request is guided
            return f"xgrammar cannot read this model's tokenizer: {type(e).__name__}: {_reason(e)}"
        self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
        return None


def _compile(compiler, spec: GuidedDecodingParams):
    kind = spec.kind
    any_whitespace = not spec.disable_any_whitespace
    if kind == "json":
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_json_schema(_JSON_OBJECT, any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":  # JSON's string escapes are EBNF's
        literals = (json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return compiler.compile_grammar("root ::= " + " | ".join(literals))
    if kind == "grammar":  # vLLM's rule: a grammar without "::=" is Lark's
        return compiler.compile_grammar(spec.grammar) if "::=" in spec.grammar else compiler.compile_lark(spec.grammar)
    tag = spec.structural_tag
    return compiler.compile_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[10:02:03] /project/cpp/x.cc:12: ...")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
    text = re.sub(r"^Check failed: .*? is false: ", "", text)
    return text[:500]


@dataclass
class GrammarMask:
    """The tokens a step's guided rows may draw next.

    bitmask: int32 [rows[-1] + 1, ceil(vocab_size / 32)] on the device, row r for the batch's
        row r (xgrammar's layout: bit j of a row set = token j allowed); rows that are not
        guided are all ones and never read.
    rows: the guided rows of the batch, ascending.
    """

    bitmask: torch.Tensor
    rows: list[int]
    vocab_size: int

    @classmethod
    def build(cls, matchers: list[tuple[int, object]], vocab_size: int, device: torch.device) -> GrammarMask:
        """matchers: (batch row, its completion's `GrammarMatcher`), rows ascending. One host
        fill per row and one copy (from pinned memory on CUDA, so the host does not wait)."""
        import xgrammar

        rows = [r for r, _ in matchers]
        width = xgrammar.get_bitmask_shape(1, vocab_size)[1]
        host = torch.full((rows[-1] + 1, width), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        for r, matcher in matchers:
            matcher.fill_next_token_bitmask(host, r)
        return cls(host.to(device, non_blocking=True), rows, vocab_size)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the disallowed tokens of the guided rows of logits float32 [R, V] to -inf, in place."""
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=self.vocab_size, indices=self.rows)
