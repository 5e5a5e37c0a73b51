"""Which all-reduce a tensor-parallel group runs (`pagedattn.parallel.all_reduce`): on the CPU
gloo, always, and said so; the one-shot's size bound and the tensors it takes; a group holding a
one-shot (a stand-in that sums through gloo, since the kernel needs CUDA) sends it what fits and
everything else to the group's own collective; why a group keeps NCCL; the timing helper."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from pagedattn.models.layers import RMSNorm
from pagedattn.parallel.all_reduce import (ONE_SHOT_PEER_BYTES, OneShotAllReduce, one_shot_max_bytes,
                                           one_shot_unsupported, planned)
from pagedattn.parallel.group import Rendezvous, time_all_reduce

from .ranks import run_ranks

MAX_BYTES = 1024  # the stand-in's bound: small, so that both paths run on small tensors


class _GlooOneShot(OneShotAllReduce):
    """The one-shot's routing and contract (a new tensor, x untouched) over gloo, counting calls."""

    def __init__(self) -> None:
        from pagedattn.kernels.all_reduce import make_slots  # at run time: importing kernels reads TRITON_INTERPRET

        super().__init__(make_slots([0, 0], 0, MAX_BYTES, 1, torch.device("cpu")))
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = x.clone()
        torch.distributed.all_reduce(out)
        return out

    def norm(self, x, weight, eps, residual=None):
        h = self(x) if residual is None else self(x) + residual
        normed = weight * torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)
        return normed if residual is None else (normed, h)


def _route(tp) -> dict:
    """Each case's sum and which path took it (one-shot calls made, input left as it was)."""
    one_shot = _GlooOneShot()
    group = dataclasses.replace(tp, one_shot=one_shot)
    cases = {
        "small bf16": torch.full((4, 64), tp.rank + 1.0, dtype=torch.bfloat16),  # 512 B
        "bound float32": torch.full((256,), tp.rank + 1.0),  # 1024 B: at the bound
        "too big": torch.full((257,), tp.rank + 1.0),
        "float16": torch.full((8,), tp.rank + 1.0, dtype=torch.float16),
        "integers": torch.full((8,), tp.rank + 1, dtype=torch.int32),
    }
    out = {}
    for name, x in cases.items():
        before, calls = x.clone(), one_shot.calls
        y = group.all_reduce(x)
        took = one_shot.calls > calls
        out[name] = (took, bool((y == 3).all()), bool((x == before).all()) if took else y is x)
    norms = {}
    for name, rows in (("norm in the one-shot", 2), ("norm after NCCL", 8)):  # 2 x 64 float32 fits, 8 x 64 not
        norm = RMSNorm(64, 1e-6)
        x, residual = torch.full((rows, 64), tp.rank + 1.0), torch.ones(rows, 64)
        calls = one_shot.calls
        normed, summed = norm(x, residual, partial_over=group)
        norms[name] = (one_shot.calls > calls, bool((summed == 4).all()), bool(torch.allclose(normed, norm(summed))))
    return {"cases": out, "norms": norms, "name": tp.all_reduce_name, "one_shot": tp.one_shot is None,
            "timed": time_all_reduce(group, torch.zeros(8), count=2, reps=3, all_reduce=group.group_all_reduce)}


def test_a_cpu_group_runs_gloo_and_routes_by_what_the_one_shot_takes():
    for result in run_ranks(_route):
        assert result["name"] == "gloo" and result["one_shot"]
        assert result["timed"] > 0
        cases = result["cases"]
        for name in ("small bf16", "bound float32", "float16"):
            assert cases[name] == (True, True, True), name  # the one-shot: a new tensor, x untouched
        for name in ("too big", "integers"):
            assert cases[name] == (False, True, True), name  # the group's collective, in place
        assert result["norms"] == {"norm in the one-shot": (True, True, True), "norm after NCCL": (False, True, True)}


def _make(tp, unsupported_on: int | None):
    """make_one_shot on CPU ranks: as is (every rank: not CUDA), or as if every rank but
    `unsupported_on` could allocate symmetric memory (a CPU tensor stands in)."""
    import torch.distributed._symmetric_memory as symm_mem

    from pagedattn.parallel import all_reduce

    calls = []
    if unsupported_on is not None:
        mine = "no GPU here" if tp.rank == unsupported_on else None
        all_reduce.one_shot_unsupported = lambda *args, **kwargs: mine
        symm_mem.empty = lambda n, dtype, device: torch.empty(n, dtype=dtype)
    one_shot, name = all_reduce.make_one_shot(tp.device_group, tp.device, tp.size, one_host=True,
                                              alive=lambda: calls.append(1))
    return one_shot, name


def test_ranks_agree_to_keep_their_own_all_reduce_when_one_cannot_run_the_one_shot():
    for one_shot, name in run_ranks(_make, None):
        assert one_shot is None and name == "NCCL (no one-shot: it needs CUDA, got cpu)"
    (zero, name0), (one, name1) = run_ranks(_make, 1)
    assert zero is None and one is None
    assert name0 == "NCCL (no one-shot: another rank could not allocate symmetric memory)"
    assert name1 == "NCCL (no one-shot: no GPU here)"


def test_the_one_shot_bound_shrinks_with_the_peers_read():
    assert one_shot_max_bytes(2) == ONE_SHOT_PEER_BYTES == 2 << 20  # [256, 4096] bf16 decode activations
    assert 512 << 10 <= one_shot_max_bytes(4) < 1 << 20  # [64, 4096] bf16 still one-shot at 4 ranks
    assert 256 << 10 <= one_shot_max_bytes(8) < 512 << 10
    assert all(one_shot_max_bytes(n) % 16 == 0 for n in range(2, 9))


@pytest.mark.parametrize(("device", "kwargs", "why"), [
    ("cpu", {}, "needs CUDA, got cpu"),
    ("cuda", {"one_host": False}, "several hosts"),
])
def test_why_a_group_keeps_its_own_all_reduce(device, kwargs, why):
    assert why in one_shot_unsupported(torch.device(device), 2, **kwargs)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="a machine with 2 GPUs may run the one-shot")
def test_without_two_gpus_a_cuda_group_would_keep_nccl():
    assert planned(torch.device("cuda", 0), 2).startswith("NCCL (no one-shot: ")
    assert planned(torch.device("cpu"), 2).startswith("gloo")


def test_torchrun_ranks_are_on_one_host_only_when_all_are_local():
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "4", "RANK": "1"}
    assert Rendezvous.from_environment(env | {"LOCAL_WORLD_SIZE": "4"}).one_host
    assert not Rendezvous.from_environment(env | {"LOCAL_WORLD_SIZE": "2"}).one_host
    assert not Rendezvous.from_environment(env).one_host  # unknown: assume several
    assert Rendezvous.local(2).one_host


def test_info_says_which_all_reduce_runs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "pagedattn", "info"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert "tensor-parallel all-reduce" in out.stdout
