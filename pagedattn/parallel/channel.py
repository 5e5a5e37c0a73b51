"""How rank 0's messages (each step's plan, pickled) reach the other ranks: once per step, on
the host, one-way.

- `PipeChannel`: ranks that rank 0 spawned on its host read a pipe each, which rank 0 writes.
  A write returns as soon as the kernel holds the bytes (the pipe is made 1 MiB deep where
  the system allows), so rank 0 never waits for a worker, and a waiting worker wakes within
  microseconds. gloo's broadcast waits for the receiver to post its buffer first (a round
  trip a message: 0.8 ms measured on a loaded 2-core CPU, against tens of microseconds for a
  pipe); the host time of a decode step is a few hundred microseconds.
- `GlooChannel`: ranks that torchrun started, maybe on other hosts, where there is no pipe:
  a broadcast over a gloo group of host memory, length first.

A worker waits on its channel between steps for as long as rank 0 is idle (a server at
night): the gloo group's timeout is `IDLE_TIMEOUT`, not the collectives' one. A plan sent over
NCCL would pass through device memory, and its copy to a worker's host would wait for that
worker's previous step: its host work could no longer overlap its device's.
"""

from __future__ import annotations

import datetime
import fcntl

import torch

IDLE_TIMEOUT = datetime.timedelta(days=365)
"""The gloo channel's timeout: how long a worker may wait for rank 0's next message."""
PIPE_BYTES = 1 << 20
_LENGTH = 8  # bytes of a message's length, sent before it (gloo)


class PipeChannel:
    """Rank 0's write ends (`writers`, one a worker) or a worker's read end (`reader`) of
    `multiprocessing` pipes."""

    def __init__(self, writers=(), reader=None) -> None:
        self.writers = list(writers)
        self.reader = reader
        for w in self.writers:
            deepen(w)

    def send(self, data: bytes) -> None:
        for w in self.writers:
            w.send_bytes(data)

    def receive(self) -> bytes:
        """The next message; EOFError once rank 0's end is closed (it has gone)."""
        return self.reader.recv_bytes()


def deepen(connection) -> None:
    """Make a pipe `PIPE_BYTES` deep (Linux' F_SETPIPE_SZ), so that a step's plan (block tables
    of hundreds of sequences: hundreds of KB) fits without the writer waiting; a system that
    refuses keeps its default (64 KiB)."""
    try:
        fcntl.fcntl(connection.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (OSError, ValueError):
        pass


class GlooChannel:
    """A broadcast from rank 0 over `group` (gloo): the length, then the bytes."""

    def __init__(self, group) -> None:
        self.group = group

    def send(self, data: bytes) -> None:
        payload = torch.frombuffer(bytearray(len(data).to_bytes(_LENGTH, "little") + data), dtype=torch.uint8)
        torch.distributed.broadcast(payload[:_LENGTH].clone(), src=0, group=self.group)
        torch.distributed.broadcast(payload[_LENGTH:], src=0, group=self.group)

    def receive(self) -> bytes:
        header = torch.empty(_LENGTH, dtype=torch.uint8)
        torch.distributed.broadcast(header, src=0, group=self.group)
        payload = torch.empty(int.from_bytes(header.numpy().tobytes(), "little"), dtype=torch.uint8)
        torch.distributed.broadcast(payload, src=0, group=self.group)
        return payload.numpy().tobytes()
