"""`run_ranks(fn, *args)`: a function run by every rank of a CPU tensor-parallel group (gloo),
each rank a spawned process; what each returned, in rank order.

A rank that raises fails the caller with that rank's traceback; ranks that do not finish within
the time limit are killed, and the caller fails saying so: a broken collective never hangs the
test run. `fn` must be importable by name (a module-level function).
"""

from __future__ import annotations

import queue as queues
import time
import traceback

import torch
import torch.multiprocessing as mp

from pagedattn.parallel.group import Rendezvous, join, leave


def run_ranks(fn, *args, world_size: int = 2, timeout_s: float = 120.0) -> list:
    ctx = mp.get_context("spawn")
    rendezvous = Rendezvous.local(world_size)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, rendezvous, results, args), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queues.Empty:
                raise AssertionError(f"expected {world_size} ranks to finish within {timeout_s:.0f} s, got "
                                     f"{sorted(values)}") from None
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(10.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
    return [values[r] for r in range(world_size)]


def _rank_main(fn, rank: int, rendezvous: Rendezvous, results, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        tp = join(rendezvous, rank, torch.device("cpu"))
        value = fn(tp, *args)
        leave(tp)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, False, traceback.format_exc()))
