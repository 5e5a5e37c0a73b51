"""The engine's log-probabilities (per position `{token id: Logprob}`, the position's own token
first, then the most likely ones) in OpenAI's shapes, as vLLM writes them:

- completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where a position's
  `top_logprobs` maps the token text of its `logprobs` most likely tokens and of its own token
  (up to `logprobs + 1` entries, OpenAI's rule) to their log-probabilities, and `text_offset` is
  where each token's text starts (the sum of the earlier tokens' text lengths). A position
  nothing predicts (a prompt's first token, with `echo`) has None for both.
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`,
  `top_logprobs` being the `top_logprobs` most likely tokens, best first.
Log-probabilities of -inf are written as -9999.0 (JSON has no infinity; OpenAI's value).
"""

from __future__ import annotations

from collections.abc import Callable

MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _token_text(token_id: int, lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _best(position: dict, k: int) -> list[tuple[int, object]]:
    """The `k` most likely (token id, Logprob) of a position, best first."""
    return sorted(position.items(), key=lambda item: (item[1].rank is None, item[1].rank, -item[1].logprob))[:k]


class CompletionLogprobs:
    """Completions' `logprobs` object, built over one or more calls (a stream's chunks):
    `add(token_ids, positions)` returns the object for those tokens, continuing the text offsets.
    `decode`: a token's text, for positions without a `Logprob` (a prompt's first token)."""

    def __init__(self, num: int, decode: Callable[[int], str]):
        self.num = num
        self.decode = decode
        self.offset = 0

    def add(self, token_ids: list[int], positions: list[dict | None]) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, position in zip(token_ids, positions):
            if position is None:
                text, logprob, best = self.decode(token_id), None, None
            else:
                own = position[token_id]
                text, logprob = _token_text(token_id, own), _logprob(own.logprob)
                best = {_token_text(t, lp): _logprob(lp.logprob) for t, lp in _best(position, self.num)}
                best.setdefault(text, logprob)
            tokens.append(text)
            token_logprobs.append(logprob)
            top.append(best)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], positions: list[dict], top: int) -> list[dict]:
    """Chat's `logprobs.content` entries of `token_ids`."""
    content = []
    for token_id, position in zip(token_ids, positions):
        own = position[token_id]
        text = _token_text(token_id, own)
        content.append({
            "token": text, "logprob": _logprob(own.logprob), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t_text := _token_text(t, lp)), "logprob": _logprob(lp.logprob),
                 "bytes": list(t_text.encode("utf-8"))}
                for t, lp in _best(position, top)
            ],
        })
    return content


def prompt_logprobs_json(positions: list[dict | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or
    `{token id: {"logprob", "rank", "decoded_token"}}`."""
    if positions is None:
        return None
    return [None if position is None else
            {str(t): {"logprob": _logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in position.items()}
            for position in positions]
