"""paged_attention against the dense float64 oracle on small named batch shapes."""

import pytest
import torch

pytest.importorskip("triton")

from cases import GPU_ONLY_GRID  # noqa: E402
from oracle import dense_attention_with_lse, rel_l2  # noqa: E402
from paged_kernel import attend, check_contiguous_kv, kernel_args, kernel_batch, oracle_options  # noqa: E402

from pagedattn.kernels import SplitKVWorkspace, paged_attention  # noqa: E402
from pagedattn.kernels.split_kv import reduce_splits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (context_len, query_len) per sequence; prefills first, then decodes.
SHAPES = {
    "single_decode": [(36, 1)],
    "many_decodes": [(0, 1), (15, 1), (16, 1), (69, 1), (4, 1)],
    "prefill_no_context": [(0, 23)],
    "chunked_prefill": [(32, 9)],
    "multi_token_decode": [(27, 3), (17, 2)],
    "mixed": [(0, 12), (35, 5), (32, 1), (8, 1)],
}


def make(lens, *, num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
         dtype=torch.float32, **options):
    return kernel_batch(lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_size=head_size, block_size=block_size, dtype=dtype, device=DEVICE,
                        **options)


def scales_of(batch):
    if not batch.fp8:
        return {}
    return dict(k_scale=torch.tensor(batch.k_scale, device=DEVICE),
                v_scale=torch.tensor(batch.v_scale, device=DEVICE))


def check_against_oracle(batch, *, lse_atol=1e-3, **kernel_options):
    scale = batch.head_size ** -0.5
    out, lse = attend(kernel_args(batch), scale=scale, **scales_of(batch), **kernel_options)
    ref_out, ref_lse = batch.reference(scale=scale, **oracle_options(kernel_options))
    assert rel_l2(out, ref_out) <= TOL[batch.dtype]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=lse_atol, rtol=1e-4)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_batch_shapes(shape, block_size):
    check_against_oracle(make(SHAPES[shape], block_size=block_size))


@pytest.mark.parametrize("head_size", [32, 64, 80, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_head_sizes_and_dtypes(head_size, dtype):
    check_against_oracle(make(SHAPES["mixed"], num_heads=2, num_kv_heads=1,
                              head_size=head_size, dtype=dtype))


@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (3, 3), (6, 2)], ids=str)
def test_gqa_mqa(heads):
    num_heads, num_kv_heads = heads
    check_against_oracle(make(SHAPES["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads,
                              block_size=5))


def test_long_prefill_many_query_tiles():
    # more query tokens than one tile holds, plus decodes sharing the launch
    check_against_oracle(make([(20, 150), (19, 1)], num_kv_heads=1, dtype=torch.float16))


@pytest.mark.parametrize("block_size", [5, 16])
def test_sliding_window_skips_blocks(block_size):
    window = 11
    batch = make([(54, 6), (0, 20), (44, 1)], block_size=block_size)
    args = kernel_args(batch)
    plain, _ = attend(args, scale=0.2)
    ref_out, ref_lse = batch.reference(scale=0.2, sliding_window=window)
    # Poison every block that lies wholly before the window of the sequence's first query:
    # reading it (even masked) would turn the output into NaN.
    for table, (context_len, _) in zip(batch.block_tables, batch.lens):
        first_key = max(0, context_len - window + 1)
        for blk in table[:first_key // block_size]:
            args.k_cache[blk] = float("nan")
            args.v_cache[blk] = float("nan")
    out, lse = attend(args, scale=0.2, sliding_window=window)
    assert rel_l2(out, ref_out) <= TOL[torch.float32]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-4, rtol=1e-4)
    assert rel_l2(out, plain) > 1e-2  # the option changes the result


def test_alibi_and_soft_cap_move_the_output():
    batch = make(SHAPES["mixed"])
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    plain, _ = attend(kernel_args(batch), scale=batch.head_size ** -0.5)
    alibi = check_against_oracle(batch, alibi_slopes=slopes)
    capped = check_against_oracle(batch, soft_cap=1.5)
    both = check_against_oracle(batch, soft_cap=1.5, alibi_slopes=slopes, sliding_window=7)
    for x in (alibi, capped, both):
        assert rel_l2(x, plain) > 1e-2


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_cache(kv_cache_dtype, dtype):
    batch = make(SHAPES["mixed"], head_size=64, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                 k_scale=0.3, v_scale=1.7)
    out = check_against_oracle(batch)
    unit, _ = attend(kernel_args(batch), scale=0.125, k_scale=torch.tensor(1.0, device=DEVICE),
                     v_scale=torch.tensor(1.0, device=DEVICE))
    assert rel_l2(out, unit) > 1e-2


# a -inf sink changes nothing; the others outweigh, match and trail the scores
SINKS = [0.5, -1.0, 3.0, float("-inf")]


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("shape", ["single_decode", "chunked_prefill", "mixed"])
def test_sinks(shape, num_splits):
    """A sink joins the softmax's denominator once: in the epilogue of an unsplit launch, in the
    reduction of a split one (the output and the LSE)."""
    batch = make(SHAPES[shape], block_size=5)
    ws = SplitKVWorkspace.allocate(batch.num_tokens, 4, 32, 4, DEVICE) if num_splits else None
    out = check_against_oracle(batch, sinks=torch.tensor(SINKS, device=DEVICE), workspace=ws, num_splits=num_splits)
    assert rel_l2(out, attend(kernel_args(batch), scale=32 ** -0.5)[0]) > 1e-2


def test_sinks_fp8_cache_bf16():
    """bf16 sinks (a model's parameter) over an FP8 cache."""
    batch = make(SHAPES["mixed"], head_size=64, dtype=torch.bfloat16, kv_cache_dtype="fp8_e5m2", k_scale=0.3,
                 v_scale=1.7)
    sinks = torch.tensor(SINKS, device=DEVICE).to(torch.bfloat16)
    check_against_oracle(batch, lse_atol=2e-2, sinks=sinks)


@pytest.mark.parametrize("window", [(5, 7), (-1, 3), (20, -1)], ids=str)
@pytest.mark.parametrize("tile", [None, (16, 1, 1, 16)], ids=["policy", "small_tiles"])
def test_two_sided_window(window, tile):
    """Bidirectional local attention, FlashAttention's window_size (left, right): keys in
    [p - left, p + right], over contiguous rows (an encoder's: queries are the keys) and over
    pages (bottom-right aligned); small tiles give programs several key and query tiles."""
    lens = [40, 17, 23]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lens), h, 32, generator=g).to(DEVICE) for h in (4, 2, 2))
    loc = torch.tensor([0, 40, 57, 80], dtype=torch.int32, device=DEVICE)
    out, lse = torch.empty_like(q), torch.empty(sum(lens), 4, device=DEVICE)
    paged_attention(q, k, v, out, query_start_loc=loc, seq_lens=loc[1:] - loc[:-1], block_tables=None,
                    kv_start_loc=loc, max_query_len=40, max_seq_len=40, scale=0.3, causal=False,
                    sliding_window=window, lse=lse, tile=tile)
    for a, b in zip(loc[:-1].tolist(), loc[1:].tolist()):
        ref, ref_lse = dense_attention_with_lse(q[a:b].cpu(), k[a:b].cpu(), v[a:b].cpu(), scale=0.3, causal=False,
                                                window=window)
        assert rel_l2(out[a:b], ref) <= TOL[torch.float32]
        torch.testing.assert_close(lse[a:b].double().cpu(), ref_lse, atol=1e-4, rtol=1e-4)
    batch = make([(30, 6), (9, 4)], block_size=5)
    out, lse = attend(kernel_args(batch), scale=0.3, causal=False, sliding_window=window)
    ref, ref_lse = batch.reference(scale=0.3, causal=False, window=window)
    assert rel_l2(out, ref) <= TOL[torch.float32]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", ["single_decode", "many_decodes", "mixed", "chunked_prefill"])
@pytest.mark.parametrize("num_splits", [pytest.param(2, marks=GPU_ONLY_GRID), 3])  # 3: uneven shares
def test_split_kv_matches_unsplit(shape, num_splits):
    batch = make(SHAPES[shape], block_size=5)
    args = kernel_args(batch)
    ws = SplitKVWorkspace.allocate(batch.num_tokens, 4, 32, 4, DEVICE)
    ws.partial_out.fill_(float("nan"))  # stale scratch must never leak into the result
    ws.partial_stats.fill_(float("nan"))
    split_out, split_lse = attend(args, scale=0.3, workspace=ws, num_splits=num_splits,
                                  sliding_window=13)
    out, lse = attend(args, scale=0.3, sliding_window=13)
    torch.testing.assert_close(split_out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split_lse, lse, atol=1e-5, rtol=1e-5)
    check_against_oracle(batch, workspace=ws, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_non_causal_queries_over_pages_in_splits(num_splits):
    """A cascade's shared part: many query rows of one sequence over its paged keys, not causal
    (every query sees every key), the keys in splits (the plan splits such a launch of few
    programs); the LSE is the whole softmax's."""
    batch = make([(70, 24)], block_size=16)
    ws = SplitKVWorkspace.allocate(batch.num_tokens, 4, 32, 4, DEVICE)
    ws.partial_out.fill_(float("nan"))
    ws.partial_stats.fill_(float("nan"))
    out, lse = attend(kernel_args(batch), scale=0.3, causal=False, workspace=ws, num_splits=num_splits)
    ref, ref_lse = batch.reference(scale=0.3, causal=False)
    assert rel_l2(out, ref) <= TOL[torch.float32]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [5, 11, 37])
def test_many_splits_and_empty_splits(num_splits):
    """Up to more splits than key tiles (empty splits: -inf LSE, zero output, never NaN) and
    more than the reduction merges per step (16)."""
    batch = make([(0, 1), (700, 1), (40, 1)], block_size=16)
    ws = SplitKVWorkspace.allocate(batch.num_tokens, 4, 32, 64, DEVICE)
    ws.partial_out.fill_(float("nan"))
    ws.partial_stats.fill_(float("nan"))
    out = check_against_oracle(batch, workspace=ws, num_splits=num_splits)
    assert not out.isnan().any()


def test_a_launch_planned_for_long_sequences_leaves_short_ones_unsplit():
    """A CUDA graph plans its split count for any length (max_seq_len = the table's room); the
    kernel then splits only the sequences with enough key tiles (`split_min_tiles`): the long
    one here, not the short one. Both must match the unsplit launch. (A profile of 4 SMs: the 4
    programs are short of the policy's 2 an SM, so it splits.)"""
    from pagedattn.device_profile import DeviceProfile

    batch = make([(700, 1), (40, 1)], block_size=16)
    args = kernel_args(batch)
    args.max_seq_len = 4096
    ws = SplitKVWorkspace.allocate(batch.num_tokens, 4, 32, 64, DEVICE)
    ws.partial_out.fill_(float("nan"))
    ws.partial_stats.fill_(float("nan"))
    profile = DeviceProfile.of(DEVICE).with_(num_sms=4)
    split_out, split_lse = attend(args, scale=0.3, workspace=ws, profile=profile)
    assert not ws.partial_stats.isnan().all()  # the launch was split
    out, lse = attend(args, scale=0.3)
    torch.testing.assert_close(split_out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split_lse, lse, atol=1e-5, rtol=1e-5)


def test_splits_sharing_their_maximum_merge_exactly_at_huge_scores():
    """The reduction weighs split s by 2^(m_s - M) l_s: splits whose largest score is the same
    -1.4e5 merge by their counts alone, where one float32 LSE per split (ulp ~0.016 there)
    would weigh them off by up to half a percent (seen on the H100 before the state was kept)."""
    ws = SplitKVWorkspace.allocate(1, 1, 4, 3, DEVICE)
    parts, stats = ws.views(3, 1)
    parts[:, 0, 0] = torch.tensor([[1.0, 0, 0, 2], [0, 1.0, 0, -2], [5, 5, 5, 5]], device=DEVICE)
    stats[:, 0, 0, 0] = torch.tensor([-144269.5, -144269.5, float("-inf")], device=DEVICE)
    stats[:, 0, 0, 1] = torch.tensor([10.0, 7.0, 0.0], device=DEVICE)  # the third split is empty
    out = torch.empty(1, 1, 4, device=DEVICE)
    lse = torch.empty(1, 1, device=DEVICE)
    reduce_splits(ws, 3, out, lse)
    want = torch.tensor([10.0, 7.0, 0.0, 6.0]) / 17
    torch.testing.assert_close(out[0, 0].cpu(), want, atol=1e-7, rtol=1e-7)
    expected_lse = (-144269.5 + torch.tensor(17.0, dtype=torch.float64).log2()) * torch.tensor(2.0).log().double()
    assert abs(float(lse) - float(expected_lse)) < 0.02  # float32 at 1e5: ulp 0.0078


def test_workspace_rows_trade_tokens_for_splits():
    ws = SplitKVWorkspace.allocate(4, 4, 32, 16, DEVICE)  # 64 rows
    assert ws.rows == 64 and ws.splits_for(4, 4, 32) == 16
    assert ws.splits_for(1, 4, 32) == 16  # capped by max_splits
    assert ws.splits_for(10, 4, 32) == 6 and ws.splits_for(40, 4, 32) == 1
    assert ws.splits_for(4, 8, 32) == 1  # another head layout: unsplit
    out, stats = ws.views(6, 10)
    assert out.shape == (6, 10, 4, 32) and stats.shape == (6, 10, 4, 2)
    with pytest.raises(ValueError, match="rows"):
        ws.views(7, 10)


def test_workspace_is_optional_and_too_small_runs_unsplit():
    batch = make(SHAPES["many_decodes"])
    small = SplitKVWorkspace.allocate(2, 4, 32, 4, DEVICE)  # fewer tokens than the step
    check_against_oracle(batch, workspace=small)
    with pytest.raises(ValueError, match="expected"):
        attend(kernel_args(batch), scale=1.0, workspace=small, num_splits=2)


@pytest.mark.parametrize("causal", [False, True])
def test_contiguous_kv_with_kv_start_loc(causal):
    """Encoder / profiling path: K/V are [total_kv, Hkv, D] rows, no block table."""
    q_lens = [5, 1, 9]
    kv_lens = [8, 3, 0] if not causal else q_lens
    lse, qsl = check_contiguous_kv(q_lens, kv_lens, num_heads=4, num_kv_heads=2, causal=causal, dtype=torch.float32,
                                   device=DEVICE, tol=1e-5, seed=3)
    if not causal:
        assert torch.isneginf(lse[qsl[2]:]).all()  # a sequence with no keys: empty part


# 128: the Gluon kernel's on an H100/H200; elsewhere the portable kernel's path, as 64
@pytest.mark.parametrize("head_size", [64, pytest.param(128, marks=GPU_ONLY_GRID)])
def test_contiguous_prompts_read_only_their_rows(head_size):
    """Fresh prompts over contiguous 16-bit K/V (the `triton` backend's prefill path) in a
    prefill tile of 128 rows. Rows between the sequences hold inf: a tile that read another
    sequence's rows would turn this one's output into NaN."""
    g = torch.Generator().manual_seed(5)
    q_lens = [300, 77, 129, 1]
    num_heads, num_kv_heads, dtype = 8, 2, torch.bfloat16
    gap = 3
    starts = [sum(q_lens[:i]) + gap * i for i in range(len(q_lens) + 1)]
    q = torch.randn(sum(q_lens), num_heads, head_size, generator=g).to(dtype)
    k = torch.full((starts[-1], num_kv_heads, head_size), float("inf")).to(dtype)
    v = k.clone()
    for b, n in enumerate(q_lens):
        k[starts[b]:starts[b] + n] = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
        v[starts[b]:starts[b] + n] = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
    qsl = [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
    out = torch.empty_like(q, device=DEVICE)
    paged_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), out,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=DEVICE),
        block_tables=None, max_query_len=max(q_lens), max_seq_len=max(q_lens), scale=0.1,
        kv_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        tile=(64, 8 if DEVICE == "cuda" else 1, 3, 128))
    for b, n in enumerate(q_lens):
        qs, ks = slice(qsl[b], qsl[b + 1]), slice(starts[b], starts[b] + n)
        ref, _ = dense_attention_with_lse(q[qs].double(), k[ks].double(), v[ks].double(), scale=0.1,
                                          causal=True)
        assert rel_l2(out[qs].double().cpu(), ref) <= TOL[dtype]


def test_strided_flashinfer_layout_cache():
    batch = make(SHAPES["mixed"], block_size=5)
    args = kernel_args(batch)
    ref, _ = attend(args, scale=0.4)
    fi = torch.stack([args.k_cache, args.v_cache], dim=1)  # [nb, 2, bs, Hkv, D]
    args.k_cache, args.v_cache = fi[:, 0], fi[:, 1]
    out, _ = attend(args, scale=0.4)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_rejects_bad_arguments():
    args = kernel_args(make(SHAPES["mixed"]))
    seq_lens = args.seq_lens
    args.seq_lens = seq_lens.long()
    with pytest.raises(ValueError, match="expected"):
        attend(args, scale=1.0)
    args.seq_lens = seq_lens
    with pytest.raises(ValueError, match="causal"):
        attend(args, scale=1.0, causal=False, sliding_window=4)
    assert bool(torch.isfinite(attend(args, scale=1.0)[0]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_rows_whose_every_logit_is_below_minus_5e4(dtype, num_splits):
    """FlashInfer once took a row's max below -5e4 for a masked row and returned zeros: every
    logit here is -1e5 (keys all 1, queries all -1), so each row is the mean of its values."""
    batch = make(SHAPES["mixed"], dtype=dtype)
    batch.layout.kv(batch.kv_cache, 0).fill_(1.0)
    for h in batch.hist_k:
        h.fill_(1.0)
    batch.key.fill_(1.0)
    batch.query.fill_(-1.0)
    scale = 1e5 / batch.head_size
    ws = SplitKVWorkspace.allocate(batch.num_tokens, 4, 32, 4, DEVICE) if num_splits else None
    out, lse = attend(kernel_args(batch), scale=scale, workspace=ws, num_splits=num_splits)
    ref_out, ref_lse = batch.reference(scale=scale)
    assert rel_l2(out, ref_out) <= TOL[dtype]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-3, rtol=1e-6)
    assert (lse < -9e4).all()


@pytest.mark.parametrize("num_splits", [None, 3])
def test_a_row_with_no_keys_is_zero_with_minus_inf_lse(num_splits):
    """A sequence given 0 keys (a padded slot) attends to nothing: zeros and -inf, no NaN, and
    the other rows keep their answers."""
    batch = make(SHAPES["many_decodes"])
    args = kernel_args(batch)
    ws = SplitKVWorkspace.allocate(batch.num_tokens, 4, 32, 4, DEVICE) if num_splits else None
    full, full_lse = attend(args, scale=0.3, workspace=ws, num_splits=num_splits)
    args.seq_lens[2] = 0
    out, lse = attend(args, scale=0.3, workspace=ws, num_splits=num_splits)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and (lse[2] == float("-inf")).all()
    keep = [i for i in range(batch.num_tokens) if i != 2]
    torch.testing.assert_close(out[keep], full[keep], atol=0, rtol=0)
    torch.testing.assert_close(lse[keep], full_lse[keep], atol=0, rtol=0)


@pytest.mark.parametrize("tile", [(16, 4, 2), (32, 4, 3), (128, 8, 2), (32, 4, 2, 64), (64, 8, 3, 16)])
@pytest.mark.parametrize("shape", ["many_decodes", "mixed"])
def test_forced_tiles_agree(tile, shape):
    """`tile=(keys per step, warps, stages[, rows])` (tuning runs, `bench kernels --tiles`)
    changes speed only."""
    check_against_oracle(make(SHAPES[shape], block_size=5), tile=tile)


@pytest.mark.parametrize("tile", [(48, 4, 2), (8, 4, 2), (64, 3, 2), (64, 4, 0), (64, 4, 2, 24), (64, 4, 2, 512)])
def test_forced_tile_refused_with_the_reason(tile):
    with pytest.raises(ValueError, match="expected tile"):
        attend(kernel_args(make(SHAPES["single_decode"])), scale=1.0, tile=tile)
