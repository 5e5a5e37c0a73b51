"""The engine loop: requests in, one scheduled step at a time, `RequestOutput`s out."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pagedattn.attention.registry import get_backend
from pagedattn.engine.block_manager import BlockManager
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.distributed import TensorParallel, model_loader
from pagedattn.engine.grammar import Grammars
from pagedattn.engine.input_processor import InputProcessor
from pagedattn.engine.model_runner import LaunchedStep, ModelRunner
from pagedattn.engine.output_processor import OutputProcessor
from pagedattn.engine.outputs import RequestOutput
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.scheduler import Scheduler, SchedulerOutput
from pagedattn.engine.sequence import SequenceGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """The engine's queues and KV pool between two steps (what a server's /metrics reports)."""

    num_waiting: int
    num_running: int
    num_swapped: int
    num_blocks: int
    num_free_blocks: int  # evictable prefix-cache blocks count as free

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool's blocks held by unfinished sequences."""
        return 1 - self.num_free_blocks / self.num_blocks


class LLMEngine:
    """Owns the model runner, the scheduler and its block manager, and the processors of
    requests (in) and step results (out).

    `loaded`: a `pagedattn.models.LoadedModel` to use instead of loading `config.model`, or a
    loader `loaded(device=..., tp=...) -> LoadedModel` (picklable: with
    `config.tensor_parallel_size > 1` every rank calls it for its shard, e.g.
    `functools.partial(load_dummy_model, "llama3-8b", dtype=torch.bfloat16)`).
    `check_integrity`: assert the block manager's invariants after every step (tests).
    With tensor parallelism the engine holds worker processes: `shutdown()` ends them (so does
    the engine's collection, or the interpreter's exit).
    """

    def __init__(self, config: EngineConfig, loaded=None, *, check_integrity: bool = False):
        self.config = config
        self.parallel: TensorParallel | None = None
        device = config.resolved_device()
        backend = get_backend(config.backend_name(device))
        loader = loaded if callable(loaded) else None
        if loaded is None:
            loader = model_loader(config, backend.get_name())
        if config.tensor_parallel_size > 1:
            if loader is None:
                raise ValueError(f"expected a loader (loaded(device=, tp=) -> LoadedModel) with tensor_parallel_size="
                                 f"{config.tensor_parallel_size}, got a LoadedModel: it lives in this process only")
            self.parallel = TensorParallel(config, loader)
            device = self.parallel.device
        with self.parallel.guard() if self.parallel is not None else contextlib.nullcontext():
            if loader is not None:
                loaded = loader(device=device, tp=self.parallel.tp) if self.parallel else loader(device=device)
            parallel = {} if self.parallel is None else dict(tp=self.parallel.tp, send=self.parallel.send,
                                                            alive=self.parallel.check)
            self.runner = ModelRunner(config, loaded, backend, device, **parallel)
            if self.parallel is not None and self.runner.graphs is not None:
                self.parallel.before_leaving(self.runner.graphs.release)
        self.tokenizer = loaded.tokenizer
        self.spec = loaded.spec
        self.max_model_len = self.spec.max_model_len
        self.device = device
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            group_windows=self.runner.kv_groups.windows,
            num_cpu_blocks=self.runner.num_cpu_blocks,
            num_cross_blocks=self.runner.num_cross_blocks,
            num_cpu_cross_blocks=self.runner.num_cpu_cross_blocks,
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
        self.check_integrity = check_integrity
        seq_ids = itertools.count()
        # guided decoding's compiler (xgrammar, on the first guided request); the server compiles through it too
        self.grammars = Grammars(self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids)
        self.input_processor = InputProcessor(
            self.tokenizer,
            vocab_size=self.spec.vocab_size,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            block_size=config.block_size,
            device=device,
            seq_ids=seq_ids,
            max_encoder_len=self.spec.max_encoder_len,
            decoder_start_token_id=self.spec.decoder_start_token_id,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            audio=loaded.audio,
            grammars=self.grammars,
        )
        self.output_processor = OutputProcessor(
            self.scheduler,
            self.block_manager,
            tokenizer=self.tokenizer,
            eos_token_ids=frozenset(self.spec.eos_token_ids),
            max_model_len=self.max_model_len,
            seq_ids=seq_ids,
        )
        self._arrivals = itertools.count()
        self._rejected: list[SequenceGroup] = []  # finished with an error before scheduling
        # the next step, launched before the last one's draws were read (async scheduling)
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self.async_scheduling = config.resolved_async_scheduling(device)

    def add_request(
        self, prompt: str | list[int] | dict, params: SamplingParams | None = None, request_id: str | None = None
    ) -> SequenceGroup:
        """Queue one request (an encoder-decoder model's prompt may be a dict with
        "encoder_prompt" and "decoder_prompt", see `InputProcessor`). A request that can never
        run finishes with finish_reason "error" at the next `step`; the others go on."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        index = next(self._arrivals)
        group = self.input_processor.make_group(prompt, params, str(index) if request_id is None else request_id, index)
        if group.error is not None:
            logger.warning("request %s finished with an error: %s", group.request_id, group.error)
            self._rejected.append(group)
        else:
            self.scheduler.add(group)
        return group

    def abort_request(self, request_id: str) -> bool:
        """Drop the unfinished request `request_id` (its client went away): its sequences finish
        with finish_reason "abort", their blocks are free when this returns, and no step reports
        it again. Call it between steps. False when no unfinished request has that id."""
        for group in self._rejected:
            if group.request_id == request_id:
                self._rejected.remove(group)
                return True
        group = self.scheduler.find(request_id)
        if group is None:
            return False
        self.scheduler.cancel(group)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._rejected)

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_swapped=len(scheduler.swapped),
            num_blocks=self.block_manager.num_blocks,
            num_free_blocks=self.block_manager.num_free_blocks,
        )

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; outputs of every request that advanced or finished.

        With async scheduling, the step after it is planned and queued on the device before its
        draws are read (when it does not depend on them, `Scheduler.schedule_next_decodes`): the
        device runs that one while the host processes this one, and the next call starts from it.
        With tensor parallelism a dead worker raises `WorkerError` (a RuntimeError naming its
        rank), and so does every later step."""
        return self._guarded_step(final_only=False)

    def _guarded_step(self, *, final_only: bool) -> list[RequestOutput]:
        if self.parallel is None:
            return self._step(final_only=final_only)
        with self.parallel.guard():
            return self._step(final_only=final_only)

    @property
    def worker_pids(self) -> dict[int, int]:
        """Tensor-parallel rank -> process id of the workers this engine started (empty without)."""
        return self.parallel.worker_pids if self.parallel is not None else {}

    def shutdown(self) -> None:
        """End the tensor-parallel workers and leave the process groups (nothing without tensor
        parallelism); the engine takes no step after it. Idempotent."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def _step(self, *, final_only: bool) -> list[RequestOutput]:
        """`step`; final_only: outputs of the requests that finished only (`generate` reads no
        other: as vLLM's offline `FINAL_ONLY`, no per-step output of every running request)."""
        finished, self._rejected = self._rejected, []
        if self._in_flight is None:
            out = self.scheduler.schedule()
            finished += out.ended
            launched = self.runner.launch(out)
        else:
            out, launched = self._in_flight
        self._in_flight = None
        advanced = [c.group for c in out.chunks if not c.seq.is_finished]  # an in-flight step may hold finished ones
        if self.async_scheduling:
            nxt = self.scheduler.schedule_next_decodes(out)
            if nxt is not None:
                self._in_flight = nxt, self.runner.launch(nxt, after=launched)
        self.output_processor.process(out, launched.results())
        if not (out.chunks or out.preempted or out.ended) and self.scheduler.has_unfinished():
            finished.append(self.scheduler.abort_unschedulable())
        self.scheduler.remove_finished()
        if self._in_flight is not None and all(c.seq.is_finished for c in self._in_flight[0].chunks):
            self._in_flight = None  # every sequence it computes has finished: nothing to read
        if self.check_integrity:
            self.block_manager.check_integrity(self.scheduler.all_seqs())
        groups = list(dict.fromkeys([*finished, *advanced]))
        return self.output_processor.outputs([g for g in groups if g.is_finished] if final_only else groups)

    # ------------------------------------------------------------------ batch API

    def generate(
        self, prompts: list, params: list[SamplingParams], *,
        progress: Callable[[list[SequenceGroup]], None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; their outputs in order. `progress(groups)` is called
        before the first step and after each (a progress bar reads the groups' state)."""
        groups = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        if progress is not None:
            progress(groups)
        while self.has_unfinished():
            for output in self._guarded_step(final_only=True):
                results[output.request_id] = output
            if progress is not None:
                progress(groups)
        return [results[g.request_id] for g in groups]
