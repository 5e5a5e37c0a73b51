"""A step queued on the device (`LaunchedStep`) and what its draws are once read (`StepResult`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedattn.engine.logprobs import PromptPlan, TokenLogprobs, host_rows
from pagedattn.engine.sampler import Draws, SamplingBatch


@dataclass(frozen=True)
class StepResult:
    """What one model step sampled, indexed like `SchedulerOutput.chunks`.

    tokens[i], logprobs[i]: chunk i's draws, one per entry of `chunk.sampling_rows()` (empty
    for a chunk that is not sampled, and for beams); log-probabilities are the model's, before
    bias, penalties, temperature, min_p, top-k and top-p.
    beam_logprobs: chunk index -> float32 [vocab] log-softmax of a sampled beam chunk's next token.
    top_logprobs[i]: chunk i's draws' `TokenLogprobs` (None for a row that did not ask); None
        when no row of the step asked.
    prompt_logprobs: chunk index -> `TokenLogprobs` of the prompt tokens its positions predict,
        in order, from the first its group has not recorded.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    beam_logprobs: dict[int, torch.Tensor]
    top_logprobs: list[list[TokenLogprobs | None]] | None = None
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


class LaunchedStep:
    """A step whose kernels are queued; `results()` waits for its draws and reads them.

    draws: one `Draws` per model step (several for multi-step decoding) of `batch`'s rows.
    tokens: int64 [R] on the device, the (last) step's draws, which the engine may carry into the
    inputs of a step launched before this one is read; row_of: id(sequence) -> its row in
    `tokens`, for the chunks that draw one token. On CUDA the draws (and log-probabilities asked
    for) go to pinned host memory right behind the sampler, so `results()` waits for this step
    only, not for steps queued after it. `alive()` (tensor parallelism) raises when a worker
    has died: the wait polls it, since the step would never complete.
    """

    def __init__(self, *, results: list[StepResult] | None = None, draws: list[Draws] | None = None,
                 batch: SamplingBatch | None = None, bounds: list[int] | None = None,
                 beam_logprobs: dict[int, torch.Tensor] | None = None, row_of: dict[int, int] | None = None,
                 prompt: PromptPlan | None = None, alive: Callable[[], None] | None = None):
        self._results = results
        self._draws = draws or []
        self._logprob_rows = batch.logprob_rows if batch is not None else ()
        self._logprob_ks = batch.logprob_ks if batch is not None else ()
        self._bounds = bounds or [0]  # chunk i's draws are rows bounds[i]..bounds[i+1]
        self._beam_logprobs = beam_logprobs or {}
        self._prompt = prompt
        self.tokens = self._draws[-1].tokens if self._draws else None
        self.row_of = row_of or {}
        tensors = []
        if self._draws:  # token ids are exact in float64: one copy of ids and log-probabilities
            tensors.append(torch.stack([x for d in self._draws for x in (d.tokens.double(), d.logprobs.double())]))
            tensors += [t for d in self._draws if d.top is not None for t in d.top.tensors()]
        if prompt is not None:
            tensors += prompt.top.tensors()
        self._host = _HostCopy(tensors, alive)

    def results(self) -> list[StepResult]:
        """One `StepResult` per model step (`out.num_steps` of them; none when no chunk ran)."""
        if self._results is None:
            host = self._host.get()
            spans = list(zip(self._bounds, self._bounds[1:]))
            prompt = self._prompt.host_results(host[-4:]) if self._prompt is not None else {}
            pairs = host[0] if self._draws else None  # float64 [2 * steps, R]: step s's ids, then log-probabilities
            self._results = []
            for s in range(max(1, len(self._draws))):  # a step of beams only draws nothing
                tokens, logprobs, top = [], [], None
                if pairs is not None:
                    tokens, logprobs = pairs[2 * s].long().tolist(), pairs[2 * s + 1].tolist()
                if self._logprob_rows:
                    top = self._top(tokens, host[1 + 4 * s : 5 + 4 * s], spans)
                self._results.append(StepResult(
                    tokens=[tokens[a:b] for a, b in spans], logprobs=[logprobs[a:b] for a, b in spans],
                    beam_logprobs=self._beam_logprobs, top_logprobs=top, prompt_logprobs=prompt if s == 0 else {},
                ))
        return self._results

    def _top(self, tokens: list[int], host: list[torch.Tensor], spans) -> list[list[TokenLogprobs | None]]:
        ids, values, token_logprobs, ranks = (t.tolist() for t in host)
        rows: list[TokenLogprobs | None] = [None] * len(tokens)
        drawn = [tokens[r] for r in self._logprob_rows]
        for r, entry in zip(self._logprob_rows, host_rows(drawn, token_logprobs, ranks, ids, values, self._logprob_ks)):
            rows[r] = entry
        return [rows[a:b] for a, b in spans]


class _HostCopy:
    """Device tensors copied to host memory behind the work queued so far: into pinned buffers
    on CUDA, with an event, so `get()` waits for these copies only. With `alive`, the wait
    polls the event and calls `alive()` in between (releasing the GIL, so the thread that
    watches the workers runs): a step waiting for a dead rank would never complete."""

    def __init__(self, tensors: list[torch.Tensor], alive: Callable[[], None] | None = None):
        self._event = None
        self._alive = alive
        self._host = tensors
        if tensors and tensors[0].is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self._host, tensors):
                host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def get(self) -> list[torch.Tensor]:
        if self._event is not None:
            if self._alive is None:
                self._event.synchronize()
            else:
                while not self._event.query():
                    self._alive()
                    time.sleep(0)
            self._event = None
        if self._alive is not None:
            self._alive()  # a collective aborted for a dead rank completes with garbage
        return self._host
