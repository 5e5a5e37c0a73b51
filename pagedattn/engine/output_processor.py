"""After a step: sampled tokens into sequences, stops and finishes, forks, beams, `RequestOutput`s.

For every scheduled chunk the cache now holds its tokens (`BlockManager.mark_computed`). A
sampled chunk gets its token; the first sample of a request with `best_of`/`n` > 1 forks the
prompt's sequence into one per completion (blocks shared, copied on write); a beam group takes
one beam-search step over its beams' log-probabilities. A sequence finishes on a stop string,
EOS (unless `ignore_eos`) or a stop token id, `max_tokens` or the model's context, and its
blocks are freed. As vLLM V1: stops count only after `min_tokens` generated tokens, and a token
that stops by its id (EOS, `stop_token_ids`) stays in `token_ids` but not in the text. A guided
completion's grammar matcher accepts each of its tokens; the EOS that ends its grammar ends it.
The log-probabilities a request asks for become `{token id: Logprob}` dicts here (decoded tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from pagedattn.engine.beam_search import beam_step
from pagedattn.engine.block_manager import BlockManager
from pagedattn.engine.launched_step import StepResult
from pagedattn.engine.logprobs import TokenLogprobs
from pagedattn.engine.outputs import CompletionOutput, RequestOutput
from pagedattn.engine.scheduler import Scheduler, SchedulerOutput
from pagedattn.engine.sequence import Sequence, SequenceGroup


class OutputProcessor:
    """Applies `StepResult`s to the scheduler's sequences and reports requests.

    `seq_ids`: the engine's source of sequence ids (forks take new ones).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        *,
        tokenizer,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        seq_ids: Iterator[int],
    ):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.seq_ids = seq_ids
        self._token_texts: dict[int, str | None] = {}  # decode([id]) of the tokens in logprobs

    def process(self, out: SchedulerOutput, results: list[StepResult]) -> None:
        """Apply the step's results (one per model step, see `ModelRunner.launch`)."""
        if not results:  # nothing ran (only swaps, preemptions or errors)
            return
        # Model step k computed each chunk's tokens up to seq_len + k (multi-step: a decode per step).
        # Runs for every chunk of every step: locals, one read of each chunk's fields.
        mark_computed, apply = self.block_manager.mark_computed, self._apply
        for k, result in enumerate(results):
            prompt, top = result.prompt_logprobs, result.top_logprobs
            for i, (c, tokens, logprobs) in enumerate(zip(out.chunks, result.tokens, result.logprobs)):
                seq = c.seq
                if seq.is_finished:
                    continue
                mark_computed(seq, c.scheduled.seq_len + k)
                if prompt and i in prompt:
                    c.group.prompt_logprobs += [t.to_dict(self._token_text) for t in prompt[i]]
                if tokens:
                    apply(c.group, seq, tokens, logprobs, top[i] if top is not None else None)
        beams: dict[int, tuple[SequenceGroup, list[int]]] = {}
        for i in results[0].beam_logprobs:
            beams.setdefault(id(out.chunks[i].group), (out.chunks[i].group, []))[1].append(i)
        for group, idx in beams.values():
            logprobs = torch.stack([results[0].beam_logprobs[i] for i in idx])
            self._beam_step(group, [out.chunks[i].seq for i in idx], logprobs)

    def _apply(self, group: SequenceGroup, seq: Sequence, tokens: list[int], logprobs: list[float],
               top: list[TokenLogprobs | None] | None) -> None:
        """Append a chunk's draws: one token, or the `width` first tokens of a forking prompt."""
        if group.needs_fork:  # the prompt's one sample becomes `width` sequences
            targets = [seq]
            for k in range(1, len(tokens)):
                child = seq.fork(next(self.seq_ids))
                self.block_manager.fork(seq, child)
                child.generator = group.generators[k]
                group.seqs.append(child)
                targets.append(child)
            group.forked = True
            for j, (s, t, lp) in enumerate(zip(targets, tokens, logprobs)):
                self._append_token(group, s, t, lp, self._logprobs_dict(top, j))
        else:  # one draw (a decode, or a prompt's last chunk)
            self._append_token(group, seq, tokens[0], logprobs[0],
                               self._logprobs_dict(top, 0) if top is not None else None)
        _first_token(group)

    def _logprobs_dict(self, top: list[TokenLogprobs | None] | None, j: int) -> dict | None:
        """Draw j's {token id: Logprob}, when its request asks for log-probabilities."""
        entry = top[j] if top is not None else None
        return entry.to_dict(self._token_text) if entry is not None else None

    def _append_token(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float,
                      logprobs: dict | None) -> None:
        grammar = seq.grammar
        if grammar is not None and not grammar.accept_token(token):
            # The mask allowed no token the sampler could draw: the grammar could only end, and
            # min_tokens masked its EOS. The text is complete; the completion ends there.
            self._stop(seq, None)
            return
        seq.append_token(token, logprob, logprobs)
        params = group.params
        num_output_tokens = seq.num_output_tokens
        may_stop = num_output_tokens > params.min_tokens
        if grammar is not None and grammar.is_terminated():  # it took its stop token: an EOS, even with ignore_eos
            self._stop(seq, None)
            return
        if may_stop and ((not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids):
            self._stop(seq, None if token in self.eos_token_ids and not params.ignore_eos else token)
            return
        delta = seq.detokenizer.add(token) if seq.detokenizer is not None else ""
        if delta and params.stop and may_stop:
            stop = _truncate_at_stop(seq, delta, params.stop)
            if stop is not None:
                seq.stop_reason = stop
                self.scheduler.finish_seq(seq, "stop")
                return
        if num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            if seq.detokenizer is not None:
                seq.detokenizer.flush()
            self.scheduler.finish_seq(seq, "length")

    def _stop(self, seq: Sequence, stop_reason: int | None) -> None:
        """Finish `seq` stopped by a token id (EOS, a stop token id, its grammar's end): the
        token is not detokenized (vLLM's include_stop_str_in_output=False)."""
        if seq.detokenizer is not None:
            seq.detokenizer.flush()
        seq.stop_reason = stop_reason
        self.scheduler.finish_seq(seq, "stop")

    def _beam_step(self, group: SequenceGroup, beams: list[Sequence], logprobs: torch.Tensor) -> None:
        """logprobs: float32 [len(beams), V], each beam's next-token log-softmax."""
        params = group.params
        result = beam_step(
            beams,
            logprobs,
            group.beam_hypotheses,
            width=params.width,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            max_tokens=params.max_tokens,
            max_model_len=self.max_model_len,
        )
        group.forked = True
        # Fork every continuation from its unchanged parent first, then append the tokens.
        claimed: set[int] = set()
        new_beams = []
        for parent, _, _ in result.continuations:
            if parent in claimed:
                child = beams[parent].fork(next(self.seq_ids))
                self.block_manager.fork(beams[parent], child)
                new_beams.append(child)
            else:
                claimed.add(parent)
                new_beams.append(beams[parent])
        for i, beam in enumerate(beams):
            if i not in claimed:
                self.scheduler.finish_seq(beam, "length")
        for beam, (_, token, score) in zip(new_beams, result.continuations):
            beam.token_ids.append(token)
            beam.cumulative_logprob = score
        group.seqs = new_beams
        if result.done:
            for beam in new_beams:
                self.scheduler.finish_seq(beam, "length")
            group.beam_done = True
        _first_token(group)

    # ------------------------------------------------------------------ outputs

    def outputs(self, groups: list[SequenceGroup]) -> list[RequestOutput]:
        """The `RequestOutput` of each group, stamping the finish time of those that finished."""
        now = time.perf_counter()
        outputs = []
        for g in groups:
            finished = g.is_finished  # asked once: it looks at every sequence of the group
            if finished and g.metrics.finished_time is None:
                g.metrics.finished_time = now
            outputs.append(self._output(g, finished))
        return outputs

    def _output(self, group: SequenceGroup, finished: bool) -> RequestOutput:
        params = group.params
        if group.error is not None:
            outputs = [CompletionOutput("", [], "error", 0.0) for _ in range(params.n)]
        elif params.use_beam_search:
            hyps = group.beam_hypotheses[: params.n] if finished else []
            outputs = [
                CompletionOutput(self._decode(h.token_ids), h.token_ids, h.finish_reason, h.cumulative_logprob)
                for h in hyps
            ]
        else:
            seqs = group.seqs
            if finished and len(seqs) > params.n:
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
            outputs = [
                CompletionOutput(s.text, s.output_token_ids, s.finish_reason, s.cumulative_logprob,
                                 list(s.output_logprobs) if s.output_logprobs is not None else None, s.stop_reason)
                for s in seqs
            ]
        prompt_logprobs = group.prompt_logprobs
        # In RequestOutput's field order, by position: keywords took twice as long to build (every
        # request, every step).
        return RequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids, outputs, finished, group.metrics, group.error,
            group.encoder_prompt, group.encoder_prompt_token_ids,
            list(prompt_logprobs) if prompt_logprobs is not None and group.error is None else None,
        )

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _token_text(self, token: int) -> str | None:
        """One token's text alone, special tokens kept (vLLM's `Logprob.decoded_token`); None
        without a tokenizer. Cached: a step may decode the same top tokens for many positions."""
        text = self._token_texts.get(token)
        if text is None and self.tokenizer is not None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text


def _first_token(group: SequenceGroup) -> None:
    if group.metrics.first_token_time is None:
        group.metrics.first_token_time = time.perf_counter()


def _truncate_at_stop(seq: Sequence, delta: str, stops: list[str]) -> str | None:
    """Cut the text before the first stop string that the new text completes; returns that stop
    string (None when none is complete)."""
    text = seq.detokenizer.text
    found = [(i, s) for s in stops if (i := text.find(s, max(0, len(text) - len(delta) - len(s) + 1))) >= 0]
    if not found:
        return None
    index, stop = min(found, key=lambda f: f[0])
    seq.detokenizer.truncate(index)
    return stop
