"""`AsyncEngine`: one asyncio task steps an `LLMEngine` while HTTP handlers stream its outputs.

The engine is not thread-safe and a step blocks for the model's forward pass, so:
- each step runs in one worker thread, and the event loop keeps serving HTTP meanwhile;
- handlers never touch the engine: adding and aborting requests queue a command that the loop
  task applies between steps, when no step is running;
- every HTTP request has an `asyncio.Queue` that the loop task fills with the `RequestOutput`s
  of its engine requests (one per prompt) after each step.
A request that arrives while a step runs joins the next one: continuous batching across HTTP
requests. Requests beyond the running batch wait in the engine scheduler's queue (first come,
first served); `num_waiting` tells the server how long that queue is. A request whose consumer
stops reading (client gone, handler cancelled) is aborted: its blocks are freed before the next
step. While requests run, a throughput line is logged every `log_interval_s`, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pagedattn.engine.llm_engine import EngineStats, LLMEngine
from pagedattn.engine.outputs import RequestOutput
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
"""How often the throughput line is logged while requests run (vLLM's interval)."""


class EngineDeadError(RuntimeError):
    """A step raised: the engine's state is no longer trusted and no request is served."""


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _Progress:
    """What the loop knows of one engine request between steps (for the latency metrics)."""

    submitted: float  # time.perf_counter() when the handler queued it
    prompt_len: int
    generated: int = 0  # output tokens reported so far
    last_token: float | None = None  # when the last step that gave it tokens ended


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, *, log_interval_s: float = LOG_INTERVAL_S):
        self.engine = engine
        self.metrics = metrics
        self.log_interval_s = log_interval_s
        self.dead: str | None = None  # why the loop stopped for good (a step raised)
        self._commands: deque[Callable[[], None]] = deque()
        self._streams: dict[str, asyncio.Queue] = {}  # engine request id -> its HTTP request's queue
        self._progress: dict[str, _Progress] = {}
        self._stats: EngineStats = engine.stats()
        self._num_queued = 0  # requests handed to the loop, not yet added to the engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedattn-step")
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Start the loop and the throughput log on the running event loop (the server's start-up)."""
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(), name="pagedattn-engine-loop"),
                       loop.create_task(self._log_throughput(), name="pagedattn-throughput-log")]
        self._observe_engine()

    async def stop(self) -> None:
        """Stop the loop; a step in flight runs to its end first. The engine is let go: FastAPI
        caches route functions process-wide, so an app (whose routes reach this object) outlives
        its server, and must not keep a model and its KV pool in memory."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._executor.shutdown(wait=True)
        self.dead = self.dead or "the server has stopped"
        self.engine = None

    @property
    def is_idle(self) -> bool:
        """No request queued, running or waiting for a command (the loop is parked)."""
        return not self._commands and not self._streams and (self.engine is None or not self.engine.has_unfinished())

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the scheduler's queue as of the last step, and those that
        arrived since."""
        return self._stats.num_waiting + self._num_queued

    # ------------------------------------------------------------------ requests

    async def generate(self, requests: list[EngineRequest]) -> AsyncIterator[RequestOutput]:
        """The outputs of `requests` (engine requests of one HTTP request, e.g. one per prompt),
        interleaved as steps produce them, until each has given its finished output. They are
        queued when the iteration starts; closing or cancelling the iteration before the end
        aborts the unfinished ones. Use it under `contextlib.aclosing` so an early exit aborts at once."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        running = [r.request_id for r in requests if r.request_id in self._streams]
        if running:
            raise ValueError(f"expected new request ids, got {running} which are running")
        queue: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        for r in requests:
            self._streams[r.request_id] = queue
            self._progress[r.request_id] = _Progress(now, len(r.prompt_token_ids))
        self._num_queued += len(requests)
        self._submit(lambda: self._add(requests))
        unfinished = {r.request_id for r in requests}
        try:
            while unfinished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    unfinished.discard(out.request_id)
                yield out
        finally:
            for r in requests:
                del self._streams[r.request_id]
            if unfinished:
                self._submit(lambda: self._abort(unfinished))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wake.set()

    def _add(self, requests: list[EngineRequest]) -> None:
        self._num_queued -= len(requests)
        for r in requests:
            queue = self._streams.get(r.request_id)
            if queue is None:  # aborted before it was queued
                self._progress.pop(r.request_id, None)
                continue
            try:
                self.engine.add_request(r.prompt_token_ids, r.params, r.request_id)
            except (TypeError, ValueError) as e:
                self._progress.pop(r.request_id, None)
                queue.put_nowait(e)

    def _abort(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            if self.engine.abort_request(request_id):
                self.metrics.requests_finished.labels(reason="abort").inc()
            self._progress.pop(request_id, None)

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self._commands:
                self._commands.popleft()()
            self._observe_engine()
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # noqa: BLE001 - any failure of a step ends serving, reported to every client
                logger.exception("engine step failed; the server stops taking requests")
                self._fail(f"engine step failed: {type(e).__name__}: {e}")
                return
            self._dispatch(outputs, time.perf_counter())

    def _observe_engine(self) -> None:
        self._stats = self.engine.stats()
        self.metrics.observe_engine(self._stats)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        new_tokens = 0
        for out in outputs:
            tokens = sum(len(c.token_ids) for c in out.outputs)
            progress = self._progress.get(out.request_id)
            if progress is not None and tokens > progress.generated:
                new_tokens += tokens - progress.generated
                if progress.last_token is None:  # its prefill is done
                    self.metrics.time_to_first_token.observe(now - progress.submitted)
                    self.metrics.observe_prompt(progress.prompt_len)
                else:
                    self.metrics.inter_token_latency.observe(now - progress.last_token)
                progress.generated, progress.last_token = tokens, now
            if out.finished:
                self._progress.pop(out.request_id, None)
                reason = out.outputs[0].finish_reason if out.outputs else "error"
                self.metrics.requests_finished.labels(reason=reason or "error").inc()
                self.metrics.preemptions.inc(out.metrics.num_preemptions)
                if out.metrics.latency is not None:
                    self.metrics.request_latency.observe(out.metrics.latency)
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        self.metrics.observe_tokens(new_tokens)

    def _fail(self, reason: str) -> None:
        self.dead = reason
        for queue in set(self._streams.values()):
            queue.put_nowait(EngineDeadError(reason))

    async def _log_throughput(self) -> None:
        """Every `log_interval_s` while requests run (and once after they end), vLLM's line:
        prompt and generation tokens/s over the interval, running and waiting requests."""
        while True:
            await asyncio.sleep(self.log_interval_s)
            line = self.metrics.throughput_line(self._stats, busy=self.engine is not None and not self.is_idle)
            if line is not None:
                logger.info(line)
