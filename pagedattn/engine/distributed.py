"""Tensor parallelism in the engine: rank 0's handle on the other ranks (`TensorParallel`) and
the other ranks' main function (`run_worker`).

The process model is nano-vllm's and vLLM's: rank 0 is the caller's process; it runs the
scheduler, the block manager and the sampler, and its own shard of the model. Ranks 1..N-1
run their shards only: each builds a `ModelRunner` exactly as rank 0 does, then runs the calls
rank 0 sends it (a `StepPlan` per step, `ModelRunner.WORKER_CALLS`) until rank 0 sends None.

Started by rank 0 (`WorkerProcesses`: spawned, watched, reaped), or by torchrun: then every
rank runs the same program, and a rank other than 0 turns into a worker inside the engine's
constructor and leaves the process (SystemExit(0)) when rank 0 shuts the engine down.

Faults: a worker that dies is noticed by rank 0's watcher within a second; the watcher aborts
NCCL's communicators, so nothing rank 0 queued waits for the dead rank, and kills the other
workers. Rank 0 raises `WorkerError` naming the rank at its next check (each step, and while it
waits for one), or as soon as a collective it is in fails. Whatever escapes a step (that
error, a KeyboardInterrupt) stops the group for good: the ranks would no longer agree on which
collective comes next.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

from pagedattn.attention.registry import get_backend
from pagedattn.engine.config import EngineConfig
from pagedattn.parallel.group import COLLECTIVE_TIMEOUT, Rendezvous, TPGroup, abort_collectives, join, leave
from pagedattn.parallel.workers import WorkerError, WorkerProcesses

logger = logging.getLogger(__name__)

CLOSE_GRACE_S = 10.0
"""How long workers get to leave their loop and exit after a shutdown, before SIGKILL."""
FAILURE_WAIT_S = 3.0
"""After a collective fails, how long to wait for the watcher to name a dead worker."""
LEAVE_TIMEOUT_S = 10.0
"""How long rank 0 waits, at a shutdown, for the ranks to tear their process groups down
together, before it aborts them instead. On 2x H200 (2026-11-27, 8ca5f19) NCCL's teardown did
not return within 30 s with both ranks in it: the decode graphs, which capture the output head's
NCCL gather, were still alive, and NCCL's teardown waits until every graph holding one of its
collectives is destroyed; they are destroyed first since (`TensorParallel.before_leaving`), not
yet re-run on GPUs. The bound stays for what else may hold a teardown."""

_active: weakref.WeakSet = weakref.WeakSet()  # the running TensorParallel of this process (at most one)


def model_loader(config: EngineConfig, backend_name: str) -> Callable:
    """`loader(device=..., tp=...) -> LoadedModel` for `config.model`: what each rank calls
    to load its shard (a picklable callable: it travels to spawned workers). With tensor
    parallelism the model and tokenizer are found here first (a Hub id downloaded once, not by
    every rank at once; a missing path refused before any worker starts)."""
    from pagedattn.models.loader import load_model, resolve_model_path

    model, tokenizer = config.model, config.tokenizer
    if config.tensor_parallel_size > 1:
        model = str(resolve_model_path(model))
        tokenizer = None if tokenizer is None else str(resolve_model_path(tokenizer))
    return functools.partial(load_model, model, tokenizer=tokenizer, dtype=config.dtype,
                             attention_backend=backend_name, kv_cache_dtype=config.kv_cache_dtype,
                             max_model_len=config.max_model_len)


class TensorParallel:
    """Rank 0's side of a tensor-parallel group of `config.tensor_parallel_size` ranks: starts
    (or, under torchrun, joins) the others, sends them calls, checks them, shuts them down.

    `loader(device=, tp=)` loads a rank's shard (`model_loader`, or a dummy model's loader).
    """

    def __init__(self, config: EngineConfig, loader: Callable) -> None:
        if any(True for _ in _active):
            raise RuntimeError("expected one tensor-parallel engine per process at a time (torch.distributed has "
                               "one default group), got a second while the first runs: shut it down first "
                               "(LLM.shutdown(), or let it be collected)")
        size = config.tensor_parallel_size
        rendezvous = Rendezvous.from_environment() or Rendezvous.local(size)
        if rendezvous.world_size != size:
            raise ValueError(f"expected tensor_parallel_size equal to torchrun's WORLD_SIZE ({rendezvous.world_size}), "
                             f"got {size}")
        self.workers = None
        self.dead: str | None = None  # why the group stopped for good
        if rendezvous.launched:
            if rendezvous.rank != 0:  # this process is a worker: serve rank 0 until it shuts down, then leave
                run_worker(rendezvous.rank, None, rendezvous, config, loader)
                raise SystemExit(0)
        else:
            # The watcher aborts the group's collectives when a worker dies; it gets the group
            # through this list (filled once joined), not through `self`, which it must not keep alive.
            self._joined: list[TPGroup] = []
            self.workers = WorkerProcesses(size, run_worker, (rendezvous, config, loader),
                                           on_failure=functools.partial(_abort, self._joined))
        self.device = config.rank_device(rendezvous.local_rank)
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            channel = self.workers.channel if self.workers is not None else None
            self.tp: TPGroup = join(rendezvous, 0, self.device, channel=channel, alive=self.check)
            if self.workers is not None:
                self._joined.append(self.tp)
        except BaseException as e:
            failure = self._worker_failure(e)
            if self.workers is not None:
                self.workers.close(0.0)
            if failure is not None:
                raise WorkerError(failure) from e
            raise
        self._before_leaving: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(self, _stop, self.tp, self.workers, graceful=True,
                                           before_leaving=self._before_leaving)
        _active.add(self)
        logger.info("tensor parallelism over %d ranks; all-reduce: %s", size, self.tp.all_reduce_name)

    def before_leaving(self, release: Callable[[], None]) -> None:
        """Call `release()` at the shutdown, before the process groups are left: the CUDA graphs
        that captured NCCL collectives must be destroyed first (`DecodeGraphs.release`)."""
        self._before_leaving.append(release)

    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> process id of the workers rank 0 started (none under torchrun)."""
        return self.workers.pids if self.workers is not None else {}

    def check(self) -> None:
        """Raise WorkerError when a worker has died (or the group was stopped by an error)."""
        if self.workers is not None:
            self.workers.check()
        if self.dead is not None:
            raise WorkerError(self.dead)

    def send(self, method: str, *args) -> None:
        """Have every other rank call `runner.method(*args)` (a `WORKER_CALLS` method)."""
        self.tp.send((method, args))

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around a step (or the engine's start-up): whatever escapes stops the group for good,
        and a failure that a dead worker caused is raised as WorkerError naming it."""
        self.check()
        try:
            yield
        except BaseException as e:
            failure = self._worker_failure(e)
            if self.dead is None:
                self.dead = failure or f"the tensor-parallel engine stopped after {type(e).__name__}: {e}".strip()
                self._finalizer.detach()
                _active.discard(self)
                _stop(self.tp, self.workers, graceful=False, before_leaving=self._before_leaving)
            if failure is not None and not isinstance(e, WorkerError):
                raise WorkerError(failure) from e
            if failure is None and isinstance(e, RuntimeError) and "timed out" in str(e).lower():
                first = str(e).strip().splitlines()[0]
                raise WorkerError(f"a tensor-parallel collective timed out (timeout "
                                  f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s): {first}") from e
            raise

    def shutdown(self) -> None:
        """Tell the workers to exit, reap them, and leave the process groups. Idempotent."""
        if self._finalizer.alive:
            self._finalizer()
        _active.discard(self)
        if self.dead is None:
            self.dead = "the tensor-parallel engine was shut down"

    def _worker_failure(self, error: BaseException) -> str | None:
        """The dead worker that explains `error`, or None. Collectives whose peer went raise
        RuntimeError (gloo: its socket closed; NCCL: aborted by the watcher), a pipe to it
        OSError (BrokenPipeError): a worker's death
        is noticed within milliseconds of its sockets closing, so such an error not explained
        within FAILURE_WAIT_S is the error's own. Rank 0's other errors are its own (a model
        that cannot be split fails on every rank, and rank 0 says why in its own words)."""
        if self.workers is None or not isinstance(error, (RuntimeError, OSError, EOFError)):
            return None
        if self.workers.failure is None and not isinstance(error, WorkerError):
            self.workers.wait_for_failure(FAILURE_WAIT_S)
        return self.workers.failure


def _abort(joined: list[TPGroup]) -> None:
    for tp in joined:
        abort_collectives(tp)


def _stop(tp: TPGroup, workers: WorkerProcesses | None, *, graceful: bool,
          before_leaving: list[Callable[[], None]] | None = None) -> None:
    """Stop the group: tell the workers to leave and leave the process groups with them
    (graceful), reap the workers; else (or when leaving takes more than LEAVE_TIMEOUT_S) kill
    them and abort the groups. `before_leaving` runs first either way (the CUDA graphs holding
    NCCL collectives destroyed: NCCL's teardown waits for them). A finalizer: it holds no
    engine object.

    Rank 0 leaves before it reaps: NCCL's communicator teardown (`destroy_process_group`)
    returns on a rank only once every rank of the communicator has called it, so a worker
    leaving on its own waits for rank 0, and a rank 0 that first waited for that worker to exit
    (then killed it) would wait for a dead rank in its own teardown: every TP=2 shutdown on
    two H200s hung (2026-11-27, eebda9e), where gloo's local teardown on the CPU had not."""
    if graceful:
        if workers is not None:
            workers.stopping()  # their exits from here on are expected, not deaths to abort for
        try:
            tp.send(None)
        except Exception:  # noqa: BLE001 - a worker gone already: reaped below
            graceful = False
    if graceful:
        graceful = _within(LEAVE_TIMEOUT_S, _leave_after, before_leaving, tp)
        if not graceful:
            logger.warning("tensor-parallel shutdown: leaving the process groups took over %.0f s; aborting them",
                           LEAVE_TIMEOUT_S)
    if workers is not None:
        workers.close(CLOSE_GRACE_S if graceful else 0.0)
    if not graceful and not _within(LEAVE_TIMEOUT_S, _leave_after, before_leaving, tp, abort=True):
        logger.warning("tensor-parallel shutdown: aborting the process groups took over %.0f s; left behind",
                       LEAVE_TIMEOUT_S)


def _leave_after(before_leaving: list[Callable[[], None]] | None, tp: TPGroup, *, abort: bool = False) -> None:
    """Run the `before_leaving` callables (once: each is dropped as it runs), then `leave`."""
    while before_leaving:
        before_leaving.pop()()
    leave(tp, abort=abort)


def _within(seconds: float, fn: Callable, *args, **kwargs) -> bool:
    """Run fn(*args, **kwargs) on a daemon thread; whether it returned within `seconds` (a
    teardown stuck in NCCL then stays behind on its thread, which does not keep the process
    from exiting)."""
    def run() -> None:
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - tearing down: the error that matters is raised elsewhere
            logger.debug("leaving the process groups failed", exc_info=True)

    thread = threading.Thread(target=run, name="pagedattn-tp-leave", daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def run_worker(rank: int, channel, rendezvous: Rendezvous, config: EngineConfig, loader: Callable) -> None:
    """Rank `rank`'s main: join the group, load the shard, build the runner as rank 0 does, and
    run the calls rank 0 sends until it sends None. `channel`: the worker's end of rank 0's
    messages (None under torchrun: a gloo group's)."""
    from pagedattn.engine.model_runner import WORKER_CALLS, ModelRunner

    device = config.rank_device(rendezvous.local_rank if rendezvous.launched else rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif not rendezvous.launched:  # ranks of one CPU share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    tp = join(rendezvous, rank, device, channel=channel)
    backend = get_backend(config.backend_name(device))
    runner = ModelRunner(config, loader(device=device, tp=tp), backend, device, tp=tp)
    while (call := tp.receive()) is not None:
        method, args = call
        if method not in WORKER_CALLS:
            raise ValueError(f"expected a call in {sorted(WORKER_CALLS)}, got {method!r}")
        getattr(runner, method)(*args)
    # An error above is reported to rank 0 by the caller (`WorkerProcesses`), which ends this
    # process without tearing the groups down: that could wait on collectives that never end.
    if runner.graphs is not None:
        runner.graphs.release()  # before leaving: NCCL's teardown waits for graphs holding its collectives
    leave(tp)
