"""Incremental detokenization: a completion's text grows by the delta of each new token."""

from __future__ import annotations

import copy
import functools

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, so the first word keeps its space
_TOKEN_TEXTS = 1 << 16  # one-token texts a `Decoder` keeps (the most recently used)


def decoder(tokenizer):
    """`ids -> text` without special tokens, as `tokenizer.decode` gives it. A fast tokenizer
    that cleans up no spaces is decoded by its Rust tokenizer directly: transformers' wrapper
    around it cost ~85% of the engine's detokenization time (two decodes per token), for the
    same text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class Decoder:
    """A tokenizer's `decoder`, and the text of one token alone, cached. Once a completion's text
    flows, the window before each new token (`IncrementalDetokenizer`) is the one token read
    last: half the decodes are of one token, and a token's text is the same in every sequence.
    One per engine, shared by its sequences' detokenizers."""

    def __init__(self, tokenizer):
        decode = self.decode = decoder(tokenizer)
        self.decode_token = functools.lru_cache(maxsize=_TOKEN_TEXTS)(lambda token_id: decode([token_id]))


class IncrementalDetokenizer:
    """Decodes a window `ids[prefix_offset:]` and emits the text past `ids[prefix_offset:read_offset]`.

    Holding back while the decoded text ends in U+FFFD keeps multi-byte characters that span
    several tokens whole. Special tokens (EOS, ...) are skipped. `decoder`: the engine's shared
    `Decoder` of `tokenizer` (one of its own without).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], decoder: Decoder | None = None):
        self.tokenizer = tokenizer
        self._decoder = decoder if decoder is not None else Decoder(tokenizer)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def fork(self) -> IncrementalDetokenizer:
        """A copy that goes on alone (a forked sequence's), sharing the tokenizer and decoder: a
        deep copy would copy the tokenizer too (its whole vocabulary)."""
        child = copy.copy(self)
        child.ids = list(self.ids)
        return child

    def add(self, token_id: int) -> str:
        """Append a token; returns the text it completes (possibly empty)."""
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a completion: emit what was held back, incomplete characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        # Runs for every generated token of every sequence: locals over attribute reads.
        ids, decoder, prefix_offset, read_offset = self.ids, self._decoder, self.prefix_offset, self.read_offset
        if read_offset - prefix_offset == 1:
            prefix_text = decoder.decode_token(ids[prefix_offset])
        else:
            prefix_text = decoder.decode(ids[prefix_offset:read_offset])
        new_text = decoder.decode(ids[prefix_offset:])
        n = len(prefix_text)
        if len(new_text) <= n or (not final and new_text.endswith("\ufffd")):
            return ""
        delta = new_text[n:]
        self.prefix_offset = read_offset
        self.read_offset = len(ids)
        self.text += delta
        return delta

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]
