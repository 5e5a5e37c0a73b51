"""The decode step's GEMMs at batch 64 (Llama-3-8B shapes, bf16): time and weight bandwidth under
cuBLAS and cuBLASLt, to see how far each projection is from the copy bandwidth.

    python scripts/gemm_probe.py [--batch 64]
"""

import argparse
import statistics

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}


def time_us(fn, reps: int = 100) -> float:
    for _ in range(10):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    times = []
    for _ in range(reps // 10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 10)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / (time_us(lambda: dst.copy_(src), 20) * 1e-6) / 1e9
    del src, dst
    print(f"copy bandwidth {copy:.0f} GB/s")
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        total = 0.0
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(args.batch, k, device="cuda", dtype=torch.bfloat16)
            us = time_us(lambda: torch.nn.functional.linear(x, w))
            gbs = w.numel() * 2 / (us * 1e-6) / 1e9
            per_step = 1 if name == "lm_head" else 32
            total += us * per_step
            print(f"{lib:9s} {name:8s} M={args.batch} K={k} N={n}: {us:7.1f} us  {gbs:6.0f} GB/s "
                  f"({100 * gbs / copy:.0f}% of copy)")
        print(f"{lib:9s} one step's GEMMs (32 layers + head): {total / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
