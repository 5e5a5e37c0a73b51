"""Log-probabilities to return (`SamplingParams.logprobs`, `prompt_logprobs`): the model's
log_softmax of raw logits (before bias, penalties, temperature), as vLLM's default
`raw_logprobs`. On the device: each row's token, its log-probability and rank, and the row's
top-k; on the host (`TokenLogprobs`), the `{token id: Logprob}` dict of one position.

A rank counts the tokens at least as likely as the token (vLLM's), so the most likely is 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedattn.engine.outputs import Logprob


@dataclass
class TopLogprobs:
    """Device tensors of L positions: ids int64 [L, K] and logprobs float32 [L, K], the K most
    likely tokens, best first; token_logprobs float32 [L] and ranks int64 [L], those of the
    position's own token (drawn or, for a prompt, the next prompt token)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    token_logprobs: torch.Tensor
    ranks: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> TopLogprobs:
        """logits: float32 [L, V] raw; tokens: int64 [L]; k: 0 <= k <= V."""
        logprobs = torch.log_softmax(logits, dim=-1)
        token_logprobs = logprobs.gather(1, tokens.unsqueeze(1))  # [L, 1]
        ranks = (logprobs >= token_logprobs).sum(dim=-1)
        values, ids = logprobs.topk(k, dim=-1)
        return cls(ids, values, token_logprobs.squeeze(1), ranks)

    @classmethod
    def cat(cls, parts: list[TopLogprobs]) -> TopLogprobs:
        if len(parts) == 1:
            return parts[0]
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("ids", "logprobs", "token_logprobs", "ranks")))

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids, self.logprobs, self.token_logprobs, self.ranks]


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities on the host: its token's, then its top ids / logprobs."""

    token: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]

    def to_dict(self, decode: Callable[[int], str | None]) -> dict[int, Logprob]:
        """{token: Logprob} with the position's own token first, then the top ones (ranks 1..k)."""
        out = {self.token: Logprob(self.logprob, self.rank, decode(self.token))}
        for rank, (t, lp) in enumerate(zip(self.top_ids, self.top_logprobs), 1):
            if t not in out:
                out[t] = Logprob(lp, rank, decode(t))
        return out


def host_rows(tokens: list[int], logprobs: list[float], ranks: list[int], ids: list[list[int]],
              values: list[list[float]], ks: list[int]) -> list[TokenLogprobs]:
    """Host lists of L positions (ids/values [L][K]) as `TokenLogprobs`, row i keeping its ks[i] best."""
    rows = zip(tokens, logprobs, ranks, ids, values, ks)
    return [TokenLogprobs(t, lp, r, i[:k], v[:k]) for t, lp, r, i, v, k in rows]


def num_logprobs(asked: int, vocab_size: int) -> int:
    """The top-k size of a `logprobs`/`prompt_logprobs` value (-1: the whole vocabulary)."""
    return vocab_size if asked == -1 else asked


@dataclass
class PromptPlan:
    """The prompt positions whose log-probabilities a step computes (`SamplingParams.prompt_logprobs`).

    positions: indices into the step's flattened query tokens; targets: the prompt token each
    position predicts (the next one); spans: chunk index -> (start, end) into both lists and the
    request's top-k size. top: the device result over every position, filled by the runner.
    """

    positions: list[int]
    targets: list[int]
    spans: dict[int, tuple[int, int, int]]
    top: TopLogprobs | None = None

    def host_results(self, host: list[torch.Tensor]) -> dict[int, list[TokenLogprobs]]:
        """chunk index -> its positions' `TokenLogprobs`, from the host copies of `top.tensors()`."""
        ids, values, token_logprobs, ranks = (t.tolist() for t in host)
        return {
            i: host_rows(self.targets[a:b], token_logprobs[a:b], ranks[a:b], ids[a:b], values[a:b], [k] * (b - a))
            for i, (a, b, k) in self.spans.items()
        }
