"""The one-shot all-reduce kernel (`pagedattn.kernels.all_reduce`) between two ranks that share
its buffers: on the CPU two forked processes over shared memory (interpreted, so that each
rank's waits spin while the other runs); on one GPU two streams of one process (both ranks'
programs resident at once). Against a dense oracle: the sum, the residual add and the RMSNorm,
over several calls (both parities of the slots), every rank with the same bits."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pagedattn.kernels.all_reduce import (MAX_COLS, buffer_bytes, fits,  # noqa: E402
                                          make_slots, one_shot_all_reduce)

WORLD, PROGRAMS, SLOT_BYTES = 2, 4, 8192
EPS = 1e-5


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(6, 64, generator=g) for _ in range(WORLD)]
    bf16 = [torch.randn(5, 96, generator=g).to(torch.bfloat16) for _ in range(WORLD)]
    residual = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(torch.bfloat16)
    move = lambda ts: [t.to(device) for t in ts]  # noqa: E731
    return move(parts), move(bf16), residual.to(device), weight.to(device)


def _calls(rank: int, slots, device) -> list:
    """Each rank's calls, in the same order: three sums (alternating parities), then a sum with
    the residual add and the norm, then a norm without a residual."""
    parts, bf16, residual, weight = _inputs(device)
    out = [one_shot_all_reduce(parts[rank] * (i + 1), slots) for i in range(3)]
    out.extend(one_shot_all_reduce(bf16[rank], slots, weight=weight, eps=EPS, residual=residual))
    out.append(one_shot_all_reduce(bf16[rank], slots, weight=weight, eps=EPS))
    return [*out, slots.counters.clone()]  # on the device: no host wait while a peer may still be launching


def _rank_process(rank: int, buffers, queue) -> None:
    slots = make_slots([b.data_ptr() for b in buffers], rank, SLOT_BYTES, PROGRAMS, torch.device("cpu"))
    queue.put((rank, [t.float().numpy() for t in _calls(rank, slots, torch.device("cpu"))]))


def _run_on_cpu() -> list[list[torch.Tensor]]:
    buffers = [torch.zeros(buffer_bytes(PROGRAMS, WORLD, SLOT_BYTES), dtype=torch.uint8).share_memory_()
               for _ in range(WORLD)]
    ctx = multiprocessing.get_context("fork")  # the children map the buffers at the same addresses
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_process, args=(r, buffers, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [[torch.from_numpy(a) for a in results[r]] for r in range(WORLD)]


def _run_on_gpu() -> list[list[torch.Tensor]]:
    device = torch.device("cuda")
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    # Each rank's calls run once first, alone on buffers of their own with their waits released,
    # on its stream: the kernels compile and load, and the allocator caches every block the calls
    # take on that stream. A device allocation or a module load made while one rank's kernel
    # spins, waiting for the other's launch from this same thread, would wait for that kernel.
    for r in range(WORLD):
        scratch = [torch.zeros(buffer_bytes(PROGRAMS, WORLD, SLOT_BYTES), dtype=torch.uint8, device=device)
                   for _ in range(WORLD)]
        alone = make_slots([b.data_ptr() for b in scratch], r, SLOT_BYTES, PROGRAMS, device)
        alone.abort.fill_(1)
        with torch.cuda.stream(streams[r]):
            _calls(r, alone, device)
        torch.cuda.synchronize()
    buffers = [torch.zeros(buffer_bytes(PROGRAMS, WORLD, SLOT_BYTES), dtype=torch.uint8, device=device)
               for _ in range(WORLD)]
    ptrs = [b.data_ptr() for b in buffers]
    slots = [make_slots(ptrs, r, SLOT_BYTES, PROGRAMS, device) for r in range(WORLD)]
    torch.cuda.synchronize()
    results = [None] * WORLD
    for r in (1, 0):  # rank 1's waits spin until rank 0's flags arrive: both ranks' kernels in flight together
        with torch.cuda.stream(streams[r]):
            results[r] = _calls(r, slots[r], device)
    torch.cuda.synchronize()
    return [[t.float().cpu() for t in rank] for rank in results]


def _gpu_process(queue) -> None:
    queue.put([[t.numpy() for t in rank] for rank in _run_on_gpu()])


def _run_on_gpu_bounded(timeout_s: float = 120.0) -> list[list[torch.Tensor]]:
    """`_run_on_gpu` in a process of its own: a wait that never ends fails the test, not the run."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_gpu_process, args=(queue,))
    proc.start()
    try:
        got = queue.get(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - queue.Empty: the ranks never met
        pytest.fail(f"two ranks on two streams did not finish within {timeout_s:.0f} s")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return [[torch.from_numpy(a) for a in rank] for rank in got]


def test_two_ranks_sum_add_and_normalise_alike():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    got = _run_on_gpu_bounded() if device.type == "cuda" else _run_on_cpu()
    parts, bf16, residual, weight = _inputs(torch.device("cpu"))
    total = sum(parts)
    for i in range(3):
        torch.testing.assert_close(got[0][i], total * (i + 1), rtol=1e-6, atol=1e-5)
    s = (bf16[0].float() + bf16[1].float()).to(torch.bfloat16)
    h = (s.float() + residual.float()).to(torch.bfloat16)
    normed = (weight * F.rms_norm(h.float(), (96,), eps=EPS).to(torch.bfloat16)).float()
    torch.testing.assert_close(got[0][3], normed, rtol=2e-2, atol=2e-2)
    exact = device.type == "cuda"  # the interpreter rounds bfloat16 its own way
    torch.testing.assert_close(got[0][4], h.float(), rtol=0 if exact else 1e-2, atol=0 if exact else 4e-2)
    plain = (weight * F.rms_norm(s.float(), (96,), eps=EPS).to(torch.bfloat16)).float()
    torch.testing.assert_close(got[0][5], plain, rtol=2e-2, atol=2e-2)
    assert got[0][-1].tolist() == [5] * PROGRAMS  # five calls a program
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a, b)  # the same sum order on every rank: the same bits


def test_an_aborted_wait_passes_when_the_peer_never_comes():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    buffers = [torch.zeros(buffer_bytes(PROGRAMS, WORLD, SLOT_BYTES), dtype=torch.uint8, device=device)
               for _ in range(WORLD)]
    slots = make_slots([b.data_ptr() for b in buffers], 0, SLOT_BYTES, PROGRAMS, device)
    slots.abort.fill_(1)
    x = torch.ones(4, 32, device=device)
    assert one_shot_all_reduce(x, slots).shape == x.shape  # returns (its sum garbage)
    assert slots.counters.tolist() == [1] * PROGRAMS


def test_what_the_kernel_takes():
    slots = make_slots([0, 0], 0, SLOT_BYTES, PROGRAMS, torch.device("cpu"))
    assert fits(torch.zeros(8, 256), slots)  # 8 KiB: a whole slot
    assert fits(torch.zeros(4, 16, dtype=torch.float16), slots)
    assert not fits(torch.zeros(8, 257), slots)  # over the slot
    assert not fits(torch.zeros(8, 64)[:, ::2], slots)  # not contiguous
    assert not fits(torch.zeros(4, 4, dtype=torch.int32), slots)
    assert not fits(torch.zeros(1, MAX_COLS + 1, dtype=torch.bfloat16), make_slots([0, 0], 0, 1 << 20, 1,
                                                                                     torch.device("cpu")))
    with pytest.raises(ValueError, match="contiguous float tensor"):
        one_shot_all_reduce(torch.zeros(8, 64)[:, ::2], slots)


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedattn.kernels.all_reduce import _one_shot_kernel
sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
       "data_ptrs": "*i64", "flag_ptrs": "*i64", "counter_ptr": "*i32", "abort_ptr": "*i32", "rank": "i32",
       "n_rows": "i32", "n_cols": "i32", "slot_elems": "i32", "eps": "fp32", "WORLD": "constexpr",
       "RESIDUAL": "constexpr", "NORM": "constexpr", "BLOCK": "constexpr"}
aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12)}  # as the JIT specialises
out = {}
for cc in map(int, sys.argv[1:]):
    for fused in (False, True):
        src = ASTSource(_one_shot_kernel, sig, constexprs={"WORLD": 2, "RESIDUAL": fused, "NORM": fused, "BLOCK": 8192},
                        attrs=aligned)
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 16})
        ptx = k.asm["ptx"]
        out[f"{cc} {fused}"] = {"shared": k.metadata.shared, "release": "atom.global.sys.release" in ptx,
                                "acquire": "ld.global.sys.acquire" in ptx, "vector": "st.global.v4" in ptx}
print(json.dumps(out))
"""


def test_the_kernel_compiles_for_each_gpu_generation():
    # The interpreter never lowers the kernel: compile it for sm_80/86/89/90 (A100, A10, L40S,
    # H100) as the JIT would, and check that the flags keep their system-scope release and
    # acquire, the rows move in 16-byte vectors, and shared memory stays far below any GPU's.
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.compiler", reason="compiling for a GPU target needs triton's backends")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, "80", "86", "89", "90"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 8
    for name, r in report.items():
        assert r["release"] and r["acquire"] and r["vector"], name
        assert r["shared"] < 4096, name
