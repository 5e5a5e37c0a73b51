"""Kernel benchmarks: our paged attention against FlashInfer on the same data (GPU only).

Cases (bf16, Hq=32, Hkv=8, D=128, block/page size 16, pages shuffled):
- decode B=64, L=4096 (FlashInfer 0.7.2 on H100: ~464 us; target >= 0.7x its speed)
- decode B=4, L=16384 (our split-KV path)
- causal prefill 4 x 4096 tokens, no context (target >= 0.6x FlashInfer's TFLOP/s)

Times are medians of `triton.testing.do_bench`. GB/s counts K/V bytes read plus query and
output; TFLOP/s uses 4 * Hq * D * (keys each query sees), the FlashAttention convention for
causal (only the unmasked half). FlashInfer runs when it imports:
`BatchDecodeWithPagedKVCacheWrapper` (tensor cores) and `BatchPrefillWithPagedKVCacheWrapper`,
planned once, `run(q, (k, v))` with the NHD `[num_pages, page_size, Hkv, D]` K and V of the
same cache.

Run: `pagedattn bench kernels [--out kernel_bench.md]`.
"""

from __future__ import annotations

import argparse

import torch
import triton

from pagedattn.benchmarks import require_cuda
from pagedattn.intmath import cdiv
from pagedattn.kernels import SplitKVWorkspace, paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
CASES = [("decode B=64 L=4096", 64, 1, 4096), ("decode B=4 L=16384", 4, 1, 16384),
         ("prefill causal 4x4096", 4, 4096, 4096)]


def _make_case(num_seqs: int, query_len: int, seq_len: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    pages_per_seq = cdiv(seq_len, BLOCK_SIZE)
    num_blocks = num_seqs * pages_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=g,
                           device=device, dtype=DTYPE)
    tables = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32)
    tables = tables.view(num_seqs, pages_per_seq)
    query = torch.randn(num_seqs * query_len, NUM_HEADS, HEAD_SIZE, generator=g,
                        device=device, dtype=DTYPE)
    qsl = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * query_len
    seq_lens = torch.full((num_seqs,), seq_len, device=device, dtype=torch.int32)
    return kv_cache, tables, query, qsl, seq_lens


def _ours(kv_cache, tables, query, qsl, seq_lens, query_len, seq_len):
    out = torch.empty_like(query)
    ws = SplitKVWorkspace.allocate(query.shape[0], NUM_HEADS, HEAD_SIZE, 16, query.device)

    def fn():
        paged_attention(query, kv_cache[0], kv_cache[1], out, query_start_loc=qsl,
                        seq_lens=seq_lens, block_tables=tables, max_query_len=query_len,
                        max_seq_len=seq_len, scale=HEAD_SIZE ** -0.5, causal=True,
                        workspace=ws)
        return out
    return fn


def _flashinfer(kv_cache, tables, query, qsl, seq_len, decode: bool):
    import flashinfer  # optional; the caller catches ImportError

    device = query.device
    num_seqs, pages_per_seq = tables.shape
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    indptr = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * pages_per_seq
    indices = tables.flatten()
    last = seq_len - (pages_per_seq - 1) * BLOCK_SIZE
    last_page_len = torch.full((num_seqs,), last, device=device, dtype=torch.int32)
    if decode:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                use_tensor_cores=True)
        wrapper.plan(indptr, indices, last_page_len, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE,
                     BLOCK_SIZE, pos_encoding_mode="NONE", q_data_type=DTYPE,
                     kv_data_type=DTYPE, sm_scale=HEAD_SIZE ** -0.5)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(qsl, indptr, indices, last_page_len, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE,
                     BLOCK_SIZE, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE,
                     sm_scale=HEAD_SIZE ** -0.5)
    kv = (kv_cache[0], kv_cache[1])
    return lambda: wrapper.run(query, kv)


def run_benchmarks(out_path: str | None = None) -> list[dict]:
    """Time every case, print a table (and write it to `out_path`), return the rows."""
    device = torch.device("cuda")
    rows = []
    for name, num_seqs, query_len, seq_len in CASES:
        kv_cache, tables, query, qsl, seq_lens = _make_case(num_seqs, query_len, seq_len,
                                                            device)
        decode = query_len == 1
        keys_seen = seq_len if decode else (seq_len + 1) / 2  # causal, no context
        tokens = num_seqs * query_len
        flops = 4.0 * tokens * NUM_HEADS * HEAD_SIZE * keys_seen
        nbytes = (2 * num_seqs * seq_len * NUM_KV_HEADS * HEAD_SIZE
                  + 2 * tokens * NUM_HEADS * HEAD_SIZE) * kv_cache.element_size()
        impls = {"ours": _ours(kv_cache, tables, query, qsl, seq_lens, query_len, seq_len)}
        try:
            impls["flashinfer"] = _flashinfer(kv_cache, tables, query, qsl, seq_len, decode)
        except Exception as exc:  # noqa: BLE001 - report why the peer is missing, keep going
            print(f"[{name}] flashinfer unavailable: {type(exc).__name__}: {exc}")
        results = {}
        for impl, fn in impls.items():
            out = fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            results[impl] = (ms, out.float())
        agreement = ""
        if "flashinfer" in results:
            a, b = results["ours"][1], results["flashinfer"][1]
            agreement = f"{float((a - b).norm() / b.norm()):.1e}"
        for impl, (ms, _) in results.items():
            ratio = results["flashinfer"][0] / ms if "flashinfer" in results else float("nan")
            rows.append(dict(case=name, impl=impl, us=ms * 1e3, gbs=nbytes / ms / 1e6,
                             tflops=flops / ms / 1e9, speed_vs_flashinfer=ratio,
                             rel_l2_vs_flashinfer=agreement))
        del kv_cache, query, impls, results
        torch.cuda.empty_cache()

    header = ("| case | impl | time (us) | GB/s | TFLOP/s | speed ours/FlashInfer "
              "| rel L2 vs FlashInfer |\n|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['case']} | {r['impl']} | {r['us']:.1f} | {r['gbs']:.0f} | "
             f"{r['tflops']:.1f} | {r['speed_vs_flashinfer']:.2f} | "
             f"{r['rel_l2_vs_flashinfer']} |" for r in rows]
    gpu = torch.cuda.get_device_name(device)
    table = f"Device: {gpu}; triton {triton.__version__}; torch {torch.__version__}\n\n" \
        + header + "\n".join(lines) + "\n"
    print(table)
    if out_path:
        with open(out_path, "w") as f:
            f.write(table)
    return rows


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    require_cuda(parser.prog)
    run_benchmarks(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
