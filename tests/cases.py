"""Named batch shapes and the scenario that runs one attention step against the oracle.

A scenario owns everything a step needs: a KV pool whose physical blocks are handed out in a
random order (with spare blocks that must stay untouched), each sequence's history K/V
scattered into the pool by the test's own loop (never by the library's store op), the step's
query/key/value, and the dense copies the oracle reads. Only public API (shared/API.md) is
used, so the same tests run for every backend; the per-backend cache layout is the one thing
the tests must know about, and `CacheLayout` holds it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import pytest
import torch

import pagedattn
from oracle import (FP8_DTYPES, assert_attention_close, dense_attention, fp8_dequantize,
                    fp8_quantize, tolerance_for)

# ----------------------------------------------------------------------------- batch shapes


@dataclass(frozen=True)
class Shape:
    """One named batch: (context_len, query_len) per sequence, prefills listed first."""

    name: str
    lens: tuple[tuple[int, int], ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    block_size: int = 16
    # Sequences at odd indices get this many blocks beyond what seq_len needs, as an engine
    # that allocates ahead would hand them over.
    slack_blocks: int = 0

    def __post_init__(self):
        kinds = [is_prefill(c, q) for c, q in self.lens]
        assert kinds == sorted(kinds, reverse=True), f"{self.name}: prefills must come first"
        assert all(q >= 1 and c >= 0 for c, q in self.lens), self.name

    def __str__(self) -> str:
        return self.name


def is_prefill(context_len: int, query_len: int) -> bool:
    return query_len > 1 or context_len == 0


_S = Shape
CATALOGUE: dict[str, Shape] = {s.name: s for s in [
    _S("single_decode", ((37, 1),)),
    _S("many_decodes", ((5, 1), (16, 1), (31, 1), (64, 1), (100, 1), (1, 1), (47, 1), (200, 1))),
    _S("long_prefill", ((0, 1000),), num_heads=2, num_kv_heads=1),
    _S("chunked_prefill", ((700, 64), (300, 33)), num_heads=2, num_kv_heads=2),
    _S("mixed", ((0, 33), (40, 17), (0, 1), (20, 2), (12, 1), (90, 1), (3, 1)), slack_blocks=1),
    # block_size 16: lengths at, just below and just above block boundaries
    _S("block_boundaries", ((0, 16), (16, 16), (0, 15), (0, 17), (15, 17), (31, 2),
                            (15, 1), (16, 1), (31, 1), (32, 1), (47, 1))),
    _S("block_size_1", ((0, 7), (9, 3), (20, 1), (1, 1)), block_size=1),
    _S("block_size_5", ((0, 12), (10, 5), (4, 1), (25, 1), (9, 1)), block_size=5),
    _S("gqa_8to1", ((0, 20), (13, 6), (30, 1), (45, 1)), num_heads=16, num_kv_heads=2),
    _S("mqa", ((10, 9), (0, 4), (50, 1)), num_heads=8, num_kv_heads=1),
    _S("mha_decode_long", ((517, 1), (250, 1)), num_heads=2, num_kv_heads=2, block_size=32),
]}


def shapes(*names: str) -> list[Shape]:
    return [CATALOGUE[n] for n in names] if names else list(CATALOGUE.values())


# ----------------------------------------------------------------------------- backends


def is_reference_backend(backend) -> bool:
    """True for the torch backend, which must support every option."""
    return backend is pagedattn.get_backend("torch")


@contextlib.contextmanager
def refusal_guard(backend, what: str = "this configuration") -> Iterator[None]:
    """Turns a construction-time refusal of a non-reference backend into a skip with reason.

    API.md section 3: unsupported combinations raise NotImplementedError/ValueError at
    construction. The torch backend is the definition and refuses nothing.
    """
    try:
        yield
    except (NotImplementedError, ValueError) as e:
        if is_reference_backend(backend):
            raise
        pytest.skip(f"{backend.get_name()} refuses {what}: {type(e).__name__}: {e}")


# The model dtype of tests that do not sweep dtypes. conftest's `backend` fixture sets it from
# --dtype: float32 unless the backend refuses it (FlashInfer-like kernels take fp16/bf16 only).
DEFAULT_DTYPE: dict[str, torch.dtype] = {"dtype": torch.float32}


def default_dtype() -> torch.dtype:
    return DEFAULT_DTYPE["dtype"]


_DTYPE_REFUSALS: dict[tuple, str | None] = {}


def dtype_refusal(backend, device, dtype: torch.dtype) -> str | None:
    """Why `backend` refuses `dtype` on `device` (None: it accepts it), found by one tiny step.

    The dtype is not an impl constructor argument, so a backend can only refuse it when it sees
    the tensors; the probe keeps such refusals from failing every test of a dtype it never
    claimed to support.
    """
    key = (backend, str(device), dtype)
    if key not in _DTYPE_REFUSALS:
        sizes = list(backend.get_supported_head_sizes())
        d = 64 if not sizes or 64 in sizes else sizes[0]
        bs, nb = 16, 2
        try:
            cache = torch.zeros(backend.get_kv_cache_shape(nb, bs, 1, d), dtype=dtype,
                                device=device)
            md = backend.get_builder_cls()(bs, device).build([pagedattn.ScheduledSeq(3, 3, [1])])
            impl = backend.get_impl_cls()(2, d, d ** -0.5, 1)
            x = torch.zeros(3, 2 * d, dtype=dtype, device=device)
            impl.forward(x, x[:, :d], x[:, :d], cache, md)
            _DTYPE_REFUSALS[key] = None
        except (TypeError, ValueError, NotImplementedError) as e:
            _DTYPE_REFUSALS[key] = f"{type(e).__name__}: {e}"
    return _DTYPE_REFUSALS[key]


def skip_refused_dtype(backend, device, dtype: torch.dtype) -> None:
    if is_reference_backend(backend):
        return  # the torch backend takes fp32/fp16/bf16 everywhere; a refusal is a failure
    why = dtype_refusal(backend, device, dtype)
    if why is not None:
        pytest.skip(f"{backend.get_name()} refuses {dtype} on {device}: {why}")


def skip_unsupported_head_size(backend, head_size: int) -> None:
    sizes = list(backend.get_supported_head_sizes())
    if sizes and head_size not in sizes:
        assert not is_reference_backend(backend), "the torch backend must take any head size"
        pytest.skip(f"{backend.get_name()} supports head sizes {sizes}, not {head_size}")


# ----------------------------------------------------------------------------- cache layout


class CacheLayout:
    """Where K and V of one slot live in a backend's cache tensor (API.md section 1).

    kv_first   (torch, triton, flash_attn): (2, num_blocks, block_size, Hkv, D)
    block_first (flashinfer):               (num_blocks, 2, block_size, Hkv, D)
    flat        (xformers):                 (2, num_blocks, block_size * Hkv * D); the tests
                assume each block is [block_size, Hkv, D] flattened (the NHD order the other
                layouts share, DESIGN.md "KV cache").
    """

    def __init__(self, backend, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        name = backend.get_name().lower().replace("-", "_")
        nb, bs, h, d = num_blocks, block_size, num_kv_heads, head_size
        if "flashinfer" in name:
            self.kind, expected = "block_first", (nb, 2, bs, h, d)
        elif "xformers" in name:
            self.kind, expected = "flat", (2, nb, bs * h * d)
        else:
            self.kind, expected = "kv_first", (2, nb, bs, h, d)
        self.shape = tuple(backend.get_kv_cache_shape(nb, bs, h, d))
        assert self.shape == expected, (
            f"{backend.get_name()}.get_kv_cache_shape({nb}, {bs}, {h}, {d}): expected "
            f"{expected}, got {self.shape}")

    def kv(self, cache: torch.Tensor, which: int) -> torch.Tensor:
        """K (which=0) or V (which=1) as a [num_blocks, block_size, Hkv, D] view."""
        if self.kind == "kv_first":
            return cache[which]
        if self.kind == "block_first":
            return cache[:, which]
        return cache[which].view(self.num_blocks, self.block_size, self.num_kv_heads,
                                 self.head_size)

    def slot(self, cache: torch.Tensor, which: int, slot: int) -> torch.Tensor:
        """[Hkv, D] view of one slot of K or V."""
        return self.kv(cache, which)[slot // self.block_size, slot % self.block_size]

    def block(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([block_size, Hkv, D], [block_size, Hkv, D]) views of block `block`, K and V."""
        return self.kv(cache, 0)[block], self.kv(cache, 1)[block]


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """A bitwise view, so comparisons are exact (no NaN != NaN, no -0 == 0)."""
    return t.contiguous().view(torch.uint8)


def make_garbage_cache(shape: Sequence[int], cache_dtype: torch.dtype, device,
                       generator: torch.Generator) -> torch.Tensor:
    """A pool full of finite stale values, as blocks freed by earlier sequences hold."""
    junk = torch.randn(tuple(shape), generator=generator) * 50.0
    if cache_dtype in FP8_DTYPES:
        fmax = torch.finfo(cache_dtype).max
        junk = junk.clamp(-fmax, fmax)
    return junk.to(cache_dtype).to(device)


def slot_of(block_table: Sequence[int], pos: int, block_size: int) -> int:
    return block_table[pos // block_size] * block_size + pos % block_size


def write_tokens(layout: CacheLayout, cache: torch.Tensor, which: int,
                 block_table: Sequence[int], start: int, values: torch.Tensor) -> None:
    """The test's own scatter: token `start + i` of a sequence gets values[i] ([Hkv, D])."""
    view = layout.kv(cache, which)
    bs, pos, i = layout.block_size, start, 0
    while i < values.shape[0]:
        off = pos % bs
        n = min(bs - off, values.shape[0] - i)
        view[block_table[pos // bs], off:off + n] = values[i:i + n].to(cache.device)
        pos, i = pos + n, i + n


def cache_values(x: torch.Tensor, cache_dtype: torch.dtype, scale: float):
    """(what the cache stores for x, what a backend reads back as float64)."""
    if cache_dtype in FP8_DTYPES:
        stored = fp8_quantize(x, scale, cache_dtype)
        return stored, fp8_dequantize(stored, scale)
    stored = x.to(cache_dtype)
    return stored, stored.to(torch.float64)


def allocate_tables(needed: Sequence[int], spare: int, generator: torch.Generator):
    """Block tables over a shuffled pool: (num_blocks, tables, spare block ids)."""
    num_blocks = sum(needed) + spare
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at:at + n])
        at += n
    return num_blocks, tables, perm[at:]


def as_scale(value: float, as_tensor: bool, device):
    """k_scale/v_scale as a Python float or a 0-dim float32 device tensor (both are API)."""
    return torch.tensor(value, dtype=torch.float32, device=device) if as_tensor else value


# ----------------------------------------------------------------------------- scenario


@dataclass
class Scenario:
    backend: type
    shape: Shape
    head_size: int
    dtype: torch.dtype
    device: torch.device
    kv_cache_dtype: str
    cache_dtype: torch.dtype
    layout: CacheLayout
    block_tables: list[list[int]]
    spare_blocks: list[int]
    kv_cache: torch.Tensor          # the pool, history written, step not yet run
    initial_cache: torch.Tensor     # a copy of kv_cache before the step
    query: torch.Tensor             # [T, Hq, D] dtype, device
    key: torch.Tensor               # [T, Hkv, D] dtype, device
    value: torch.Tensor             # [T, Hkv, D] dtype, device
    k_scale: float
    v_scale: float
    hist_k: list[torch.Tensor]      # per sequence [context_len, Hkv, D] float64, as the cache reads
    hist_v: list[torch.Tensor]
    seqs: list = field(default_factory=list)  # [pagedattn.ScheduledSeq]

    # -- geometry
    @property
    def num_heads(self) -> int:
        return self.shape.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.shape.num_kv_heads

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def num_tokens(self) -> int:
        return sum(q for _, q in self.shape.lens)

    @property
    def fp8(self) -> bool:
        return self.cache_dtype in FP8_DTYPES

    @property
    def default_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_size)

    def row_ranges(self) -> list[tuple[int, int]]:
        out, at = [], 0
        for _, q in self.shape.lens:
            out.append((at, at + q))
            at += q
        return out

    def step_slots(self) -> list[int]:
        """Expected slot of every query token of the step, in batch order."""
        bs = self.block_size
        return [slot_of(t, p, bs) for t, (c, q) in zip(self.block_tables, self.shape.lens)
                for p in range(c, c + q)]

    # -- running the library
    def build(self, *, builder_window: int | None = None, pad_to: int | None = None,
              seqs=None):
        with refusal_guard(self.backend, f"block_size={self.block_size} / sliding_window="
                                         f"{builder_window} in the builder"):
            builder = self.backend.get_builder_cls()(self.block_size, self.device,
                                                     sliding_window=builder_window)
        seqs = self.seqs if seqs is None else seqs
        if pad_to is None:
            return builder.build(seqs)
        return builder.build(seqs, cuda_graph_pad_to=pad_to)

    def impl(self, *, scale: float | None = None, alibi_slopes=None,
             sliding_window: int | None = None, logits_soft_cap: float | None = None,
             attn_type=None, num_heads: int | None = None):
        opts = dict(alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                    kv_cache_dtype=self.kv_cache_dtype, logits_soft_cap=logits_soft_cap,
                    attn_type=attn_type or pagedattn.AttentionType.DECODER)
        shown = {k: v for k, v in opts.items() if v is not None and k != "alibi_slopes"}
        if alibi_slopes is not None:
            shown["alibi"] = True
        with refusal_guard(self.backend, f"{shown}, head_size={self.head_size}"):
            impl = self.backend.get_impl_cls()(
                num_heads or self.num_heads, self.head_size,
                self.default_scale if scale is None else scale, self.num_kv_heads, **opts)
        impl.set_query_dtype(self.dtype)
        return impl

    def forward(self, impl, md, *, scales_as_tensors: bool = False, output=None,
                kv_cache=None, query=None, key=None, value=None) -> torch.Tensor:
        q = self.query if query is None else query
        k = self.key if key is None else key
        v = self.value if value is None else value
        kwargs = {}
        if output is not None:
            kwargs["output"] = output
        return impl.forward(
            q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1),
            self.kv_cache if kv_cache is None else kv_cache, md,
            k_scale=as_scale(self.k_scale, scales_as_tensors, self.device),
            v_scale=as_scale(self.v_scale, scales_as_tensors, self.device), **kwargs)

    def run(self, *, builder_window: int | None = None, scales_as_tensors: bool = False,
            **impl_opts) -> torch.Tensor:
        """One step with a fresh builder and impl; writes into self.kv_cache."""
        impl = self.impl(**impl_opts)  # first: a backend that plans ahead plans it in build
        md = self.build(builder_window=builder_window)
        return self.forward(impl, md, scales_as_tensors=scales_as_tensors)

    def reset_cache(self) -> None:
        self.kv_cache.copy_(self.initial_cache)

    # -- the oracle
    def reference(self, *, scale: float | None = None, alibi_slopes=None,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None,
                  attn_type=None, num_heads=None) -> list[torch.Tensor]:
        """Acceptable [T, Hq, D] float64 answers (two for FP8 caches: the new tokens read
        quantised from the cache, or straight from the inputs)."""
        del attn_type, num_heads  # decoder self-attention only
        scale = self.default_scale if scale is None else scale
        new_k, new_v = self.key.cpu(), self.value.cpu()
        variants = [(new_k.double(), new_v.double())]
        if self.fp8:
            variants.insert(0, (cache_values(new_k, self.cache_dtype, self.k_scale)[1],
                                cache_values(new_v, self.cache_dtype, self.v_scale)[1]))
        q = self.query.cpu()
        refs = []
        for nk, nv in variants:
            rows = []
            for i, (a, b) in enumerate(self.row_ranges()):
                k = torch.cat([self.hist_k[i], nk[a:b]])
                v = torch.cat([self.hist_v[i], nv[a:b]])
                rows.append(dense_attention(
                    q[a:b], k, v, scale=scale, causal=True, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes))
            refs.append(torch.cat(rows))
        return refs

    def check(self, out: torch.Tensor, **opts) -> None:
        assert out.shape == (self.num_tokens, self.num_heads * self.head_size), (
            f"expected output shape {(self.num_tokens, self.num_heads * self.head_size)}, "
            f"got {tuple(out.shape)}")
        assert out.dtype == self.dtype, f"expected output dtype {self.dtype}, got {out.dtype}"
        assert out.device.type == self.device.type, f"output on {out.device}, not {self.device}"
        assert_attention_close(out, self.reference(**opts),
                               tolerance_for(self.dtype, self.fp8), self.row_ranges(),
                               what=f"{self.shape.name} {opts}")

    def check_cache_writes(self) -> None:
        """The step's K/V sit at their slots and nothing else in the pool changed."""
        actual = self.kv_cache.detach().clone()
        expected = self.initial_cache.clone()
        lay = self.layout
        for which, new, scale in ((0, self.key, self.k_scale), (1, self.value, self.v_scale)):
            stored, _ = cache_values(new.cpu(), self.cache_dtype, scale)
            for t, slot in enumerate(self.step_slots()):
                got = lay.slot(actual, which, slot).cpu()
                if self.fp8:
                    # the backend may round a tie differently: allow one FP8 step
                    g, e = got.double() * scale, stored[t].double() * scale
                    step = 0.13 if self.cache_dtype == torch.float8_e4m3fn else 0.26
                    ok = bool(((g - e).abs() <= step * e.abs() + 1e-6 * abs(scale)).all())
                else:
                    ok = torch.equal(raw_bits(got), raw_bits(stored[t]))
                if not ok:
                    e, g = stored[t].double().flatten(), got.double().flatten()
                    i = int(((g - e).abs() - (e.abs() * 0.13 if self.fp8 else 0)).argmax())
                    raise AssertionError(
                        f"{'KV'[which]} of token {t} at slot {slot}, element {i} of [Hkv*D]: "
                        f"expected {float(e[i])} (stored form), got {float(g[i])}")
                lay.slot(actual, which, slot).copy_(lay.slot(expected, which, slot))
        changed = raw_bits(actual) != raw_bits(expected)
        assert not bool(changed.any()), (
            f"{int(changed.sum())} bytes of the KV pool outside the step's slots changed "
            f"(spare blocks {self.spare_blocks})")

    def check_spare_blocks_untouched(self) -> None:
        for blk in self.spare_blocks:
            for which in (0, 1):
                now = self.layout.block(self.kv_cache, blk)[which]
                before = self.layout.block(self.initial_cache, blk)[which]
                assert torch.equal(raw_bits(now), raw_bits(before)), f"spare block {blk} changed"


def make_scenario(backend, shape: Shape, *, head_size: int = 64,
                  dtype: torch.dtype | None = None, device="cpu", kv_cache_dtype: str = "auto",
                  seed: int = 0, data_seed: int | None = None, spare_blocks: int = 5,
                  magnitude: float = 1.0, lookahead: int = 0) -> Scenario:
    """Builds the pool, the history and the step's inputs for `shape` (see module doc).

    `seed` draws the block tables; `data_seed` (default: `seed`) the values, so two
    scenarios can share tables (one metadata) but hold different layers' data.
    `lookahead` tokens of room are allocated past every seq_len (for multi-step decoding).
    """
    skip_unsupported_head_size(backend, head_size)
    device = torch.device(device)
    dtype = default_dtype() if dtype is None else dtype
    skip_refused_dtype(backend, device, dtype)
    num_blocks, tables, spare = allocate_tables(
        [math.ceil((c + q + lookahead) / shape.block_size) + (shape.slack_blocks if i % 2 else 0)
         for i, (c, q) in enumerate(shape.lens)], spare_blocks,
        torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed if data_seed is None else data_seed + 7919)
    bs, hq, hkv, d = shape.block_size, shape.num_heads, shape.num_kv_heads, head_size
    cache_dtype = pagedattn.kv_cache_dtype(kv_cache_dtype, dtype)
    layout = CacheLayout(backend, num_blocks, bs, hkv, d)
    cache = make_garbage_cache(layout.shape, cache_dtype, device, g)

    # every sequence's full K/V (history + this step), rounded to the model dtype
    full_k = [(torch.randn(c + q, hkv, d, generator=g) * magnitude).to(dtype)
              for c, q in shape.lens]
    full_v = [(torch.randn(c + q, hkv, d, generator=g) * magnitude).to(dtype)
              for c, q in shape.lens]
    k_scale = v_scale = 1.0
    if cache_dtype in FP8_DTYPES:
        # non-unit scales from the data: the largest value lands at half the format's range
        half = 0.5 * torch.finfo(cache_dtype).max
        k_scale = float(max(float(k.abs().max()) for k in full_k)) / half
        v_scale = float(max(float(v.abs().max()) for v in full_v)) / half

    hist_k, hist_v = [], []
    for table, (c, _), k, v in zip(tables, shape.lens, full_k, full_v):
        for which, x, scale, hist in ((0, k[:c], k_scale, hist_k), (1, v[:c], v_scale, hist_v)):
            stored, seen = cache_values(x, cache_dtype, scale)
            write_tokens(layout, cache, which, table, 0, stored)
            hist.append(seen)

    query = (torch.randn(sum(q for _, q in shape.lens), hq, d, generator=g)).to(dtype)
    key = torch.cat([k[c:] for (c, _), k in zip(shape.lens, full_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(shape.lens, full_v)])
    seqs = [pagedattn.ScheduledSeq(c + q, q, list(t)) for (c, q), t in zip(shape.lens, tables)]
    return Scenario(
        backend=backend, shape=shape, head_size=d, dtype=dtype, device=device,
        kv_cache_dtype=kv_cache_dtype, cache_dtype=cache_dtype, layout=layout,
        block_tables=tables, spare_blocks=spare, kv_cache=cache, initial_cache=cache.clone(),
        query=query.to(device), key=key.to(device), value=value.to(device),
        k_scale=k_scale, v_scale=v_scale, hist_k=hist_k, hist_v=hist_v, seqs=seqs)


def alibi_slopes_for(num_heads: int) -> list[float]:
    """Geometric slopes as in ALiBi (BLOOM), distinct per head."""
    return [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]
