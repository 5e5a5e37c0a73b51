"""Paged-attention kernels and backends against FlashInfer and dense SDPA, on the same data (GPU).

`pagedattn bench kernels [--grid G[,G...]] [--backend P[,P...]] [--quick] [--match TEXT]
[--splits N[,N...]] [--tiles [M]xKxWxS[,...]] [--out DIR]`

Per case (cases.py: decode, short (decode at an engine's short contexts), long, prefill, chunked,
mixed, graph grids), in one process on one set of tensors (shuffled pages, bf16 queries, bf16 or
FP8 e4m3 KV), rows for:
- every available registered backend through the contract (`impl.forward`, store included);
- `raw`: our kernels called directly (one `paged_attention` launch, storing through its `write`); with
  `--splits`, also `raw-s<N>`: the same with the split-KV count forced to N, and with `--tiles`
  `raw-[m<M>]n<K>w<W>s<S>`: with M query rows, K keys per step, W warps and S pipeline stages
  (to tune the policies);
- `flashinfer-raw`: FlashInfer's wrappers called directly, with its `append_paged_kv_cache`
  (bf16) or our `store_kv` (FP8) so it stores what the contract stores; always run when
  FlashInfer imports, since it is the reference of the speed and error columns;
- `sdpa-cudnn`, `sdpa-flash`: torch SDPA on dense copies, an upper bound where one applies;
and the device's copy bandwidth and bf16 matmul rate measured at the start of the same run.
Each row: time (median), GB/s and TFLOP/s over the case's floors (floors.py), percent of the
ceiling that bounds the case, speed vs flashinfer-raw, and rel L2 error against its output.
Decode is timed by CUDA-graph replay on every side (timing.py says how), the rest eagerly with
the L2 flushed. Writes results.json, results.csv, results.md and roofline.png to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedattn.benchmarks import require_cuda

from .cases import GRIDS, select
from .tiles import parse_tile

SDPA_NAMES = ("sdpa", "sdpa-cudnn", "sdpa-flash")
OWN_NAMES = ("raw", "flashinfer-raw")


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None, prog: str | None) -> argparse.Namespace:
    import pagedattn

    backends = pagedattn.list_backends()
    valid = [*OWN_NAMES, *SDPA_NAMES, *(s.name for s in backends)]
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                     epilog="\n".join(__doc__.splitlines()[4:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", default="all", help=f"comma list of {', '.join(GRIDS)}, or all (default)")
    parser.add_argument("--backend", default=None,
                        help=f"comma list of providers (default: all): {', '.join(valid)}")
    parser.add_argument("--quick", action="store_true",
                        help="a handful of representative cells per grid (minutes, after compilation)")
    parser.add_argument("--match", default=None,
                        help="comma list of substrings; keep only cases whose name holds one")
    parser.add_argument("--splits", default="",
                        help="comma list of split-KV counts: a raw-s<N> row each, our kernels "
                             "with the split count forced")
    parser.add_argument("--tiles", default="",
                        help="comma list of [ROWSx]KEYSxWARPSxSTAGES (e.g. 64x4x3,128x128x8x3): a "
                             "raw-[m<M>]n<K>w<W>s<S> row each, our kernels with that tile")
    parser.add_argument("--out", default="kernel_bench", type=Path,
                        help="folder for results.json/.csv/.md and roofline.png (default: kernel_bench)")
    args = parser.parse_args(argv)
    args.grids = _names(args.grid)
    try:
        args.cases = select(args.grids, args.quick)
    except ValueError as exc:
        parser.error(str(exc))
    if args.match:
        keys = [m.lower() for m in _names(args.match)]
        args.cases = [c for c in args.cases if any(k in c.name.lower() for k in keys)]
    if not args.cases:
        parser.error(f"expected at least one case, got none for --grid {args.grid} --match {args.match}")
    try:
        args.splits = sorted({int(n) for n in _names(args.splits)})
    except ValueError:
        parser.error(f"expected --splits as comma-separated integers, got {args.splits!r}")
    if any(n < 1 for n in args.splits):  # above the workspace's cap, a row says so
        parser.error(f"expected --splits counts >= 1, got {args.splits}")
    text, args.tiles = args.tiles, []
    for item in _names(text):
        tile = parse_tile(item)
        if tile is None:
            parser.error(f"expected --tiles as [ROWSx]KEYSxWARPSxSTAGES items (e.g. 64x4x3, 128x128x8x3), "
                         f"got {item!r}")
        args.tiles.append(tile)
    args.providers = _names(args.backend) if args.backend else None
    bad = [n for n in args.providers or [] if n not in valid]
    if bad:
        parser.error(f"expected --backend names among {', '.join(valid)}, got {', '.join(bad)}")
    return args


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    prog = prog or "pagedattn bench kernels"
    require_cuda(prog)
    try:
        from .suite import run_suite  # triton, tqdm, matplotlib: only once there is a GPU to use
    except ModuleNotFoundError as exc:
        print(f"{prog}: needs the {exc.name!r} package, which is not installed", file=sys.stderr)
        return 2
    run_suite(args.cases, args.providers, args.out, list(argv if argv is not None else sys.argv[1:]),
              args.splits, args.tiles)
    return 0
