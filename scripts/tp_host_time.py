"""Host time of a decode step with tensor parallelism against without, and where it goes.

A tiny random Llama (`tiny-llama`: 2 layers, hidden 64, so the model's own compute is small and
the host's work shows) decodes `--batch` requests for `--steps` steps at TP=1 and at TP=2, on
the CPU (gloo) by default. Per step, medians over the pure decode steps:
- wall: `engine.step()`; on the CPU the ranks meet in every gloo all-reduce, so rank 0's wall
  time includes waiting for the worker to reach the step;
- rank 0's host time (its main thread's CPU time: waits excluded), and of it: the step plan
  made (`StepPlan.of`), pickled and written down the pipe (`TPGroup.send`, the write apart);
- the worker's host time: the plan read and unpickled (`TPGroup.receive`, the read's wait
  apart) and run (`ModelRunner.execute`).
On a GPU the device runs behind the host (async scheduling): a step takes about the largest of
rank 0's host time, the worker's host time and the device time, so the host times are what
tensor parallelism must not raise.

`--parts` adds rank 0's time per part of the step and its mean without the model's forward (on the CPU
the forward is compute a GPU runs behind the host); `--async-scheduling` takes the GPU's path on
the CPU (each decode planned while the step before it runs).

Every request runs through the timed steps (the pool holds them all), so `--prompt-len` is at most
tiny-llama's 1,024-token context less the tokens generated (`--steps` and the prefill's steps; the
script names the limit): `--batch 256 --prompt-len 900` times decodes over ~1k-token contexts.

    python scripts/tp_host_time.py [--batch 64] [--steps 64] [--device cpu] [--sizes 1,2] [--prompt-len 32]
        [--parts] [--async-scheduling] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPE = "tiny-llama"
SAVE_EVERY = 8  # worker steps between writes of its totals
BLOCK_SIZE = 16
PREFILLS_PER_STEP = 8  # long prompts prefilled per step at most: the CPU attends them padded to the longest


class Clock:
    """Seconds (wall and this thread's CPU time) spent inside wrapped callables, by name."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, attr: str, name: str) -> None:
        """Time `owner.attr` (a function, or a classmethod) under `name` from now on."""
        inner = owner.__dict__[attr]
        if isinstance(inner, classmethod):
            setattr(owner, attr, classmethod(self.timed(inner.__func__, name)))
        else:
            setattr(owner, attr, self.timed(inner, name))

    def timed(self, fn, name: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w
                self.cpu[name] += time.thread_time() - c
                self.calls[name] += 1
        return timed

    def snapshot(self) -> dict:
        return {"wall": dict(self.wall), "cpu": dict(self.cpu), "calls": dict(self.calls)}


def timed_parts(clock: Clock) -> None:
    """Wrap what a step does with tensor parallelism (every process wraps the same)."""
    from pagedattn.engine.model_runner import ModelRunner
    from pagedattn.engine.step_plan import StepPlan
    from pagedattn.parallel.channel import PipeChannel
    from pagedattn.parallel.group import TPGroup

    clock.wrap(StepPlan, "of", "plan")
    clock.wrap(TPGroup, "send", "send")
    clock.wrap(PipeChannel, "send", "pipe write")
    clock.wrap(TPGroup, "receive", "receive")
    clock.wrap(PipeChannel, "receive", "pipe read")
    clock.wrap(ModelRunner, "execute", "execute")


def timed_rank0_parts(clock: Clock) -> None:
    """Wrap the parts of rank 0's step (`--parts`): the scheduler, the metadata build, the model's
    eager forward (on the CPU its compute, which a GPU runs behind the host), the sampler's
    launch, the output processing and the `RequestOutput`s."""
    from pagedattn.engine.model_runner import ModelRunner
    from pagedattn.engine.output_processor import OutputProcessor
    from pagedattn.engine.scheduler import Scheduler
    from pagedattn.engine.step_metadata import GroupedMetadataBuilder

    clock.wrap(Scheduler, "schedule", "schedule")
    clock.wrap(Scheduler, "schedule_next_decodes", "schedule")
    clock.wrap(GroupedMetadataBuilder, "build", "metadata")
    clock.wrap(ModelRunner, "_run", "forward")
    clock.wrap(ModelRunner, "_sample", "sample")
    clock.wrap(OutputProcessor, "process", "process")
    clock.wrap(OutputProcessor, "outputs", "outputs")


def worker_loader(path: str, inner, *, device, tp):
    """The worker's loader: wraps its step parts, and writes their totals to `path` every
    SAVE_EVERY executes (the worker process leaves without running exit handlers)."""
    clock = Clock()
    timed_parts(clock)
    from pagedattn.engine.model_runner import ModelRunner

    execute = ModelRunner.execute

    def execute_and_save(self, plan):
        execute(self, plan)
        if clock.calls["execute"] % SAVE_EVERY == 0:
            Path(path).write_text(json.dumps(clock.snapshot()))

    ModelRunner.execute = execute_and_save
    return inner(device=device, tp=tp)


def run(size: int, batch: int, steps: int, device: str, *, parts: bool = False, async_scheduling: bool | None = None,
        prompt_len: int = 32) -> dict:
    from pagedattn.engine.config import DEFAULT_CHUNKED_BATCHED_TOKENS, EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.engine.sampling_params import SamplingParams
    from pagedattn.models.dummy import load_dummy_model

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    inner = functools.partial(load_dummy_model, SHAPE, dtype=dtype, seed=0)
    stats_path = tempfile.mktemp(prefix="tp-worker-", suffix=".json")
    # Every request must still run through the timed steps, its blocks in the pool: else those steps run
    # (and time) fewer sequences than --batch. The prompts are prefilled PREFILLS_PER_STEP a step (a
    # budget that grows for long prompts only) while the first ones decode.
    budget = max(DEFAULT_CHUNKED_BATCHED_TOKENS[torch.device(device).type], batch + PREFILLS_PER_STEP * prompt_len)
    prefill_steps = -(-batch * prompt_len // (budget - batch)) + 1
    max_tokens = prefill_steps + SAVE_EVERY + steps + 2
    blocks = max(4096, batch * -(-(prompt_len + max_tokens) // BLOCK_SIZE))
    config = EngineConfig(device=device, tensor_parallel_size=size, max_num_seqs=batch, max_num_batched_tokens=budget,
                          block_size=BLOCK_SIZE, num_kv_blocks=blocks, seed=0, async_scheduling=async_scheduling)
    loader = functools.partial(worker_loader, stats_path, inner) if size > 1 else inner(device=torch.device(device))
    engine = LLMEngine(config, loader)
    if prompt_len + max_tokens > engine.scheduler.max_model_len:
        engine.shutdown()
        raise SystemExit(f"expected --prompt-len <= {engine.scheduler.max_model_len - max_tokens} ({SHAPE}'s context "
                         f"of {engine.scheduler.max_model_len} less {max_tokens} tokens generated), got {prompt_len}")
    if device == "cpu":
        torch.set_num_threads(1)  # each rank one core (the workers take cpu_count // size)
    clock = Clock()
    timed_parts(clock)
    if parts:
        timed_rank0_parts(clock)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(batch):
            engine.add_request([(i * 7 + j) % 500 + 3 for j in range(prompt_len)], params)
        for _ in range(SAVE_EVERY):  # the prefill, then decodes until the worker has saved its totals
            engine.step()
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for g in engine.scheduler.running for s in g.seqs):
            engine.step()  # long prompts: until every prefill is done
        worker_before = read_json(stats_path)
        before = clock.snapshot()
        walls, cpus = [], []
        for _ in range(steps):
            w, c = time.perf_counter(), time.thread_time()
            engine.step()
            walls.append(time.perf_counter() - w)
            cpus.append(time.thread_time() - c)
        after = clock.snapshot()
        time.sleep(0.2)
        worker = delta(worker_before, read_json(stats_path))
    finally:
        engine.shutdown()
        Path(stats_path).unlink(missing_ok=True)
    per_step = {k: v * 1e3 / steps for k, v in delta(before, after)["cpu"].items()}
    if parts:
        out_parts = {k: per_step.get(k, 0.0) for k in ("schedule", "plan", "metadata", "forward", "sample", "process",
                                                        "outputs")}
    out = {"tensor_parallel_size": size, "batch": batch, "steps": steps,
           "wall_ms": statistics.median(walls) * 1e3, "rank0_host_ms": statistics.median(cpus) * 1e3,
           # the mean counts the garbage collector's occasional full collections, which the median skips
           "rank0_host_mean_ms": statistics.mean(cpus) * 1e3,
           "rank0_ms": {"plan": per_step.get("plan", 0.0),
                        "pickle": per_step.get("send", 0.0) - per_step.get("pipe write", 0.0),
                        "pipe write": per_step.get("pipe write", 0.0)}}
    if parts:
        out["rank0_parts_ms"] = out_parts
        out["rank0_host_mean_ms_without_forward"] = out["rank0_host_mean_ms"] - out_parts["forward"]
    if worker:
        out["worker_ms"] = worker_per_step(worker)
    return out


def read_json(path: str) -> dict:
    """A JSON file (a worker's stats, `worker_loader`; a stage's results), or {} where it is not
    written yet."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def worker_per_step(worker: dict) -> dict:
    """ms per step of a worker's host work, from the difference of two of its stats files (`delta`):
    its host time (the plan received and run), the unpickling (the receive less the pipe's read),
    the run, and the wall time it waited for rank 0 (the pipe's read)."""
    n = worker["calls"].get("execute", 0) or 1
    cpu, wall = worker["cpu"], worker["wall"]
    return {"host": (cpu.get("receive", 0.0) + cpu.get("execute", 0.0)) * 1e3 / n,
            "unpickle": (cpu.get("receive", 0.0) - cpu.get("pipe read", 0.0)) * 1e3 / n,
            "execute": cpu.get("execute", 0.0) * 1e3 / n,
            "waiting for rank 0": wall.get("pipe read", 0.0) * 1e3 / n, "steps": n}


def delta(a: dict, b: dict) -> dict:
    """`b` less `a`, part by part ({} when `b` is: no stats yet)."""
    if not b:
        return {}
    return {part: {k: v - a.get(part, {}).get(k, 0) for k, v in b[part].items()} for part in b}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to run (default: 1,2)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--parts", action="store_true",
                   help="also rank 0's host time per part of the step, and its mean without the model's forward")
    p.add_argument("--async-scheduling", action="store_true",
                   help="async scheduling on the CPU too (the GPU's default: the step a GPU runs)")
    p.add_argument("--json", help="write the numbers here too")
    args = p.parse_args()
    results = [run(int(size), args.batch, args.steps, args.device, parts=args.parts, prompt_len=args.prompt_len,
                   async_scheduling=True if args.async_scheduling else None) for size in args.sizes.split(",")]
    for r in results:
        line = (f"TP={r['tensor_parallel_size']} batch {r['batch']}: step {r['wall_ms']:.2f} ms wall, "
                f"rank 0 host {r['rank0_host_ms']:.2f} ms (plan {r['rank0_ms']['plan']:.3f}")
        if r["tensor_parallel_size"] > 1:
            line += f", pickle {r['rank0_ms']['pickle']:.3f}, pipe write {r['rank0_ms']['pipe write']:.3f}"
        line += ")"
        if "worker_ms" in r:
            w = r["worker_ms"]
            line += (f"; worker host {w['host']:.2f} ms (unpickle {w['unpickle']:.3f}, execute {w['execute']:.2f}), "
                     f"waiting for rank 0 {w['waiting for rank 0']:.2f} ms")
        print(line, flush=True)
        if "rank0_parts_ms" in r:
            print(f"  rank 0 host mean {r['rank0_host_mean_ms']:.2f} ms, without the forward "
                  f"{r['rank0_host_mean_ms_without_forward']:.2f} ms: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["rank0_parts_ms"].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
