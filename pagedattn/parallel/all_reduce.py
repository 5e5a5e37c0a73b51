"""The one-shot all-reduce of a tensor-parallel group over symmetric memory: the small messages
of decode steps; NCCL keeps everything else (and gloo everything on the CPU).

Why: a row-parallel layer sums its partial output [T, hidden] over the ranks twice a layer. At
decode sizes that is latency, not bandwidth: NCCL's ring took 25.6 us for [64, 4096] bf16
(512 KiB) inside a CUDA graph on two H200s, two a layer: 1.64 ms of a Llama-3-8B step (0.84x
the step's floor per GPU). A one-shot all-reduce (vLLM's custom all-reduce; PyTorch's
`torch.ops.symm_mem.one_shot_all_reduce_copy_out`, used here) is one kernel: each rank copies
its input into a buffer that every rank has mapped (symmetric memory: CUDA virtual-memory
handles exchanged once at start-up, read over NVLink/P2P), the ranks meet at a barrier of flags
in that memory, each sums every rank's copy into its output, and a second barrier keeps the next
call from overwriting a copy a peer still reads. No proxy thread, no second stream: it is
captured in the decode CUDA graphs like any kernel, and consecutive calls may share the buffer.
NVLink multicast (multimem instructions) is never used: the GPU machines run with it off
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0), and the one-shot kernel needs only
the peers' buffer pointers.

Which all-reduce runs: the one-shot where it applies (`OneShotAllReduce.fits`: bfloat16 or
float32, the kernel's dtypes; contiguous, 16-byte aligned; at most `one_shot_max_bytes`),
NCCL otherwise. `make_one_shot` builds it on every rank together at `join`, or says why not
(`one_shot_unsupported`: not CUDA, ranks on several hosts, no P2P access between the GPUs, a
torch without the op; or the buffer's allocation, rendezvous or a first checked sum failed on
some rank); every rank then agrees, so all take the same path. Nothing here runs on the CPU.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ONE_SHOT_PEER_BYTES = 2 << 20
"""The most bytes one one-shot all-reduce reads from its peers: (size - 1) x the message.
At 2 ranks both algorithms move the same bytes per rank (the one-shot reads the peer's copy, N;
NCCL's ring receives N/2 in each of its two phases), so the one-shot's single kernel and barrier
win wherever its grid (24 blocks of 512 threads in torch's kernel) keeps the link as busy as
NCCL: the 2 MiB bound takes every decode step up to batch 256 at hidden 4096 (batch 128 at
8192), where NCCL's latency dominates, and leaves prefill chunks (2048 tokens at hidden 4096:
16 MiB) to NCCL's ring. vLLM runs its one-stage kernel at 2 GPUs up to 8 MiB; at 4 and 8 ranks it
switches to two-stage above 512 and 256 KiB, since a one-shot then reads 3x and 7x the message:
dividing this bound by (size - 1) gives 682 and 292 KiB there. `scripts/tp_gpu_check.py`
times both algorithms at 0.5, 2 and 8 MiB to check the bound."""
RELEASE_TIMEOUT_S = 30.0
"""After a peer died, how long `OneShotAllReduce.release` keeps this rank's queued one-shot
kernels passing their barriers before it gives up."""
_RELEASE_SLOTS = 1024  # signal-pad flags kept released: the kernel's blocks (24 at most) x ranks
_DTYPES = (torch.bfloat16, torch.float32)  # what torch's one-shot kernel is built for (no float16)
_ALIGN = 16  # bytes: the kernel's vector width; the buffer and the input must agree on alignment


def one_shot_max_bytes(size: int) -> int:
    """The largest message a group of `size` ranks sums with the one-shot all-reduce."""
    return ONE_SHOT_PEER_BYTES // max(1, size - 1) // _ALIGN * _ALIGN


def one_shot_unsupported(device: torch.device, size: int, *, one_host: bool = True) -> str | None:
    """Why a group of `size` ranks on `device`'s kind (cuda:0..size-1 on one host) cannot run
    the one-shot all-reduce, or None when it can (as far as can be known before trying)."""
    if device.type != "cuda":
        return f"it needs CUDA, got {device.type}"
    if not one_host:
        return "the ranks are on several hosts (symmetric memory maps GPUs of one host)"
    if torch.version.hip is not None:
        return "it needs CUDA's symmetric memory, got ROCm"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce_copy_out"
    if torch.cuda.device_count() < size:
        return f"this process sees {torch.cuda.device_count()} GPUs, fewer than the {size} ranks"
    for a in range(size):
        for b in range(size):
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"cuda:{a} has no peer-to-peer access to cuda:{b}"
    return None


def planned(device: torch.device, size: int) -> str:
    """What a group of `size` ranks on `device`'s kind would all-reduce with, as far as can be
    known without making it (`pagedattn info`): the group itself may still fall back to NCCL."""
    if device.type != "cuda":
        return "gloo (the one-shot needs CUDA)"
    why = one_shot_unsupported(device, size)
    return f"NCCL (no one-shot: {why})" if why else _describe(one_shot_max_bytes(size))


def _describe(max_bytes: int) -> str:
    return f"one-shot over symmetric memory up to {_size(max_bytes)}, NCCL above"


class OneShotAllReduce:
    """Sums a tensor over the group through `buffer` (uint8 [max_bytes], symmetric memory
    rendezvoused over the group named `group_name`; `handle` the rendezvous' `_SymmetricMemory`):
    `fits(x)`, then `x = one_shot(x)`."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int, handle=None) -> None:
        self.buffer = buffer
        self.group_name = group_name
        self.max_bytes = max_bytes
        self.handle = handle

    def fits(self, x: torch.Tensor) -> bool:
        """Whether the one-shot kernel takes `x`: its dtype, contiguous and 16-byte aligned (start
        and size, as the buffer's view is), at most `max_bytes`, on the buffer's device."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype in _DTYPES and 0 < nbytes <= self.max_bytes and nbytes % _ALIGN == 0
                and (x.storage_offset() * x.element_size()) % _ALIGN == 0 and x.is_contiguous()
                and x.device == self.buffer.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (any shape that `fits`) summed over the ranks, in a new tensor; x is left as it was.
        No allocation but the output's (from the graph's pool inside a capture), no host wait."""
        staging = self.buffer.view(x.dtype)[: x.numel()].view_as(x)  # the kernel copies x here first
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)
        return out

    def release(self) -> None:
        """A peer died: let this rank's queued one-shot kernels finish (their sums garbage), as
        aborting NCCL lets its kernels return. Each barrier spins until every peer's flag
        arrives, which a dead peer never sends; a daemon thread keeps this rank's flags raised
        and the peers' cleared (on a stream of its own, beside the spinning kernel's at most 24
        blocks) until the device's default stream has drained, or RELEASE_TIMEOUT_S. Without it
        that stream would never drain, and freeing the buffer (which synchronises the device)
        would hang the process. Any thread may call it."""
        if self.handle is not None:
            threading.Thread(target=self._release, name="pagedattn-one-shot-release", daemon=True).start()

    def _release(self) -> None:
        device = self.buffer.device
        slots = min(self.handle.signal_pad_size // 4, _RELEASE_SLOTS)
        with torch.cuda.device(device):
            pads = [self.handle.get_signal_pad(r, [slots], torch.int32) for r in range(self.handle.world_size)]
            mine = pads.pop(self.handle.rank)
            side, queued = torch.cuda.Stream(device), torch.cuda.default_stream(device)
            deadline = time.monotonic() + RELEASE_TIMEOUT_S
            while not queued.query() and time.monotonic() < deadline:
                with torch.cuda.stream(side):
                    mine.fill_(1)  # every wait of this rank's barriers passes
                    for pad in pads:
                        pad.fill_(0)  # every flag this rank puts to a peer finds its slot free
                side.synchronize()
                time.sleep(0.001)


def make_one_shot(device_group, device: torch.device, size: int, *, one_host: bool,
                  alive: Callable[[], None] | None = None) -> tuple[OneShotAllReduce | None, str]:
    """Every rank of `device_group` (NCCL, `size` ranks, this rank on `device`) calls it at
    once: (the one-shot all-reduce, its description), or (None, why the group keeps NCCL alone).
    Each step is agreed on by all ranks before the next (an all-reduce of a flag, waited for
    while polling `alive()`, which raises when a spawned rank has died), so one rank's failure
    leaves every rank on NCCL rather than some waiting for a peer that gave up; a rank that dies
    inside the rendezvous itself, while the others wait in it, is left to the store's timeout."""
    import torch.distributed._symmetric_memory as symm_mem

    why = one_shot_unsupported(device, size, one_host=one_host)
    max_bytes = one_shot_max_bytes(size)
    one_shot = buffer = None
    if why is None:
        try:
            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        except Exception as e:  # noqa: BLE001 - any failure means NCCL; the reason is reported
            why = f"symmetric memory could not be allocated ({type(e).__name__}: {e})"
    agree = functools.partial(_agree, device_group=device_group, device=device, alive=alive)
    why = agree(why, "could not allocate symmetric memory")
    if why is None:
        try:
            handle = symm_mem.rendezvous(buffer, device_group.group_name)
            one_shot = OneShotAllReduce(buffer, device_group.group_name, max_bytes, handle)
        except Exception as e:  # noqa: BLE001
            why = f"the symmetric-memory rendezvous failed ({type(e).__name__}: {e})"
    why = agree(why, "failed the symmetric-memory rendezvous")
    if why is None:
        why = agree(_check(one_shot, device, torch.distributed.get_rank(device_group), size),
                    "failed a checked one-shot sum")
    if why is not None:
        logger.info("tensor-parallel all-reduce: NCCL alone (no one-shot: %s)", why)
        return None, f"NCCL (no one-shot: {why})"
    return one_shot, _describe(max_bytes)


def _check(one_shot: OneShotAllReduce, device: torch.device, rank: int, size: int) -> str | None:
    """Why a first one-shot sum of known values (rank r adds r + 1, eagerly) is wrong, or None: a
    mapping that reads the wrong memory shows here, not as wrong tokens."""
    x = torch.full((one_shot.max_bytes // 4,), float(rank + 1), dtype=torch.float32, device=device)
    try:
        got = one_shot(x)
    except Exception as e:  # noqa: BLE001
        return f"a checked one-shot sum failed ({type(e).__name__}: {e})"
    want = size * (size + 1) / 2
    if not bool((got == want).all()):
        return f"a checked one-shot sum gave {got.unique()[:4].tolist()}, expected {want}"
    return None


def _agree(why: str | None, elsewhere: str, *, device_group, device: torch.device,
           alive: Callable[[], None] | None) -> str | None:
    """None when no rank has a reason; else this rank's reason, or that another rank `elsewhere`."""
    ok = torch.tensor([0 if why else 1], dtype=torch.int32, device=device)
    work = torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=device_group, async_op=True)
    while alive is not None and not work.is_completed():
        alive()
        time.sleep(0.01)
    work.wait()
    if int(ok.item()) == 1:
        return None
    return why or f"another rank {elsewhere}"


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:g} KiB"
