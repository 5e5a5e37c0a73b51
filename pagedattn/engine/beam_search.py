"""One beam-search step of a group, scored like transformers' `generate(num_beams=W)`.

Candidates are the top `K = max(2, 1 + number of EOS ids) * W` continuations of all live beams
by summed log-probability. A candidate that ends (EOS, max_tokens or the context) becomes a
finished hypothesis when it ranks among the first W, scored `sum_logprobs / generated_len **
length_penalty`; the best W unfinished candidates continue. With `early_stopping=False`
the search ends once W hypotheses are finished and the best live beam, scored at the current
length, cannot beat the worst of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.engine.sequence import BeamHypothesis, Sequence

LENGTH_PENALTY = 1.0


@dataclass
class BeamStep:
    """The outcome of one step: new live beams as (parent index, token, cumulative logprob),
    best first, and whether the search is over."""

    continuations: list[tuple[int, int, float]]
    done: bool


def beam_step(
    beams: list[Sequence],
    logprobs: torch.Tensor,
    hypotheses: list[BeamHypothesis],
    *,
    width: int,
    eos_token_ids: frozenset[int],
    max_tokens: int,
    max_model_len: int,
) -> BeamStep:
    """Advance `beams` (live, best first) given their next-token `logprobs` float32 [len(beams), V].

    Appends newly finished hypotheses to `hypotheses` (kept sorted best first, at most `width`).
    """
    vocab = logprobs.shape[1]
    scores = torch.tensor([b.cumulative_logprob for b in beams], dtype=torch.float32, device=logprobs.device)
    total = (logprobs + scores.unsqueeze(1)).reshape(-1)  # [beams * V]
    k = min(max(2, 1 + len(eos_token_ids)) * width, total.numel())
    top_scores, top_index = total.topk(k)
    generated = beams[0].num_output_tokens + 1  # every live beam has generated the same number
    out_of_room = generated >= max_tokens or beams[0].num_prompt_tokens + generated >= max_model_len
    continuations: list[tuple[int, int, float]] = []
    for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_index.tolist())):
        parent, token = divmod(index, vocab)
        is_eos = token in eos_token_ids
        if is_eos or out_of_room:
            if rank < width:
                hypotheses.append(
                    BeamHypothesis(
                        score=score / generated**LENGTH_PENALTY,
                        token_ids=beams[parent].output_token_ids + [token],
                        cumulative_logprob=score,
                        finish_reason="stop" if is_eos else "length",
                    )
                )
        elif len(continuations) < width:
            continuations.append((parent, token, score))
    hypotheses.sort(key=lambda h: h.score, reverse=True)
    del hypotheses[width:]
    if not continuations:
        return BeamStep(continuations, done=True)
    best_possible = continuations[0][2] / generated**LENGTH_PENALTY
    done = len(hypotheses) == width and best_possible <= hypotheses[-1].score
    return BeamStep(continuations, done)
