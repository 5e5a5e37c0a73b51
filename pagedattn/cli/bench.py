"""`pagedattn bench NAME [ARGS]`: run one benchmark of `pagedattn.benchmarks`."""

from __future__ import annotations

import argparse

from pagedattn.benchmarks import BENCHMARKS, run_benchmark


def add_parser(sub) -> None:
    """Register `bench` on `sub`, the `add_subparsers()` object of the `pagedattn` parser. Each
    benchmark parses its own arguments (`pagedattn bench NAME --help`), so its module is imported
    only when it runs."""
    listing = "\n".join(f"  {b.name:<11} {b.summary}" for b in BENCHMARKS.values())
    b = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS),
                       description=f"benchmarks:\n{listing}\n\n`pagedattn bench NAME --help` shows NAME's options.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("name", choices=list(BENCHMARKS), metavar="NAME", help="one of: " + ", ".join(BENCHMARKS))
    rest = b.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the benchmark's own options")
    rest.required = False  # argparse marks a REMAINDER positional required; a missing NAME is the error
    b.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return run_benchmark(args.name, args.args)
