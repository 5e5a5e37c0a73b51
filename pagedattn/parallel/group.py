"""The tensor-parallel group: this process's rank, the group's size, and the collectives that
the model's layers and the engine's step hand-off use.

- the device group (NCCL on CUDA, gloo on the CPU), torch.distributed's default group: the
  all-reduces of row-parallel layers, the all-gather of the vocab-parallel output head, and
  the step's device tensors that only rank 0 holds (token ids drawn on its GPU: async
  scheduling, multi-step decoding). Its collectives are queued on the device stream, never
  wait for the host, and are captured in the decode CUDA graphs. On GPUs of one host with
  peer access, all-reduces of decode-step sizes run a one-shot kernel over symmetric memory
  instead of NCCL (`pagedattn.parallel.all_reduce`); `TPGroup.all_reduce_name` says which;
- the channel (`pagedattn.parallel.channel`): rank 0's messages, once per step, on the host
  (`send` / `receive`).

The rendezvous is torchrun's when its variables are set (`Rendezvous.from_environment`: a
multi-node `torchrun --nnodes` launch joins the same way), else a free port on this host
(`Rendezvous.local`), where rank 0 spawns the other ranks itself.

`TPGroup(rank=0, size=1)` (the default) is one process without torch.distributed: every
collective is the identity, so models built for tensor parallelism run unchanged alone.
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedattn.cuda_timing import capture, median_event_ms
from pagedattn.parallel.all_reduce import OneShotAllReduce, make_one_shot
from pagedattn.parallel.channel import IDLE_TIMEOUT, GlooChannel

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
"""The device group's timeout (torch's NCCL default), and the rendezvous': a collective that
waits longer raises (gloo) or has NCCL's watchdog abort the process. Ranks reach their first
collective after loading their shard, so it covers a slow disk. A worker that dies is
noticed in seconds by its process sentinel (`pagedattn.parallel.workers`), not by this."""
# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; 2.11 has the old name only
_all_gather_single = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one tensor-parallel group meet (torch.distributed's TCP store)."""

    host: str
    port: int
    world_size: int
    launched: bool = False
    """True under torchrun (the ranks were started by it, rank 0 starts none)."""
    rank: int = 0
    """This process's rank when `launched` (torchrun's RANK)."""
    local_rank: int = 0
    """This process's GPU on its host when `launched` (torchrun's LOCAL_RANK)."""
    local_world_size: int | None = None
    """Ranks on this host (torchrun's LOCAL_WORLD_SIZE; None: unknown); `local` ranks all are."""

    @property
    def one_host(self) -> bool:
        """Whether every rank runs on this host (so their GPUs may map each other's memory)."""
        return not self.launched or self.local_world_size == self.world_size

    @classmethod
    def local(cls, world_size: int) -> Rendezvous:
        """A free TCP port on the loopback interface, for ranks that rank 0 spawns on this host."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return cls("127.0.0.1", port, world_size)

    @classmethod
    def from_environment(cls, environ=os.environ) -> Rendezvous | None:
        """torchrun's rendezvous (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK), or
        None when this process was not started by it. ValueError when only some are set."""
        names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
        present = [n for n in names if n in environ]
        if not present:
            return None
        if len(present) < len(names):
            missing = [n for n in names if n not in environ]
            raise ValueError(f"expected torchrun's variables {list(names)} all set or none, got {present} without "
                             f"{missing}")
        try:
            local_world_size = environ.get("LOCAL_WORLD_SIZE")
            return cls(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), int(environ["WORLD_SIZE"]), launched=True,
                       rank=int(environ["RANK"]), local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])),
                       local_world_size=None if local_world_size is None else int(local_world_size))
        except ValueError:
            raise ValueError(f"expected integer MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE, got "
                             f"{[environ.get(n) for n in (*names, 'LOCAL_RANK', 'LOCAL_WORLD_SIZE')]}") from None


@dataclass(frozen=True, eq=False)
class TPGroup:
    """One rank's view of its tensor-parallel group (`rank` of `size`). Models keep it; it
    reads no process-global state, so a model built alone (`TPGroup()`) never touches
    torch.distributed."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    """Where the device group's tensors live (this rank's GPU, or the CPU)."""
    device_group: object | None = field(default=None, repr=False)
    channel: object | None = field(default=None, repr=False)
    """rank 0's messages to the others (`PipeChannel` or `GlooChannel`)."""
    owns_world: bool = field(default=False, repr=False)
    """True when `join` made torch.distributed's default group (so `leave` destroys it)."""
    one_shot: OneShotAllReduce | None = field(default=None, repr=False)
    """The one-shot all-reduce of the messages it `fits`, or None (NCCL or gloo for all)."""
    all_reduce_name: str = "none (one rank)"
    """Which all-reduce runs, and for what sizes (`pagedattn info` and the engine's log say it)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks: the one-shot's new tensor where it fits, else x, in place
        (NCCL or gloo). Use the returned tensor."""
        if self.size == 1:
            return x
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        return self.group_all_reduce(x)

    def all_reduce_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None):
        """RMSNorm of x summed over the ranks [plus `residual`] in one kernel, as
        `kernels.fused_layers.rms_norm` returns it (normed, or (normed, sum + residual)), where
        the one-shot takes x; None otherwise (the caller all-reduces, then normalises)."""
        if self.size > 1 and self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot.norm(x, weight, eps, residual)
        return None

    def group_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks by the device group's own collective (NCCL, or gloo on the
        CPU), in place; returned. `all_reduce` picks it for what the one-shot does not take."""
        torch.distributed.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C] of every rank side by side: [N, size * C] (rank r's columns r*C..(r+1)*C)."""
        if self.size == 1:
            return x
        out = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=self.device_group)
        return out.view(self.size, x.shape[0], x.shape[1]).transpose(0, 1).reshape(x.shape[0], -1)  # [N, size, C]

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """x's elementwise largest over the ranks, in place (the device group's collective);
        returned."""
        if self.size > 1:
            torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=self.device_group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), in place; returned."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0, group=self.device_group)
        return x

    def min(self, value: int) -> int:
        """The smallest of the ranks' `value` (each rank's KV pool sized by its own memory)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.device_group)
        return int(t.item())

    def send(self, message) -> None:
        """Rank 0: `message` (picklable) to every other rank's `receive`."""
        self.channel.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def receive(self):
        """Ranks 1..size-1: the next message rank 0 `send`s."""
        return pickle.loads(self.channel.receive())


def join(rendezvous: Rendezvous, rank: int, device: torch.device, *, channel=None,
         alive: Callable[[], None] | None = None, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> TPGroup:
    """Join the group as `rank` on `device` (cuda:i or the CPU). `channel`: rank 0's messages
    (a `PipeChannel` for spawned ranks); None makes a `GlooChannel` over a new gloo group.

    Under torchrun the process group torchrun's environment describes is made (or, when the
    program made it already, used: its size must be the rendezvous'). Otherwise rank 0 hosts the
    TCP store and waits for the others to reach it, calling `alive()` every 0.1 s, which raises
    when a spawned rank has died (a rank that never arrives is then known in seconds, not after
    `timeout`).
    """
    dist = torch.distributed
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    if backend == "nccl" and rank == 0:
        # Rank 0 is the caller's process: on a collective's error or timeout NCCL's watchdog
        # tears its process down by default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3); 2 aborts the
        # communicators instead, so that the engine raises (read when the group is made).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    owns_world = not dist.is_initialized()
    if not owns_world:
        if dist.get_world_size() != rendezvous.world_size:
            raise ValueError(f"expected torch.distributed's group of {rendezvous.world_size} processes (the "
                             f"tensor-parallel size), got one of {dist.get_world_size()} already made by the program")
    elif rendezvous.launched:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=rendezvous.world_size,
                                timeout=timeout, device_id=device_id)
    else:
        store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
        store.add("joined", 1)
        if rank == 0:
            _wait_for_ranks(store, rendezvous.world_size, timeout, alive)
        dist.init_process_group(backend, store=store, rank=rank, world_size=rendezvous.world_size,
                                timeout=timeout, device_id=device_id)
    if channel is None:
        channel = GlooChannel(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))
    one_shot, name = None, backend
    if backend == "nccl":
        one_shot, name = make_one_shot(dist.group.WORLD, device, rendezvous.world_size, one_host=rendezvous.one_host,
                                       alive=alive)
    return TPGroup(rank, rendezvous.world_size, device, dist.group.WORLD, channel, owns_world, one_shot, name)


def _wait_for_ranks(store, world_size: int, timeout: datetime.timedelta, alive: Callable[[], None] | None) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    while (joined := store.add("joined", 0)) < world_size:
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"expected {world_size} tensor-parallel ranks at the rendezvous within "
                               f"{timeout.total_seconds():.0f} s, got {joined}")
        time.sleep(0.1)


def leave(group: TPGroup, *, abort: bool = False) -> None:
    """Tear the process groups down (the last use of `group`). `abort`: a rank died, so NCCL's
    pending collectives are aborted rather than waited for (torch's experimental
    `_abort_process_group`, which also forgets every group of this process)."""
    dist = torch.distributed
    if group.size == 1 or not dist.is_initialized():
        return
    if abort and group.device.type == "cuda":
        try:
            dist.distributed_c10d._abort_process_group()
        except (AttributeError, RuntimeError, ValueError):  # a torch without it, or gone already
            pass
        return
    if group.owns_world:
        dist.destroy_process_group()
    elif isinstance(group.channel, GlooChannel):
        dist.destroy_process_group(group.channel.group)


def abort_collectives(group: TPGroup) -> None:
    """Abort the device group's NCCL communicators, and release the one-shot all-reduce's
    barriers (`OneShotAllReduce.release`), from any thread: kernels waiting for a dead rank
    return (their results are garbage) and a host waiting on them wakes. The groups stay
    registered (the thread that uses them may be inside a collective's Python code) until
    `leave(abort=True)`. Nothing for gloo, whose collectives fail when a peer's socket closes."""
    if group.size == 1 or group.device.type != "cuda":
        return
    if group.one_shot is not None:
        group.one_shot.release()
    try:
        group.device_group.abort()
    except (AttributeError, RuntimeError):  # aborted already, or a torch without it
        pass


def time_all_reduce(group: TPGroup, x: torch.Tensor, *, count: int, reps: int,
                    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """Seconds of one all-reduce of `x` over `group` (every rank calls it with the same shape) by
    `all_reduce` (None: `group.all_reduce`, whichever it picks for `x`): on CUDA, a graph of
    `count` of them replayed `reps` times, the median replay divided by `count` (launch gaps
    excluded, as inside a decode graph); on the CPU, the median of `reps`."""
    all_reduce = all_reduce or group.all_reduce
    if x.device.type != "cuda":
        all_reduce(x)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            all_reduce(x)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    graph = capture([functools.partial(all_reduce, x)] * count)  # run once first: communicators exist
    return median_event_ms(graph.replay, reps, warmup=1) / 1e3 / count
