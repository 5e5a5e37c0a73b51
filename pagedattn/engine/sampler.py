"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request generators."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.engine.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling options of a step, as device tensors built once.

    temperatures: float32 [R] (0 for greedy rows); top_k: int64 [R] (vocab size when off);
    top_p: float32 [R]; generators: one per row, None to use the engine's default generator.
    An all-greedy batch has no device tensors (None): argmax needs none, and a step spares
    their copies.
    """

    temperatures: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def build(
        cls,
        rows: list[tuple[SamplingParams, torch.Generator | None]],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        temps = [0.0 if p.is_greedy else float(p.temperature) for p, _ in rows]
        top_k = [vocab_size if p.top_k < 1 or p.is_greedy else min(p.top_k, vocab_size) for p, _ in rows]
        top_p = [1.0 if p.is_greedy else float(p.top_p) for p, _ in rows]
        all_greedy = all(t == 0.0 for t in temps)
        tensors = [None, None, None]
        if not all_greedy:
            # One copy of the three rows: from pinned memory on CUDA, so the host does not wait for
            # the steps queued before this one (a pageable copy may).
            flat = torch.tensor([temps, [float(k) for k in top_k], top_p], dtype=torch.float64)
            if device.type == "cuda":
                flat = flat.pin_memory()
            flat = flat.to(device, non_blocking=True)
            tensors = [flat[0].float(), flat[1].long(), flat[2].float()]
        return cls(
            temperatures=tensors[0],
            top_k=tensors[1],
            top_p=tensors[2],
            generators=[g for _, g in rows],
            all_greedy=all_greedy,
            any_top_k=any(k < vocab_size for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
        )


class Sampler:
    """`sample(logits [R, V] float32, batch) -> (token ids int64 [R], logprobs float32 [R])`.

    Sampling draws Exp(1) noise per row from the row's own generator and takes
    argmax(probs / noise), which is a draw from `probs`; so a seeded request gets the same
    tokens whatever else is in the batch. Log-probabilities are the model's (before
    temperature, top-k and top-p), for `cumulative_logprob`.
    """

    def __init__(self, default_generator: torch.Generator):
        self.default_generator = default_generator

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = logits.argmax(dim=-1)  # [R]
        if not batch.all_greedy:
            random = batch.temperatures > 0  # [R]
            scaled = logits / torch.where(random, batch.temperatures, 1.0).unsqueeze(1)
            if batch.any_top_k or batch.any_top_p:
                scaled = _apply_top_k_top_p(scaled, batch.top_k, batch.top_p, batch.any_top_k, batch.any_top_p)
            probs = torch.softmax(scaled, dim=-1)
            noise = torch.empty_like(probs)
            if all(g is None for g in batch.generators):
                noise.exponential_(generator=self.default_generator)
            else:
                for i, g in enumerate(batch.generators):
                    noise[i].exponential_(generator=g or self.default_generator)
            sampled = (probs / noise.clamp_min_(1e-10)).argmax(dim=-1)
            tokens = torch.where(random, sampled, tokens)
        # the chosen tokens' log-probabilities, without a [R, V] log_softmax written and read back
        chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens, chosen - torch.logsumexp(logits, dim=-1)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_k: bool, any_top_p: bool
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. logits: float32 [R, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    if any_top_k:
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)  # [1, V]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if any_top_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [R, V]; the top token always stays
        sorted_logits = sorted_logits.masked_fill(mass_before > top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
