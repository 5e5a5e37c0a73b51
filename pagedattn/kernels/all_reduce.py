"""The one-shot all-reduce of a tensor-parallel group's decode-size messages, with the residual
add and RMSNorm that follow a row-parallel layer fused into the same kernel.

Why: at decode sizes an all-reduce is latency, not bandwidth. PyTorch's one-shot kernel
(`torch.ops.symm_mem.one_shot_all_reduce_copy_out`, 24 programs pulling the peers' copies)
took 15.0 us for [64, 8192] bf16 on two H200s (8ca5f19), 160 of them a step of the Llama-3-70B
shape: 2.41 ms of a 23.78 ms step whose floor per GPU is 16.91 ms. Each one was followed by a
residual add + RMSNorm launch that reads the sum back. Here one kernel does both, with every
program's rows in flight at once.

The protocol, per call (every rank makes the same calls in the same order, each over the same
grid of `programs`; `SymmetricSlots` holds what the ranks mapped at start-up):
- each rank's symmetric buffer holds flags (int32 [programs, world]) and two parities of
  `world` slots of `slot_elems` elements each;
- program b owns rows b, b + programs, ... of the message [T, N]. It writes its rows of this
  rank's partial sum into slot [parity][rank] of every peer's buffer (posted writes over
  NVLink/P2P: no round trip per load, as a pull would have);
- then it sets flag [b, rank] in every peer's buffer to the call's number (its counter + 1;
  release, system scope) and waits until each peer's flag [b, peer] in its own buffer has
  reached that number (acquire, system scope; numbers compared modulo 2^32);
- then it sums the ranks' rows in rank order (its own from x) in float32, so every rank gets
  the same bits, rounds to the model dtype, and with a residual and a norm weight adds the
  residual (written out: the new residual stream) and normalises, as `fused_layers.rms_norm`.

No second barrier: a rank writes parity p of call i only after it saw its peers' flags of call
i - 1, which they raise after their call i - 2 (the last one that read parity p) has finished,
kernels on a stream running in order. Numbers only grow, so a fast rank may raise the next
call's flag before a slow one has seen this call's: `>=` still holds. The counters live on the
device, so CUDA graphs replay the protocol as eagerly launched calls do; `abort` (any non-zero)
lets every wait pass, for a peer that died.

The grid is the group's `programs` for every call (at most the SM count, so that every
program of both ranks is resident at once and no wait depends on a program not yet scheduled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, check_tensor, next_pow2
from .fused_layers import norm_warps, rms_norm_row

MAX_COLS = 16384
"""The widest row one program owns (a message's last dimension): hidden sizes up to 16k."""


@dataclass(frozen=True)
class SymmetricSlots:
    """One rank's view of the buffers the ranks mapped for the one-shot kernel."""

    data_ptrs: torch.Tensor
    """int64 [world]: each rank's data slots (device addresses this GPU can read and write)."""
    flag_ptrs: torch.Tensor
    """int64 [world]: each rank's flags, int32 [programs, world]."""
    counters: torch.Tensor
    """int32 [programs]: this rank's calls so far, per program (zero at start)."""
    abort: torch.Tensor
    """int32 [1]: non-zero lets every wait pass (a peer died)."""
    rank: int
    world: int
    slot_bytes: int
    """Bytes of one slot: the largest message."""
    programs: int


@triton.jit(do_not_specialize=["n_rows"])  # one compile for every batch size, 1 included
def _one_shot_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     data_ptrs, flag_ptrs, counter_ptr, abort_ptr,
                     rank, n_rows, n_cols, slot_elems, eps,
                     WORLD: tl.constexpr, RESIDUAL: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    call = tl.load(counter_ptr + pid) + 1
    parity = (call & 1).to(tl.int64)
    for row in range(pid, n_rows, programs):
        offs = row * n_cols + cols  # a message is at most a slot: int32 offsets
        x = tl.load(x_ptr + offs, mask=mask)
        for peer in tl.static_range(WORLD):
            if peer != rank:
                dst = tl.multiple_of(tl.load(data_ptrs + peer).to(tl.pointer_type(dtype)), 16)  # 16-byte slots
                tl.store(dst + (parity * WORLD + rank) * slot_elems + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's rows written before the flags say so
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flags + pid * WORLD + rank, call, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            seen = tl.atomic_add(own_flags + pid * WORLD + peer, 0, sem="acquire", scope="sys")
            while ((seen - call) < 0) & (tl.load(abort_ptr, volatile=True) == 0):
                seen = tl.atomic_add(own_flags + pid * WORLD + peer, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    data = tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(dtype)), 16)
    for row in range(pid, n_rows, programs):
        offs = row * n_cols + cols  # a message is at most a slot: int32 offsets
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for src in tl.static_range(WORLD):
            if src == rank:
                acc += tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                acc += tl.load(data + (parity * WORLD + src) * slot_elems + offs, mask=mask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
        h = acc.to(dtype)
        if RESIDUAL:
            r = tl.load(res_ptr + offs, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + offs, h, mask=mask)
        if NORM:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            h = rms_norm_row(h, w, n_cols, eps, dtype)
        tl.store(out_ptr + offs, h, mask=mask)
    tl.store(counter_ptr + pid, call)


def fits(x: torch.Tensor, slots: SymmetricSlots) -> bool:
    """Whether the kernel takes x: a float dtype, contiguous, rows of at most `MAX_COLS`, at most
    a slot's bytes, on the slots' device (every rank decides the same for the same shape)."""
    nbytes = x.numel() * x.element_size()
    return (x.dtype in FLOAT_DTYPES and 0 < nbytes <= slots.slot_bytes and x.dim() >= 1
            and x.shape[-1] <= MAX_COLS and x.is_contiguous() and x.device == slots.counters.device)


def one_shot_all_reduce(x: torch.Tensor, slots: SymmetricSlots, *, weight: torch.Tensor | None = None,
                        eps: float = 0.0, residual: torch.Tensor | None = None):
    """x (this rank's partial sum, a shape that `fits`) summed over the ranks, in a new tensor.
    With `weight` ([N], x's dtype): the RMSNorm of the sum instead; with `residual` too (x's
    shape): (normed of sum + residual, sum + residual), as `fused_layers.rms_norm` returns.
    Every rank calls it with the same shape and options. x is left as it was."""
    check(fits(x, slots), "x", f"a contiguous float tensor of at most {slots.slot_bytes} bytes, rows of at most "
          f"{MAX_COLS}, on {slots.counters.device}", f"{x.dtype} {tuple(x.shape)} on {x.device}")
    n_cols = x.shape[-1]
    rows = x.view(-1, n_cols)
    out = torch.empty_like(rows)
    res_in = res_out = w = out  # never read or written without a residual or a weight
    if weight is not None:
        check_tensor(weight, "weight", ndim=1, dtypes=(x.dtype,), device=x.device)
        check(weight.shape[0] == n_cols, "weight.shape[0]", n_cols, weight.shape[0])
        w = weight
    if residual is not None:
        check(weight is not None, "residual", "with a norm weight", "no weight")
        check_tensor(residual, "residual", dtypes=(x.dtype,), device=x.device)
        check(residual.shape == x.shape and residual.is_contiguous(), "residual", f"contiguous {tuple(x.shape)}",
              f"{tuple(residual.shape)} strides {residual.stride()}")
        res_in, res_out = residual.view(-1, n_cols), torch.empty_like(out)
    block = next_pow2(n_cols)
    _one_shot_kernel[(slots.programs,)](
        rows, res_in, w, out, res_out,
        slots.data_ptrs, slots.flag_ptrs, slots.counters, slots.abort,
        slots.rank, rows.shape[0], n_cols, slots.slot_bytes // x.element_size(), float(eps),
        WORLD=slots.world, RESIDUAL=residual is not None, NORM=weight is not None, BLOCK=block,
        num_warps=norm_warps(block),
    )
    out = out.view_as(x)
    return out if residual is None else (out, res_out.view_as(x))


def flag_bytes(programs: int, world: int) -> int:
    """Bytes of the flags at the start of each rank's buffer (a multiple of 4 KiB, so the data
    slots after them start aligned)."""
    return -(-programs * world * 4 // 4096) * 4096


def buffer_bytes(programs: int, world: int, slot_bytes: int) -> int:
    """Bytes of each rank's symmetric buffer: the flags, then 2 parities x `world` slots."""
    return flag_bytes(programs, world) + 2 * world * slot_bytes


def make_slots(buffer_ptrs: list[int], rank: int, slot_bytes: int, programs: int,
               device: torch.device) -> SymmetricSlots:
    """The slots over the ranks' buffers (`buffer_ptrs[r]`: rank r's buffer as this GPU maps it,
    each `buffer_bytes` long and zeroed before any rank's first call)."""
    world = len(buffer_ptrs)
    offset = flag_bytes(programs, world)
    return SymmetricSlots(
        data_ptrs=torch.tensor([p + offset for p in buffer_ptrs], dtype=torch.int64, device=device),
        flag_ptrs=torch.tensor(buffer_ptrs, dtype=torch.int64, device=device),
        counters=torch.zeros(programs, dtype=torch.int32, device=device),
        abort=torch.zeros(1, dtype=torch.int32, device=device),
        rank=rank, world=world, slot_bytes=slot_bytes, programs=programs,
    )
