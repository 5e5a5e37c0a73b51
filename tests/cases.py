"""Named batch shapes, the backend-dependent skips, and the scenario that runs one attention
step of a backend against the oracle.

A scenario is a `PagedBatch` (paged_batch.py: shuffled pool, spare blocks, history written by
the test's own loop, dense copies for the oracle) plus the library calls of one step: the
builder, the impl, `forward`, and the checks of its output and its cache writes. Only public
API (shared/API.md) is used, so the same tests run for every backend.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Iterator

import pytest
import torch

import pagedattn
from oracle import DTYPES, assert_attention_close, tolerance_for
from paged_batch import PagedBatch, cache_values, make_paged_batch, raw_bits

# ----------------------------------------------------------------------------- the interpreter

KERNEL_GRID = pytest.mark.gpu_grid(keep=("triton",))
"""A cell of a kernel grid (a value of an option, a head size, a dtype on one more shape): on the
CPU, where our kernels run interpreted, only the triton backend runs it; flash_attn and xformers
run the same kernel behind their adapters, which their unmarked cells cover (conftest.py)."""

GPU_ONLY_GRID = pytest.mark.gpu_grid()
"""A cell that the unmarked cells cover on every interpreted backend; it runs on CUDA."""

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
"""Whether the kernels run interpreted, read as the session starts (tests/kernels sets
TRITON_INTERPRET later, for itself): a random search draws fewer examples then."""


def grid(values, *, kernel_grid=(), gpu_only=(), ids=str):
    """`values` for parametrize, those in `kernel_grid` marked `KERNEL_GRID`, those in `gpu_only`
    `GPU_ONLY_GRID`."""
    def marks(v):
        return KERNEL_GRID if v in kernel_grid else GPU_ONLY_GRID if v in gpu_only else ()

    return [pytest.param(v, id=ids(v), marks=marks(v)) for v in values]


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

    def __str__(self) -> str:
        return self.name


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


@functools.lru_cache(maxsize=None)
def dtype_refusal(backend, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `backend` refuses `dtype` on `device` (None: it accepts it), found by one tiny step.

    The dtype is not an impl constructor argument, so a backend can only refuse it when it sees
    the tensors; the probe keeps such refusals from failing every test of a dtype it never
    claimed to support.
    """
    sizes = list(backend.get_supported_head_sizes())
    d = 64 if not sizes or 64 in sizes else sizes[0]
    bs, nb = 16, 2
    try:
        cache = torch.zeros(backend.get_kv_cache_shape(nb, bs, 1, d), dtype=dtype, device=device)
        md = backend.get_builder_cls()(bs, device).build([pagedattn.ScheduledSeq(3, 3, [1])])
        impl = backend.get_impl_cls()(2, d, d ** -0.5, 1)
        x = torch.zeros(3, 2 * d, dtype=dtype, device=device)
        impl.forward(x, x[:, :d], x[:, :d], cache, md)
    except (TypeError, ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def skip_refused_dtype(backend, device, dtype: torch.dtype) -> None:
    if is_reference_backend(backend):
        return  # the torch backend takes fp32/fp16/bf16 everywhere; a refusal is a failure
    why = dtype_refusal(backend, torch.device(device), dtype)
    if why is not None:
        pytest.skip(f"{backend.get_name()} refuses {dtype} on {device}: {why}")


def model_dtype_for(backend, device, choice: str = "auto") -> torch.dtype:
    """The model dtype of tests that do not sweep dtypes: `choice` (fp32, fp16, bf16), or for
    "auto" fp32 unless the backend refuses it on `device` (FlashInfer takes fp16/bf16 only)."""
    if choice == "auto":
        choice = next((n for n in ("fp32", "bf16", "fp16")
                       if dtype_refusal(backend, torch.device(device), DTYPES[n]) is None), "fp32")
    return DTYPES[choice]


def small_head_size(backend) -> int:
    """16, or the smallest head size the backend supports: for tests that need tiny shapes."""
    sizes = sorted(backend.get_supported_head_sizes())
    return 16 if not sizes or 16 in sizes else sizes[0]


def skip_unsupported_head_size(backend, head_size: int) -> None:
    sizes = list(backend.get_supported_head_sizes())
    if sizes and head_size not in sizes:
        assert not is_reference_backend(backend), "the torch backend must take any head size"
        pytest.skip(f"{backend.get_name()} supports head sizes {sizes}, not {head_size}")


def as_scale(value: float, as_tensor: bool, device):
    """k_scale/v_scale as a Python float or a 0-dim float32 device tensor (both are API)."""
    return torch.tensor(value, dtype=torch.float32, device=device) if as_tensor else value


# ----------------------------------------------------------------------------- scenario


@dataclass
class Scenario(PagedBatch):
    """A `PagedBatch` in `backend`'s layout, with the calls and checks of one step."""

    backend: type = None
    shape: Shape = None
    kv_cache_dtype: str = "auto"
    initial_cache: torch.Tensor = None  # a copy of kv_cache before the step
    seqs: list = field(default_factory=list)  # [pagedattn.ScheduledSeq]

    @property
    def default_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_size)

    # -- running the library
    def builder(self, *, builder_window: int | None = None, layers=()):
        """A metadata builder of this scenario's backend, told the model's `layers` (the impls a
        planning backend plans in `build`); keep one to build several steps, as an engine does."""
        with refusal_guard(self.backend, f"block_size={self.block_size} / sliding_window="
                                         f"{builder_window} in the builder"):
            builder = self.backend.get_builder_cls()(self.block_size, self.device,
                                                     sliding_window=builder_window)
        builder.set_layers(layers)
        return builder

    def build(self, *, builder_window: int | None = None, pad_to: int | None = None,
              seqs=None, layers=()):
        builder = self.builder(builder_window=builder_window, layers=layers)
        seqs = self.seqs if seqs is None else seqs
        if pad_to is None:
            return builder.build(seqs)
        return builder.build(seqs, cuda_graph_pad_to=pad_to)

    def impl(self, *, scale: float | None = None, alibi_slopes=None,
             sliding_window: int | None = None, logits_soft_cap: float | None = None,
             attn_type=None, num_heads: int | None = None, sinks=None):
        opts = dict(alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                    kv_cache_dtype=self.kv_cache_dtype, logits_soft_cap=logits_soft_cap,
                    attn_type=attn_type or pagedattn.AttentionType.DECODER)
        if sinks is not None:  # a float32 tensor [Hq] on the device, as a model's parameter is
            opts["sinks"] = torch.as_tensor(sinks, dtype=torch.float32, device=self.device)
        shown = {k: v for k, v in opts.items() if v is not None and k not in ("alibi_slopes", "sinks")}
        if alibi_slopes is not None:
            shown["alibi"] = True
        if sinks is not None:
            shown["sinks"] = True
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
    def references(self, *, scale: float | None = None, alibi_slopes=None,
                   sliding_window: int | None = None, logits_soft_cap: float | None = None,
                   attn_type=None, num_heads=None, sinks=None) -> list[torch.Tensor]:
        """Acceptable [T, Hq, D] float64 answers (two for FP8 caches: the new tokens read
        quantised from the cache, or straight from the inputs)."""
        del attn_type, num_heads  # decoder self-attention only
        scale = self.default_scale if scale is None else scale
        opts = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                    alibi_slopes=alibi_slopes, sinks=sinks)
        sources = (True, False) if self.fp8 else (False,)
        return [self.reference(scale=scale, new_from_cache=c, **opts)[0] for c in sources]

    def check(self, out: torch.Tensor, **opts) -> None:
        assert out.shape == (self.num_tokens, self.num_heads * self.head_size), (
            f"expected output shape {(self.num_tokens, self.num_heads * self.head_size)}, "
            f"got {tuple(out.shape)}")
        assert out.dtype == self.dtype, f"expected output dtype {self.dtype}, got {out.dtype}"
        assert out.device.type == self.device.type, f"output on {out.device}, not {self.device}"
        assert_attention_close(out, self.references(**opts),
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


def make_scenario(backend, shape: Shape, *, dtype: torch.dtype, device="cpu",
                  head_size: int = 64, kv_cache_dtype: str = "auto", **batch_options) -> Scenario:
    """The step `shape` in `backend`'s cache layout; skips what a non-reference backend does
    not support. `batch_options` are `make_paged_batch`'s (seed, data_seed, spare_blocks,
    magnitude, lookahead, ...)."""
    skip_unsupported_head_size(backend, head_size)
    device = torch.device(device)
    skip_refused_dtype(backend, device, dtype)
    batch = make_paged_batch(
        backend, shape.lens, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        head_size=head_size, block_size=shape.block_size, dtype=dtype, device=device,
        kv_cache_dtype=kv_cache_dtype, slack_blocks=shape.slack_blocks, **batch_options)
    fields = {f: getattr(batch, f) for f in PagedBatch.__dataclass_fields__}
    return Scenario(**fields, backend=backend, shape=shape, kv_cache_dtype=kv_cache_dtype,
                    initial_cache=batch.kv_cache.clone(), seqs=batch.scheduled())


def alibi_slopes_for(num_heads: int) -> list[float]:
    """Geometric slopes as in ALiBi (BLOOM), distinct per head."""
    return [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]
