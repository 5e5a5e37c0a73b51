"""Does Dao-AILab's FA4 (`flash_attn.cute`, flash-attn-4 over nvidia-cutlass-dsl) run here, and how
fast is it next to `pagedattn.flash_attn_interface` on the same paged cache? (GPU machine only.)

For each case: FA4's `flash_attn_varlen_func(..., seqused_k=, page_table=)` and ours
(`flash_attn_varlen_func(..., block_table=)`) on one shuffled bf16 pool (block size 16, Hq=32,
Hkv=8, D=128), checked against a float32 dense reference on gathered K/V, then timed
(`triton.testing.do_bench`, median). The first FA4 call per variant compiles (CuTe DSL JIT):
its seconds are reported as `compile_s`. One JSON line per case; errors are results too.

    python scripts/fa4_probe.py [--out fa4.json]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

HQ, HKV, D, BS = 32, 8, 128, 16


def _case(name, lens, device):
    """lens: [(context_len, query_len)]: query rows are the last query_len of context+query keys."""
    g = torch.Generator(device="cpu").manual_seed(0)
    kv_lens = [c + q for c, q in lens]
    pages = [(n + BS - 1) // BS for n in kv_lens]
    num_blocks = sum(pages) + 8
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[at:at + p]
        at += p
    k_cache = torch.randn(num_blocks, BS, HKV, D, generator=g).to(device, torch.bfloat16)
    v_cache = torch.randn(num_blocks, BS, HKV, D, generator=g).to(device, torch.bfloat16)
    q_lens = [q for _, q in lens]
    q = torch.randn(sum(q_lens), HQ, D, generator=g).to(device, torch.bfloat16)
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return dict(name=name, lens=lens, kv_lens=kv_lens, q=q, k_cache=k_cache, v_cache=v_cache,
                table=table.to(device), cu_q=cu_q, seqused=torch.tensor(kv_lens, dtype=torch.int32, device=device),
                max_q=max(q_lens), max_k=max(kv_lens))


def _reference(c, rows=64):
    """Dense float32 attention for at most `rows` query rows per sequence (the last ones)."""
    outs, starts = [], c["cu_q"].tolist()
    for i, (ctx, ql) in enumerate(c["lens"]):
        n = ctx + ql
        blocks = c["table"][i, :(n + BS - 1) // BS].long()
        k = c["k_cache"][blocks].reshape(-1, HKV, D)[:n].float().repeat_interleave(HQ // HKV, 1)
        v = c["v_cache"][blocks].reshape(-1, HKV, D)[:n].float().repeat_interleave(HQ // HKV, 1)
        take = min(ql, rows)
        q = c["q"][starts[i + 1] - take:starts[i + 1]].float()
        s = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
        pos = torch.arange(n - take, n, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > pos, float("-inf"))
        outs.append((i, take, torch.einsum("hqk,khd->qhd", s.softmax(-1), v)))
    return outs


def _error(c, out):
    worst, starts = 0.0, c["cu_q"].tolist()
    for i, take, ref in _reference(c):
        got = out[starts[i + 1] - take:starts[i + 1]].float()
        worst = max(worst, ((got - ref).norm() / ref.norm()).item())
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import triton.testing

    from pagedattn import flash_attn_interface as ours

    device = torch.device("cuda")
    rows = []
    try:
        t0 = time.perf_counter()
        from flash_attn.cute import flash_attn_varlen_func as fa4
        import flash_attn.cute as cute_pkg
        rows.append(dict(case="import", ok=True, seconds=round(time.perf_counter() - t0, 1),
                         version=getattr(cute_pkg, "__version__", "?")))
    except Exception as exc:  # noqa: BLE001 - why it does not import is the result
        rows.append(dict(case="import", ok=False, error=f"{type(exc).__name__}: {exc}",
                         trace=traceback.format_exc()[-2000:]))
        fa4 = None
    cases = [("decode B=1 L=1024", [(1023, 1)]), ("decode B=64 L=4096", [(4095, 1)] * 64),
             ("decode B=4 L=16384", [(16383, 1)] * 4), ("prefill causal 4x4096", [(0, 4096)] * 4),
             ("chunk 4x512 over 2048", [(2048, 512)] * 4)]
    for name, lens in cases:
        c = _case(name, lens, device)
        row = dict(case=name)
        out_ours = torch.empty_like(c["q"])
        if c["max_q"] == 1:  # decode: FlashAttention's kvcache entry point, one query per sequence
            def call_ours():
                return ours.flash_attn_with_kvcache(c["q"].unsqueeze(1), c["k_cache"], c["v_cache"],
                                                    cache_seqlens=c["seqused"], block_table=c["table"],
                                                    causal=True).squeeze(1)
        else:
            cu_k = torch.tensor([0] + c["kv_lens"], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

            def call_ours():
                return ours.flash_attn_varlen_func(c["q"], c["k_cache"], c["v_cache"], c["cu_q"], cu_k, c["max_q"],
                                                   c["max_k"], causal=True, block_table=c["table"], out=out_ours)
        try:
            row["ours_err"] = _error(c, call_ours())
            row["ours_us"] = 1000 * triton.testing.do_bench(call_ours)
        except Exception as exc:  # noqa: BLE001 - a failure is a result too
            row["ours_error"] = f"{type(exc).__name__}: {exc}"
        if fa4 is not None:
            fn = lambda: fa4(c["q"], c["k_cache"], c["v_cache"], cu_seqlens_q=c["cu_q"],  # noqa: E731
                             max_seqlen_q=c["max_q"], max_seqlen_k=c["max_k"], seqused_k=c["seqused"],
                             page_table=c["table"], softmax_scale=D ** -0.5, causal=True)
            try:
                t0 = time.perf_counter()
                res = fn()
                torch.cuda.synchronize()
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                out = res[0] if isinstance(res, tuple) else res
                row["fa4_err"] = _error(c, out)
                row["fa4_us"] = 1000 * triton.testing.do_bench(fn)
                if "ours_us" in row:
                    row["fa4_speed_vs_ours"] = row["ours_us"] / row["fa4_us"]
            except Exception as exc:  # noqa: BLE001
                row["fa4_error"] = f"{type(exc).__name__}: {exc}"
                row["trace"] = traceback.format_exc()[-1500:]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del c
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps(rows[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
