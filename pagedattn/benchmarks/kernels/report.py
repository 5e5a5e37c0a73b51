"""Rows of `pagedattn bench kernels` and the files they are written to.

A row is one (case, provider): the case's shape (`Case.summary`), the provider, its time, and
what follows from the case's floors (floors.py) and the run's ceilings (ceilings.py):
- gbs = bytes / time, tflops = FLOPs / time;
- bound: "memory" when the case's arithmetic intensity is below the ridge point
  (matmul TFLOP/s / copy GB/s), else "compute"; pct_of_ceiling = gbs / copy_gbs or
  tflops / matmul_tflops accordingly (a read-only kernel may pass 100% of a copy);
- speed_vs_flashinfer = flashinfer-raw time / this time (> 1: faster than FlashInfer);
- rel_l2 = ||out - ref|| / ||ref|| against `rel_l2_ref` (flashinfer-raw, else the flashinfer
  or torch backend): a fast but wrong kernel shows here.
A provider that cannot run a case gets a row with `skipped` saying why and no numbers.

Files: results.json (environment, ceilings, arguments, rows), results.csv (rows, each with the
GPU, its clocks and the library versions), results.md
(the table printed at the end) and roofline.png (intensity vs achieved TFLOP/s, the measured
ceilings as the roof).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from matplotlib.figure import Figure

from .cases import Case
from .floors import Work

ROW_FIELDS = (
    "grid", "case", "heads", "num_seqs", "num_tokens", "max_seq_len", "mean_seq_len", "block_size",
    "kv_dtype", "features", "timing", "provider", "kind", "store", "time_us", "gbs", "tflops", "bound",
    "pct_of_ceiling", "speed_vs_flashinfer", "rel_l2", "rel_l2_ref", "bytes", "flops", "intensity",
    "floor_us", "how", "note", "skipped", "eager_us", "replay_us", "eager_speed_vs_flashinfer",
    "replay_speed_vs_flashinfer",
)
# the environment, repeated on every CSV row so a CSV read alone still says where it ran
ENV_FIELDS = ("gpu", "sm_clock", "mem_clock", "max_sm_clock", "torch", "triton", "flashinfer", "date")


def floor_us(work: Work, ceilings: dict) -> float:
    """The case's lower bound in microseconds: the larger of bytes / copy and FLOPs / matmul."""
    return max(work.bytes / (ceilings["copy_gbs"] * 1e3), work.flops / (ceilings["matmul_tflops"] * 1e6))


def make_row(case: Case, work: Work, ceilings: dict, provider: str, kind: str, **fields) -> dict:
    """A row of `provider` on `case`; `fields` holds time_us (or skipped) and the notes."""
    row = dict(case.summary(), provider=provider, kind=kind, bytes=work.bytes, flops=work.flops,
               intensity=round(work.intensity, 3), floor_us=round(floor_us(work, ceilings), 2))
    row.update(fields)
    t = row.get("time_us")
    if t:
        row["gbs"] = round(work.bytes / t / 1e3, 1)
        row["tflops"] = round(work.flops / t / 1e6, 2)
        ridge = ceilings["matmul_tflops"] * 1e3 / ceilings["copy_gbs"]  # FLOP per byte
        memory = work.intensity < ridge
        row["bound"] = "memory" if memory else "compute"
        pct = row["gbs"] / ceilings["copy_gbs"] if memory else row["tflops"] / ceilings["matmul_tflops"]
        row["pct_of_ceiling"] = round(100 * pct, 1)
        row["time_us"] = round(t, 2)
    return row


def _plain(x):
    """NaN/inf as strings: strict JSON has no such numbers (a NaN error must still show)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def write_json(path: Path, report: dict) -> None:
    path.write_text(json.dumps(_plain(report), indent=1, default=str) + "\n")


def env_columns(env: dict) -> dict:
    """ENV_FIELDS of `env` (environment.py; clocks from the first GPU nvidia-smi lists)."""
    smi = (env.get("nvidia_smi") or [{}])[0]
    return dict(gpu=env.get("gpu"), sm_clock=smi.get("clocks.sm"), mem_clock=smi.get("clocks.mem"),
                max_sm_clock=smi.get("clocks.max.sm"), torch=env.get("torch"), triton=env.get("triton"),
                flashinfer=env.get("flashinfer"), date=env.get("date"))


def write_csv(path: Path, report: dict) -> None:
    env = env_columns(report["environment"])
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS + ENV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(dict(r, **env) for r in report["rows"])


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)  # NaN prints as nan: a wrong output must show


def markdown(report: dict) -> str:
    """The results as a markdown table, preceded by the device and the ceilings."""
    env, ceil = report["environment"], report["ceilings"]
    head = (f"Device: {env.get('gpu')}; torch {env.get('torch')}, triton {env.get('triton')}, "
            f"flashinfer {env.get('flashinfer') or 'absent'}; ceilings: copy {ceil['copy_gbs']:.0f} GB/s, "
            f"read {ceil['read_gbs']:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s\n")
    for line in report.get("unavailable", []):
        head += f"Not run: {line}\n"
    head += "\n"
    lines = ["| case | provider | time (us) | GB/s | TFLOP/s | % ceiling | speed vs FlashInfer "
             "| rel L2 | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        note = r.get("skipped") or "; ".join(x for x in (r.get("store"), r.get("note")) if x and x != "-")
        if r.get("eager_us"):
            note += (f"; eager back to back {r['eager_us']:.1f} us ({_fmt(r.get('eager_speed_vs_flashinfer'), '.2f')}x), "
                     f"replayed {_fmt(r.get('replay_us'), '.1f')} us ({_fmt(r.get('replay_speed_vs_flashinfer'), '.2f')}x)")
        lines.append(
            f"| {r['case']} | {r['provider']} | {_fmt(r.get('time_us'), '.1f')} | {_fmt(r.get('gbs'), '.0f')} "
            f"| {_fmt(r.get('tflops'), '.1f')} | {_fmt(r.get('pct_of_ceiling'), '.0f')} "
            f"| {_fmt(r.get('speed_vs_flashinfer'), '.2f')} | {_fmt(r.get('rel_l2'), '.1e')} "
            f"| {note.replace('|', '/')} |")
    return head + "\n".join(lines) + "\n"


def roofline(path: Path, report: dict) -> None:
    """Arithmetic intensity (FLOP/byte) against achieved TFLOP/s, log-log, one colour per
    provider, under the roof min(matmul, intensity x copy bandwidth)."""
    ceil = report["ceilings"]
    rows = [r for r in report["rows"] if r.get("time_us")]
    fig = Figure(figsize=(9, 6), layout="constrained")
    ax = fig.add_subplot()
    if rows:
        lo = min(r["intensity"] for r in rows) / 2
        hi = max(r["intensity"] for r in rows) * 2
    else:
        lo, hi = 0.5, 5000.0
    ridge = ceil["matmul_tflops"] * 1e3 / ceil["copy_gbs"]
    xs = [lo, min(max(ridge, lo), hi), hi]
    ax.plot(xs, [min(ceil["matmul_tflops"], x * ceil["copy_gbs"] / 1e3) for x in xs], color="black",
            label=f"roof: copy {ceil['copy_gbs']:.0f} GB/s, matmul {ceil['matmul_tflops']:.0f} TFLOP/s")
    for provider in dict.fromkeys(r["provider"] for r in rows):
        mine = [r for r in rows if r["provider"] == provider]
        ax.scatter([r["intensity"] for r in mine], [r["tflops"] for r in mine], s=18, alpha=0.8,
                   label=provider)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of the case's floor)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"pagedattn bench kernels on {report['environment'].get('gpu')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def write_all(out_dir: Path, report: dict) -> dict[str, Path]:
    """results.json, results.csv, results.md and roofline.png under `out_dir`; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in ("results.json", "results.csv", "results.md", "roofline.png")}
    write_json(paths["results.json"], report)
    write_csv(paths["results.csv"], report)
    paths["results.md"].write_text(markdown(report))
    roofline(paths["roofline.png"], report)
    return paths
