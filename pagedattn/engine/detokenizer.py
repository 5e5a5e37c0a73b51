"""Incremental detokenization: a completion's text grows by the delta of each new token."""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, so the first word keeps its space


class IncrementalDetokenizer:
    """Decodes a window `ids[prefix_offset:]` and emits the text past `ids[prefix_offset:read_offset]`.

    Holding back while the decoded text ends in U+FFFD keeps multi-byte characters that span
    several tokens whole. Special tokens (EOS, ...) are skipped.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
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
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]
