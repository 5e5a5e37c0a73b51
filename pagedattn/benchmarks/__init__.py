"""`pagedattn bench`: benchmarks are commands, never timed tests.

- `kernels`: our Triton kernels against FlashInfer on the same data (GPU).
- `backends`: the registered backends through the public contract (`impl.forward` with each
  builder's metadata) on identical inputs (GPU).
- `engine`: `pagedattn.LLM` against transformers' `generate` on the default model (tokens/s and
  peak resident memory, each side in its own process).
"""

from __future__ import annotations

import argparse


def bench_main(args: argparse.Namespace) -> int:
    if args.what == "kernels":
        from pagedattn.kernels.bench import run_benchmarks

        run_benchmarks(args.out)
        return 0
    if args.what == "backends":
        from pagedattn.benchmarks.backends import run_backend_benchmark

        return run_backend_benchmark(args.out)
    from pagedattn.benchmarks.engine import run_engine_benchmark

    return run_engine_benchmark(args.out, args.device)
