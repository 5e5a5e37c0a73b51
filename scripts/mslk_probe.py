"""Does MSLK's fmha (xFormers' kernels since 2026-04: `mslk.attention.fmha`) run here, and how fast?

Run on the GPU machine with the wheels of `.mslk/` installed (`bash scripts/gpu_check.sh mslk`).
For each forward operator MSLK ships for Hopper (cutlassF, fa2F, fa3F, fa3F_splitKV,
cuteDSLF-hopper, triton_splitKF): whether it loads, whether it runs our two cases (a causal
ragged prefill through `BlockDiagonalCausalMask`, a paged decode through
`PagedBlockDiagonalCausalWithOffsetPaddedKeysMask`) and agrees with a float32 dense reference,
and its time next to our kernel's (`pagedattn.kernels.paged_attention`) on the same tensors:
bf16, Hq=32, Hkv=8, D=128. Writes JSON to --out and a table to stdout; never raises for an
operator (its error is the answer).
"""

from __future__ import annotations

import argparse
import json
import math
import traceback

import torch
import triton.testing

HQ, HKV, D = 32, 8, 128
PREFILL = [4096] * 4  # causal prefill 4x4k (ragged)
DECODE_B, DECODE_L, BLOCK = 64, 4096, 256  # paged decode B=64 L=4k (MSLK's paged biases want 256-slot pages)


def _dense(q, k, v, causal):
    """float32 reference of one sequence: q [S, Hq, D], k/v [L, Hkv, D] -> [S, Hq, D]."""
    g = HQ // HKV
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("shd,lhd->hsl", q.float(), k) / math.sqrt(D)
    if causal:
        n, length = q.shape[0], k.shape[0]
        keep = torch.arange(length, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + length - n
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("hsl,lhd->shd", s.softmax(-1), v)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def prefill_case(fmha, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    total = sum(PREFILL)
    q = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens(PREFILL)
    # xFormers' BMGHK layout for GQA: [1, T, Hkv, G, D]
    qx = q.view(1, total, HKV, HQ // HKV, D)
    kx, vx = (t.view(1, total, HKV, 1, D).expand(1, total, HKV, HQ // HKV, D) for t in (k, v))
    ref = _dense(q[:512], k[:512], v[:512], causal=True)  # the first 512 rows of sequence 0
    return (qx, kx, vx, bias), ref, lambda out: out.reshape(total, HQ, D)[:512], (q, k, v)


def decode_case(fmha, dev):
    g = torch.Generator(device=dev).manual_seed(1)
    pages = DECODE_L // BLOCK
    num_blocks = DECODE_B * pages + 7
    k_pool, v_pool = (torch.randn(1, num_blocks * BLOCK, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
                      for _ in range(2))
    table = torch.randperm(num_blocks, device=dev, generator=g)[: DECODE_B * pages].view(DECODE_B, pages).int()
    q = torch.randn(DECODE_B, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    bias = fmha.attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        q_seqlen=[1] * DECODE_B, kv_seqlen=[DECODE_L] * DECODE_B, block_tables=table, page_size=BLOCK)
    qx = q.view(1, DECODE_B, HKV, HQ // HKV, D)
    kx, vx = (t.view(1, -1, HKV, 1, D).expand(1, t.shape[1], HKV, HQ // HKV, D) for t in (k_pool, v_pool))
    rows = table[0].long()
    slots = (rows[:, None] * BLOCK + torch.arange(BLOCK, device=dev)).flatten()
    ref = _dense(q[:1], k_pool[0, slots], v_pool[0, slots], causal=True)
    return (qx, kx, vx, bias), ref, lambda out: out.reshape(DECODE_B, HQ, D)[:1], (q, k_pool, v_pool, table)


def ours_prefill(q, k, v):
    from pagedattn.kernels import paged_attention

    loc = torch.tensor([0, *torch.tensor(PREFILL).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    lens = torch.tensor(PREFILL, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    return lambda: paged_attention(q, k, v, out, query_start_loc=loc, seq_lens=lens, block_tables=None,
                                   kv_start_loc=loc, max_query_len=max(PREFILL), max_seq_len=max(PREFILL),
                                   scale=D**-0.5)


def ours_decode(q, k_pool, v_pool, table):
    from pagedattn.kernels import paged_attention, shared_workspace

    k, v = (t.view(-1, BLOCK, HKV, D) for t in (k_pool, v_pool))
    loc = torch.arange(DECODE_B + 1, dtype=torch.int32, device=q.device)
    lens = torch.full((DECODE_B,), DECODE_L, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    ws = shared_workspace(q.device, HQ, HKV, D)
    return lambda: paged_attention(q, k, v, out, query_start_loc=loc, seq_lens=lens, block_tables=table,
                                   max_query_len=1, max_seq_len=DECODE_L, scale=D**-0.5, workspace=ws)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="mslk_probe.json")
    args = p.parse_args()
    dev = torch.device("cuda")
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev), "operators": {}}
    try:
        import mslk
        from mslk.attention import fmha
    except Exception as e:  # noqa: BLE001
        result["import_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        print(json.dumps(result, indent=2))
        open(args.out, "w").write(json.dumps(result, indent=2))
        return 1
    result["mslk"] = getattr(mslk, "__version__", "?")
    cases = {"prefill 4x4k causal": prefill_case(fmha, dev), "decode B=64 L=4k paged": decode_case(fmha, dev)}
    ours = {"prefill 4x4k causal": ours_prefill(*cases["prefill 4x4k causal"][3]),
            "decode B=64 L=4k paged": ours_decode(*cases["decode B=64 L=4k paged"][3])}
    result["ours_us"] = {name: triton.testing.do_bench(fn) * 1e3 for name, fn in ours.items()}
    ops = {name: getattr(fmha, module).FwOp for name, module in
           (("cutlass", "cutlass"), ("fa2", "flash"), ("fa3", "flash3"), ("cute_hopper", "cute_hopper"),
            ("triton_splitk", "triton_splitk"))}
    ops["fa3_splitkv"] = getattr(fmha.flash3, "FwOp_KVSplit", None)
    for name, op in ops.items():
        entry = result["operators"][name] = {}
        if op is None:
            entry["error"] = "not in this MSLK"
            continue
        entry["NAME"] = op.NAME
        try:
            entry["is_available"] = bool(op.is_available())
        except Exception as e:  # noqa: BLE001
            entry["is_available"] = f"{type(e).__name__}: {e}"
        for case, (inputs, ref, pick, _) in cases.items():
            qx, kx, vx, bias = inputs
            try:
                why = op.not_supported_reasons(fmha.Inputs(query=qx, key=kx, value=vx, attn_bias=bias, scale=D**-0.5))
                if why:
                    entry[case] = {"refused": why}
                    continue
                run = lambda: fmha.memory_efficient_attention_forward(qx, kx, vx, attn_bias=bias,  # noqa: E731
                                                                       scale=D**-0.5, op=op)
                out = run()
                us = triton.testing.do_bench(run) * 1e3
                entry[case] = {"us": us, "rel_l2": _rel(pick(out), ref),
                               "speed_vs_ours": result["ours_us"][case] / us}
            except Exception as e:  # noqa: BLE001 - the error is the answer
                entry[case] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"}
    text = json.dumps(result, indent=2)
    print(text)
    open(args.out, "w").write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
