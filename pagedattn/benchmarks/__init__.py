"""`pagedattn bench NAME [ARGS]`: benchmarks are commands, never timed tests.

Each benchmark is a module here with `main(argv, prog) -> int` that parses its own arguments, so
`pagedattn bench NAME --help` shows them and `python -m pagedattn.benchmarks.<module>` runs the
same thing. A module is imported only when its benchmark runs: most need a GPU or an optional
package, and `pagedattn --help` must not pay for them.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Benchmark:
    name: str  # the command: `pagedattn bench <name>`
    module: str  # dotted path of the module holding `main(argv, prog) -> int`
    summary: str  # one line for `pagedattn bench --help`


BENCHMARKS = {b.name: b for b in (
    Benchmark("kernels", "pagedattn.benchmarks.kernels",
              "kernels and every backend vs FlashInfer and dense SDPA over decode/long/prefill/chunked/"
              "mixed/graph grids: JSON/CSV/roofline (GPU)"),
    Benchmark("backends", "pagedattn.benchmarks.backends",
              "every registered backend through impl.forward on identical inputs (GPU)"),
    Benchmark("overhead", "pagedattn.benchmarks.overhead",
              "host time of one layer's impl.forward per backend: eager decode, mixed or prefill steps (CPU or GPU)"),
    Benchmark("engine", "pagedattn.benchmarks.engine",
              "the engine against transformers' generate_batch at real model shapes: throughput, latency"),
)}


def run_benchmark(name: str, argv: list[str]) -> int:
    """Run benchmark `name` (a key of BENCHMARKS) with its own command-line arguments `argv`."""
    bench = BENCHMARKS[name]
    prog = f"pagedattn bench {name}"
    try:
        module = importlib.import_module(bench.module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "pagedattn":
            raise  # our own import broke: a bug, show all of it
        print(f"{prog}: needs the {exc.name!r} package, which is not installed", file=sys.stderr)
        return 2
    return module.main(argv, prog)


def require_cuda(prog: str) -> None:
    """Exit with status 2 and one line on stderr when this machine has no CUDA device (called by
    the GPU-only benchmarks after parsing their arguments, so `--help` still works)."""
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA device, found none (torch.cuda.is_available() is False)", file=sys.stderr)
        raise SystemExit(2)
