"""The engine loop: requests in, one scheduled step at a time, `RequestOutput`s out."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from pagedattn.attention.registry import get_backend
from pagedattn.engine.beam_search import beam_step
from pagedattn.engine.block_manager import BlockManager
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.engine.model_runner import ModelRunner
from pagedattn.engine.outputs import CompletionOutput, RequestOutput
from pagedattn.engine.sampler import SamplingBatch
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from pagedattn.engine.sequence import Sequence, SequenceGroup, SeqStatus

logger = logging.getLogger(__name__)

_SEED_STRIDE = 0x9E3779B97F4A7C15  # completion k of a seeded request draws from seed + k * stride


class LLMEngine:
    """Owns the model runner, the scheduler and its block manager.

    `loaded`: a `pagedattn.models.LoadedModel` to use instead of loading `config.model`.
    `check_integrity`: assert the block manager's invariants after every step (tests).
    """

    def __init__(self, config: EngineConfig, loaded=None, *, check_integrity: bool = False):
        self.config = config
        device = config.resolved_device()
        backend_name = "torch" if config.backend == "auto" and device.type == "cpu" else config.backend
        backend = get_backend(backend_name)
        if loaded is None:
            from pagedattn.models.loader import load_model

            loaded = load_model(
                config.model,
                dtype=config.dtype,
                device=device,
                attention_backend=backend.get_name(),
                kv_cache_dtype=config.kv_cache_dtype,
            )
        self.tokenizer = loaded.tokenizer
        self.spec = loaded.spec
        self.max_model_len = self.spec.max_model_len
        self.runner = ModelRunner(config, loaded, backend, device)
        self.device = device
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            sliding_window=self.spec.builder_sliding_window,
            num_cpu_blocks=self.runner.num_cpu_blocks,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_scheduler_steps=config.num_scheduler_steps,
            preemption_mode=config.preemption_mode,
        )
        self.eos_token_ids = frozenset(self.spec.eos_token_ids)
        self.check_integrity = check_integrity
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._rejected: list[SequenceGroup] = []  # finished with an error before scheduling

    # ------------------------------------------------------------------ requests

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> SequenceGroup:
        """Queue one request. A request that can never run finishes with finish_reason "error"
        at the next `step`; the others go on."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        index = next(self._arrivals)
        request_id = str(index) if request_id is None else request_id
        text, token_ids, error = self._tokenize(prompt)
        if error is None:
            error = self._check_request(token_ids, params)
        seq = Sequence(next(self._seq_ids), token_ids, self.config.block_size)
        group = SequenceGroup(request_id, text, token_ids, params, [seq], index)
        if error is not None:
            logger.warning("request %s finished with an error: %s", request_id, error)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = "error"
            group.error = error
            self._rejected.append(group)
            return group
        generators = self._generators(params)
        seq.generator = generators[0]
        group.generators = generators
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids)
        self.scheduler.add(group)
        return group

    def _tokenize(self, prompt) -> tuple[str | None, list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return prompt, [], "a text prompt needs a tokenizer; this model has none (pass token ids)"
            return prompt, list(self.tokenizer.encode(prompt)), None
        try:
            token_ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            return None, [], f"expected a prompt string or a list of token ids, got {prompt!r:.80}"
        return None, token_ids, None

    def _check_request(self, token_ids: list[int], params: SamplingParams) -> str | None:
        vocab = self.spec.vocab_size
        if not token_ids:
            return "expected a non-empty prompt, got 0 tokens"
        if len(token_ids) > self.max_model_len:
            return f"prompt of {len(token_ids)} tokens is longer than the model's context of {self.max_model_len} tokens"
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            return f"expected token ids in [0, {vocab}), got {bad[:5]}"
        if params.width > self.config.max_num_seqs:
            return f"expected n/best_of <= max_num_seqs ({self.config.max_num_seqs}), got {params.width}"
        return None

    def _generators(self, params: SamplingParams) -> list[torch.Generator | None]:
        if params.seed is None:
            return [None] * params.width
        return [
            torch.Generator(device=self.device).manual_seed((params.seed + k * _SEED_STRIDE) % 2**64)
            for k in range(params.width)
        ]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._rejected)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; outputs of every request that advanced or finished."""
        finished = self._rejected
        self._rejected = []
        out = self.scheduler.schedule()
        finished += out.errored
        now = time.perf_counter()
        for c in out.chunks:
            if c.group.metrics.first_scheduled_time is None:
                c.group.metrics.first_scheduled_time = now
        if out.num_steps > 1:
            self._process_multistep(out)
        else:
            logits = self.runner.execute(out)
            if logits is not None:
                self._process(out, logits)
        if not (out.chunks or out.preempted or out.errored) and self.scheduler.has_unfinished():
            self._unblock()
        self.scheduler.remove_finished()
        if self.check_integrity:
            self.block_manager.check_integrity(self.scheduler.all_seqs())
        groups = list(dict.fromkeys([*finished, *(c.group for c in out.chunks)]))
        now = time.perf_counter()
        for g in groups:
            if g.is_finished and g.metrics.finished_time is None:
                g.metrics.finished_time = now
        return [self._output(g) for g in groups]

    def _unblock(self) -> None:
        # Nothing could run although requests wait: the head request can never be scheduled
        # with this configuration (e.g. beams larger than the step budget). Fail it, not the engine.
        group = (self.scheduler.running or list(self.scheduler.swapped) or list(self.scheduler.waiting))[0]
        self.scheduler.abort(group, f"request {group.request_id} cannot be scheduled under the step budget")
        self._rejected.append(group)

    def _process(self, out: SchedulerOutput, logits: torch.Tensor) -> None:
        for c in out.chunks:
            self.block_manager.mark_computed(c.seq, c.seq.num_computed_tokens + c.num_tokens)
        sampled = [c for c in out.chunks if c.sample]
        beam_rows: dict[int, tuple[SequenceGroup, list[int]]] = {}
        rows: list[int] = []  # logits row of each sampling row
        params_rows = []
        owners: list[ScheduledChunk] = []
        for i, c in enumerate(sampled):
            if c.group.is_beam:
                beam_rows.setdefault(id(c.group), (c.group, []))[1].append(i)
                continue
            width = c.group.params.width if c.group.needs_fork else 1
            gens = c.group.generators if c.group.needs_fork else [c.seq.generator]
            rows += [i] * width
            params_rows += [(c.group.params, g) for g in gens]
            owners.append(c)
        if rows:
            batch = SamplingBatch.build(params_rows, logits.shape[1], self.device)
            index = torch.tensor(rows, dtype=torch.int64).to(logits.device)
            tokens, logprobs = self.runner.sampler.sample(logits.index_select(0, index), batch)
            tokens, logprobs = tokens.tolist(), logprobs.tolist()
            j = 0
            for c in owners:
                width = c.group.params.width if c.group.needs_fork else 1
                self._append_samples(c, tokens[j : j + width], logprobs[j : j + width])
                j += width
        for group, idx in beam_rows.values():
            self._beam_step(group, [sampled[i].seq for i in idx], logits[idx])

    def _process_multistep(self, out: SchedulerOutput) -> None:
        params_rows = [(c.group.params, c.seq.generator) for c in out.chunks]
        batch = SamplingBatch.build(params_rows, self.spec.vocab_size, self.device)
        tokens, logprobs = self.runner.execute_multistep(out, batch)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        for i, c in enumerate(out.chunks):
            computed = c.seq.num_computed_tokens
            for step in range(out.num_steps):
                self._append_token(c.group, c.seq, tokens[step][i], logprobs[step][i])
                if c.seq.is_finished:
                    break
            else:
                self.block_manager.mark_computed(c.seq, computed + out.num_steps)
            self._first_token(c.group)

    def _append_samples(self, c: ScheduledChunk, tokens: list[int], logprobs: list[float]) -> None:
        group, seq = c.group, c.seq
        targets = [seq]
        if group.needs_fork:  # the prompt's one sample becomes `width` sequences
            for k in range(1, len(tokens)):
                child = seq.fork(next(self._seq_ids))
                self.block_manager.fork(seq, child)
                child.generator = group.generators[k]
                group.seqs.append(child)
                targets.append(child)
            group.forked = True
        for s, t, lp in zip(targets, tokens, logprobs):
            self._append_token(group, s, t, lp)
        self._first_token(group)

    def _first_token(self, group: SequenceGroup) -> None:
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = time.perf_counter()

    def _append_token(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float) -> None:
        seq.append_token(token, logprob)
        params = group.params
        delta = seq.detokenizer.add(token) if seq.detokenizer is not None else ""
        if delta and params.stop and self._truncate_at_stop(seq, delta, params.stop):
            self.scheduler.finish_seq(seq, "stop")
            return
        reason = None
        if not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if seq.detokenizer is not None:
                seq.detokenizer.flush()
            self.scheduler.finish_seq(seq, reason)

    @staticmethod
    def _truncate_at_stop(seq: Sequence, delta: str, stops: list[str]) -> bool:
        """Cut the text before the first stop string that the new text completes."""
        text = seq.detokenizer.text
        found = [
            i
            for s in stops
            if (i := text.find(s, max(0, len(text) - len(delta) - len(s) + 1))) >= 0
        ]
        if not found:
            return False
        seq.detokenizer.truncate(min(found))
        return True

    def _beam_step(self, group: SequenceGroup, beams: list[Sequence], logits: torch.Tensor) -> None:
        params = group.params
        result = beam_step(
            beams,
            torch.log_softmax(logits, dim=-1),
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
                child = beams[parent].fork(next(self._seq_ids))
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
        self._first_token(group)

    # ------------------------------------------------------------------ outputs

    def _output(self, group: SequenceGroup) -> RequestOutput:
        params = group.params
        if group.error is not None:
            outputs = [CompletionOutput("", [], "error", 0.0) for _ in range(params.n)]
        elif group.is_beam:
            hyps = group.beam_hypotheses[: params.n] if group.is_finished else []
            outputs = [
                CompletionOutput(self._decode(h.token_ids), h.token_ids, h.finish_reason, h.cumulative_logprob)
                for h in hyps
            ]
        else:
            seqs = group.seqs
            if group.is_finished and len(seqs) > params.n:
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
            outputs = [
                CompletionOutput(s.text, s.output_token_ids, s.finish_reason, s.cumulative_logprob) for s in seqs
            ]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=group.is_finished,
            metrics=group.metrics,
            error=group.error,
        )

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ batch API

    def generate(
        self, prompts: list, params: list[SamplingParams], *, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        groups = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(groups), desc="Generating", dynamic_ncols=True)
        generated, start = 0, time.perf_counter()
        while self.has_unfinished():
            for output in self.step():
                if output.finished:
                    results[output.request_id] = output
                    generated += sum(len(c.token_ids) for c in output.outputs)
                    if pbar is not None:
                        pbar.update(1)
                        pbar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}")
        if pbar is not None:
            pbar.close()
        return [results[g.request_id] for g in groups]
