"""Faults of a tensor-parallel engine (2 CPU ranks, gloo): a worker killed mid-generate ends it
with an error naming the rank within seconds, never a hang; a worker that fails at start-up
names itself; Ctrl-C leaves no process behind (shutdown and collection: test_generate.py);
impossible settings are refused."""

from __future__ import annotations

import functools
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import pagedattn
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.models.loader import load_model

from .conftest import alive

LONG = pagedattn.SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)


def _gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_killed_worker_ends_generate_with_its_rank(tiny_kv):
    llm = pagedattn.LLM(tiny_kv(2).folder, device="cpu", tensor_parallel_size=2, max_num_seqs=4)
    pid = llm.engine.worker_pids[1]
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 exited with code -9"):
        llm.generate([[1, 2, 3, 4]] * 16, LONG, use_tqdm=False)  # many steps: the kill lands mid-generate
    assert time.monotonic() - start < 30
    killer.join()
    assert _gone(pid)
    with pytest.raises(RuntimeError, match="rank 1"):  # the engine stays stopped
        llm.generate([[1, 2, 3]], LONG, use_tqdm=False)


def fail_on_rank_1(folder: str, *, device, tp):
    if tp.rank == 1:
        raise ValueError("no shard for rank 1 here")
    return load_model(folder, dtype=torch.float32, device=device, tp=tp)


def test_a_worker_failing_at_start_up_names_itself(tiny_kv):
    config = EngineConfig(device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 exited with code 1: ValueError: no shard for rank 1 here"):
        LLMEngine(config, functools.partial(fail_on_rank_1, tiny_kv(2).folder))
    assert time.monotonic() - start < 180  # spawning and importing take seconds; a hang would take COLLECTIVE_TIMEOUT
    gc.collect()
    assert not [p for p in _children() if "spawn" in p]


CTRL_C_SCRIPT = """
import sys, pagedattn
if __name__ == "__main__":
    llm = pagedattn.LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    print(llm.engine.worker_pids[1], flush=True)
    llm.generate([[1, 2, 3]] * 8, pagedattn.SamplingParams(temperature=0, max_tokens=10**4, ignore_eos=True,
                 ), use_tqdm=False)
"""


def test_ctrl_c_leaves_no_process(tiny_kv, tmp_path):
    """SIGINT to the terminal's process group (rank 0 and its worker) mid-generate."""
    script = tmp_path / "run.py"
    script.write_text(CTRL_C_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(script), tiny_kv(1).folder], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        pid = int(proc.stdout.readline())
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "KeyboardInterrupt" in stderr
    assert _gone(pid)


@pytest.mark.parametrize(("options", "match"), [
    (dict(tensor_parallel_size=0), "tensor_parallel_size to be an int >= 1"),
    (dict(tensor_parallel_size=2, device="cuda:1"), "device"),
])
def test_impossible_settings_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


def test_a_loaded_model_cannot_be_split(tiny_kv):
    loaded = load_model(tiny_kv(2).folder, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="expected a loader"):
        LLMEngine(EngineConfig(device="cpu", tensor_parallel_size=2), loaded)


def test_heads_that_do_not_divide_are_refused(tiny_kv):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) divisible by tensor_parallel_size=3"):
        pagedattn.LLM(tiny_kv(4).folder, device="cpu", tensor_parallel_size=3, num_kv_blocks=16)
    gc.collect()
    assert not [p for p in _children() if "spawn" in p]


def _children() -> list[str]:
    """Command lines of this process's live children."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                with open(f"/proc/{entry}/cmdline") as f:
                    out.append(f.read().replace("\0", " "))
        except (OSError, IndexError, ValueError):
            continue
    return out


class _Recorded:
    """A TPGroup's and WorkerProcesses' stand-in for `_stop`: records what it is asked, in order."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def send(self, message) -> None:
        self.calls.append(("send", message))

    def stopping(self) -> None:
        self.calls.append(("stopping",))

    def close(self, grace_s: float) -> None:
        self.calls.append(("close", grace_s))


@pytest.mark.parametrize("hangs", [False, True])
def test_shutdown_leaves_with_the_workers_before_reaping_them(monkeypatch, hangs):
    # NCCL's teardown returns only once every rank has called it and every CUDA graph holding
    # its collectives is destroyed: rank 0 releases its graphs, then leaves while its workers
    # do, not after killing them; a teardown that hangs anyway is aborted, bounded.
    from pagedattn.engine import distributed

    calls = []

    def leave(tp, *, abort=False):
        calls.append(("leave", abort))
        if hangs and not abort:
            time.sleep(5)

    monkeypatch.setattr(distributed, "leave", leave)
    monkeypatch.setattr(distributed, "LEAVE_TIMEOUT_S", 0.2)
    start = time.monotonic()
    release = [lambda: calls.append(("release graphs",))]  # runs once, before the first leave
    distributed._stop(_Recorded(calls), _Recorded(calls), graceful=True, before_leaving=release)
    assert time.monotonic() - start < 3
    if hangs:
        assert calls == [("stopping",), ("send", None), ("release graphs",), ("leave", False), ("close", 0.0),
                         ("leave", True)]
    else:
        assert calls == [("stopping",), ("send", None), ("release graphs",), ("leave", False),
                         ("close", distributed.CLOSE_GRACE_S)]


def test_a_graceful_shutdown_is_no_worker_failure(tiny_kv, monkeypatch):
    # A worker leaves and exits while rank 0 is still leaving (here: rank 0 leaves 2 s late):
    # its exit must not count as a death, whose handling aborts rank 0's communicators under
    # its own teardown (NCCL: a double free, glibc's abort; gloo shows the recorded failure).
    from pagedattn.engine import distributed

    leave = distributed.leave
    monkeypatch.setattr(distributed, "leave", lambda tp, **kw: (time.sleep(2), leave(tp, **kw)))
    llm = pagedattn.LLM(tiny_kv(2).folder, device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
    workers = llm.engine.parallel.workers
    llm.generate([[1, 2, 3]], pagedattn.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.shutdown()
    time.sleep(0.5)  # the watcher would have seen the exit by now
    assert workers.failure is None
