"""The cases of `pagedattn bench kernels`: one attention step each, grouped into grids.

A case is a batch in the contract's vocabulary (API.md): per sequence `(context_len,
query_len)`, prefills first, over a paged cache of `block_size` (0: ragged, the keys are the
step's own contiguous K/V and nothing is cached), plus the layer's heads and options. Host data
only: nothing here touches a GPU, so the case lists are testable anywhere.

Grids (`--grid`):
- decode: B in {1,16,64,256} x L in {1k,4k,16k} x heads 32/8/128 and 8/1/128, block 16 and 1,
  bf16 and FP8 (e4m3) KV (96 cells); sliding window (128, 4096), soft cap 50 and ALiBi at
  B=16 L=4k and B=4 L=16k; ragged lengths drawn from a seeded Pareto (Zipf-like) distribution.
- long: L = 128k at B 1 and 2 (both head configs; FP8 too).
- prefill: causal, B*S = 16k at (16,1k), (4,4k), (1,16k), D in 64/128/256, paged (block 16)
  and ragged.
- chunked: a chunk of C tokens over a cached prefix of P, causal.
- mixed: prefill chunks and decodes in one step.
- graph: a whole decode step (store and attention) replayed from a CUDA graph, one per replay.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

GRIDS = ("decode", "short", "long", "prefill", "chunked", "mixed", "graph")
KV_DTYPES = ("bf16", "fp8_e4m3")  # names as pagedattn.kv_cache_dtype takes them ("auto" -> "bf16")
HEADS_GQA4 = (32, 8, 128)  # Llama-3-8B
HEADS_GQA8 = (8, 1, 128)  # Llama-3-70B at tensor parallel 8: few programs, the hard decode
K, M = 1024, 1024 * 1024


@dataclass(frozen=True)
class Case:
    """One timed attention step.

    seqs: (context_len, query_len) per sequence, prefills (query_len > 1 or context 0) first.
    block_size: tokens per cache block; 0 means ragged (keys are the step's K/V, no cache).
    timing: "graph" (N calls captured in one CUDA graph, cycling input sets, time / N),
        "step" (one call per graph replay: a whole decode step), "events" (eager calls between
        CUDA events, L2 flushed before each).
    """

    grid: str
    name: str
    seqs: tuple[tuple[int, int], ...]
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    kv_dtype: str = "bf16"
    sliding_window: int | None = None
    soft_cap: float | None = None
    alibi: bool = False
    timing: str = "events"

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(q for _, q in self.seqs)

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in self.seqs]

    @property
    def max_query_len(self) -> int:
        return max(q for _, q in self.seqs)

    @property
    def is_decode(self) -> bool:
        """Every sequence a single-token decode (FlashInfer's decode wrapper applies)."""
        return all(q == 1 and c > 0 for c, q in self.seqs)

    @property
    def num_prefills(self) -> int:
        return sum(1 for c, q in self.seqs if q > 1 or c == 0)

    @property
    def uniform(self) -> bool:
        return len(set(self.seqs)) == 1

    @property
    def paged(self) -> bool:
        return self.block_size > 0

    @property
    def fp8(self) -> bool:
        return self.kv_dtype != "bf16"

    @property
    def features(self) -> str:
        parts = [f"window {self.sliding_window}" if self.sliding_window else "",
                 f"soft cap {self.soft_cap:g}" if self.soft_cap else "", "ALiBi" if self.alibi else ""]
        return ", ".join(p for p in parts if p)

    def summary(self) -> dict:
        """The case as one flat record (JSON/CSV): its shape, not the per-sequence list."""
        lens = self.seq_lens
        return dict(grid=self.grid, case=self.name, heads=f"{self.num_heads}/{self.num_kv_heads}/{self.head_size}",
                    num_seqs=self.num_seqs, num_tokens=self.num_tokens, max_seq_len=max(lens),
                    mean_seq_len=round(sum(lens) / len(lens), 1), block_size=self.block_size,
                    kv_dtype=self.kv_dtype, features=self.features, timing=self.timing)


def _size(n: int) -> str:
    return f"{n // K}k" if n % K == 0 else str(n)


def skewed_lengths(num_seqs: int, mean: int, max_len: int, seed: int = 0, alpha: float = 1.2,
                   min_len: int = 16) -> list[int]:
    """Seeded Pareto (Zipf-like) lengths: many short sequences, a few long ones, rescaled so the
    mean is about `mean` (before clamping to [min_len, max_len])."""
    rng = random.Random(seed)
    raw = [rng.paretovariate(alpha) for _ in range(num_seqs)]
    scale = mean / (sum(raw) / num_seqs)
    return [min(max_len, max(min_len, round(x * scale))) for x in raw]


def _decode(name: str, lens: list[int], heads=HEADS_GQA4, **kw) -> Case:
    hq, hkv, d = heads
    return Case("decode", name, tuple((n - 1, 1) for n in lens), hq, hkv, d, timing="graph", **kw)


def _heads_name(heads) -> str:
    return "{}/{}/{}".format(*heads)


def decode_cases() -> list[Case]:
    out = []
    for kv in KV_DTYPES:
        for bs in (16, 1):
            for heads in (HEADS_GQA4, HEADS_GQA8):
                for b in (1, 16, 64, 256):
                    for n in (1 * K, 4 * K, 16 * K):
                        name = f"decode {_heads_name(heads)} B={b} L={_size(n)} block {bs} {kv}"
                        out.append(_decode(name, [n] * b, heads, block_size=bs, kv_dtype=kv))
    # 64k keys each: the torch backend (the reference where FlashInfer has no ALiBi) still runs
    for b, n in ((16, 4 * K), (4, 16 * K)):
        for opts in (dict(sliding_window=128), dict(sliding_window=4096), dict(soft_cap=50.0),
                     dict(alibi=True)):
            probe = Case("decode", "", (), **opts)
            out.append(_decode(f"decode 32/8/128 B={b} L={_size(n)} {probe.features}", [n] * b, **opts))
    for b in (16, 64, 256):
        lens = skewed_lengths(b, mean=2 * K, max_len=32 * K, seed=b)
        out.append(_decode(f"decode 32/8/128 B={b} ragged mean 2k (Pareto, max {_size(max(lens))})", lens))
    return out


def short_cases() -> list[Case]:
    """Decode at the short contexts of an engine's early steps (a 128-token prompt and its first
    outputs): per-program latency, not bandwidth, decides these."""
    return [_decode(f"short 32/8/128 B={b} L={n} block 16 bf16", [n] * b)
            for b in (64, 256) for n in (128, 256, 512)]


def long_cases() -> list[Case]:
    out = []
    for heads in (HEADS_GQA4, HEADS_GQA8):
        for b in (1, 2):
            for kv in KV_DTYPES:
                hq, hkv, d = heads
                out.append(Case("long", f"long {_heads_name(heads)} B={b} L=128k {kv}",
                                ((128 * K - 1, 1),) * b, hq, hkv, d, kv_dtype=kv, timing="graph"))
    return out


PREFILL_HEADS = {64: (32, 8, 64), 128: HEADS_GQA4, 256: (16, 8, 256)}


def prefill_cases() -> list[Case]:
    out = []
    for d, (hq, hkv, _) in PREFILL_HEADS.items():
        for b, s in ((16, 1 * K), (4, 4 * K), (1, 16 * K)):
            for bs, kind in ((16, "paged"), (0, "ragged")):
                out.append(Case("prefill", f"prefill {kind} {hq}/{hkv}/{d} {b}x{_size(s)}",
                                ((0, s),) * b, hq, hkv, d, block_size=bs))
    return out


def chunked_cases() -> list[Case]:
    out = []
    for b, prefix, chunk in ((4, 1 * K, 512), (4, 4 * K, 512), (4, 16 * K, 512), (4, 1 * K, 2 * K),
                             (4, 4 * K, 2 * K), (4, 16 * K, 2 * K), (1, 16 * K, 8 * K)):
        out.append(Case("chunked", f"chunked {b}x({_size(chunk)} over {_size(prefix)})",
                        ((prefix, chunk),) * b))
    return out


def mixed_cases() -> list[Case]:
    return [
        Case("mixed", "mixed 2k chunk over 2k + 64 decodes of 2k", ((2 * K, 2 * K),) + ((2 * K - 1, 1),) * 64),
        Case("mixed", "mixed 4x(512 over 2k) + 60 decodes of 2k", ((2 * K, 512),) * 4 + ((2 * K - 1, 1),) * 60),
        Case("mixed", "mixed 2 prompts of 2k + 8 decodes of 1k", ((0, 2 * K),) * 2 + ((K - 1, 1),) * 8),
    ]


def graph_cases() -> list[Case]:
    return [Case("graph", f"graph step {_heads_name(h)} B=1 L=1k {kv}", ((K - 1, 1),), *h, kv_dtype=kv,
                 timing="step")
            for h, kv in ((HEADS_GQA4, "bf16"), (HEADS_GQA8, "bf16"), (HEADS_GQA4, "fp8_e4m3"))]


_BUILDERS = dict(decode=decode_cases, short=short_cases, long=long_cases, prefill=prefill_cases, chunked=chunked_cases,
                 mixed=mixed_cases, graph=graph_cases)

# A handful of representative cells per grid (`--quick`): the headline cells.
QUICK = {
    "decode": ("decode 32/8/128 B=1 L=1k block 16 bf16", "decode 32/8/128 B=64 L=4k block 16 bf16",
               "decode 8/1/128 B=1 L=16k block 16 bf16", "decode 8/1/128 B=256 L=1k block 16 bf16",
               "decode 32/8/128 B=64 L=4k block 16 fp8_e4m3", "decode 32/8/128 B=16 L=4k block 1 bf16",
               "decode 32/8/128 B=16 L=4k window 128"),
    "short": ("short 32/8/128 B=64 L=256 block 16 bf16",),
    "long": ("long 8/1/128 B=1 L=128k bf16",),
    "prefill": ("prefill paged 32/8/128 16x1k", "prefill paged 32/8/128 4x4k", "prefill ragged 32/8/128 4x4k"),
    "chunked": ("chunked 4x(2k over 4k)",),
    "mixed": ("mixed 2k chunk over 2k + 64 decodes of 2k",),
    "graph": ("graph step 32/8/128 B=1 L=1k bf16",),
}


def select(grids: list[str], quick: bool = False) -> list[Case]:
    """The cases of `grids` (names from GRIDS, or "all"), in grid order; `quick`: QUICK only."""
    names = list(GRIDS) if "all" in grids else grids
    unknown = [g for g in names if g not in GRIDS]
    if unknown:
        raise ValueError(f"expected grids among {', '.join(GRIDS)} or all, got {', '.join(unknown)}")
    out = []
    for g in dict.fromkeys(names):
        cases = _BUILDERS[g]()
        out += [c for c in cases if c.name in QUICK[g]] if quick else cases
    return out
