"""Cascade (shared-prefix) attention on one GPU (issue #33), in one command (random weights,
nothing downloaded):

1. attention: one layer at the Llama-3-8B shape (32 query / 8 KV heads of 128, bf16, pages of
   16), a decode step of 64 sequences whose tables begin with the same 4096-token prefix, each
   with 128 + 64 tokens of its own: the layer attending each whole context against the cascade
   (the prefix once for the 64 queries, the suffixes, the merge) on the same cache; device time
   of each from CUDA graphs of 20 calls replayed (CUDA events), the parts alone, the eager call's
   wall time, and how far the outputs lie apart (relative L2, max |diff|). Per backend
   (`--backends`; triton by default: FlashInfer compiles each new kernel variant for a minute or
   more without its ahead-of-time pack, docs/GPU.md);
2. engine: the Llama-3-8B shape (all 32 layers unless `--num-layers`), 64 requests of that
   prefix and 128 tokens of their own, 128 greedy output tokens (EOS ignored), on one engine
   with cascade attention, without it (decode graphs) and without it eagerly
   (`pagedattn.benchmarks.engine_shared_prefix`): the median pure decode step of each, the
   steps cascaded, and token equality (at a divergence, both candidates' log-probabilities).

    python scripts/cascade_gpu_check.py OUT.json [--backends triton,flashinfer] [--num-layers N]
    python scripts/cascade_gpu_check.py OUT.json --device cpu --tiny   # the logic on the CPU, tiny shapes

Prints a summary (one line a result) and writes every number to OUT.json. Target (issue #33):
the attention part >= 1.5x faster with cascade, outputs equal at bf16 tolerance. About 2-3
minutes on an H100, start-up included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Sizes:
    shape: str = "llama3-8b"
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    batch: int = 64
    prefix_len: int = 4096
    own_len: int = 128  # each request's own prompt tokens; also its output tokens in the engine part
    generated: int = 64  # tokens each sequence has generated at the timed attention step
    reps: int = 20  # calls captured in one graph
    replays: int = 10
    dtype: torch.dtype = torch.bfloat16
    min_prefix_tokens: int | None = None  # the engine's thresholds (None: its defaults)
    min_seqs: int | None = None


FULL = Sizes()
TINY = Sizes(shape="tiny-llama", num_heads=4, num_kv_heads=2, head_size=16, batch=8, prefix_len=64, own_len=8,
             generated=3, reps=2, replays=2, dtype=torch.float32, min_prefix_tokens=16, min_seqs=4)
TARGET_SPEEDUP = 1.5
REL_L2_BF16 = 1e-2  # two bf16 roundings of one attention apart: well under this


def _environment(device: torch.device) -> dict:
    import pagedattn
    from pagedattn.benchmarks import tree_commit

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "pagedattn": pagedattn.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["commit"] = tree_commit()
    return env


# ---------------------------------------------------------------------- part 1: one layer


def _layer_step(backend_name: str, sz: Sizes, device: torch.device):
    """A cache of `batch` sequences sharing `prefix_len` tokens of blocks, the layer, and the
    step's whole, suffix and prefix metadata."""
    import pagedattn
    from pagedattn.intmath import cdiv

    backend = pagedattn.get_backend(backend_name)
    bs, n_prefix = sz.block_size, sz.prefix_len // sz.block_size
    context = sz.prefix_len + sz.own_len + sz.generated  # each sequence's keys before the step
    own_blocks = cdiv(context + 1, bs) - n_prefix
    num_blocks = n_prefix + sz.batch * own_blocks + 8
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled pages
    shared, rest = order[:n_prefix], order[n_prefix:]
    tables = [shared + rest[i * own_blocks:(i + 1) * own_blocks] for i in range(sz.batch)]
    shape = backend.get_kv_cache_shape(num_blocks, bs, sz.num_kv_heads, sz.head_size)
    cache = torch.randn(shape, generator=gen).to(device=device, dtype=sz.dtype)
    layer = pagedattn.Attention(sz.num_heads, sz.head_size, sz.head_size ** -0.5, sz.num_kv_heads,
                                backend=backend_name, dtype=sz.dtype)
    if layer.prefix_impl is None:
        raise RuntimeError(f"{backend_name}: no cascade: {layer.cascade_refusal}")
    builder = backend.get_builder_cls()(bs, device)
    builder.set_layers([layer.impl, layer.prefix_impl])
    seqs = [pagedattn.ScheduledSeq(context + 1, 1, t) for t in tables]
    shift = n_prefix * bs
    whole = builder.build(seqs)
    suffix = builder.build([pagedattn.ScheduledSeq(s.seq_len - shift, 1, s.block_table[n_prefix:]) for s in seqs])
    prefix = builder.build_shared_prefix(sz.batch, shared)
    hq, hkv, d = sz.num_heads * sz.head_size, sz.num_kv_heads * sz.head_size, sz.head_size
    q = torch.randn(sz.batch, hq, generator=gen).to(device=device, dtype=sz.dtype)
    k = torch.randn(sz.batch, hkv, generator=gen).to(device=device, dtype=sz.dtype)
    v = torch.randn(sz.batch, hkv, generator=gen).to(device=device, dtype=sz.dtype)
    del d
    return layer, cache, whole, suffix, prefix, (q, k, v)


def _device_time(fn, sz: Sizes, device: torch.device) -> tuple[float | None, str]:
    """Seconds of one `fn()` on the device: `reps` calls captured in a CUDA graph, replayed
    `replays` times between CUDA events; (None, why) where the capture fails. On the CPU: the
    wall time of the calls."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(sz.reps * sz.replays):
            fn()
        return (time.perf_counter() - start) / (sz.reps * sz.replays), "cpu wall"
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()  # warm: compiles, lazily made workspaces
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(sz.reps):
                fn()
        graph.replay()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(sz.replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / (sz.reps * sz.replays), "cuda graph"
    except Exception as e:  # noqa: BLE001 - a backend whose calls do not capture: eager numbers only
        return None, f"no graph: {type(e).__name__}: {e}"


def _wall_time(fn, sz: Sizes, device: torch.device) -> float:
    """Seconds of one eager call, host included (what an eager step pays a layer)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    n = sz.reps * sz.replays
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / n


@torch.inference_mode()
def run_attention(backend_name: str, sz: Sizes, device: torch.device) -> dict:
    import pagedattn

    layer, cache, whole_md, suffix_md, prefix_md, (q, k, v) = _layer_step(backend_name, sz, device)

    def whole():
        with pagedattn.forward_context(whole_md, [cache]):
            return layer(q, k, v)

    def cascade():
        with pagedattn.forward_context(suffix_md, [cache], shared_prefix=[prefix_md]):
            return layer(q, k, v)

    def prefix_part():
        return layer.prefix_impl.forward(q, None, None, cache, prefix_md, return_lse=True)

    def suffix_part():
        return layer.impl.forward(q, k, v, cache, suffix_md, return_lse=True)

    parts = (prefix_part(), suffix_part())

    def merge():
        return pagedattn.merge_attn_states(parts[0][0], parts[0][1], parts[1][0], parts[1][1])

    ref, got = whole().float(), cascade().float()
    diff = got - ref
    result = {"backend": backend_name, "rel_l2": float(diff.norm() / ref.norm()),
              "max_abs_diff": float(diff.abs().max()), "max_abs_out": float(ref.abs().max())}
    result["equal_at_bf16"] = result["rel_l2"] <= REL_L2_BF16
    for name, fn in (("whole", whole), ("cascade", cascade), ("prefix", prefix_part), ("suffix", suffix_part),
                     ("merge", merge)):
        result[f"{name}_s"], result[f"{name}_timing"] = _device_time(fn, sz, device)
    for name, fn in (("whole", whole), ("cascade", cascade)):
        result[f"{name}_eager_wall_s"] = _wall_time(fn, sz, device)
    if result["whole_s"] and result["cascade_s"]:
        result["speedup"] = result["whole_s"] / result["cascade_s"]
    kv_token = 2 * sz.num_kv_heads * sz.head_size * sz.dtype.itemsize
    context = sz.prefix_len + sz.own_len + sz.generated + 1
    result["kv_bytes_whole"] = sz.batch * context * kv_token
    result["kv_bytes_cascade"] = (sz.prefix_len + sz.batch * (context - sz.prefix_len)) * kv_token
    return result


def _attention_line(r: dict) -> str:
    us = lambda x: "n/a" if x is None else f"{x * 1e6:.1f}"  # noqa: E731
    text = (f"attention [{r['backend']}], one layer, {r['kv_bytes_whole'] / 1e9:.2f} GB of K/V per step whole vs "
            f"{r['kv_bytes_cascade'] / 1e9:.3f} GB cascaded: whole {us(r['whole_s'])} us, cascade "
            f"{us(r['cascade_s'])} us (prefix {us(r['prefix_s'])} + suffix {us(r['suffix_s'])} + merge "
            f"{us(r['merge_s'])}; {r['cascade_timing']})")
    if r.get("speedup"):
        met = "met" if r["speedup"] >= TARGET_SPEEDUP else "NOT met"
        text += f": {r['speedup']:.2f}x [{met}: >= {TARGET_SPEEDUP}x]"
    text += (f"; eager calls {us(r['whole_eager_wall_s'])} / {us(r['cascade_eager_wall_s'])} us wall; outputs "
             f"rel L2 {r['rel_l2']:.2e}, max |diff| {r['max_abs_diff']:.2e} of {r['max_abs_out']:.2f} "
             f"[{'equal' if r['equal_at_bf16'] else 'NOT equal'} at bf16 tolerance]")
    return text


# ---------------------------------------------------------------------- part 2: the engine


def run_engine(sz: Sizes, device: torch.device, num_layers: int | None) -> dict:
    from pagedattn.benchmarks.engine_shared_prefix import run_shared_prefix
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.models.dummy import SHAPES, load_dummy_model

    max_model_len = sz.prefix_len + 2 * sz.own_len + sz.block_size
    thresholds = {}
    if sz.min_prefix_tokens is not None:
        thresholds = dict(cascade_min_prefix_tokens=sz.min_prefix_tokens, cascade_min_seqs=sz.min_seqs)
    start = time.perf_counter()
    loaded = load_dummy_model(sz.shape, device=device, dtype=sz.dtype, max_model_len=max_model_len, seed=0,
                              num_layers=num_layers)
    engine = LLMEngine(EngineConfig(device=str(device), max_num_seqs=sz.batch, seed=0, cascade_attention=True,
                                    **thresholds), loaded)
    result = {"start_up_s": time.perf_counter() - start, "num_layers": engine.spec.num_layers,
              "all_layers": engine.spec.num_layers == SHAPES[sz.shape]["num_hidden_layers"],
              "backend": engine.runner.backend.get_name()}
    try:
        result.update(run_shared_prefix(engine, prefix_len=sz.prefix_len, suffix_len=sz.own_len,
                                        output_len=sz.own_len, batch=sz.batch, seed=0))
    finally:
        engine.shutdown()
    return result


def _engine_lines(r: dict, sz: Sizes) -> list[str]:
    from pagedattn.benchmarks.engine_report import shared_prefix_line

    layers = f"{r['num_layers']} layers" + ("" if r["all_layers"] else " (not all of the shape's)")
    lines = [f"engine up in {r['start_up_s']:.0f} s ({sz.shape}, {layers}, {r['backend']})",
             shared_prefix_line(f"engine {sz.shape}", r)]
    for mode in ("whole", "whole_eager"):
        for d in r[f"equal_{mode}"]["diverged"][:4]:
            lines.append(f"  against {mode}: request {d['request']} diverges at token {d['position']}: "
                         f"{d.get('tokens')}, each run's margin for its choice {d.get('gaps')} nats"
                         f"{' (a near tie)' if d.get('near_tie') else ''}")
    return lines


# ---------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="path of the JSON result")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: the script's logic)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU rehearsal)")
    p.add_argument("--backends", default=None,
                   help="comma list for the attention part (default: triton on CUDA, torch on the CPU)")
    p.add_argument("--num-layers", type=int, default=None, help="the engine part's first N layers (default: all)")
    p.add_argument("--parts", default="attention,engine", help="comma list of attention, engine")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("expected a CUDA device (or --device cpu --tiny)")
    sz = TINY if args.tiny else FULL
    backends = (args.backends or ("triton" if device.type == "cuda" else "torch")).split(",")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data: dict = {"environment": _environment(device), "sizes": {k: str(v) for k, v in dataclasses.asdict(sz).items()}}
    failed = False
    began = time.perf_counter()

    def line(text: str) -> None:
        print(text, flush=True)

    def attempt(name: str, fn, *fn_args):
        nonlocal failed
        start = time.perf_counter()
        try:
            data[name] = fn(*fn_args)
        except Exception as e:  # noqa: BLE001 - the other parts still run
            failed = True
            line(f"{name}: FAILED after {time.perf_counter() - start:.0f} s: {type(e).__name__}: {e}")
            data[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            return None
        finally:
            out.write_text(json.dumps(data, indent=2, default=str) + "\n")
        return data[name]

    line(f"cascade_gpu_check on {data['environment']}")
    parts = set(args.parts.split(","))
    if "attention" in parts:
        for name in backends:
            r = attempt(f"attention_{name}", run_attention, name, sz, device)
            if r:
                line(_attention_line(r))
    if "engine" in parts:
        r = attempt("engine", run_engine, sz, device, args.num_layers)
        if r:
            for text in _engine_lines(r, sz):
                line(text)
            eq = r["equal_whole"]
            if r["cascade"]["cascade_steps"] == 0:
                failed = True
                line("engine: no step was cascaded")
            data["engine_tokens_equal"] = eq["equal"] == eq["of"]
    data["wall_s"] = time.perf_counter() - began
    out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    line(f"done in {data['wall_s']:.0f} s; wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
