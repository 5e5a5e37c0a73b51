"""What `pagedattn bench engine` writes: the environment, the targets, JSON, CSV, a plot, a table.

Files in the output folder: `engine_bench.json` (everything), `engine_offline.csv` (one row per
implementation, shape, workload and batch), `engine_online.csv` (one row per shape),
`engine_throughput.png` (output tokens/s against batch, one panel per shape).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

DECODE_FLOOR_RATIO = 1.3  # a decode step at batch 64 within this many times its bandwidth floor
DECODE_FLOOR_RATIO_BY_SHAPE = {"llama3-70b": 1.35}  # its own target (issue #31: at tensor-parallel size 2)
SPEEDUP = 5.0  # offline throughput against transformers' generate_batch
SPREAD = 0.05  # (max - min) / median of the repetitions

OFFLINE_FIELDS = ["shape", "impl", "backend", "device", "dtype", "workload", "batch", "mean_input_len",
                  "mean_output_len", "reps", "generated_tokens", "median_s", "tokens_per_s", "spread",
                  "speedup", "note"]
ONLINE_FIELDS = ["shape", "backend", "num_requests", "completed", "failed", "request_rate", "duration_s",
                 "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                 "itl_p50_ms", "itl_p99_ms", "latency_p50_ms", "latency_p99_ms", "jit_compiles", "note"]


def environment(device: torch.device) -> dict:
    """Versions, the device and its clocks (nvidia-smi when present), the CPU and its threads."""
    import transformers

    import pagedattn
    from pagedattn.benchmarks import tree_commit

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "pagedattn": pagedattn.__version__, "git_commit": tree_commit(),
           "device": str(device), "cpu": _cpu_name(), "torch_threads": torch.get_num_threads(),
           "load_average_before": load_average()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        if shutil.which("nvidia-smi"):
            query = "driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,temperature.gpu"
            index = device.index if device.index is not None else torch.cuda.current_device()
            env["nvidia_smi"] = dict(zip(query.split(","), (_run(
                ["nvidia-smi", f"--id={index}", f"--query-gpu={query}", "--format=csv,noheader"]) or "").split(", ")))
    return env


def load_average() -> float | None:
    """The host's 1-minute load average: other work on a shared CPU moves every CPU number."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------- targets


def targets(result: dict) -> list[dict]:
    """Each target checked against this run: what was measured and whether it is met."""
    out = []
    for shape, s in result["shapes"].items():
        d = s.get("decode_step")
        if d:
            ratio = DECODE_FLOOR_RATIO_BY_SHAPE.get(shape, DECODE_FLOOR_RATIO)
            out.append({"shape": _shape_name(shape, s),
                        "target": f"decode step at batch {d['batch']} <= {ratio}x floor{_per_gpu(s)}",
                        "measured": f"{d['median_step_s'] * 1e3:.2f} ms, floor {d['floor_s'] * 1e3:.2f} ms: "
                                    f"{d['ratio_to_floor']:.2f}x",
                        "met": d["ratio_to_floor"] <= ratio})
    rows = result["offline"]
    for row in rows:
        if row["impl"] == "pagedattn" and row["speedup"] is not None:
            out.append({"shape": row["shape"], "target": f"{row['workload']} batch {row['batch']}: >= {SPEEDUP}x "
                        "transformers generate_batch", "measured": f"{row['speedup']:.2f}x",
                        "met": row["speedup"] >= SPEEDUP})
    spreads = [r for r in rows if r["spread"] is not None]
    if spreads:
        worst = max(spreads, key=lambda r: r["spread"])
        within = sum(r["spread"] < SPREAD for r in spreads)
        out.append({"shape": "all", "target": f"spread between repetitions < {SPREAD:.0%}",
                    "measured": f"{within} of {len(spreads)} cells; worst {worst['spread']:.1%} "
                                f"({worst['shape']} {worst['impl']} {worst['workload']} batch {worst['batch']})",
                    "met": within == len(spreads)})
    return out


def _shape_name(shape: str, s: dict) -> str:
    """The shape, with its layers when cut (`--num-layers`) and its tensor-parallel size."""
    name = shape if s.get("all_layers", True) else f"{shape} ({s['num_layers']} layers)"
    return name + (f" TP={s['tensor_parallel_size']}" if s.get("tensor_parallel_size", 1) > 1 else "")


def _per_gpu(s: dict) -> str:
    return " per GPU" if s.get("tensor_parallel_size", 1) > 1 else ""


# ---------------------------------------------------------------------- files


def write(result: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Write the JSON, the two CSVs and the plot into `out_dir` (created); the paths written."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "engine_bench.json", folder / "engine_offline.csv", folder / "engine_online.csv"]
    paths[0].write_text(json.dumps(result, indent=2, default=str) + "\n")
    _csv(paths[1], OFFLINE_FIELDS, result["offline"])
    online = [{"shape": shape, "backend": s["backend"], **s["online"],
               "jit_compiles": s["online"].get("jit_compiles", {}).get("count")}
              for shape, s in result["shapes"].items() if s.get("online")]
    _csv(paths[2], ONLINE_FIELDS, online)
    png = plot(result, folder / "engine_throughput.png")
    return paths + ([png] if png else [])


def _compiles_line(c: dict | None) -> str:
    if not c or not c["available"]:
        return ""
    return f"; {c['count']} Triton compiles during the run ({c['seconds']:.1f} s" + (
        f": {', '.join(f'{k} x{n}' for k, n in c['kernels'].items())})" if c["kernels"] else ")")


def _csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _rounded(row.get(k)) for k in fields})


def _rounded(x):
    return round(x, 6) if isinstance(x, float) else x


def plot(result: dict, path: Path) -> Path | None:
    """Output tokens/s against batch (log 2), one panel per shape; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    shapes = list(result["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
    colors = {}
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in result["offline"] if r["shape"] == shape]
        for impl, style in (("pagedattn", "-o"), ("transformers", "--s")):
            for workload in dict.fromkeys(r["workload"] for r in rows):
                pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows
                             if r["impl"] == impl and r["workload"] == workload)
                if pts:
                    color = colors.setdefault(workload, f"C{len(colors)}")
                    ax.plot(*zip(*pts), style, color=color, label=f"{impl} {workload}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests submitted at once)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{shape} ({result['environment'].get('gpu') or result['environment']['device']})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- the table


def decode_step_line(shape: str, s: dict) -> str:
    """The decode step of shape `shape` (its entry `s` of the result's shapes, with a
    "decode_step"), against its floor, as one line."""
    d, sync = s["decode_step"], s.get("decode_step_sync")
    return (f"{_shape_name(shape, s)} decode step at batch {d['batch']}: {d['median_step_s'] * 1e3:.2f} ms (p10 "
            f"{d['p10_step_s'] * 1e3:.2f}, p90 {d['p90_step_s'] * 1e3:.2f}), floor{_per_gpu(s)} "
            f"{d['floor_s'] * 1e3:.2f} ms ({d['ratio_to_floor']:.2f}x)"
            + (f"; model and output head alone (graph replay) {d['graph_replay_s'] * 1e3:.2f} ms"
               if d.get("graph_replay_s") else "")
            + (f"; all-reduce {d['all_reduce_s'] * 1e6:.1f} us x {d['all_reduces_per_step']} = "
               f"{d['all_reduce_step_s'] * 1e3:.2f} ms a step ({d.get('all_reduce', 'NCCL')})"
               if d.get("all_reduce_s") is not None else "")
            + (f"; without async scheduling {sync['median_step_s'] * 1e3:.2f} ms" if sync else ""))


def print_summary(result: dict) -> None:
    p = print
    env = result["environment"]
    p(f"\n{env.get('gpu') or env['cpu']}, torch {env['torch']}, transformers {env['transformers']}, "
      f"copy bandwidth {result['copy_bandwidth_gb_s']:.0f} GB/s, load average {env['load_average_before']} "
      f"before, {env['load_average_after']} after")
    p(f"{'shape':<13} {'impl':<12} {'backend':<18} {'workload':<9} {'batch':>5} {'tokens/s':>10} {'spread':>7} "
      f"{'speedup':>8}  note")
    for r in result["offline"]:
        spread = f"{r['spread']:.1%}" if r["spread"] is not None else "-"
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        p(f"{r['shape']:<13} {r['impl']:<12} {r['backend']:<18} {r['workload']:<9} {r['batch']:>5} "
          f"{r['tokens_per_s']:>10.1f} "
          f"{spread:>7} {speedup:>8}  {r['note']}")
    for shape, s in result["shapes"].items():
        if "error" in s:
            p(f"{shape}: FAILED: {s['error']}")
        for why in s.get("skipped", []):
            p(f"{shape}: {why}")
        if s.get("decode_step"):
            p(decode_step_line(shape, s))
        sp = s.get("shared_prefix")
        if sp:
            p(shared_prefix_line(_shape_name(shape, s), sp))
        o = s.get("online")
        if o:
            f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            p(f"{shape} online: {o['completed']}/{o['num_requests']} requests at {o['request_rate']:g}/s, "
              f"{o['output_tokens_per_s']:.1f} tokens/s; ms p50/p99: TTFT {f(o['ttft_p50_ms'])}/{f(o['ttft_p99_ms'])}, "
              f"TPOT {f(o['tpot_p50_ms'])}/{f(o['tpot_p99_ms'])}, ITL {f(o['itl_p50_ms'])}/{f(o['itl_p99_ms'])}"
              + _compiles_line(o.get("jit_compiles"))
              + (f"; first error: {o['first_error']}" if o.get("first_error") else ""))
    p("targets:")
    for t in result["targets"]:
        p(f"  [{'met' if t['met'] else 'NOT met'}] {t['shape']}: {t['target']}: {t['measured']}")


def shared_prefix_line(name: str, sp: dict) -> str:
    """One line of `engine_shared_prefix.run_shared_prefix`'s result."""
    c, w, e = sp["cascade"], sp["whole"], sp["whole_eager"]
    eq, eq_eager = sp["equal_whole"], sp["equal_whole_eager"]
    return (f"{name} {sp['batch']} requests over a shared prefix of {sp['prefix_len']} tokens (+{sp['suffix_len']} "
            f"each), decode step: cascade {c['median_step_s'] * 1e3:.2f} ms ({c['cascade_steps']} of {c['steps']} "
            f"steps cascaded, {'graphs' if sp.get('cascade_graphs') else 'eager'}), without "
            f"{w['median_step_s'] * 1e3:.2f} ms"
            f"{' (graphs)' if sp['graphs'] else ''}, without eagerly {e['median_step_s'] * 1e3:.2f} ms: "
            f"{w['median_step_s'] / c['median_step_s']:.2f}x; equal tokens {eq['equal']}/{eq['of']} "
            f"({eq_eager['equal']}/{eq_eager['of']} against the eager run; divergences at near ties "
            f"{eq['near_ties']}/{eq['of'] - eq['equal']})")
