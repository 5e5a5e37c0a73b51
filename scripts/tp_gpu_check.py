"""Tensor parallelism on a 2-GPU machine, in one command (random weights, nothing downloaded):

1. equal: Llama-3-8B shape, 64 requests (128 random prompt tokens, 64 greedy tokens, EOS
   ignored) at TP=1 and TP=2: token equality; where a request diverges, its first divergent
   position and the log-probabilities of both candidates on both sides (a near tie in bf16, or
   not);
2. decode: the decode step at batch 64 against its floor (TP=1: weights + KV; TP=2: per GPU, one
   rank's weights and KV heads) and, at TP=2, the all-reduce time (2 x layers of them a step);
3. throughput: 256 requests of 128/128 tokens, output tokens/s at TP=2 against TP=1 (a warm-up
   run, then the median of 2);
4. big: the Llama-3-70B shape at TP=2 with as many of its 80 layers as fit the two GPUs (all
   of them where memory allows; the report says how many ran), its decode step at batch 64
   against the floor per GPU;
5. serve: `pagedattn serve --tensor-parallel-size 2` over a 2-layer Llama-3-8B-shaped checkpoint
   written to a temporary folder, one /v1/completions request through the `openai` client (or
   httpx where that package is not installed, said so), then SIGINT: the server and its worker
   must be gone;
6. fault: a TP=2 engine whose worker is killed (SIGKILL) mid-generate must raise an error naming
   rank 1 within seconds, and leave no process.

    python scripts/tp_gpu_check.py OUT [--parts equal,decode,throughput,big,serve,fault]

Writes OUT/summary.txt (one line a check, written as each ends), OUT/tp_check.json (every
number) and OUT/tp_check.log (the engine's INFO log). Parts 1-3 share one engine per TP size;
about 6 minutes on two H100s. Targets (issue #31) are printed next to the measurements.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

PARTS = ("equal", "decode", "throughput", "big", "serve", "fault")
DEVICE = "cuda"  # module constants: a CPU rehearsal of this script's logic sets "cpu" and tiny shapes
SHAPE, BIG = "llama3-8b", "llama3-70b"
REQUESTS, PROMPT_LEN, OUTPUT_LEN = 64, 128, 64
THROUGHPUT_REQUESTS = 256
BIG_HEADROOM_GIB = 9.0  # per GPU beside the 70B shard: KV of batch 64, activations, graphs, NCCL, CUDA context
TARGETS = {"decode_ratio": 1.3, "big_decode_ratio": 1.35, "speedup": 1.6}

log = logging.getLogger("tp_gpu_check")


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict = {"environment": _environment()}

    def line(self, text: str) -> None:
        print(text, flush=True)
        with (self.out / "summary.txt").open("a") as f:
            f.write(text + "\n")

    def save(self, key: str, value) -> None:
        self.data[key] = value
        (self.out / "tp_check.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def _environment() -> dict:
    import pagedattn

    cuda = torch.cuda.is_available()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "pagedattn": pagedattn.__version__,
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except OSError:
        env["commit"] = None
    return env


def _loader(shape: str, num_layers: int | None = None, max_model_len: int = 4096):
    from pagedattn.models.dummy import SHAPES, load_dummy_model

    max_model_len = min(max_model_len, SHAPES[shape]["max_position_embeddings"])
    return functools.partial(load_dummy_model, shape, dtype=torch.bfloat16, max_model_len=max_model_len, seed=0,
                             num_layers=num_layers)


def _engine(loader, size: int, **options):
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine

    config = EngineConfig(device=DEVICE, tensor_parallel_size=size, seed=0, **options)
    return LLMEngine(config, loader if size > 1 else loader(device=torch.device(DEVICE)))


def _free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _gpu_bytes() -> int:
    """The smaller of the two GPUs' memory."""
    return min(torch.cuda.mem_get_info(i)[1] for i in range(2))


# ---------------------------------------------------------------------- parts 1-3, per TP size


def run_size(size: int, parts: set[str], bandwidth: float, report: Report) -> dict:
    from pagedattn.benchmarks import engine_offline as offline
    from pagedattn.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    engine = _engine(_loader(SHAPE), size, max_num_seqs=max(THROUGHPUT_REQUESTS, 64))
    result = {"start_up_s": time.perf_counter() - start, "num_kv_blocks": engine.block_manager.num_blocks,
              "weight_bytes_per_gpu": offline.weight_bytes_read(engine.runner.model)}
    report.line(f"TP={size}: engine up in {result['start_up_s']:.0f} s, {result['num_kv_blocks']} KV blocks, "
                f"{result['weight_bytes_per_gpu'] / 1e9:.2f} GB of weights read a step per GPU")
    try:
        if "equal" in parts:
            lengths = [(PROMPT_LEN, OUTPUT_LEN)] * REQUESTS
            requests = offline.make_requests(lengths, vocab_size=engine.spec.vocab_size, seed=0, rep=0)
            params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True, logprobs=2)
            outs = engine.generate([r.prompt for r in requests], [params] * REQUESTS)
            result["greedy"] = [{"tokens": o.outputs[0].token_ids,
                                 "top": [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]}
                                for o in outs]
        if "throughput" in parts:
            lengths = [(128, 128)] * THROUGHPUT_REQUESTS
            cell = offline.measure(lambda rep: offline.run_ours(engine, offline.make_requests(
                lengths, vocab_size=engine.spec.vocab_size, seed=0, rep=rep)), 2, 120.0, lambda: None)
            result["throughput"] = {k: cell[k] for k in ("tokens_per_s", "runs_s", "median_s", "note")}
            report.line(f"TP={size}: 128/128 x {THROUGHPUT_REQUESTS}: {cell['tokens_per_s']:.0f} output tokens/s "
                        f"(runs {cell['runs_s']} s)")
        if "decode" in parts:
            result["decode"] = _decode(engine, result["weight_bytes_per_gpu"], bandwidth, size)
            target = TARGETS["decode_ratio"] if size > 1 else None
            report.line(_decode_line(f"TP={size} {SHAPE}", result["decode"], target))
    finally:
        engine.shutdown()
        engine = None  # the last reference: its memory goes before the next engine's
        _free()
    return result


def _decode(engine, weight_bytes: int, bandwidth: float, size: int) -> dict:
    from pagedattn.benchmarks import engine_offline as offline

    d = offline.decode_step(engine, batch=64, prompt_len=128, steps=128, seed=0, weight_bytes=weight_bytes,
                            bandwidth=bandwidth)
    all_reduce = engine.runner.time_all_reduce(64)
    if all_reduce is not None:
        layers = engine.spec.num_layers
        d.update(all_reduce_s=all_reduce, all_reduce_step_s=2 * layers * all_reduce)
    engine.async_scheduling = False  # the host's share: each step read before the next is queued
    d["sync_median_step_s"] = offline.decode_step(engine, batch=64, prompt_len=128, steps=64, seed=1,
                                                  weight_bytes=weight_bytes, bandwidth=bandwidth)["median_step_s"]
    engine.async_scheduling = True
    d["tensor_parallel_size"] = size
    return d


def _decode_line(name: str, d: dict, target: float | None) -> str:
    text = (f"{name} decode step at batch 64: {d['median_step_s'] * 1e3:.2f} ms, floor"
            f"{' per GPU' if d['tensor_parallel_size'] > 1 else ''} {d['floor_s'] * 1e3:.2f} ms "
            f"({d['ratio_to_floor']:.2f}x); graph replay {(d['graph_replay_s'] or 0) * 1e3:.2f} ms; "
            f"sync {d['sync_median_step_s'] * 1e3:.2f} ms")
    if "all_reduce_s" in d:
        text += f"; all-reduce {d['all_reduce_s'] * 1e6:.1f} us, {d['all_reduce_step_s'] * 1e3:.2f} ms a step"
    if target is not None:
        text += f" [{'met' if d['ratio_to_floor'] <= target else 'NOT met'}: <= {target}x]"
    return text


def compare(one: dict, two: dict, report: Report) -> dict:
    """Token equality of the greedy runs; at each request's first divergence, both candidates'
    log-probabilities on both sides (the gap between them is the logit gap: same normalizer)."""
    equal, diverged = 0, []
    for i, (a, b) in enumerate(zip(one["greedy"], two["greedy"])):
        if a["tokens"] == b["tokens"]:
            equal += 1
            continue
        j = next(k for k, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
        ta, tb = a["tokens"][j], b["tokens"][j]
        top_a, top_b = a["top"][j], b["top"][j]
        diverged.append({"request": i, "position": j, "tp1_token": ta, "tp2_token": tb,
                         "tp1_logprobs": {ta: top_a.get(ta), tb: top_a.get(tb)},
                         "tp2_logprobs": {ta: top_b.get(ta), tb: top_b.get(tb)},
                         "tp1_gap": None if top_a.get(tb) is None else top_a[ta] - top_a[tb],
                         "tp2_gap": None if top_b.get(ta) is None else top_b[tb] - top_b[ta]})
    agree = []  # |log-probability difference| of the chosen token, while both sides chose the same ones
    for a, b in zip(one["greedy"], two["greedy"]):
        for ta, tb, x, y in zip(a["tokens"], b["tokens"], a["top"], b["top"]):
            if ta != tb:
                break
            agree.append(abs(x[ta] - y[tb]))
    result = {"requests": len(one["greedy"]), "equal": equal, "diverged": diverged,
              "max_logprob_diff_on_equal_tokens": max(agree, default=0.0)}
    report.line(f"equal: {equal}/{len(one['greedy'])} requests give the same {OUTPUT_LEN} greedy tokens at TP=2 "
                f"as at TP=1; chosen-token log-probability differences up to "
                f"{result['max_logprob_diff_on_equal_tokens']:.4f} where the tokens agree")
    for d in diverged[:8]:
        report.line(f"  request {d['request']} diverges at token {d['position']}: TP=1 {d['tp1_token']} vs TP=2 "
                    f"{d['tp2_token']}; gap TP=1 {_fmt(d['tp1_gap'])}, TP=2 {_fmt(d['tp2_gap'])} nats")
    return result


def _fmt(x) -> str:
    return "n/a (not in the top 2)" if x is None else f"{x:.4f}"


# ---------------------------------------------------------------------- part 4: the 70B shape


def run_big(bandwidth: float, report: Report, utilization: float) -> dict:
    from pagedattn.benchmarks import engine_offline as offline
    from pagedattn.models.dummy import SHAPES

    s = SHAPES[BIG]
    total = _gpu_bytes()
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    heads, kv = s["num_attention_heads"], s["num_key_value_heads"]
    head = hidden // heads
    # bf16 bytes a layer holds on each of 2 ranks: q/k/v, o, gate/up and down
    per_layer = (hidden * (heads + 2 * kv) * head + heads * head * hidden + 3 * hidden * inter) * 2 / 2
    fixed = 2 * s["vocab_size"] * hidden * 2 / 2  # embedding and head
    fit = int((total * utilization - fixed - BIG_HEADROOM_GIB * 2**30) // per_layer)
    layers = max(1, min(s["num_hidden_layers"], fit))
    for attempt in range(2):  # the estimate may be a little too hopeful: then 80% of its layers
        report.line(f"big: {BIG} at TP=2 with {layers} of {s['num_hidden_layers']} layers ({per_layer / 2**30:.2f} "
                    f"GiB a layer a GPU, {total / 2**30:.1f} GiB GPUs at gpu_memory_utilization {utilization})")
        start = time.perf_counter()
        try:
            engine = _engine(_loader(BIG, None if layers == s["num_hidden_layers"] else layers, max_model_len=1024),
                             2, max_num_seqs=64, max_num_batched_tokens=2048, gpu_memory_utilization=utilization)
            break
        except Exception as e:  # noqa: BLE001 - out of memory on either rank (a worker's comes as WorkerError)
            if attempt:
                raise
            report.line(f"big: {layers} layers do not fit ({type(e).__name__}: {str(e)[:200]}); trying fewer")
            _free()
            layers = int(layers * 0.8)
    try:
        weight_bytes = offline.weight_bytes_read(engine.runner.model)
        result = {"layers": layers, "all_layers": layers == s["num_hidden_layers"],
                  "start_up_s": time.perf_counter() - start, "num_kv_blocks": engine.block_manager.num_blocks,
                  "weight_bytes_per_gpu": weight_bytes,
                  "decode": _decode(engine, weight_bytes, bandwidth, 2)}
        report.line(_decode_line(f"TP=2 {BIG} ({layers} layers)", result["decode"], TARGETS["big_decode_ratio"]))
    finally:
        engine.shutdown()
        engine = None
        _free()
    return result


# ---------------------------------------------------------------------- part 5: the server


def run_serve(report: Report) -> dict:
    from pagedattn.models.dummy import SHAPES, load_dummy_model, transformers_model

    folder = Path(tempfile.mkdtemp(prefix="tp-serve-"))
    max_len = min(2048, SHAPES[SHAPE]["max_position_embeddings"])
    loaded = load_dummy_model(SHAPE, device=DEVICE, dtype=torch.bfloat16, num_layers=2, max_model_len=max_len)
    transformers_model(loaded).save_pretrained(folder, safe_serialization=True)
    loaded.tokenizer.save_pretrained(folder)
    del loaded
    _free()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "pagedattn", "serve", "--model", str(folder), "--tensor-parallel-size", "2",
               "--port", str(port), "--max-model-len", str(max_len), "--max-num-seqs", "32", "--log-level", "warning",
               "--device", DEVICE]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    logfile = (report.out / "serve.log").open("w")
    start = time.perf_counter()
    server = subprocess.Popen(command, stdout=logfile, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    result: dict = {"command": " ".join(command)}
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, server, 300)
        result["ready_s"] = time.perf_counter() - start
        workers = _children(server.pid)  # the tensor-parallel worker (and multiprocessing's resource tracker)
        result["children"] = {pid: _cmdline(pid) for pid in workers}
        prompt = " ".join(f"t{i}" for i in range(100, 132))
        try:
            import openai

            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            answer = client.completions.create(model=folder.name, prompt=prompt, max_tokens=16, temperature=0)
            result.update(client=f"openai {openai.__version__}", text=answer.choices[0].text,
                          completion_tokens=answer.usage.completion_tokens)
        except ImportError:
            import httpx

            body = httpx.post(f"{url}/v1/completions", json={"model": folder.name, "prompt": prompt, "max_tokens": 16,
                                                             "temperature": 0}, timeout=60).json()
            result.update(client=f"httpx {httpx.__version__} (the openai package is not installed here)",
                          text=body["choices"][0]["text"], completion_tokens=body["usage"]["completion_tokens"])
        os.killpg(server.pid, signal.SIGINT)  # a terminal's Ctrl-C: the server and its worker
        result["exit_code"] = server.wait(timeout=60)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        result["left"] = {pid: _cmdline(pid) for pid in workers if _alive(pid)}
        result["gone_after_s"] = time.perf_counter() - start - result["ready_s"]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        logfile.close()
    ok = result.get("completion_tokens") == 16 and not result["left"]
    report.line(f"serve: [{'met' if ok else 'NOT met'}] ready in {result['ready_s']:.0f} s with children "
                f"{result['children']}; {result['client']} got {result['completion_tokens']} tokens "
                f"{result['text'][:60]!r}; after SIGINT exit {result['exit_code']}, left: {result['left'] or 'none'}")
    return result


def _wait_ready(url: str, server, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before answering (serve.log)")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server did not answer within {timeout_s:.0f} s")


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()[:120]
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------- part 6: a dead worker


def run_fault(report: Report) -> dict:
    from pagedattn.engine.sampling_params import SamplingParams

    engine = _engine(_loader(SHAPE, num_layers=2), 2, max_num_seqs=64)
    pid = engine.worker_pids[1]
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    for i in range(32):
        engine.add_request(list(range(i, i + 64)), params)
    threading.Timer(2.0, os.kill, (pid, signal.SIGKILL)).start()
    start, error = time.perf_counter(), None
    try:
        while engine.has_unfinished():
            engine.step()
    except RuntimeError as e:
        error = str(e)
    elapsed = time.perf_counter() - start - 2.0
    time.sleep(1.0)
    result = {"error": error, "seconds_after_kill": elapsed, "worker_left": _alive(pid)}
    ok = error is not None and "rank 1" in error and elapsed < 30 and not result["worker_left"]
    report.line(f"fault: [{'met' if ok else 'NOT met'}] worker killed mid-generate -> {error!r} "
                f"{elapsed:.1f} s after the kill; worker process left: {result['worker_left']}")
    del engine
    _free()
    return result


# ---------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder for summary.txt, tp_check.json, tp_check.log, serve.log")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)} (default: all)")
    p.add_argument("--big-utilization", type=float, default=0.95,
                   help="gpu_memory_utilization of the 70B shape (default 0.95)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS) or (DEVICE == "cuda" and torch.cuda.device_count() < 2):
        p.error(f"expected --parts from {PARTS} and 2 GPUs, got {sorted(parts)} and {torch.cuda.device_count()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=out / "tp_check.log", level=logging.INFO,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s")
    report = Report(out)
    report.line(f"tp_gpu_check on {report.data['environment']}")
    from pagedattn.benchmarks.engine_offline import copy_bandwidth

    bandwidth = copy_bandwidth(torch.device(DEVICE), 1 << 30)
    report.save("copy_bandwidth_gb_s", bandwidth / 1e9)
    report.line(f"copy bandwidth (GPU 0): {bandwidth / 1e9:.0f} GB/s")
    failed = False

    def attempt(name: str, fn, *fn_args):
        nonlocal failed
        start = time.perf_counter()
        try:
            value = fn(*fn_args)
            report.save(name, value)
            return value
        except Exception as e:  # noqa: BLE001 - the other parts still run
            failed = True
            report.line(f"{name}: FAILED after {time.perf_counter() - start:.0f} s: {type(e).__name__}: {e}")
            log.error("%s failed:\n%s", name, traceback.format_exc())
            report.save(name, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            return None

    sized = parts & {"equal", "decode", "throughput"}
    if sized:
        one = attempt("tp1", run_size, 1, sized, bandwidth, report)
        two = attempt("tp2", run_size, 2, sized, bandwidth, report)
        if one and two and "equal" in parts:
            attempt("equal", compare, one, two, report)
        if one and two and "throughput" in parts:
            speedup = two["throughput"]["tokens_per_s"] / one["throughput"]["tokens_per_s"]
            report.save("speedup", speedup)
            report.line(f"throughput: [{'met' if speedup >= TARGETS['speedup'] else 'NOT met'}] TP=2 is {speedup:.2f}x "
                        f"TP=1 (target >= {TARGETS['speedup']}x)")
    if "big" in parts:
        attempt("big", run_big, bandwidth, report, args.big_utilization)
    if "serve" in parts:
        attempt("serve", run_serve, report)
    if "fault" in parts:  # last: an aborted NCCL group is not reused in this process
        attempt("fault", run_fault, report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
