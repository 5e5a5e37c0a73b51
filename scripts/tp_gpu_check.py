"""Tensor parallelism on a 2-GPU machine in one command of at most --budget seconds (540 by
default), start-ups included; random weights, nothing downloaded. Stages in priority order, each
in its own process under its own time budget: a stage cut by its budget keeps what it measured
(each number is written as it is made) and the next stage starts.

1. all-reduce: [64, 4096], [256, 4096] and [1024, 4096] bf16 (0.5, 2 and 8 MiB), summed by NCCL
   and by the one-shot over symmetric memory, each in a CUDA graph of 64 calls (us a call), the
   one-shot's sums against NCCL's, and which of the two the group picks for each size;
2. tp1, 3. tp2: the Llama-3-8B shape at TP=1, then TP=2, one engine each: its start-up and
   where it went (ranks spawned and joined, model, memory profile, warm-up and its Triton
   compiles, graph capture); the decode step at batch 64 against its floor (per GPU at TP=2),
   with the graph's replay and the all-reduce's time; 256 requests of 128/128 tokens, output
   tokens/s, with where rank 0's steps went (waiting for the device, or host work) and at TP=2
   the worker's host time a step; 64 greedy requests (128 prompt tokens, 64 out, top-2
   log-probabilities); the shutdown, timed, and whether a worker is left. After both: how many
   greedy requests agree and, where one does not, its first differing token and the
   log-probability gaps there; the throughput ratio;
4. serve: `pagedattn serve --tensor-parallel-size 2` over a 2-layer checkpoint of the 8B shape,
   one completion through the openai client (httpx where it is missing, said so), then SIGINT:
   the server and its worker must be gone.
The Llama-3-70B shape at TP=2 (its layers that fit): `pagedattn bench engine --model-shape
llama3-70b --tensor-parallel-size 2 --num-layers N`.

    python scripts/tp_gpu_check.py OUT [--budget 540] [--stages all-reduce,tp1,tp2,serve] [--device cpu]

Writes OUT/summary.txt (a line a measurement, as it ends; also printed), OUT/tp_check.json (every
number; a running stage's own in OUT/stage-NAME.json until it is merged), OUT/tp_check.log (the
engines' INFO log) and OUT/serve.log (the server's): four files. `--device cpu` rehearses every
stage on gloo with a tiny model.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]

import torch  # noqa: E402

STAGES = {"all-reduce": 120, "tp1": 150, "tp2": 190, "serve": 150}
"""Seconds each stage may take, start-up included (2x H200, 2026-11-27, eebda9e: an 8B engine up in
89-99 s; the tp2 stage ran out of 170 s after its last measurement, the serve stage out of 90 s
before its server was ready)."""
SERVER_PID = "serve.pid"
"""The serve stage's server runs in a session of its own (a terminal's Ctrl-C is what it is sent),
so killing the stage's process group misses it: the stage writes the server's pid here, and the
orchestrator kills that group too when it cuts the stage."""
MIN_STAGE_S = 30  # a stage with less time left than this is skipped
MAX_MODEL_LEN = 512
"""Every request here fits (128 + 129 tokens). The warm-up's steps reach the context: at 512 it
runs and compiles fewer of them than at the 4096 this check used before (their start-up: 70 s)."""
REQUESTS, PROMPT_LEN, OUTPUT_LEN, THROUGHPUT_REQUESTS, DECODE_BATCH = 64, 128, 64, 256, 64
TARGETS = {"decode_ratio": 1.3, "speedup": 1.6}


class Report:
    """Numbers of a stage (or of the whole check) in `path`, rewritten on each `save`; lines
    to stdout and OUT/summary.txt."""

    def __init__(self, out: Path, path: Path) -> None:
        self.out, self.path = out, path
        self.data: dict = {}

    def line(self, text: str) -> None:
        print(text, flush=True)
        with (self.out / "summary.txt").open("a") as f:
            f.write(text + "\n")

    def save(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


class Setup:
    """What the stages run on: the 8B shape on two GPUs, or (`--device cpu`) a tiny model on gloo
    with fewer and shorter requests (a rehearsal of the logic)."""

    def __init__(self, device: str) -> None:
        self.device = device
        cpu = device == "cpu"
        self.shape = "tiny-llama" if cpu else "llama3-8b"
        self.dtype = torch.float32 if cpu else torch.bfloat16
        self.scale = 4 if cpu else 1  # request counts and lengths divided by it

    def n(self, count: int) -> int:
        return max(2, count // self.scale)


# ---------------------------------------------------------------------- stage 1: the all-reduce


def stage_all_reduce(setup: Setup, report: Report) -> None:
    import torch.multiprocessing as mp

    from pagedattn.parallel.group import Rendezvous

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = Rendezvous.local(2)
    procs = [ctx.Process(target=_all_reduce_rank, args=(rank, rendezvous, setup.device, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            rank, value = results.get(timeout=STAGES["all-reduce"])
            if rank == 0 or "error" in value:
                report.save(f"rank{rank}", value)
        value = report.data["rank0"]
        if "error" in value:
            raise RuntimeError(value["error"])
        report.line(f"all-reduce: the group picks {value['picked']}")
        for s in value["sizes"]:
            line = (f"  [{s['rows']}, {s['hidden']}] {s['dtype']} ({s['bytes'] >> 10} KiB): {value['group']} "
                    f"{s['group_us']:.1f} us")
            if "ours_us" in s:
                line += (f", torch's one-shot {s['torch_us']:.1f}, ours {s['ours_us']:.1f} (max |ours - NCCL| "
                         f"{s['max_diff']:g}, ranks equal {s['ranks_equal']}); +add+norm: then rms_norm "
                         f"{s['ours_then_norm_us']:.1f}, fused {s['fused_us']:.1f} (equal {s['fused_equal']})")
            report.line(line + f"; picked: {s['picked']}")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _all_reduce_rank(rank: int, rendezvous, device_type: str, results) -> None:
    try:
        results.put((rank, _time_all_reduces(rank, rendezvous, device_type)))
    except BaseException as e:  # noqa: BLE001 - reported to the stage
        results.put((rank, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))


def _time_all_reduces(rank: int, rendezvous, device_type: str) -> dict:
    """Each size by NCCL, by PyTorch's one-shot kernel (torch.ops.symm_mem, what the group ran
    before 2026-11-28), by ours (a buffer beyond the group's bound, to time it where NCCL takes
    over), and ours with the residual add and RMSNorm fused against ours then `rms_norm`."""
    from pagedattn.kernels.all_reduce import buffer_bytes, make_slots, one_shot_all_reduce
    from pagedattn.kernels.fused_layers import rms_norm
    from pagedattn.parallel.all_reduce import MAX_PROGRAMS, one_shot_max_bytes
    from pagedattn.parallel.group import join, leave, time_all_reduce

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = join(rendezvous, rank, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ours = theirs = None
    if tp.one_shot is not None:
        import torch.distributed._symmetric_memory as symm_mem

        wide = 8 << 20
        programs = tp.one_shot.slots.programs
        buffer = symm_mem.empty(buffer_bytes(programs, 2, wide), dtype=torch.uint8, device=device).zero_()
        handle = symm_mem.rendezvous(buffer, tp.device_group.group_name)
        slots = make_slots(list(handle.buffer_ptrs), rank, wide, programs, device)
        torch.distributed.barrier()
        ours = functools.partial(one_shot_all_reduce, slots=slots)
        staging = symm_mem.empty(wide, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(staging, tp.device_group.group_name)

        def theirs(x):
            out = torch.empty_like(x)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging.view(x.dtype)[: x.numel()].view_as(x), x, "sum",
                                                             tp.device_group.group_name, out)
            return out
    group = "NCCL" if device.type == "cuda" else "gloo"
    out = {"group": group, "picked": tp.all_reduce_name, "one_shot_max_bytes": one_shot_max_bytes(2), "sizes": [],
           "max_programs": MAX_PROGRAMS,
           "env": {k: os.environ.get(k) for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE")}}
    timed = functools.partial(time_all_reduce, tp, count=64, reps=20)
    for rows, hidden in ((64, 4096), (256, 4096), (64, 8192), (128, 8192), (1024, 4096)):
        x = torch.zeros(rows, hidden, dtype=dtype, device=device)
        entry = {"rows": rows, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
                 "bytes": x.numel() * x.element_size(),
                 "picked": "one-shot" if tp.one_shot is not None and tp.one_shot.fits(x) else group,
                 "group_us": timed(x, all_reduce=tp.group_all_reduce) * 1e6}
        if ours is not None:
            g = torch.Generator(device).manual_seed(rank)
            v = torch.randn(rows, hidden, generator=g, device=device).to(dtype)
            res = torch.randn(rows, hidden, generator=torch.Generator(device).manual_seed(7), device=device).to(dtype)
            w = torch.ones(hidden, dtype=dtype, device=device)
            ref = tp.group_all_reduce(v.clone()).float()
            mine = ours(v)
            both = torch.stack([mine, torch.empty_like(mine)])
            torch.distributed.all_gather_into_tensor(both, mine)
            fused_normed, fused_sum = ours(v, weight=w, eps=1e-5, residual=res)
            want_normed, want_sum = rms_norm(mine, w, 1e-5, res)
            entry.update(
                torch_us=timed(x, all_reduce=theirs) * 1e6,
                ours_us=timed(x, all_reduce=ours) * 1e6,
                ours_then_norm_us=timed(x, all_reduce=lambda t: rms_norm(ours(t), w, 1e-5, res)) * 1e6,
                fused_us=timed(x, all_reduce=lambda t: ours(t, weight=w, eps=1e-5, residual=res)) * 1e6,
                max_diff=(mine.float() - ref).abs().max().item(),
                torch_max_diff=(theirs(v).float() - ref).abs().max().item(),
                ranks_equal=bool(torch.equal(both[0], both[1])),
                fused_equal=bool(torch.equal(fused_sum, want_sum) and torch.equal(fused_normed, want_normed)))
        out["sizes"].append(entry)
    torch.distributed.barrier()
    leave(tp)
    return out


# ---------------------------------------------------------------------- stages 2-3: one engine a TP size


def _loader(setup: Setup, shape: str, num_layers: int | None = None, max_model_len: int = MAX_MODEL_LEN):
    from pagedattn.models.dummy import load_dummy_model

    return functools.partial(load_dummy_model, shape, dtype=setup.dtype, max_model_len=max_model_len, seed=0,
                             num_layers=num_layers)


class StartUp:
    """Seconds of an engine's start-up parts on rank 0 (every rank runs the same in step: their
    collectives pair up) and the Triton compiles met (`CompileLog`): the rest of the total is
    the model's loading (random weights made on the GPU) and the engine's own set-up."""

    PARTS = {"spawn and join": ("pagedattn.engine.distributed", "TensorParallel", "__init__"),
             "runner": ("pagedattn.engine.model_runner", "ModelRunner", "__init__"),
             "of it profile and KV pool": ("pagedattn.engine.kv_pool", "KVPoolSizer", "num_kv_blocks"),
             "of it warm-up": ("pagedattn.engine.model_runner", "ModelRunner", "_warm_up"),
             "of it graph capture": ("pagedattn.engine.model_runner", "ModelRunner", "_capture_graphs")}

    def __init__(self) -> None:
        import importlib

        from tp_host_time import Clock

        self.clock = Clock()
        for name, (module, cls, attr) in self.PARTS.items():
            self.clock.wrap(getattr(importlib.import_module(module), cls), attr, name)

    def parts(self, total: float, compiles) -> dict:
        parts = {name: round(self.clock.wall.get(name, 0.0), 2) for name in self.PARTS}
        parts["model and the rest"] = round(total - parts["spawn and join"] - parts["runner"], 2)
        summary = compiles.summary()
        return {"total_s": round(total, 2), "parts_s": parts, "triton_compiles": summary["count"],
                "triton_compile_s": round(summary["seconds"], 2)}


def stage_size(setup: Setup, report: Report, size: int) -> None:
    from pagedattn.benchmarks import engine_offline as offline
    from pagedattn.benchmarks.jit_log import CompileLog
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine
    from tp_host_time import worker_loader

    device = torch.device(setup.device)
    bandwidth = offline.copy_bandwidth(device, 1 << 30)
    report.save("copy_bandwidth_gb_s", bandwidth / 1e9)
    worker_stats = tempfile.mktemp(prefix="tp-worker-", suffix=".json")
    loader = _loader(setup, setup.shape)
    startup = StartUp()
    start = time.perf_counter()
    with CompileLog() as compiles:
        loaded = functools.partial(worker_loader, worker_stats, loader) if size > 1 else loader(device=device)
        config = EngineConfig(device=setup.device, tensor_parallel_size=size, seed=0,
                              max_num_seqs=max(setup.n(THROUGHPUT_REQUESTS), DECODE_BATCH))
        engine = LLMEngine(config, loaded)
    up = startup.parts(time.perf_counter() - start, compiles)
    up.update(num_kv_blocks=engine.block_manager.num_blocks, weight_bytes_per_gpu=offline.weight_bytes_read(
        engine.runner.model), all_reduce=engine.parallel.tp.all_reduce_name if engine.parallel else None)
    report.save("start_up", up)
    report.line(f"TP={size}: engine up in {up['total_s']:.0f} s ({_parts(up['parts_s'])}; "
                f"{up['triton_compiles']} Triton compiles, {up['triton_compile_s']:.0f} s); all-reduce: "
                f"{up['all_reduce']}")
    try:
        decode = _decode(engine, up["weight_bytes_per_gpu"], bandwidth, size)
        report.save("decode", decode)
        report.line(_decode_line(f"TP={size} {setup.shape}", decode, TARGETS["decode_ratio"] if size > 1 else None))
        report.save("throughput", _throughput(setup, engine, size, worker_stats, report))
        report.save("greedy", _greedy(setup, engine))
        report.line(f"TP={size}: {len(report.data['greedy'])} greedy requests done")
    finally:
        pids = list(engine.worker_pids.values())
        start = time.perf_counter()
        engine.shutdown()  # it hung on 2x H200 at eebda9e: timed, and whether a worker is left
        took = time.perf_counter() - start
        left = [pid for pid in pids if _alive(pid)]
        report.save("shutdown", {"seconds": round(took, 2), "left": left})
        report.line(f"TP={size}: shut down in {took:.1f} s; workers left: {left or 'none'}")
        Path(worker_stats).unlink(missing_ok=True)


def _parts(parts: dict) -> str:
    return ", ".join(f"{k} {v:.0f} s" for k, v in parts.items())


def _decode(engine, weight_bytes: int, bandwidth: float, size: int) -> dict:
    from pagedattn.benchmarks import engine_offline as offline

    d = offline.decode_step(engine, batch=DECODE_BATCH, prompt_len=PROMPT_LEN, steps=128, seed=0,
                            weight_bytes=weight_bytes, bandwidth=bandwidth)
    all_reduce = engine.runner.time_all_reduce(DECODE_BATCH)
    if all_reduce is not None:
        layers = engine.spec.num_layers
        d.update(all_reduce_s=all_reduce, all_reduce_step_s=2 * layers * all_reduce)
    d["tensor_parallel_size"] = size
    return d


def _decode_line(name: str, d: dict, target: float | None) -> str:
    replay = f"{d['graph_replay_s'] * 1e3:.2f} ms" if d.get("graph_replay_s") else "n/a"
    text = (f"{name} decode step at batch {DECODE_BATCH}: {d['median_step_s'] * 1e3:.2f} ms, floor"
            f"{' per GPU' if d['tensor_parallel_size'] > 1 else ''} {d['floor_s'] * 1e3:.2f} ms "
            f"({d['ratio_to_floor']:.2f}x); graph replay {replay}")
    if "all_reduce_s" in d:
        text += f"; all-reduce {d['all_reduce_s'] * 1e6:.1f} us, {d['all_reduce_step_s'] * 1e3:.2f} ms a step"
    if target is not None:
        text += f" [{'met' if d['ratio_to_floor'] <= target else 'NOT met'}: <= {target}x]"
    return text


def _throughput(setup: Setup, engine, size: int, worker_stats: str, report: Report) -> dict:
    """Output tokens/s of THROUGHPUT_REQUESTS x 128/128 (a warm-up run, the median of 3), and over
    those runs: rank 0's mean step, its wait for the device's draws, and the worker's host time."""
    from pagedattn.benchmarks import engine_offline as offline
    from pagedattn.engine import launched_step
    from pagedattn.engine.llm_engine import LLMEngine
    from tp_host_time import Clock, delta, read_json, worker_per_step

    clock = Clock()
    clock.wrap(LLMEngine, "step", "step")
    clock.wrap(launched_step._HostCopy, "get", "wait for the device")
    before = read_json(worker_stats)
    n, length = setup.n(THROUGHPUT_REQUESTS), setup.n(128)
    lengths = [(length, length)] * n
    cell = offline.measure(lambda rep: offline.run_ours(engine, offline.make_requests(
        lengths, vocab_size=engine.spec.vocab_size, seed=0, rep=rep)), 3, 120.0, lambda: None)
    steps = clock.calls["step"]
    out = {k: cell[k] for k in ("tokens_per_s", "runs_s", "median_s", "note")}
    wait = clock.wall["wait for the device"]  # the wait spins (a CPU busy all the while): wall time apart
    step = clock.wall["step"]
    out["rank0_per_step_ms"] = {"step": step * 1e3 / steps, "host": (step - wait) * 1e3 / steps,
                                "waiting for the device": wait * 1e3 / steps, "steps": steps}
    worker = read_json(worker_stats)
    if worker and before:
        out["worker_per_step_ms"] = worker_per_step(delta(before, worker))
    r = out["rank0_per_step_ms"]
    worker = f"; worker host {out['worker_per_step_ms']['host']:.2f} ms" if "worker_per_step_ms" in out else ""
    report.line(f"TP={size}: {n} x {length}/{length}: {cell['tokens_per_s']:.0f} output tokens/s (runs "
                f"{cell['runs_s']} s); rank 0 a step: {r['step']:.2f} ms, host {r['host']:.2f} ms, waiting for the "
                f"device {r['waiting for the device']:.2f} ms{worker}")
    return out


def _greedy(setup: Setup, engine) -> list[dict]:
    from pagedattn.benchmarks import engine_offline as offline
    from pagedattn.engine.sampling_params import SamplingParams

    n, out_len = setup.n(REQUESTS), setup.n(OUTPUT_LEN)
    requests = offline.make_requests([(setup.n(PROMPT_LEN), out_len)] * n, vocab_size=engine.spec.vocab_size,
                                     seed=0, rep=0)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, logprobs=2)
    outs = engine.generate([r.prompt for r in requests], [params] * n)
    return [{"tokens": o.outputs[0].token_ids,
             "top": [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]} for o in outs]


def compare(one: list[dict], two: list[dict], report: Report) -> dict:
    """Token equality of the greedy runs; at each request's first divergence, both candidates'
    log-probabilities on both sides (the gap between them is the logit gap: same normalizer)."""
    equal, diverged, agree = 0, [], []
    for i, (a, b) in enumerate(zip(one, two)):
        for ta, tb, x, y in zip(a["tokens"], b["tokens"], a["top"], b["top"]):
            if ta != tb:
                break
            agree.append(abs(x[str(ta)] - y[str(tb)]))  # JSON keys are strings
        if a["tokens"] == b["tokens"]:
            equal += 1
            continue
        j = next(k for k, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
        ta, tb, top_a, top_b = str(a["tokens"][j]), str(b["tokens"][j]), a["top"][j], b["top"][j]
        diverged.append({"request": i, "position": j, "tp1_token": ta, "tp2_token": tb,
                         "tp1_gap": None if tb not in top_a else top_a[ta] - top_a[tb],
                         "tp2_gap": None if ta not in top_b else top_b[tb] - top_b[ta]})
    result = {"requests": len(one), "equal": equal, "diverged": diverged,
              "max_logprob_diff_on_equal_tokens": max(agree, default=0.0)}
    report.line(f"equal: {equal}/{len(one)} greedy requests give the same tokens at TP=2 as at TP=1; chosen-token "
                f"log-probabilities differ by up to {result['max_logprob_diff_on_equal_tokens']:.4f} where they agree")
    for d in diverged[:8]:
        report.line(f"  request {d['request']} differs first at token {d['position']}: TP=1 {d['tp1_token']} vs TP=2 "
                    f"{d['tp2_token']}; top-2 gap TP=1 {_gap(d['tp1_gap'])}, TP=2 {_gap(d['tp2_gap'])} nats")
    return result


def _gap(x) -> str:
    return "n/a (not in the top 2)" if x is None else f"{x:.4f}"


# ---------------------------------------------------------------------- stage 4: the server


def stage_serve(setup: Setup, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="tp-serve-") as tmp:
        _serve(setup, report, Path(tmp))


def _serve(setup: Setup, report: Report, folder: Path) -> None:
    from serve_process import ServeProcess

    from pagedattn.models.dummy import load_dummy_model, transformers_model

    loaded = load_dummy_model(setup.shape, device=setup.device, dtype=setup.dtype, num_layers=2,
                              max_model_len=MAX_MODEL_LEN)
    transformers_model(loaded).save_pretrained(folder, safe_serialization=True)
    loaded.tokenizer.save_pretrained(folder)
    del loaded
    args = ["--model", str(folder), "--tensor-parallel-size", "2", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", "32", "--log-level", "warning", "--device", setup.device]
    result: dict = {"command": "pagedattn serve " + " ".join(args)}
    with (report.out / "serve.log").open("w") as log, ServeProcess(args, log=log) as server:
        (report.out / SERVER_PID).write_text(str(server.proc.pid))
        result["ready_s"] = server.wait_ready(STAGES["serve"] - 20)
        workers = server.children()  # the tensor-parallel worker (and multiprocessing's resource tracker)
        prompt = " ".join(f"t{i}" for i in range(100, 132))
        try:
            import openai

            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
            answer = client.completions.create(model=folder.name, prompt=prompt, max_tokens=16, temperature=0)
            result.update(client=f"openai {openai.__version__}", text=answer.choices[0].text,
                          completion_tokens=answer.usage.completion_tokens)
        except ImportError:
            import httpx

            request = {"model": folder.name, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            body = httpx.post(f"{server.url}/v1/completions", json=request, timeout=60).json()
            result.update(client=f"httpx {httpx.__version__} (the openai package is not installed here)",
                          text=body["choices"][0]["text"], completion_tokens=body["usage"]["completion_tokens"])
        result["exit_code"] = server.stop(60)  # SIGINT to its process group: a terminal's Ctrl-C
    (report.out / SERVER_PID).unlink(missing_ok=True)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    result["left"] = [pid for pid in workers if _alive(pid)]
    report.save("serve", result)
    ok = result.get("completion_tokens") == 16 and not result["left"] and result["exit_code"] == 0
    report.line(f"serve: [{'met' if ok else 'NOT met'}] ready in {result['ready_s']:.0f} s with {len(workers)} "
                f"child processes; {result['client']} got {result['completion_tokens']} tokens "
                f"{result['text'][:60]!r}; after SIGINT exit {result['exit_code']}, left: {result['left'] or 'none'}")


def _kill_server(out: Path) -> None:
    """Kill the process group of a server that a cut serve stage left running (its KV pool holds
    90% of the GPUs' memory, which the next command would find taken)."""
    path = out / SERVER_PID
    if path.exists():
        try:
            os.killpg(int(path.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
        path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------- the stages' processes


def run_stage(name: str, out: Path, device: str) -> int:
    """One stage in this process (the orchestrator's child)."""
    logging.basicConfig(filename=out / "tp_check.log", level=logging.INFO,
                        format=f"%(asctime)s {name} %(process)d %(name)s %(levelname)s: %(message)s")
    setup = Setup(device)
    report = Report(out, out / f"stage-{name}.json")
    fn = {"all-reduce": stage_all_reduce, "tp1": functools.partial(stage_size, size=1),
          "tp2": functools.partial(stage_size, size=2), "serve": stage_serve}[name]
    try:
        fn(setup, report)
        return 0
    except Exception as e:  # noqa: BLE001 - recorded; the orchestrator goes on
        report.save("error", {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        report.line(f"{name}: FAILED: {type(e).__name__}: {str(e)[:300]}")
        return 1


def orchestrate(out: Path, stages: list[str], budget: float, device: str) -> int:
    from tp_host_time import read_json

    for old in [out / "summary.txt", out / "tp_check.log", *out.glob("stage-*.json")]:
        old.unlink(missing_ok=True)
    report = Report(out, out / "tp_check.json")
    report.save("environment", _environment())
    report.line(f"tp_gpu_check: stages {stages} within {budget:.0f} s on {report.data['environment']}")
    deadline = time.monotonic() + budget
    failed = False
    for name in stages:
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            report.line(f"{name}: skipped, {left:.0f} s left of the budget")
            failed = True
            continue
        limit = min(STAGES[name], left)
        start = time.monotonic()
        child = subprocess.Popen([sys.executable, __file__, str(out), "--stage", name, "--device", device],
                                 start_new_session=True)
        try:
            code = child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the stage and its workers
            child.wait()
            _kill_server(out)
            code = None
            report.line(f"{name}: cut at its budget of {limit:.0f} s; what it measured is kept")
        failed |= code != 0
        stage_path = out / f"stage-{name}.json"
        report.save(name, dict(read_json(str(stage_path)), seconds=round(time.monotonic() - start, 1),
                               exit_code=code))
        stage_path.unlink(missing_ok=True)  # merged: OUT keeps few files (what comes back from a GPU run is counted)
    one, two = report.data.get("tp1", {}), report.data.get("tp2", {})
    if "greedy" in one and "greedy" in two:
        report.save("equal", compare(one["greedy"], two["greedy"], report))
    if "throughput" in one and "throughput" in two:
        speedup = two["throughput"]["tokens_per_s"] / one["throughput"]["tokens_per_s"]
        report.save("speedup", speedup)
        report.line(f"throughput: [{'met' if speedup >= TARGETS['speedup'] else 'NOT met'}] TP=2 is {speedup:.2f}x "
                    f"TP=1 (target >= {TARGETS['speedup']}x)")
    return 1 if failed else 0


def _environment() -> dict:
    """Versions, GPUs and commit, read without a CUDA context here (the stages' processes hold
    the GPUs: a context in this one would take memory from their KV pools)."""
    import pagedattn
    from pagedattn.benchmarks import tree_commit

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "pagedattn": pagedattn.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None,
           "commit": tree_commit()}
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=False).stdout
        env["gpus"] = [line for line in gpus.split("\n") if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        env["gpus"] = None
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder for summary.txt, tp_check.json and the logs")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}, run in this "
                   "order (default: all)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole check (default 540)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a rehearsal on gloo, tiny model")
    p.add_argument("--stage", help=argparse.SUPPRESS)  # run one stage in this process (the orchestrator's child)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        return run_stage(args.stage, out, args.device)
    stages = args.stages.split(",")
    if set(stages) - set(STAGES) or (args.device == "cuda" and torch.cuda.device_count() < 2):
        p.error(f"expected --stages from {list(STAGES)} and 2 GPUs, got {stages} and {torch.cuda.device_count()}")
    return orchestrate(out, stages, args.budget, args.device)


if __name__ == "__main__":
    sys.exit(main())
