"""`AsyncEngine`: one asyncio task steps an `LLMEngine` while HTTP handlers stream its outputs.

The engine is not thread-safe and a step blocks for the model's forward pass, so:
- each step runs in one worker thread, and the event loop keeps serving HTTP meanwhile;
- handlers never touch the engine: adding and aborting a request queue a command that the loop
  task applies between steps, when no step is running;
- every request has an `asyncio.Queue` that the loop task fills with its `RequestOutput`s after
  each step.
A request that arrives while a step runs joins the next one: continuous batching across HTTP
requests. A request whose consumer stops reading (client gone, handler cancelled) is aborted:
its blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.engine.outputs import RequestOutput
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A step raised: the engine's state is no longer trusted and no request is served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.dead: str | None = None  # why the loop stopped for good (a step raised)
        self._commands: deque[Callable[[], None]] = deque()
        self._streams: dict[str, asyncio.Queue] = {}
        self._generated: dict[str, int] = {}  # output tokens reported so far, per request
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedattn-step")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Start the loop task on the running event loop (the server's start-up)."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pagedattn-engine-loop")
        self.metrics.observe_engine(self.engine.stats())

    async def stop(self) -> None:
        """Stop the loop; a step in flight runs to its end first. The engine is let go: FastAPI
        caches route functions process-wide, so an app (whose routes reach this object) outlives
        its server, and must not keep a model and its KV pool in memory."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
        self.dead = self.dead or "the server has stopped"
        self.engine = None

    @property
    def is_idle(self) -> bool:
        """No request queued, running or waiting for a command (the loop is parked)."""
        return not self._commands and not self._streams and (self.engine is None or not self.engine.has_unfinished())

    # ------------------------------------------------------------------ requests

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The outputs of one request, the last one finished. The request is queued when the
        iteration starts; closing or cancelling the iteration before the end aborts it. Use it
        under `contextlib.aclosing` so an early exit aborts at once."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if request_id in self._streams:
            raise ValueError(f"expected a new request id, got {request_id!r} which is running")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._submit(lambda: self._add(prompt_token_ids, params, request_id))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            del self._streams[request_id]
            if not finished:
                self._submit(lambda: self._abort(request_id))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wake.set()

    def _add(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        if request_id not in self._streams:  # aborted before it was queued
            return
        try:
            self.engine.add_request(prompt_token_ids, params, request_id)
        except (TypeError, ValueError) as e:
            self._streams[request_id].put_nowait(e)
            return
        self._generated[request_id] = 0
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))

    def _abort(self, request_id: str) -> None:
        if self.engine.abort_request(request_id):
            self.metrics.requests_finished.labels(reason="abort").inc()
        self._generated.pop(request_id, None)

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self._commands:
                self._commands.popleft()()
            self.metrics.observe_engine(self.engine.stats())
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
            self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        new_tokens = 0
        for out in outputs:
            tokens = sum(len(c.token_ids) for c in out.outputs)
            new_tokens += tokens - self._generated.get(out.request_id, 0)
            if out.finished:
                self._generated.pop(out.request_id, None)
                reason = out.outputs[0].finish_reason if out.outputs else "error"
                self.metrics.requests_finished.labels(reason=reason or "error").inc()
                self.metrics.preemptions.inc(out.metrics.num_preemptions)
                if out.metrics.latency is not None:
                    self.metrics.request_latency.observe(out.metrics.latency)
            else:
                self._generated[out.request_id] = tokens
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        self.metrics.observe_tokens(new_tokens)

    def _fail(self, reason: str) -> None:
        self.dead = reason
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(reason))
