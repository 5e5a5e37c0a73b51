"""GPU probe of the Gluon Hopper prefill kernel (`pagedattn.kernels.hopper_prefill`): for the
prefill and chunked cases of `pagedattn bench kernels`, its error against torch SDPA (flash, on
dense copies: an independent oracle) and against the portable kernel, and its time beside the
portable kernel and FlashInfer's wrappers, for every tile in --tiles, in one process.

    python scripts/hopper_probe.py [--match TEXT] [--tiles 64,4,8 64,3,4 ...] [--json FILE]

Times: median of CUDA-event intervals, cycling the workload's input sets; every side stores the
step's K/V first where the case is paged (ours: store_kv; FlashInfer: append_paged_kv_cache).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from pagedattn.benchmarks.kernels.cases import chunked_cases, prefill_cases
from pagedattn.benchmarks.kernels.peers import prepare_flashinfer
from pagedattn.benchmarks.kernels.raw import prepare_raw
from pagedattn.benchmarks.kernels.step import NotApplicable
from pagedattn.cuda_timing import median_event_ms
from pagedattn.benchmarks.kernels.workload import make_workload
from pagedattn.kernels import hopper_prefill as hp
from pagedattn.kernels import store_kv
from pagedattn.kernels.attention_plan import search_steps


def gluon_calls(w, tile):
    c = w.case
    max_seq_len = max(c.seq_lens)

    def call(s):
        if c.paged:
            store_kv(s.key, s.value, s.cache[0], s.cache[1], w.slot_mapping, w.k_scale, w.v_scale)
            k, v, tables, kv_start = s.cache[0], s.cache[1], w.block_tables, None
        else:
            k, v, tables, kv_start = s.key, s.value, None, w.query_start_loc
        common = dict(query_start_loc=w.query_start_loc, seq_lens=w.seq_lens, block_tables=tables, scale=w.scale,
                      causal=True, lse=None, kv_start_loc=kv_start, search_steps=search_steps(c.num_seqs))
        hp.hopper_prefill(s.query, k, v, s.out, max_seq_len=max_seq_len, tile=tile, **common)
    return [lambda s=s: call(s) for s in w.sets]


def oracle(w) -> torch.Tensor | None:
    """SDPA (flash) of set 0 on dense copies, [T, Hq, D]; None where the case has a prefix."""
    c = w.case
    if not c.uniform or c.seqs[0][0] != 0:
        return None
    q, k, v = w.dense(0)
    g = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=w.scale)
    return o.transpose(1, 2).reshape(-1, c.num_heads, c.head_size)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def timed(calls) -> float:
    n = len(calls)
    i = [0]

    def one():
        calls[i[0] % n]()
        i[0] += 1
    return median_event_ms(one, reps=30, warmup=3) * 1e3


def _tile(text: str) -> tuple[int, ...]:
    try:
        tile = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BLOCK_N,STAGES,WARPS (e.g. 64,3,4), got {text!r}") from None
    if len(tile) != 3:
        raise argparse.ArgumentTypeError(f"expected BLOCK_N,STAGES,WARPS (e.g. 64,3,4), got {text!r}")
    return tile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--match", default="")
    ap.add_argument("--tiles", nargs="*", default=[(64, 4, 8), (64, 3, 4), (128, 3, 4)], type=_tile,
                    help="BLOCK_N,STAGES,WARPS of each Gluon row (hopper_prefill.check_tile says which run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-fi", action="store_true")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    tiles = a.tiles
    rows = []
    for case in prefill_cases() + chunked_cases():
        if a.match not in case.name or case.head_size not in hp.HEAD_SIZES:
            continue
        w = make_workload(case, dev, num_sets=2)
        flops = case_flops(case)
        row = {"case": case.name}
        ref = oracle(w)
        raw = prepare_raw(w)
        raw.calls[0]()
        portable = w.sets[0].out.clone()
        row["portable_us"] = timed(raw.calls)
        if ref is not None:
            row["portable_err"] = rel(portable, ref)
        if not a.no_fi:
            try:
                fi = prepare_flashinfer(w, graph=False)
                fi.calls[0]()
                row["fi_err"] = rel(w.sets[0].out, portable)
                row["fi_us"] = timed(fi.calls)
            except NotApplicable as exc:
                row["fi"] = str(exc)
        for tile in tiles:
            name = "g" + "x".join(map(str, tile))
            try:
                calls = gluon_calls(w, tile)
                w.sets[0].out.zero_()
                calls[0]()
                torch.cuda.synchronize()
                out = w.sets[0].out
                row[name + "_vs_portable"] = rel(out, portable)
                if ref is not None:
                    row[name + "_err"] = rel(out, ref)
                row[name + "_us"] = timed(calls)
            except Exception as exc:  # noqa: BLE001 - a probe reports every failure and goes on
                row[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        for k in list(row):
            if k.endswith("_us"):
                row[k[:-3] + "_tflops"] = round(flops / row[k] / 1e6, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del w
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def case_flops(case) -> float:
    """Causal attention FLOPs (4 per query-key pair and head dim, visible pairs only)."""
    total = 0
    for ctx, q in case.seqs:
        total += q * ctx + q * (q + 1) // 2
    return 4.0 * total * case.num_heads * case.head_size


if __name__ == "__main__":
    sys.exit(main())
