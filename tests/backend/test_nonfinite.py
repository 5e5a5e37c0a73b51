"""Non-finite numbers: slots nobody wrote never reach a result, and NaN/Inf in the step's own
data propagate to the rows that see them, never turned into zeros, and never to another
sequence.

A whole-block gather may read a block's unwritten tail (or the random bytes an FP8 pool starts
with, NaN encodings included), but those values must be masked before the matmul. A NaN in the
query, or in a key/value a query sees, must reach that query's row: a reference backend that
hides it would hide numerical bugs. Every backend, public contract only.
"""

import pytest
import torch

import pagedattn
from cases import Shape, grid, make_scenario, refusal_guard, small_head_size
from oracle import assert_attention_close, dense_attention, tolerance_for
from paged_batch import CacheLayout, cache_values, write_tokens

NUM_BLOCKS, BS, HQ, HKV = 4, 16, 4, 2
# (seq_len, query_len, block table); each decode's last block is partly written
STEPS = {
    "prefill": [(5, 5, [0])],
    "decodes": [(20, 1, [1, 2]), (3, 1, [3])],
    "mixed": [(5, 5, [0]), (20, 1, [1, 2]), (3, 1, [3])],
}


def _pool(layout, cache_dtype, device, unwritten: str, g) -> torch.Tensor:
    """The pool with every slot holding zero, NaN, or (FP8) random bytes."""
    if unwritten == "zero":
        return torch.zeros(layout.shape, dtype=cache_dtype, device=device)
    if cache_dtype.itemsize == 1:  # FP8: whatever torch.empty left, NaN encodings included
        raw = torch.randint(0, 256, layout.shape, dtype=torch.uint8, generator=g)
        return raw.view(cache_dtype).to(device)
    return torch.full(layout.shape, float("nan"), dtype=cache_dtype, device=device)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("step", grid(list(STEPS), kernel_grid=["prefill", "decodes"]))  # mixed holds both
def test_unwritten_slots_never_reach_the_output(backend, device, model_dtype, step,
                                                kv_cache_dtype):
    d = small_head_size(backend)
    layout = CacheLayout(backend, NUM_BLOCKS, BS, HKV, d)
    cache_dtype = pagedattn.kv_cache_dtype(kv_cache_dtype, model_dtype)
    g = torch.Generator().manual_seed(93)
    parts = STEPS[step]
    seqs = [pagedattn.ScheduledSeq(n, q, t) for n, q, t in parts]
    t = sum(q for _, q, _ in parts)
    hist = [(torch.randn(n - q, HKV, d, generator=g).to(model_dtype),
             torch.randn(n - q, HKV, d, generator=g).to(model_dtype)) for n, q, _ in parts]
    q, k, v = (torch.randn(t, h * d, generator=g).to(model_dtype).to(device)
               for h in (HQ, HKV, HKV))
    with refusal_guard(backend, f"kv_cache_dtype={kv_cache_dtype}, head_size={d}"):
        impl = backend.get_impl_cls()(HQ, d, d ** -0.5, HKV, kv_cache_dtype=kv_cache_dtype)
    impl.set_query_dtype(model_dtype)

    outs = {}
    for unwritten in ("zero", "junk"):
        cache = _pool(layout, cache_dtype, device, unwritten, g)
        for (_, _, table), (hk, hv) in zip(parts, hist):  # the history, scale 1
            write_tokens(layout, cache, 0, table, 0, cache_values(hk, cache_dtype, 1.0)[0])
            write_tokens(layout, cache, 1, table, 0, cache_values(hv, cache_dtype, 1.0)[0])
        md = backend.get_builder_cls()(BS, device).build(seqs)
        outs[unwritten] = impl.forward(q, k, v, cache, md)
    nonfinite = int((~torch.isfinite(outs["junk"])).sum())
    assert nonfinite == 0, f"unwritten slots reached the output: {nonfinite} non-finite values"
    assert float(outs["zero"].abs().max()) > 0.1, "a zero-filled pool gave an all-zero output"
    tol = tolerance_for(model_dtype, cache_dtype.itemsize == 1).atol / 10
    torch.testing.assert_close(outs["junk"], outs["zero"], atol=tol, rtol=tol,
                               msg=lambda m: f"junk in unwritten slots changed the output: {m}")


# chunked prefill over a history, a fresh prompt, a decode
SHAPE = Shape("nonfinite", ((4, 4), (0, 3), (6, 1)), block_size=4)


def _scenario(backend, device, dtype, seed):
    return make_scenario(backend, SHAPE, device=device, dtype=dtype,
                         head_size=small_head_size(backend), seed=seed)


def _check_rows(sc, out, poisoned: list[int], free: tuple[int, ...] = ()) -> None:
    """Rows in `poisoned` are wholly non-finite; rows in `free` are not checked; every other
    row is finite and right."""
    for r in poisoned:
        finite = int(torch.isfinite(out[r]).sum())
        assert finite == 0, (
            f"row {r} sees a non-finite input but {finite} of its values came out finite "
            f"(max |x| {float(out[r].float().nan_to_num().abs().max()):.3g})")
    keep = [r for r in range(sc.num_tokens) if r not in poisoned and r not in free]
    ref = sc.references()[0]
    assert_attention_close(out[keep], ref[keep], tolerance_for(sc.dtype),
                           what=f"rows {keep}, which see no non-finite input")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_query_row_stays_in_its_row(backend, device, model_dtype, bad):
    sc = _scenario(backend, device, model_dtype, seed=94)
    row = 5  # the second token of the fresh prompt
    sc.query[row] = bad
    _check_rows(sc, sc.run(), [row])


# (which tensor, where, value, rows that see it, rows not checked): the poisoned token is
# position 2 of sequence 0's history (all four of its queries see it) or the step's new token
# at position 5 (row 1: rows 1..3 see it). Row 0 (position 4) masks it causally; whether a
# masked non-finite key or value reaches a row of its own sequence is the kernel's business
# (FlashAttention-style kernels multiply a masked value by a zero weight, and 0 * NaN is NaN),
# so row 0 is not checked. Rows of the other sequences must stay exact.
POISON = {
    "key_nan_history": ("k", "history", float("nan"), [0, 1, 2, 3], ()),
    "value_nan_history": ("v", "history", float("nan"), [0, 1, 2, 3], ()),
    "value_inf_history": ("v", "history", float("inf"), [0, 1, 2, 3], ()),
    "key_nan_step": ("k", "step", float("nan"), [1, 2, 3], (0,)),
    "value_nan_step": ("v", "step", float("nan"), [1, 2, 3], (0,)),
}


@pytest.mark.parametrize("case", list(POISON))
def test_nonfinite_key_or_value_reaches_the_rows_that_see_it(backend, device, model_dtype,
                                                            case):
    which, where, bad, rows, free = POISON[case]
    sc = _scenario(backend, device, model_dtype, seed=95)
    idx = "kv".index(which)
    if where == "history":
        hist = (sc.hist_k, sc.hist_v)[idx][0]
        hist[2] = bad
        write_tokens(sc.layout, sc.kv_cache, idx, sc.block_tables[0], 2,
                     hist[2:3].to(sc.cache_dtype))
    else:
        (sc.key, sc.value)[idx][1] = bad
    _check_rows(sc, sc.run(), rows, free)


def test_oracle_keeps_unseen_nan_out():
    """The oracle's own guarantee the tests above lean on: a NaN value a query cannot see
    (a later position) leaves that query's row finite."""
    q = torch.randn(3, 2, 8)
    k = torch.randn(3, 1, 8)
    v = torch.randn(3, 1, 8)
    v[2] = float("nan")
    out = dense_attention(q, k, v, scale=0.3)
    assert bool(torch.isfinite(out[:2]).all()) and bool(torch.isnan(out[2]).all())

