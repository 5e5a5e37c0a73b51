"""Per-layer host time of `impl.forward`: what one attention layer costs the CPU per step.

Steps (`--step`), over a shuffled paged cache, eager, Hq=32, Hkv=8, D=128, block size 16, bf16
on CUDA and float32 on the CPU:
- `decode`: `--batch` decode sequences (default 1) of seq_len L;
- `mixed`: a chunk of `--chunk` tokens over a cached prefix of as many, then `--batch` decodes
  of L (the chunked-prefill step of a server: 2k over 2k + 64 decodes of 2k);
- `prefill`: `--batch` fresh prompts of L tokens.
Each step builds its metadata with the backend's builder (untimed), then calls
`impl.forward(q, k, v, kv_cache, md)` once per layer (each layer its own impl, called as
`pagedattn.Attention` calls it; one cache, shared: the host time does not depend on which memory
a kernel reads), timing every call with `time.perf_counter()`. Python's garbage collector is off
while timing, as in `timeit`. `--profile N` also prints the N functions of most own time under
cProfile (a second pass).

On CUDA the calls are not synchronised: kernels launch asynchronously, so while the launch queue
is not full the wall time of a call is its host time. The device is synchronised after each
step's layers (every `--layers` calls), outside the timed calls, so the queue never fills. On the
CPU the kernels run inside the call: the time is host work plus the attention itself.

Reported per backend, in microseconds: the median and p90 over every timed call, and the median
of each step's first layer (per-step work a backend does lazily in forward shows there). Backends
that cannot run here are listed with the reason; `triton` is skipped under TRITON_INTERPRET
(interpreted time means nothing).

Only the public contract is used (`pagedattn.list_backends`, `get_backend`, `ScheduledSeq`,
`Backend.get_kv_cache_shape/get_builder_cls/get_impl_cls`, `builder.build`, `impl.forward`),
and nothing else of this package, so the file also measures an older checkout of it:

    pagedattn bench overhead [--step decode|mixed|prefill] [--json]
    PYTHONPATH=/path/to/old/checkout python pagedattn/benchmarks/overhead.py --json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

import pagedattn


STEPS = ("decode", "mixed", "prefill")


@dataclass(frozen=True)
class Case:
    """The timed step and how many times it runs."""

    step: str = "decode"  # one of STEPS
    batch: int = 1  # decodes (decode, mixed) or prompts (prefill)
    chunk: int = 2048  # mixed: the prefill chunk's tokens, over a cached prefix of as many
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    seq_len: int = 1024  # a decode's (its token included) or a prompt's tokens
    block_size: int = 16
    layers: int = 32  # forward calls per step: the calls between two synchronisations on CUDA
    steps: int = 50  # timed steps
    warmup_steps: int = 3  # untimed steps first (JIT compilation, caches, allocator)


def _skip_reason(status) -> str | None:
    """Why backend `status` (a `pagedattn.BackendStatus`) is not timed here; None: it is."""
    if not status.available:
        return "unavailable: " + "; ".join(status.reasons)
    if status.name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        return "skipped: TRITON_INTERPRET=1 runs the kernels interpreted, so their time means nothing"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_seqs(case: Case) -> tuple[list[tuple[int, int]], int]:
    """The step's sequences as (seq_len, query_len), prefills first, and the blocks they hold."""
    if case.step == "decode":
        seqs = [(case.seq_len, 1)] * case.batch
    elif case.step == "mixed":
        seqs = [(2 * case.chunk, case.chunk)] + [(case.seq_len, 1)] * case.batch
    else:
        seqs = [(case.seq_len, case.seq_len)] * case.batch
    return seqs, sum(-(-s // case.block_size) for s, _ in seqs)


def measure(backend, case: Case, device: torch.device, dtype: torch.dtype, profile: cProfile.Profile | None = None
            ) -> dict:
    """Time `impl.forward` of `backend` (a backend class) on `case`: every timed call's host time
    in microseconds, and the same for each step's first layer. With `profile`, the timed calls
    run under it."""
    shapes, num_blocks = _step_seqs(case)
    g = torch.Generator(device="cpu").manual_seed(0)
    pages = torch.randperm(num_blocks, generator=g).tolist()  # shuffled pages
    seqs = []
    for seq_len, query_len in shapes:
        n = -(-seq_len // case.block_size)
        seqs.append(pagedattn.ScheduledSeq(seq_len, query_len, pages[:n]))
        pages = pages[n:]
    tokens = sum(q for _, q in shapes)
    shape = backend.get_kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    impl_cls = backend.get_impl_cls()
    scale = case.head_size ** -0.5
    impls = [impl_cls(case.num_heads, case.head_size, scale, case.num_kv_heads) for _ in range(case.layers)]
    cache = torch.randn(shape, generator=g, dtype=torch.float32).to(device, dtype)
    q = torch.randn(tokens, case.num_heads * case.head_size, generator=g).to(device, dtype)  # [T, Hq*D]
    k = torch.randn(tokens, case.num_kv_heads * case.head_size, generator=g).to(device, dtype)  # [T, Hkv*D]
    v = torch.randn(tokens, case.num_kv_heads * case.head_size, generator=g).to(device, dtype)  # [T, Hkv*D]
    out = torch.empty_like(q)
    builder = backend.get_builder_cls()(case.block_size, device)
    builder.set_layers(impls)

    every, first = [], []
    gc_was_on = gc.isenabled()
    gc.disable()  # as timeit does: no collection pauses inside the timed calls
    try:
        with torch.inference_mode():
            for step in range(case.warmup_steps + case.steps):
                md = builder.build(seqs)
                _sync(device)  # the build's copies finish outside the timed calls
                timed = step >= case.warmup_steps
                if timed and profile is not None:
                    profile.enable()
                times = []
                for impl in impls:
                    start = time.perf_counter()
                    impl.forward(q, k, v, cache, md, output=out)
                    times.append(time.perf_counter() - start)
                if timed and profile is not None:
                    profile.disable()
                _sync(device)
                if timed:
                    every += times
                    first.append(times[0])
    finally:
        if gc_was_on:
            gc.enable()
    return dict(every_us=[t * 1e6 for t in every], first_us=[t * 1e6 for t in first])


def profile_report(backend, case: Case, device: torch.device, dtype: torch.dtype, top: int) -> str:
    """The `top` functions of most own time over the timed calls of `case`, as pstats prints them."""
    prof = cProfile.Profile()
    measure(backend, case, device, dtype, prof)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def _summary(name: str, times: dict) -> dict:
    every = times["every_us"]
    return dict(backend=name, median_us=round(statistics.median(every), 2),
                p90_us=round(statistics.quantiles(every, n=10)[8], 2),
                first_layer_median_us=round(statistics.median(times["first_us"]), 2), calls=len(every))


def run_overhead(case: Case, device: torch.device, names: list[str] | None = None, profile_top: int = 0) -> dict:
    """Every available backend (or those in `names`) on `case`: a summary row each, or why not
    (and, with `profile_top`, each one's cProfile listing under "profile")."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    available = {s.name: s for s in pagedattn.list_backends()}
    rows = []
    for name in names or list(available):
        status = available.get(name)
        skip = f"unknown backend; registered: {', '.join(available)}" if status is None else _skip_reason(status)
        if skip:
            rows.append(dict(backend=name, skipped=skip))
        else:
            try:
                backend = pagedattn.get_backend(name)
                rows.append(_summary(name, measure(backend, case, device, dtype)))
                if profile_top:
                    rows[-1]["profile"] = profile_report(backend, case, device, dtype, profile_top)
            except Exception as exc:  # noqa: BLE001 - a backend that refuses this case is a result too
                rows.append(dict(backend=name, skipped=f"failed: {type(exc).__name__}: {exc}".splitlines()[0]))
    return dict(device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                dtype=str(dtype).removeprefix("torch."), torch=torch.__version__, threads=torch.get_num_threads(),
                pagedattn=os.path.dirname(os.path.abspath(pagedattn.__file__)), case=asdict(case), results=rows)


def _print_table(report: dict) -> None:
    c = report["case"]
    what = f"{c['step']} B={c['batch']}" + (f" chunk {c['chunk']} over {c['chunk']}" if c["step"] == "mixed" else "")
    print(f"impl.forward host time per layer: {what}, Hq={c['num_heads']} Hkv={c['num_kv_heads']} "
          f"D={c['head_size']} L={c['seq_len']} block {c['block_size']}, {report['dtype']} on {report['device']}, "
          f"{report['threads']} threads, {c['steps']} steps x {c['layers']} layers; pagedattn from {report['pagedattn']}")
    print(f"{'backend':<11} {'median us':>10} {'p90 us':>10} {'1st layer us':>13} {'calls':>6}")
    for r in report["results"]:
        if "skipped" in r:
            print(f"{r['backend']:<11} {r['skipped']}")
        else:
            print(f"{r['backend']:<11} {r['median_us']:>10.1f} {r['p90_us']:>10.1f} "
                  f"{r['first_layer_median_us']:>13.1f} {r['calls']:>6}")
    for r in report["results"]:
        if r.get("profile"):
            print(f"\n{r['backend']}: cProfile of the timed calls (own time first)\n{r['profile']}")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    defaults = Case()
    parser.add_argument("--step", choices=STEPS, default=defaults.step,
                        help="decode: --batch decodes; mixed: a --chunk chunk over as many cached tokens and "
                             "--batch decodes; prefill: --batch fresh prompts (default: decode)")
    parser.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                        help="backends to time (default: every registered one that can run here)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when present)")
    for field in ("batch", "chunk", "num_heads", "num_kv_heads", "head_size", "seq_len", "block_size", "layers",
                  "steps", "warmup_steps"):
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(defaults, field))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's); 1 is steadier on a shared machine")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also list the N functions of most own time under cProfile (a second pass)")
    args = parser.parse_args(argv)
    if min(args.seq_len, args.block_size, args.batch, args.chunk) < 1:
        parser.error(f"expected --seq-len, --block-size, --batch and --chunk >= 1, got {args.seq_len}, "
                     f"{args.block_size}, {args.batch} and {args.chunk}")
    if min(args.steps, args.layers) < 1 or args.steps * args.layers < 2:
        parser.error(f"expected --steps and --layers >= 1 with at least 2 calls in all, "
                     f"got {args.steps} and {args.layers}")
    case = Case(args.step, args.batch, args.chunk, args.num_heads, args.num_kv_heads, args.head_size, args.seq_len,
                args.block_size, args.layers, args.steps, args.warmup_steps)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: --device {args.device} needs a CUDA device, found none\n")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report = run_overhead(case, device, args.backends, args.profile)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
