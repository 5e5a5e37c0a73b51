"""paged_attention against the dense float64 oracle on small named batch shapes."""

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_oracle import dense_attention, make_paged_batch, reference_paged, rel_l2  # noqa: E402

from pagedattn.kernels import SplitKVWorkspace, paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (query_len, seq_len) per sequence; prefills first, then decodes.
SHAPES = {
    "single_decode": [(1, 37)],
    "many_decodes": [(1, 1), (1, 16), (1, 17), (1, 70), (1, 5)],
    "prefill_no_context": [(23, 23)],
    "chunked_prefill": [(9, 41)],
    "multi_token_decode": [(3, 30), (2, 19)],
    "mixed": [(12, 12), (5, 40), (1, 33), (1, 9)],
}


def run(batch, *, out_dtype=None, workspace=None, num_splits=None, lse=True, **kw):
    out = torch.empty_like(batch.query)
    lse_t = torch.full(batch.query.shape[:2], 7.0, device=DEVICE) if lse else None
    paged_attention(
        batch.query, batch.k_cache, batch.v_cache, out,
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        block_tables=batch.block_tables, max_query_len=max(batch.query_lens),
        max_seq_len=max(batch.seq_len_list), workspace=workspace, num_splits=num_splits,
        lse=lse_t, **kw)
    return out, lse_t


def check_against_oracle(batch, dtype, *, k_scale=1.0, v_scale=1.0, **kw):
    scale = batch.query.shape[-1] ** -0.5
    scales = {}
    if batch.k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scales = dict(k_scale=torch.tensor(k_scale, device=DEVICE),
                      v_scale=torch.tensor(v_scale, device=DEVICE))
    out, lse = run(batch, scale=scale, **scales, **kw)
    ref_out, ref_lse = reference_paged(batch, scale=scale, k_scale=k_scale, v_scale=v_scale,
                                       **{k: v for k, v in kw.items()
                                          if k not in ("workspace", "num_splits")})
    assert rel_l2(out, ref_out) <= TOL[dtype]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-3, rtol=1e-4)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_batch_shapes(shape, block_size):
    batch = make_paged_batch(SHAPES[shape], num_heads=4, num_kv_heads=2, head_size=32,
                             block_size=block_size, dtype=torch.float32, device=DEVICE)
    check_against_oracle(batch, torch.float32)


@pytest.mark.parametrize("head_size", [32, 64, 80, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_head_sizes_and_dtypes(head_size, dtype):
    batch = make_paged_batch(SHAPES["mixed"], num_heads=2, num_kv_heads=1,
                             head_size=head_size, block_size=16, dtype=dtype, device=DEVICE)
    check_against_oracle(batch, dtype)


@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (3, 3), (6, 2)], ids=str)
def test_gqa_mqa(heads):
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(SHAPES["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=32, block_size=5, dtype=torch.float32, device=DEVICE)
    check_against_oracle(batch, torch.float32)


def test_long_prefill_many_query_tiles():
    # more query tokens than one tile holds, plus decodes sharing the launch
    batch = make_paged_batch([(150, 170), (1, 20)], num_heads=4, num_kv_heads=1, head_size=32,
                             block_size=16, dtype=torch.float16, device=DEVICE)
    check_against_oracle(batch, torch.float16)


@pytest.mark.parametrize("block_size", [5, 16])
def test_sliding_window_skips_blocks(block_size):
    window = 11
    seqs = [(6, 60), (1, 45), (20, 20)]
    batch = make_paged_batch(seqs, num_heads=4, num_kv_heads=2, head_size=32,
                             block_size=block_size, dtype=torch.float32, device=DEVICE)
    plain, _ = run(batch, scale=0.2)
    ref_out, ref_lse = reference_paged(batch, scale=0.2, sliding_window=window)
    # Poison every block that lies wholly before the window of the sequence's first query:
    # reading it (even masked) would turn the output into NaN.
    for b, (q_len, seq_len) in enumerate(seqs):
        first_key = max(0, seq_len - q_len - window + 1)
        for i in range(first_key // block_size):
            blk = int(batch.block_tables[b, i])
            batch.k_cache[blk] = float("nan")
            batch.v_cache[blk] = float("nan")
    out, lse = run(batch, scale=0.2, sliding_window=window)
    assert rel_l2(out, ref_out) <= TOL[torch.float32]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-4, rtol=1e-4)
    assert rel_l2(out, plain) > 1e-2  # the option changes the result


def test_alibi_and_soft_cap_move_the_output():
    batch = make_paged_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=32,
                             block_size=16, dtype=torch.float32, device=DEVICE)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    plain, _ = run(batch, scale=0.5)
    alibi = check_against_oracle(batch, torch.float32, alibi_slopes=slopes)
    capped = check_against_oracle(batch, torch.float32, soft_cap=1.5)
    both = check_against_oracle(batch, torch.float32, soft_cap=1.5, alibi_slopes=slopes,
                                sliding_window=7)
    for x in (alibi, capped, both):
        assert rel_l2(x, plain) > 1e-2


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_cache(cache_dtype, dtype):
    batch = make_paged_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=64,
                             block_size=16, dtype=dtype, cache_dtype=cache_dtype,
                             device=DEVICE)
    out = check_against_oracle(batch, dtype, k_scale=0.3, v_scale=1.7)
    unit, _ = run(batch, scale=0.125, k_scale=torch.tensor(1.0, device=DEVICE),
                  v_scale=torch.tensor(1.0, device=DEVICE))
    assert rel_l2(out, unit) > 1e-2


@pytest.mark.parametrize("shape", ["single_decode", "many_decodes", "mixed", "chunked_prefill"])
@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_kv_matches_unsplit(shape, num_splits):
    batch = make_paged_batch(SHAPES[shape], num_heads=4, num_kv_heads=2, head_size=32,
                             block_size=5, dtype=torch.float32, device=DEVICE)
    ws = SplitKVWorkspace.allocate(batch.query.shape[0], 4, 32, 4, DEVICE)
    ws.partial_out.fill_(float("nan"))  # stale scratch must never leak into the result
    ws.partial_lse.fill_(float("nan"))
    split_out, split_lse = run(batch, scale=0.3, workspace=ws, num_splits=num_splits,
                               sliding_window=13)
    out, lse = run(batch, scale=0.3, sliding_window=13)
    torch.testing.assert_close(split_out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split_lse, lse, atol=1e-5, rtol=1e-5)
    check_against_oracle(batch, torch.float32, workspace=ws, num_splits=num_splits)


def test_workspace_is_optional_and_too_small_runs_unsplit():
    batch = make_paged_batch(SHAPES["many_decodes"], num_heads=4, num_kv_heads=2,
                             head_size=32, block_size=16, dtype=torch.float32, device=DEVICE)
    small = SplitKVWorkspace.allocate(2, 4, 32, 4, DEVICE)  # fewer tokens than the step
    check_against_oracle(batch, torch.float32, workspace=small)
    with pytest.raises(ValueError, match="expected"):
        run(batch, scale=1.0, workspace=small, num_splits=2)


@pytest.mark.parametrize("causal", [False, True])
def test_contiguous_kv_with_kv_start_loc(causal):
    """Encoder / profiling path: K/V are [total_kv, Hkv, D] rows, no block table."""
    g = torch.Generator().manual_seed(3)
    q_lens = [5, 1, 9]
    kv_lens = [8, 3, 0] if not causal else q_lens
    num_heads, num_kv_heads, head_size = 4, 2, 48
    q = torch.randn(sum(q_lens), num_heads, head_size, generator=g)
    k = torch.randn(sum(kv_lens) + 2, num_kv_heads, head_size, generator=g)
    v = torch.randn(sum(kv_lens) + 2, num_kv_heads, head_size, generator=g)
    qsl = [0, 5, 6, 15]
    ksl = [0, kv_lens[0], kv_lens[0] + kv_lens[1], sum(kv_lens)]
    out = torch.empty_like(q, device=DEVICE)
    lse = torch.empty(q.shape[:2], device=DEVICE)
    paged_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), out,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        block_tables=None, max_query_len=9, max_seq_len=9, scale=0.3, causal=causal,
        lse=lse, kv_start_loc=torch.tensor(ksl, dtype=torch.int32, device=DEVICE))
    for b in range(3):
        qs, ks = slice(qsl[b], qsl[b + 1]), slice(ksl[b], ksl[b + 1])
        ref_o, ref_l = dense_attention(q[qs], k[ks], v[ks], scale=0.3, causal=causal)
        torch.testing.assert_close(out[qs].double().cpu(), ref_o.cpu(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[qs].double().cpu(), ref_l.cpu(), atol=1e-5, rtol=1e-5)
    if not causal:
        assert torch.isneginf(lse[qsl[2]:]).all()  # a sequence with no keys: empty part


def test_strided_flashinfer_layout_cache():
    batch = make_paged_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=32,
                             block_size=5, dtype=torch.float32, device=DEVICE)
    fi = torch.stack([batch.k_cache, batch.v_cache], dim=1)  # [nb, 2, bs, Hkv, D]
    ref, _ = run(batch, scale=0.4)
    batch.k_cache, batch.v_cache = fi[:, 0], fi[:, 1]
    out, _ = run(batch, scale=0.4)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_rejects_bad_arguments():
    batch = make_paged_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=32,
                             block_size=16, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="expected"):
        batch.seq_lens = batch.seq_lens.long()
        run(batch, scale=1.0)
    batch.seq_lens = batch.seq_lens.int()
    with pytest.raises(ValueError, match="causal"):
        run(batch, scale=1.0, causal=False, sliding_window=4)
    assert math.isfinite(float(run(batch, scale=1.0)[0].sum()))
