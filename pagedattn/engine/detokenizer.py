"""Incremental detokenization: a completion's text grows by the delta of each new token."""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, so the first word keeps its space


def decoder(tokenizer):
    """`ids -> text` without special tokens, as `tokenizer.decode` gives it. A fast tokenizer
    that cleans up no spaces is decoded by its Rust tokenizer directly: transformers' wrapper
    around it cost ~85% of the engine's detokenization time (two decodes per token), for the
    same text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Decodes a window `ids[prefix_offset:]` and emits the text past `ids[prefix_offset:read_offset]`.

    Holding back while the decoded text ends in U+FFFD keeps multi-byte characters that span
    several tokens whole. Special tokens (EOS, ...) are skipped.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self._decode = decoder(tokenizer)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append a token; returns the text it completes (possibly empty)."""
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a completion: emit what was held back, incomplete characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]
