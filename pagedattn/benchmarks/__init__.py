"""`pagedattn bench NAME [ARGS]`: benchmarks are commands, never timed tests.

Each benchmark is a module here with `main(argv, prog) -> int` that parses its own arguments, so
`pagedattn bench NAME --help` shows them and `python -m pagedattn.benchmarks.<module>` runs the
same thing. A module is imported only when its benchmark runs: most need a GPU or an optional
package, and `pagedattn --help` must not pay for them.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

COMMIT_ENV = "PAGEDATTN_COMMIT"
_CHECKOUT = Path(__file__).resolve().parents[2]  # the folder holding this pagedattn package


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


def tree_commit(root: Path | str = _CHECKOUT) -> str:
    """The commit this tree is, as results record it: `$PAGEDATTN_COMMIT` when set; else `git
    rev-parse --short HEAD` when `root` (default: the folder holding this package) is the top of a
    git checkout, with `-dirty` when a tracked file differs from it or that cannot be read
    (untracked files do not count); else "unknown". The GPU machine gets a copy of the working
    tree beside a stale .git, whose HEAD is another commit: there the one who copies the tree says
    which commit it is. The top-folder test keeps an installed package (site-packages inside some
    other repository's virtualenv) from reporting that repository's commit."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        return given
    top_head = (_git(root, "rev-parse", "--show-toplevel", "--short", "HEAD") or "").splitlines()
    if len(top_head) != 2 or Path(top_head[0]).resolve() != Path(root).resolve():
        return "unknown"
    head = top_head[1]
    changed = _git(root, "--no-optional-locks", "status", "--porcelain", "--untracked-files=no")
    return head if changed == "" else f"{head}-dirty"


def _git(root: Path | str, *args: str) -> str | None:
    """git's stripped stdout, or None when git is missing, fails or takes over 20 s."""
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()
