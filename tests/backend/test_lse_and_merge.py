"""`forward(..., return_lse=True)` against the oracle's LSE, and `pagedattn.merge_attn_states`:
attention over a sequence's keys in two disjoint parts, merged, equals attention over all of them.

The LSE is the natural log of each query row's softmax denominator (its sink's term included),
float32 [T, Hq]; the parts of the merge are a cascade's: the prefix blocks read as
cross-attention (every query sees all of them) and the suffix blocks as a causal step of their own.
"""

import math

import pytest
import torch

import pagedattn
from cases import Shape, alibi_slopes_for, make_scenario, refusal_guard, shapes
from oracle import assert_attention_close, tolerance_for

AT = pagedattn.AttentionType
LSE_ATOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
PROMPTS = Shape("fresh_prompts", ((0, 40), (0, 9)))
# one sequence, one KV head: few programs, so our kernels split its keys (FlashDecoding)
LONG_DECODE = Shape("long_decode_mqa", ((400, 1),), num_heads=4, num_kv_heads=1)


def _forward_lse(sc, impl, md, *, output_lse=None):
    q, k, v = (x.reshape(x.shape[0], -1) for x in (sc.query, sc.key, sc.value))
    return impl.forward(q, k, v, sc.kv_cache, md, k_scale=sc.k_scale, v_scale=sc.v_scale, return_lse=True,
                        output_lse=output_lse)


def _check_lse(sc, lse, **opts):
    """`lse` [T, Hq] against the oracle's (for an FP8 cache either reading of the new tokens)."""
    assert lse.shape == (sc.num_tokens, sc.num_heads) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    sources = (True, False) if sc.fp8 else (False,)
    refs = [sc.reference(scale=sc.default_scale, new_from_cache=c, **opts)[1] for c in sources]
    got = lse.detach().cpu().double()
    atol = max(LSE_ATOL[sc.dtype], 2e-2 if sc.fp8 else 0.0)
    errs = [float((got - r).abs().max()) for r in refs]
    assert min(errs) <= atol, f"{sc.shape.name} {opts}: LSE off by {min(errs):.3e} (> {atol})"


@pytest.mark.parametrize("shape", [shapes("single_decode")[0], PROMPTS, shapes("chunked_prefill")[0],
                                   shapes("mixed")[0]], ids=str)
def test_lse(backend, device, model_dtype, shape):
    """Decode, fresh prompts, chunks over a cached prefix, a mixed step."""
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype, seed=60)
    impl = sc.impl()
    out, lse = _forward_lse(sc, impl, sc.build())
    sc.check(out)
    _check_lse(sc, lse)


@pytest.mark.parametrize("shape", [LONG_DECODE, shapes("mixed")[0]], ids=str)
def test_lse_with_sinks_and_options(backend, device, model_dtype, shape):
    """Sinks in the output and the LSE, with a window and ALiBi; a long decode our kernels split
    (the reduction adds the sink), into a caller's `output_lse`."""
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype, seed=61)
    opts = dict(sinks=torch.linspace(-1.0, 2.0, sc.num_heads).tolist(), sliding_window=300,
                alibi_slopes=alibi_slopes_for(sc.num_heads))
    impl = sc.impl(**opts)
    buffer = torch.full((sc.num_tokens, sc.num_heads), float("nan"), device=device)
    out, lse = _forward_lse(sc, impl, sc.build(), output_lse=buffer)
    assert lse is buffer
    sc.check(out, **opts)
    _check_lse(sc, lse, **opts)


def test_lse_fp8_cache_with_sinks(backend, device, model_dtype):
    sc = make_scenario(backend, shapes("mixed")[0], device=device, dtype=model_dtype, kv_cache_dtype="fp8_e5m2",
                       seed=62, magnitude=2.0)
    sinks = [1.0, -0.5, 0.0, 2.5]
    out, lse = _forward_lse(sc, sc.impl(sinks=sinks), sc.build())
    sc.check(out, sinks=sinks)
    _check_lse(sc, lse, sinks=sinks)


# (context_len, query_len) and the prefix each sequence's first part holds (whole blocks of 16,
# all before its first query)
MERGE_LENS = ((40, 5), (37, 1), (20, 1))
PREFIX = (32, 16, 16)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_merge_of_two_parts_equals_the_whole(backend, device, model_dtype, with_sinks):
    """A cascade: each sequence's prefix blocks as cross-attention (not causal: every query
    follows them), its suffix blocks as a causal step of their own (positions shift by whole
    blocks), merged by their LSEs. With sinks, only the prefix part has them: its LSE carries
    the sink, so the merge is the whole attention with sinks."""
    sc = make_scenario(backend, Shape("cascade", MERGE_LENS), device=device, dtype=model_dtype, seed=63,
                       write_step=True)
    bs = sc.block_size
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device) if with_sinks else None
    with refusal_guard(backend, f"cross-attention, sinks={with_sinks}"):
        whole_impl = backend.get_impl_cls()(sc.num_heads, sc.head_size, sc.default_scale, sc.num_kv_heads,
                                            sinks=sinks)
        prefix_impl = backend.get_impl_cls()(sc.num_heads, sc.head_size, sc.default_scale, sc.num_kv_heads,
                                             attn_type=AT.ENCODER_DECODER, sinks=sinks)
        suffix_impl = backend.get_impl_cls()(sc.num_heads, sc.head_size, sc.default_scale, sc.num_kv_heads)
    for impl in (whole_impl, prefix_impl, suffix_impl):
        impl.set_query_dtype(sc.dtype)
    builder = sc.builder()
    tables = sc.block_tables
    whole = builder.build(sc.seqs)
    prefix = builder.build([pagedattn.ScheduledSeq(c + q, q, t, encoder_len=p, cross_block_table=t[:p // bs])
                            for (c, q), t, p in zip(MERGE_LENS, tables, PREFIX)])
    suffix = builder.build([pagedattn.ScheduledSeq(c + q - p, q, t[p // bs:])
                            for (c, q), t, p in zip(MERGE_LENS, tables, PREFIX)])
    q, k, v = (x.reshape(x.shape[0], -1) for x in (sc.query, sc.key, sc.value))
    out_w, lse_w = whole_impl.forward(q, k, v, sc.kv_cache, whole, return_lse=True)
    out_a, lse_a = prefix_impl.forward(q, None, None, sc.kv_cache, prefix, return_lse=True)
    out_b, lse_b = suffix_impl.forward(q, k, v, sc.kv_cache, suffix, return_lse=True)
    out, lse = pagedattn.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert out.shape == out_w.shape and out.dtype == out_w.dtype
    sinks_list = None if sinks is None else sinks.tolist()
    sc.check(out_w, sinks=sinks_list)
    assert_attention_close(out, out_w.double().cpu(), tolerance_for(sc.dtype), sc.row_ranges(), what="merged parts")
    torch.testing.assert_close(lse, lse_w, atol=LSE_ATOL[sc.dtype], rtol=0)


def test_merge_attn_states_rules(device):
    """The merge's own rules, on the tensors' device (PyTorch on the CPU, our kernel on CUDA or
    under TRITON_INTERPRET=1): an empty part (-inf, or +inf as FlashAttention 2 writes it) weighs
    nothing, two empty parts give 0 and -inf, outputs may alias, [T, H*D] rows work."""
    t, h, d = 3, 2, 8
    g = torch.Generator().manual_seed(5)
    out_a, out_b = (torch.randn(t, h, d, generator=g).to(device) for _ in range(2))
    lse_a = torch.tensor([[0.0, float("-inf")], [1.0, float("inf")], [float("-inf"), 3.0]], device=device)
    lse_b = torch.tensor([[math.log(3.0), float("-inf")], [float("-inf"), 2.0], [0.5, 0.5]], device=device)
    expect = out_a.clone()
    expect[0, 0] = 0.25 * out_a[0, 0] + 0.75 * out_b[0, 0]
    expect[0, 1] = 0.0
    expect[1, 1] = out_b[1, 1]
    w = 1.0 / (1.0 + math.exp(-2.5))  # part a's weight: e^3 / (e^3 + e^0.5)
    expect[2, 1] = w * out_a[2, 1] + (1 - w) * out_b[2, 1]
    expect[2, 0] = out_b[2, 0]
    out, lse = pagedattn.merge_attn_states(out_a.flatten(1), lse_a, out_b.flatten(1), lse_b)
    torch.testing.assert_close(out.view(t, h, d), expect, atol=1e-6, rtol=1e-5)
    ref_lse = torch.tensor([[math.log(4.0), float("-inf")], [1.0, 2.0], [0.5, 3.0 + math.log1p(math.exp(-2.5))]])
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-6, rtol=1e-6)
    res = pagedattn.merge_attn_states(out_a, lse_a, out_b, lse_b, out=out_a, out_lse=lse_a)  # in place
    assert res[0] is out_a and res[1] is lse_a
    torch.testing.assert_close(out_a, expect, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="lse_b"):
        pagedattn.merge_attn_states(out_a, lse_a, out_b, lse_b[:2])


def _merge_parts(device, t=3, h=2, d=8):
    g = torch.Generator().manual_seed(7)
    out_a, out_b = (torch.randn(t, h, d, generator=g).to(device) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, h, generator=g).to(device) for _ in range(2))
    return out_a, lse_a, out_b, lse_b


def _bad_merges(device):
    """name -> (error, match, args, kwargs, the four parts, which must stay unchanged)."""
    parts = a, la, b, lb = _merge_parts(device)
    buf = torch.zeros(4, 2, 8, device=device)
    expanded = torch.zeros(1, 2, 8, device=device).expand(3, 2, 8)
    a1, b1 = a[..., :1].contiguous(), b[..., :1].contiguous()
    cases = {
        "lse_a not a tensor": (TypeError, "expected lse_a a torch.Tensor", (a, la.tolist(), b, lb), {}),
        "out not a tensor": (TypeError, "expected out a torch.Tensor or None", parts, {"out": [0]}),
        "lse_a rank": (ValueError, r"lse_a float32 \[T, H\]", (a, la[:, 0], b, lb), {}),
        "lse_a float64": (ValueError, "lse_a float32", (a, la.double(), b, lb), {}),
        "out_a rank": (ValueError, r"out_a \[3, 2, D\] or \[3, 2\*D\]", (a[None], la, b[None], lb), {}),
        "out_a heads": (ValueError, r"out_a \[3, 2, D\]", (a[:, :1], la, b[:, :1], lb), {}),
        "out_b shape": (ValueError, r"out_b of \[3, 2, 8\]", (a, la, b.flatten(1), lb), {}),
        "lse_b rows": (ValueError, r"lse_b of \[3, 2\]", (a, la, b, lb[:2]), {}),
        "lse_b float16": (ValueError, "lse_b float32", (a, la, b, lb.half()), {}),
        "out_b int": (ValueError, "out_b float32/float16/bfloat16", (a, la, b.int(), lb), {}),
        "out_lse shape": (ValueError, r"out_lse of \[3, 2\]", parts, {"out_lse": la[None]}),
        "lse_a on meta": (ValueError, "lse_a of .* on meta", (a, la.to("meta"), b, lb), {}),
        "requires grad": (ValueError, "out_a without requires_grad", (a.clone().requires_grad_(), la, b, lb), {}),
        "out expanded": (ValueError, "distinct memory", parts, {"out": expanded}),
        "out shifted over out_a": (ValueError, "overlaps out_a", (buf[:3], la, b, lb), {"out": buf[1:]}),
        "out over lse_a": (ValueError, "overlaps lse_a", (a1, la, b1, lb), {"out": la[..., None]}),
        "out_lse over out_a": (ValueError, "overlaps out_a", parts, {"out_lse": a[..., 0]}),
        "out fp16 over out_a": (ValueError, "overlaps out_a", parts, {"out": a.view(torch.float16)[..., :8]}),
    }
    return {name: (*case, parts) for name, case in cases.items()}


@pytest.mark.parametrize("case", list(_bad_merges("cpu")))
def test_merge_attn_states_bad_input(device, case):
    """Every bad argument is refused before anything is written, naming what was expected."""
    error, match, args, kwargs, parts = _bad_merges(device)[case]
    before = [x.clone() for x in parts]
    with pytest.raises(error, match=match):
        pagedattn.merge_attn_states(*args, **kwargs)
    assert all(torch.equal(x, y) for x, y in zip(parts, before))


def test_merge_attn_states_allowed_aliases(device):
    """Writing over an input itself (out=out_b, out_lse=lse_b), into strided rows, or into fp16 is allowed
    and gives the same answer as a fresh result."""
    out_a, lse_a, out_b, lse_b = _merge_parts(device)
    ref, ref_lse = pagedattn.merge_attn_states(out_a, lse_a, out_b, lse_b)
    rows = torch.zeros(3, 2 * 16, device=device)[:, ::2]  # [T, H*D] with a row stride of 32
    out, lse = pagedattn.merge_attn_states(out_a.flatten(1), lse_a, out_b.flatten(1), lse_b, out=rows)
    assert out is rows
    torch.testing.assert_close(out.view(3, 2, 8), ref, atol=1e-6, rtol=1e-6)
    half, _ = pagedattn.merge_attn_states(out_a, lse_a, out_b, lse_b, out=torch.empty_like(out_a, dtype=torch.float16))
    torch.testing.assert_close(half.float(), ref, atol=2e-3, rtol=2e-3)
    out, lse = pagedattn.merge_attn_states(out_a, lse_a, out_b, lse_b, out=out_b, out_lse=lse_b)
    assert out is out_b and lse is lse_b
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
