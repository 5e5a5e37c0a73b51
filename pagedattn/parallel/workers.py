"""The processes of ranks 1..N-1 on this host: spawned by rank 0, watched, and never left behind.

Each worker is a `spawn` process (CUDA cannot be forked) joined to rank 0 by two pipes:
- the inbox: rank 0's messages (`channel`, a `PipeChannel` writing every worker's inbox; the
  worker's target reads its own);
- the lifeline: a thread in the worker waits on rank 0's end and ends the process when it
  closes, however rank 0 went (an exception, Ctrl-C, SIGKILL); a worker whose target raises
  sends the error (its line and its traceback) up it before it exits, and rank 0 puts the line
  in its error and logs the traceback (INFO).
A thread of rank 0 waits on every worker's process sentinel and pipe at once
(`multiprocessing.connection.wait`): the moment one exits while the pool is not being closed,
it records `tensor-parallel worker rank R exited with code C` (and the error the worker sent),
calls `on_failure` (the engine aborts its collectives, so nothing waits for the dead rank) and
kills the other workers, which cannot go on without it. `check()` raises that error.

Workers ignore SIGINT: Ctrl-C in a terminal reaches the whole process group, and the
workers' fate is rank 0's to decide (`close`, or their lifeline). `close()` reaps them: they
get `grace_s` to exit by themselves (after the engine told them to), then SIGKILL. A
`weakref.finalize` does the same, at the latest at interpreter exit, for a pool nobody closed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from pagedattn.parallel.channel import PipeChannel

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """The tensor-parallel group failed, for good: a worker died (the message names its rank and
    how it ended), or a collective timed out."""


class WorkerProcesses:
    """Ranks 1..world_size-1 as spawned processes running `target(rank, inbox, *args)`, `inbox`
    the worker's `PipeChannel` from rank 0's `channel`.

    `args` must pickle (they travel to a fresh interpreter); `target` must be importable by
    name. Scripts that make a tensor-parallel engine need the `if __name__ == "__main__":`
    guard that `spawn` requires: each worker imports the main module again.
    """

    def __init__(self, world_size: int, target: Callable, args: tuple = (), *,
                 on_failure: Callable[[], None] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._on_failure = on_failure
        self._failure: str | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._errors: dict[int, str] = {}
        self._procs: dict[int, object] = {}
        self._pipes: dict[int, object] = {}
        writers = []
        try:
            for rank in range(1, world_size):
                ours, theirs = ctx.Pipe(duplex=True)
                inbox, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, args=(target, rank, theirs, inbox, args),
                                   name=f"pagedattn-tp-rank{rank}", daemon=False)
                proc.start()
                theirs.close()  # only the worker holds its ends: their closing is the worker's exit
                inbox.close()
                self._procs[rank], self._pipes[rank] = proc, ours
                writers.append(writer)
        except BaseException:
            _reap(list(self._procs.values()), [*self._pipes.values(), *writers], 0.0)
            raise
        self.channel = PipeChannel(writers=writers)
        pipes = [*self._pipes.values(), *writers]
        self._finalizer = weakref.finalize(self, _reap, list(self._procs.values()), pipes, 0.0)
        self._watcher = threading.Thread(target=self._watch, name="pagedattn-tp-watch", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> dict[int, int]:
        """rank -> process id."""
        return {rank: proc.pid for rank, proc in self._procs.items()}

    @property
    def failure(self) -> str | None:
        """Why the pool failed (a worker exited while it was not being closed), else None."""
        return self._failure

    def check(self) -> None:
        """Raise WorkerError when a worker has died."""
        if self._failure is not None:
            raise WorkerError(self._failure)

    def wait_for_failure(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a worker's death to be noticed (a collective failed: was a
        peer gone?); True when one was."""
        self._watcher.join(timeout_s)
        return self._failure is not None

    def stopping(self) -> None:
        """The workers are about to be told to exit: from now on an exit is no failure. Said
        before telling them: a worker leaves the process groups and exits while rank 0 is still
        leaving, and treating that exit as a death would abort rank 0's communicators under its
        own teardown (on two H200s at 2b97658 every TP=2 shutdown ended in glibc's "corrupted
        double-linked list" abort)."""
        self._closing = True

    def close(self, grace_s: float = 10.0) -> None:
        """Reap every worker: `grace_s` seconds to exit (they were told to), then SIGKILL."""
        self.stopping()
        self._finalizer.detach()
        _reap(list(self._procs.values()), [*self._pipes.values(), *self.channel.writers], grace_s)
        self._watcher.join(1.0)

    def _watch(self) -> None:
        live = {proc.sentinel: rank for rank, proc in self._procs.items()}
        pipes = {pipe: rank for rank, pipe in self._pipes.items()}
        while live:
            try:
                ready = wait([*live, *pipes])
            except OSError:  # closed under us by `close`
                return
            for obj in ready:
                if obj in pipes:
                    try:
                        self._errors[pipes[obj]] = obj.recv()
                    except (EOFError, OSError):  # the worker's end closed: it is exiting
                        del pipes[obj]
                    continue
                rank = live.pop(obj)
                if self._closing:
                    continue
                self._procs[rank].join(1.0)
                self._fail(rank)
                return

    def _fail(self, rank: int) -> None:
        proc = self._procs[rank]
        pipe = self._pipes[rank]
        try:  # the error text may still be in the pipe
            while pipe.poll(0.2):
                self._errors[rank] = pipe.recv()
        except (EOFError, OSError):
            pass
        error, trace = self._errors.get(rank, (None, None))
        message = f"tensor-parallel worker rank {rank} exited with code {proc.exitcode}"
        if error:
            message += f": {error}"
        elif proc.exitcode is not None and proc.exitcode < 0:
            message += f" (killed by {_signal_name(-proc.exitcode)})"
        with self._lock:
            self._failure = message
        # INFO, not ERROR: the engine raises the message; the traceback is for whoever logs INFO
        logger.info("%s; stopping the engine%s", message, f"\nrank {rank}'s traceback:\n{trace}" if trace else "")
        if self._on_failure is not None:
            try:
                self._on_failure()
            except Exception:  # noqa: BLE001 - the failure is recorded; what stops the rest is the kill below
                logger.exception("aborting the collectives failed")
        _reap([p for r, p in self._procs.items() if r != rank], [], 0.0)


def _worker_main(target: Callable, rank: int, pipe, inbox, args: tuple) -> None:
    """A worker process: run `target(rank, PipeChannel(reader=inbox), *args)`; report an exception
    up `pipe`; exit when rank 0's end of `pipe` closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(pipe,), name="pagedattn-tp-lifeline", daemon=True).start()
    try:
        target(rank, PipeChannel(reader=inbox), *args)
    except BaseException as e:  # noqa: BLE001 - whatever stops a worker is reported to rank 0
        summary = f"{type(e).__name__}: {e}".strip().splitlines()
        try:
            pipe.send((summary[0] if summary else type(e).__name__, traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)  # no interpreter teardown: torch's may wait on collectives that will never complete
    os._exit(0)


def _exit_with_parent(pipe) -> None:
    try:
        while True:
            pipe.recv()  # rank 0 never sends: this returns only by raising when its end closes
    except (EOFError, OSError):
        os._exit(1)


def _reap(procs: list, pipes: list, grace_s: float) -> None:
    """Wait `grace_s` for `procs` to exit, SIGKILL those left, wait for them; close `pipes`."""
    for proc in procs:
        proc.join(grace_s)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5.0)
    for pipe in pipes:
        pipe.close()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
