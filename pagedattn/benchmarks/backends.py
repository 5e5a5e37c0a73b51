"""Backend benchmark: our registered attention backends through the public contract (GPU only).

Where `pagedattn bench kernels` times raw kernels, this times what a model layer calls:
`impl.forward(q, k, v, kv_cache, md, output=out)` with metadata from the backend's own builder,
so each backend's store of the step's K/V, its per-step views and plans are counted too.

Setup (bf16, Hq=32, Hkv=8, D=128, block size 16, scale D**-0.5): block tables are a random
permutation of the pool, K and V pools are drawn once and copied into each backend's cache
layout (`kv_cache_block_dim` 1: (2, blocks, ...), 0: (blocks, 2, ...)), and the step's
query/key/value are drawn once, so every backend reads identical data. Per case and backend:
`time (us)`: median of `triton.testing.do_bench` over the forward; `build (ms)`: host time
of `builder.build(seqs)` (median of 20, synchronised; FlashInfer plans here); GB/s counts K/V
read plus query and output; TFLOP/s counts 4 * Hq * D per (query, visible key) pair; speed
and rel L2 are against the `triton` backend (rel L2 on the first forward's output). The
`torch` reference is skipped where a case holds more than TORCH_MAX_KEYS keys.

Run: `pagedattn bench backends [--out backends.md] [--backends triton torch ...]`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass

import torch
import triton

import pagedattn
from pagedattn.benchmarks import require_cuda
from pagedattn.intmath import cdiv

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEFAULT_BACKENDS = ["triton", "flash_attn", "xformers", "flashinfer", "torch"]
TORCH_MAX_KEYS = 100_000  # the reference gathers every key to float32: skip it above this
BUILD_REPEATS = 20


@dataclass(frozen=True)
class Case:
    """One step: groups of (count, context_len, query_len), prefills first (API.md section 2)."""

    name: str
    groups: tuple[tuple[int, int, int], ...]

    def lens(self) -> list[tuple[int, int]]:
        return [(c, q) for n, c, q in self.groups for _ in range(n)]


CASES = [
    Case("decode B=64 L=4096", ((64, 4095, 1),)),
    Case("decode B=4 L=16384", ((4, 16383, 1),)),
    Case("prefill causal 4x4096", ((4, 0, 4096),)),
    Case("mixed: 4 chunks of 512 over 2048 cached + 60 decodes L=2048", ((4, 2048, 512), (60, 2047, 1))),
]


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> dict:
    """Scheduled sequences over shuffled blocks, the K/V pools and the step's q/k/v."""
    lens = case.lens()
    need = [cdiv(c + q, BLOCK_SIZE) for c, q in lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    seqs, at = [], 0
    for (c, q), n in zip(lens, need):
        seqs.append(pagedattn.ScheduledSeq(c + q, q, perm[at:at + n]))
        at += n
    g = torch.Generator(device=device).manual_seed(seed)
    t = sum(q for _, q in lens)

    def draw(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=DTYPE)

    pool = (sum(need), BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    return dict(seqs=seqs, num_blocks=sum(need), k_pool=draw(*pool), v_pool=draw(*pool),
                q=draw(t, NUM_HEADS * HEAD_SIZE), k=draw(t, NUM_KV_HEADS * HEAD_SIZE),
                v=draw(t, NUM_KV_HEADS * HEAD_SIZE))


def fill_cache(backend, inputs: dict) -> torch.Tensor:
    """The backend's cache tensor holding the shared K and V pools in its own layout."""
    nb, k_pool = inputs["num_blocks"], inputs["k_pool"]
    cache = torch.empty(backend.get_kv_cache_shape(nb, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE),
                        dtype=DTYPE, device=k_pool.device)
    dim = backend.kv_cache_block_dim  # 1: (2, blocks, ...); 0: (blocks, 2, ...)
    view = cache.view(2, nb, *k_pool.shape[1:]) if dim == 1 else cache.view(nb, 2, *k_pool.shape[1:])
    for which, pool in enumerate((k_pool, inputs["v_pool"])):
        view.select(1 - dim, which).copy_(pool)
    return cache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _do_bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def run_backend(backend, inputs: dict, device: torch.device, timer=_do_bench) -> dict:
    """One backend on one case: its first output, forward time (ms) and build time (ms)."""
    impl = backend.get_impl_cls()(NUM_HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, NUM_KV_HEADS)
    impl.set_query_dtype(DTYPE)  # before build: FlashInfer plans the layer there
    builder = backend.get_builder_cls()(BLOCK_SIZE, device)
    cache = fill_cache(backend, inputs)
    times = []
    for _ in range(BUILD_REPEATS):
        _sync(device)
        start = time.perf_counter()
        md = builder.build(inputs["seqs"])
        _sync(device)
        times.append(time.perf_counter() - start)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    out = torch.empty_like(q)

    def fn():
        return impl.forward(q, k, v, cache, md, output=out)

    first = fn().float().clone()
    return dict(out=first, ms=timer(fn), build_ms=statistics.median(times) * 1e3)


def _work(case: Case) -> tuple[int, float, float]:
    """(keys in the cache, bytes moved, FLOPs) of one step; a query at position p sees p+1 keys."""
    lens = case.lens()
    keys = sum(c + q for c, q in lens)
    tokens = sum(q for _, q in lens)
    pairs = sum(q * c + q * (q + 1) // 2 for c, q in lens)
    nbytes = (2 * keys * NUM_KV_HEADS + 2 * tokens * NUM_HEADS) * HEAD_SIZE * DTYPE.itemsize
    return keys, float(nbytes), 4.0 * NUM_HEADS * HEAD_SIZE * pairs


def _reason(exc: BaseException) -> str:
    msg = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {msg}"[:160].replace("|", "/")


def _row(case, name, provider, r, ref) -> str:
    cells = [case.name, name, provider]
    if "skip" in r:
        return "| " + " | ".join(cells + [r["skip"]] + ["-"] * 5) + " |"
    _, nbytes, flops = _work(case)
    ms = r["ms"]
    speed = f"{ref['ms'] / ms:.2f}" if ref else "-"
    rel = f"{float((r['out'] - ref['out']).norm() / ref['out'].norm()):.1e}" if ref else "-"
    cells += [f"{ms * 1e3:.1f}", f"{nbytes / ms / 1e6:.0f}", f"{flops / ms / 1e9:.1f}", speed, rel,
              f"{r['build_ms']:.2f}"]
    return "| " + " | ".join(cells) + " |"


def _backends(names: list[str] | None) -> tuple[dict, list[str]]:
    """The backend classes to run (triton first: the others are compared with it), and why
    the others cannot run."""
    found, missing = {}, []
    for name in sorted(names or DEFAULT_BACKENDS, key=lambda n: n != "triton"):
        try:
            found[name] = pagedattn.get_backend(name)
        except pagedattn.BackendUnavailableError as exc:
            missing.append(str(exc))
    return found, missing


def run_backend_benchmark(out_path: str | None, backends: list[str] | None = None) -> int:
    """Time every case on every backend, print the table (and write it to `out_path`)."""
    device = torch.device("cuda")
    found, missing = _backends(backends)
    lines = []
    for case in CASES:
        inputs, ref = make_inputs(case, device), None
        keys = _work(case)[0]
        for name, backend in found.items():
            if name == "torch" and keys > TORCH_MAX_KEYS:
                r = dict(skip=f"skipped: {keys} keys > {TORCH_MAX_KEYS} (reference too slow)")
            else:
                try:
                    r = run_backend(backend, inputs, device)
                except Exception as exc:  # noqa: BLE001 - a refusal or failure is a result too
                    r = dict(skip=f"failed: {_reason(exc)}")
            if name == "triton" and "skip" not in r:
                ref = r
            lines.append(_row(case, name, backend.provider(), r, ref))
            r = None  # drop this backend's output (the triton reference stays in `ref`)
            gc.collect()
            torch.cuda.empty_cache()
        del inputs, ref
        gc.collect()
        torch.cuda.empty_cache()

    providers = ", ".join(f"{n}={b.provider()}" for n, b in found.items())
    head = (f"Device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; "
            f"triton {triton.__version__}; {providers}\n")
    if missing:
        head += f"Not run: {'; '.join(missing)}\n"
    header = ("| case | backend | provider | time (us) | GB/s | TFLOP/s | speed vs triton "
              "| rel L2 vs triton | build (ms) |\n|---|---|---|---|---|---|---|---|---|\n")
    table = head + "\n" + header + "\n".join(lines) + "\n"
    print(table)
    if out_path:
        with open(out_path, "w") as f:
            f.write(table)
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                        help=f"backends to time (default: {' '.join(DEFAULT_BACKENDS)})")
    args = parser.parse_args(argv)
    require_cuda(parser.prog)
    return run_backend_benchmark(args.out, args.backends)


if __name__ == "__main__":
    raise SystemExit(main())
