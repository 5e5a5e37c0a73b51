"""Presence, frequency and repetition penalties of a step's rows, on the device.

As vLLM (`apply_penalties`) and OpenAI: the repetition penalty r covers the tokens of the
prompt and of the completion (a positive logit of such a token is divided by r, a negative one
multiplied), then `logit -= frequency * count + presence * (count > 0)` over the completion's
generated tokens only. The counts are built once a step from the sequences' tokens (a
scatter of host ids copied once), so preemption, forks and async scheduling need no state kept
between steps; multi-step decoding adds each draw on the device (`advance`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    """The penalised rows of a step's batch and what each has seen.

    rows: int64 [P], which of the batch's R rows have a penalty; None when every row has one.
    counts: float32 [P, V], each token's count among the row's generated tokens.
    prompt: bool [P, V], the row's prompt tokens; None when no row has a repetition penalty.
    presence, frequency, repetition: float32 [P].
    """

    rows: torch.Tensor | None
    counts: torch.Tensor
    prompt: torch.Tensor | None
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor

    @classmethod
    def build(
        cls,
        rows: torch.Tensor | None,
        generated: tuple[torch.Tensor, torch.Tensor],
        prompt: tuple[torch.Tensor, torch.Tensor] | None,
        factors: torch.Tensor,
        vocab_size: int,
    ) -> Penalties:
        """generated / prompt: (row int64 [N], token id int64 [N]) pairs, rows in [0, P), one per
        token occurrence; factors: float32 [3, P], presence, frequency and repetition."""
        num_rows = factors.shape[1]
        counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=factors.device)
        gen_rows, gen_ids = generated
        counts.index_put_((gen_rows, gen_ids), torch.ones_like(gen_ids, dtype=torch.float32), accumulate=True)
        mask = None
        if prompt is not None:
            mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=factors.device)
            mask[prompt] = True
        return cls(rows, counts, mask, factors[0], factors[1], factors[2])

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise logits float32 [R, V] in place."""
        x = logits if self.rows is None else logits.index_select(0, self.rows)  # [P, V]
        seen = self.counts > 0
        if self.prompt is not None:
            repetition = torch.where(seen | self.prompt, self.repetition.unsqueeze(1), 1.0)
            x = torch.where(x > 0, x / repetition, x * repetition)
        x = x - self.frequency.unsqueeze(1) * self.counts - self.presence.unsqueeze(1) * seen
        if self.rows is None:
            logits.copy_(x)
        else:
            logits.index_copy_(0, self.rows, x)

    def add(self, tokens: torch.Tensor) -> None:
        """Count one more generated token per row: tokens int64 [R], the batch's rows (only the
        penalised ones are read)."""
        if self.rows is not None:
            tokens = tokens.index_select(0, self.rows)
        self.counts.scatter_add_(1, tokens.unsqueeze(1), torch.ones_like(tokens, dtype=torch.float32).unsqueeze(1))
