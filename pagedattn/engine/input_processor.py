"""Before a request is queued: its prompt as token ids, checked, and its `SequenceGroup`.

A request that can never run (an empty prompt, ids that are not ints or not in the
vocabulary, a prompt longer than the context, more sequences than a step holds) is not
raised: it becomes a group finished with finish_reason "error", so the others go on.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch

from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.sequence import Sequence, SequenceGroup, SeqStatus

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
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.device = device
        self.seq_ids = seq_ids

    def make_group(self, prompt: str | list[int], params: SamplingParams, request_id: str, index: int) -> SequenceGroup:
        """The request's group: WAITING, or FINISHED with `group.error` set when it cannot run."""
        text, token_ids, error = self._tokenize(prompt)
        if error is None:
            error = self._check(token_ids, params)
        seq = Sequence(next(self.seq_ids), token_ids, self.block_size)
        group = SequenceGroup(request_id, text, token_ids, params, [seq], index)
        if error is not None:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = "error"
            group.error = error
            return group
        group.generators = self._generators(params)
        seq.generator = group.generators[0]
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids)
        return group

    def _tokenize(self, prompt) -> tuple[str | None, list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return prompt, [], "a text prompt needs a tokenizer; this model has none (pass token ids)"
            return prompt, list(self.tokenizer.encode(prompt)), None
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
        return None

    def _generators(self, params: SamplingParams) -> list[torch.Generator | None]:
        if params.seed is None:
            return [None] * params.width
        return [
            torch.Generator(device=self.device).manual_seed((params.seed + k * _SEED_STRIDE) % 2**64)
            for k in range(params.width)
        ]


def _token_id(t) -> int | None:
    """`t` as a token id if it is an integer (int, NumPy or 0-dim torch integer), else None:
    a float or a bool is refused, never truncated."""
    if isinstance(t, bool) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None
