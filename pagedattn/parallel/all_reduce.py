"""The one-shot all-reduce of a tensor-parallel group over symmetric memory: the small messages
of decode steps, with the residual add and RMSNorm after them fused in; NCCL keeps everything
else (and gloo everything on the CPU).

Why: a row-parallel layer sums its partial output [T, hidden] over the ranks twice a layer. At
decode sizes that is latency, not bandwidth: NCCL's ring took 25.6 us for [64, 4096] bf16
(512 KiB) inside a CUDA graph on two H200s, two a layer: 1.64 ms of a Llama-3-8B step (0.84x
the step's floor per GPU); PyTorch's one-shot kernel (`torch.ops.symm_mem`) 11.2 us, and 15.0 us
at [64, 8192]. Ours (`pagedattn.kernels.all_reduce`, the protocol there) is one kernel over
buffers every rank has mapped (symmetric memory: CUDA virtual-memory handles exchanged once at
start-up, written over NVLink/P2P): each rank pushes its rows into its peers' buffers, the
ranks meet at flags in that memory, and each sums the rows, adding the residual and
normalising in the same pass when a norm follows (`OneShotAllReduce.norm`). No proxy thread,
no second stream: it is captured in the decode CUDA graphs like any kernel. NVLink multicast
(multimem instructions) is never used: the GPU machines run with it off
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0).

Which all-reduce runs: the one-shot where it applies (`OneShotAllReduce.fits`: a float dtype,
contiguous, rows of at most 16k, at most `one_shot_max_bytes`), NCCL otherwise. `make_one_shot`
builds it on every rank together at `join`, or says why not (`one_shot_unsupported`: not CUDA,
ranks on several hosts, no P2P access between the GPUs, a torch without symmetric memory; or
the buffer's allocation, rendezvous or a first checked sum failed on some rank); every rank
then agrees, so all take the same path. Nothing here runs on the CPU.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedattn.device_profile import DeviceProfile

if TYPE_CHECKING:  # the kernels are imported where they run: importing them reads TRITON_INTERPRET
    from pagedattn.kernels.all_reduce import SymmetricSlots

logger = logging.getLogger(__name__)

ONE_SHOT_PEER_BYTES = 2 << 20
"""The most bytes one one-shot all-reduce writes to its peers: (size - 1) x the message.
At 2 ranks both algorithms move the same bytes per rank (the one-shot writes its copy to the
peer, N; NCCL's ring sends N/2 in each of its two phases), so the one-shot's single kernel and
barrier win wherever it keeps the link as busy as NCCL: the 2 MiB bound takes every decode step
up to batch 256 at hidden 4096 (batch 128 at 8192), where NCCL's latency dominates, and leaves
prefill chunks (2048 tokens at hidden 4096: 16 MiB) to NCCL's ring. vLLM runs its one-stage
kernel at 2 GPUs up to 8 MiB; at 4 and 8 ranks it switches to two-stage above 512 and 256 KiB,
since a one-shot then moves 3x and 7x the message: dividing this bound by (size - 1) gives 682
and 292 KiB there. `scripts/tp_gpu_check.py` times the algorithms at 0.5 to 8 MiB to check
the bound."""
MAX_PROGRAMS = 64
"""The one-shot kernel's grid at most (the SM count on smaller GPUs): one program a row of a
[64, hidden] decode message, every row's writes in flight at once."""
_ALIGN = 16  # bytes: messages and slots in whole 16-byte vectors


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
    if not hasattr(torch.distributed, "_symmetric_memory"):
        return f"torch {torch.__version__} has no symmetric memory"
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
    """Sums a tensor over the group through the ranks' mapped buffers (`slots`; `handle` the
    symmetric-memory rendezvous that keeps them mapped): `fits(x)`, then `x = one_shot(x)`, or
    `one_shot.norm(x, weight, eps, residual)` for the sum's residual add and RMSNorm at once."""

    def __init__(self, slots: SymmetricSlots, handle=None, buffer: torch.Tensor | None = None) -> None:
        from pagedattn.kernels import all_reduce as kernel

        self._kernel = kernel
        self.slots = slots
        self.handle = handle
        self.buffer = buffer  # the symmetric allocation: kept while the kernel may write into it
        self._side = None

    @property
    def max_bytes(self) -> int:
        return self.slots.slot_bytes

    def fits(self, x: torch.Tensor) -> bool:
        """Whether the kernel takes `x`: a float dtype, contiguous, rows (the last dimension) of
        at most 16k, at most `max_bytes`, on the group's device."""
        return self._kernel.fits(x, self.slots)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (any shape that `fits`) summed over the ranks, in a new tensor; x is left as it was.
        No allocation but the output's (from the graph's pool inside a capture), no host wait."""
        return self._kernel.one_shot_all_reduce(x, self.slots)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        """RMSNorm (`weight`, `eps`) of x summed over the ranks [plus `residual`], as
        `fused_layers.rms_norm` returns it: normed, or (normed, sum + residual)."""
        return self._kernel.one_shot_all_reduce(x, self.slots, weight=weight, eps=eps, residual=residual)

    def release(self) -> None:
        """A peer died: every wait of this rank's queued and future one-shot kernels passes
        (their sums garbage), as aborting NCCL lets its kernels return. Without it the device
        stream would never drain, and freeing the buffer (which synchronises the device) would
        hang the process. Any thread may call it; it does not wait."""
        device = self.slots.abort.device
        with torch.cuda.device(device):
            self._side = self._side or torch.cuda.Stream(device)  # beside the kernel that spins
            with torch.cuda.stream(self._side):
                self.slots.abort.fill_(1)


def make_one_shot(device_group, device: torch.device, size: int, *, one_host: bool,
                  alive: Callable[[], None] | None = None) -> tuple[OneShotAllReduce | None, str]:
    """Every rank of `device_group` (NCCL, `size` ranks, this rank on `device`) calls it at
    once: (the one-shot all-reduce, its description), or (None, why the group keeps NCCL alone).
    Each step is agreed on by all ranks before the next (an all-reduce of a flag, waited for
    while polling `alive()`, which raises when a spawned rank has died), so one rank's failure
    leaves every rank on NCCL rather than some waiting for a peer that gave up; a rank that dies
    inside the rendezvous itself, while the others wait in it, is left to the store's timeout."""
    import torch.distributed._symmetric_memory as symm_mem

    from pagedattn.kernels.all_reduce import buffer_bytes, make_slots

    why = one_shot_unsupported(device, size, one_host=one_host)
    max_bytes = one_shot_max_bytes(size)
    one_shot = buffer = None
    if why is None:
        programs = min(MAX_PROGRAMS, DeviceProfile.of(device).num_sms)
        try:
            buffer = symm_mem.empty(buffer_bytes(programs, size, max_bytes), dtype=torch.uint8, device=device)
            buffer.zero_()  # the flags start at zero on every rank before any rank's first call
        except Exception as e:  # noqa: BLE001 - any failure means NCCL; the reason is reported
            why = f"symmetric memory could not be allocated ({type(e).__name__}: {e})"
    agree = functools.partial(_agree, device_group=device_group, device=device, alive=alive)
    why = agree(why, "could not allocate symmetric memory")
    if why is None:
        try:
            handle = symm_mem.rendezvous(buffer, device_group.group_name)
            slots = make_slots(list(handle.buffer_ptrs), handle.rank, max_bytes, programs, device)
            one_shot = OneShotAllReduce(slots, handle, buffer)
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
    x = torch.full((one_shot.max_bytes // 4096, 1024), float(rank + 1), dtype=torch.float32, device=device)
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
