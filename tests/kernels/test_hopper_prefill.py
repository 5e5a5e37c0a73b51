"""The Gluon Hopper prefill kernel (pagedattn.kernels.hopper_prefill) against the dense float64
oracle on shuffled pages; the launches run on an H100/H200 only (skipped elsewhere with the
reason), the policy and the refusals everywhere."""

import pytest
import torch

pytest.importorskip("triton")

from cases import GPU_ONLY_GRID  # noqa: E402
from oracle import rel_l2  # noqa: E402
from paged_kernel import attend, kernel_args, kernel_batch  # noqa: E402

from pagedattn.kernels import hopper_prefill as hp  # noqa: E402
from pagedattn.kernels.attention_plan import search_steps  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REASON = hp.unavailable_reason(DEVICE)
on_hopper = pytest.mark.skipif(REASON is not None, reason=f"the Gluon kernel cannot run here: {REASON}")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (context_len, query_len) per sequence: fresh prompts, chunks over cached prefixes (the
# prefix ends mid-block), several query tiles per sequence, a one-token tail sequence.
LENS = {
    "one_prompt": [(0, 300)],
    "chunks": [(37, 150), (0, 90), (200, 129)],
    "long_chunk": [(1000, 700)],
    "ragged": [(5, 64), (130, 3), (0, 257), (17, 1)],
    "mixed": [(37, 150), (0, 90), (200, 1), (63, 1), (15, 1)],
}


def run_direct(args, *, scale, causal, tile, lse, **mixed):
    out = torch.full_like(args.query, float("nan"))
    lse_t = torch.full(args.query.shape[:2], 7.0, device=args.query.device) if lse else None
    hp.hopper_prefill(args.query, args.k_cache, args.v_cache, out, query_start_loc=args.query_start_loc,
                      seq_lens=args.seq_lens, block_tables=args.block_tables, scale=scale, causal=causal,
                      lse=lse_t, kv_start_loc=None, max_seq_len=args.max_seq_len,
                      search_steps=search_steps(args.seq_lens.shape[0]), tile=tile, **mixed)
    return out, lse_t


@on_hopper
# tiles both kernels run (head size 128: warp-specialised, the last number its consumer warps)
@pytest.mark.parametrize("tile", [hp.WS_TILE, hp.WS_MIXED_TILE, (128, 3, 4), (32, 4, 8)], ids=str)
@pytest.mark.parametrize("shape", list(LENS))
@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 8, 64), (16, 1, 128), (12, 4, 64), (12, 4, 128)], ids=str)
@pytest.mark.parametrize("block_size", [16, 1, 64])
def test_matches_the_oracle(tile, shape, heads, block_size):
    num_heads, num_kv_heads, head_size = heads
    batch = kernel_batch(LENS[shape], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                         block_size=block_size, dtype=torch.bfloat16, device=DEVICE)
    scale = head_size ** -0.5
    out, lse = run_direct(kernel_args(batch), scale=scale, causal=True, tile=tile, lse=True)
    ref_out, ref_lse = batch.reference(scale=scale)
    assert rel_l2(out, ref_out) <= TOL[torch.bfloat16]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=2e-2, rtol=1e-3)


@on_hopper
@pytest.mark.parametrize("tile", [hp.WS_MIXED_TILE, hp.WS_TILE], ids=str)
@pytest.mark.parametrize("decode_len", [1, 4])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 1, 128), (12, 4, 128), (8, 8, 128), (8, 8, 64)], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_mixed_launch_decodes_match_the_oracle(tile, decode_len, heads, causal):
    """A mixed launch's decodes (the last sequences, `num_decodes`): on one consumer at head size
    128 they take the swapped-operand body (S^T = K Q^T, O^T = V^T P^T; 8-32 query columns),
    with two consumers or at head size 64 the prefill body. Decodes of several tokens too (the
    multi-token decode of speculative steps), contexts ending mid-tile and mid-page; decodes
    wider than a tile's rows are prefill tiles like the others."""
    num_heads, num_kv_heads, head_size = heads
    if head_size == 64 and tile != hp.WS_MIXED_TILE:
        pytest.skip("head size 64 has one kernel and one tile")
    lens = [(37, 150), (0, 90), (200, decode_len), (63, decode_len), (15, decode_len), (1, decode_len),
            (1000, decode_len)]
    batch = kernel_batch(lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                         block_size=16, dtype=torch.bfloat16, device=DEVICE)
    scale = head_size ** -0.5
    out, lse = run_direct(kernel_args(batch), scale=scale, causal=causal, tile=tile if head_size == 128 else None,
                          lse=True, num_decodes=5, max_decode_query_len=decode_len)
    ref_out, ref_lse = batch.reference(scale=scale, causal=causal)
    assert rel_l2(out, ref_out) <= TOL[torch.bfloat16]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=2e-2, rtol=1e-3)


@on_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_dtypes_and_non_causal(dtype, causal):
    batch = kernel_batch(LENS["chunks"], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                         dtype=dtype, device=DEVICE)
    scale = 128 ** -0.5
    out, _ = run_direct(kernel_args(batch), scale=scale, causal=causal, tile=None, lse=False)
    ref_out, _ = batch.reference(scale=scale, causal=causal)
    assert rel_l2(out, ref_out) <= TOL[dtype]


@on_hopper
@pytest.mark.parametrize("shape", ["chunks", "mixed"])
def test_paged_attention_takes_it_for_paged_prefills(monkeypatch, shape):
    """paged_attention routes a prefill-like paged step here, a mixed one too (and the result
    is the oracle's)."""
    calls = []
    real = hp.run_hopper
    monkeypatch.setattr(hp, "run_hopper", lambda *a, **k: calls.append(1) or real(*a, **k))
    batch = kernel_batch(LENS[shape], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                         dtype=torch.bfloat16, device=DEVICE)
    scale = 64 ** -0.5
    decodes = sum(q == 1 for _, q in LENS[shape])
    out, _ = attend(kernel_args(batch), scale=scale, num_decodes=decodes)
    assert calls, "expected the Gluon kernel to run"
    assert rel_l2(out, batch.reference(scale=scale)[0]) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("option", ["sliding_window", "alibi_slopes", "soft_cap", "fp32", "decode", "head_size",
                                    "contiguous_d64", "contiguous_heads_apart",
                                    "contiguous_empty", "split", "stride"])
def test_options_outside_its_scope_take_the_portable_kernel(option):
    """`supported` is False for every option the kernel lacks, so those launches keep the
    portable kernel (checked with the device requirement met, whatever this machine is)."""
    q = torch.zeros(300, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(40, 16, 2, 128, dtype=torch.bfloat16)
    kw = dict(paged=True, group=4, max_query_len=300, max_seq_len=300, sliding_window=None, alibi_slopes=None,
              soft_cap=None, num_splits=None)
    if option in ("sliding_window", "soft_cap"):
        kw[option] = 8
    elif option == "alibi_slopes":
        kw[option] = torch.ones(8)
    elif option == "fp32":
        q, k = q.float(), k.float()
    elif option == "decode":
        kw["max_query_len"] = 1
    elif option == "head_size":
        q, k = q[..., :96], k[..., :96]
    elif option == "contiguous_d64":  # contiguous keys at head size 64: the portable kernel is faster
        q, k = q[..., :64].contiguous(), torch.zeros(300, 2, 64, dtype=torch.bfloat16)
        kw["paged"] = False
    elif option == "contiguous_empty":  # no keys at all (cross attention over nothing): no TMA descriptor
        k, kw["paged"] = torch.zeros(0, 2, 128, dtype=torch.bfloat16), False
    elif option == "contiguous_heads_apart":  # TMA reads a token's heads as one row
        k, kw["paged"] = torch.zeros(300, 2, 256, dtype=torch.bfloat16)[..., :128], False
    elif option == "split":
        kw["num_splits"] = 4
    elif option == "stride":
        q = torch.zeros(300, 8, 136, dtype=torch.bfloat16)[..., :128]
    from pagedattn.device_profile import PRESETS, DeviceProfile

    original, original_of = hp.unavailable_reason, DeviceProfile.of
    try:
        hp.unavailable_reason = lambda device: None
        DeviceProfile.of = staticmethod(lambda device=None: PRESETS["h100"])
        baseline = dict(kw, paged=True, group=4, max_query_len=300)
        assert hp.supported(torch.zeros(300, 8, 128, dtype=torch.bfloat16), torch.zeros(40, 16, 2, 128,
                            dtype=torch.bfloat16), torch.zeros(40, 16, 2, 128, dtype=torch.bfloat16),
                            **{**baseline, "sliding_window": None, "alibi_slopes": None, "soft_cap": None,
                               "num_splits": None})
        assert not hp.supported(q, k, k, **kw)
    finally:
        hp.unavailable_reason, DeviceProfile.of = original, staticmethod(original_of)


@on_hopper
@pytest.mark.parametrize("causal,long", [(True, False), (False, False), (False, True)], ids=str)
@pytest.mark.parametrize("heads", [(32, 8), (12, 4), (8, 8)], ids=str)
def test_contiguous_keys_match_the_oracle(causal, long, heads):
    """Keys as rows of the step's own K/V (TMA tiles), laid out as a fused projection's views
    (a token's K and V heads inside a wider row): fresh prompts (causal) and cross attention
    (non-causal, other key counts, rows past a sequence belonging to the next); `long`: past
    8k keys, as a long prompt's are."""
    from oracle import dense_attention_with_lse

    num_heads, num_kv_heads = heads
    d = 128
    g = torch.Generator().manual_seed(5)
    q_lens = [300, 77, 513, 1] if not long else [70, 200]
    kv_lens = q_lens if causal else [40, 700, 129, 3] if not long else [8192 + 900, 300]
    rows = torch.randn(sum(kv_lens) + 5, 3 * num_kv_heads * d, generator=g).to(torch.bfloat16).to(DEVICE)
    k, v = (rows[:, i * num_kv_heads * d:(i + 1) * num_kv_heads * d].view(-1, num_kv_heads, d) for i in (0, 1))
    q = torch.randn(sum(q_lens), num_heads, d, generator=g).to(torch.bfloat16).to(DEVICE)
    qsl = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens) + 1)], dtype=torch.int32, device=DEVICE)
    ksl = torch.tensor([sum(kv_lens[:i]) for i in range(len(kv_lens) + 1)], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    assert hp.supported(q, k, v, paged=False, group=num_heads // num_kv_heads, max_query_len=max(q_lens),
                        max_seq_len=max(kv_lens), sliding_window=None, alibi_slopes=None, soft_cap=None,
                        num_splits=None)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], 7.0, device=DEVICE)
    hp.hopper_prefill(q, k, v, out, query_start_loc=qsl, seq_lens=seq_lens, block_tables=None, scale=d ** -0.5,
                      causal=causal, lse=lse, kv_start_loc=ksl, max_seq_len=max(kv_lens),
                      search_steps=search_steps(len(q_lens)))
    for b in range(len(q_lens)):
        qs, ks = slice(qsl[b], qsl[b + 1]), slice(ksl[b], ksl[b + 1])
        ref_o, ref_l = dense_attention_with_lse(q[qs].cpu(), k[ks].cpu(), v[ks].cpu(), scale=d ** -0.5, causal=causal)
        assert rel_l2(out[qs], ref_o) <= TOL[torch.bfloat16]
        torch.testing.assert_close(lse[qs].double().cpu(), ref_l, atol=2e-2, rtol=1e-3)


def test_tile_policy():
    assert hp.choose_tile(128, 0) == hp.WS_TILE
    assert hp.choose_tile(128, 5) == hp.WS_MIXED_TILE  # decodes fill fewer rows of one consumer's tile
    assert hp.choose_tile(64, 0) == hp.choose_tile(64, 5) == hp.ONE_WARPGROUP_TILE
    for tile in (hp.WS_TILE, hp.WS_MIXED_TILE):
        hp.check_tile(tile, 128)
    hp.check_tile(hp.ONE_WARPGROUP_TILE, 64)


@pytest.mark.parametrize("tile,head_size,match", [((64, 2, 4), 64, "stages"), ((64, 1, 8), 128, "stages"),
                                                  ((48, 3, 4), 128, "BLOCK_N"), ((64, 3, 2), 64, "warps"),
                                                  ((128, 4, 8), 128, "shared memory")])
def test_check_tile_refuses_what_the_kernels_cannot_run(tile, head_size, match):
    with pytest.raises(ValueError, match=match):
        hp.check_tile(tile, head_size)


def test_a_bad_forced_tile_is_refused():
    if REASON is not None:
        pytest.skip(REASON)
    batch = kernel_batch(LENS["one_prompt"], num_heads=4, num_kv_heads=1, head_size=64, block_size=16,
                         dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="stages"):
        run_direct(kernel_args(batch), scale=0.1, causal=True, tile=(64, 2, 4), lse=False)


ON_GPU = DEVICE.type == "cuda"


@pytest.mark.parametrize("pages", ["bf16", "fp8"] if ON_GPU else ["bf16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [16, 1])
# on the CPU (store_kv first, then the portable kernel) one GQA shape; (32, 8) sizes the Gluon producer's share
@pytest.mark.parametrize("heads", [pytest.param((32, 8), id="(32, 8)", marks=GPU_ONLY_GRID),
                                   pytest.param((12, 4), id="(12, 4)")])
def test_a_contiguous_launch_stores_its_rows(pages, causal, block_size, heads):
    """`paged_attention(..., write=...)` over contiguous rows writes every row into the pages at
    its slot (none at -1, nothing else touched), exactly as `store_kv`, and attends as without
    it: from the warp-specialised kernel's producer on an H100/H200 (16-bit pages), by
    `store_kv` first elsewhere. Non-causal launches have other key counts (more and fewer than
    queries, a sequence without queries), so every program's share of rows is exercised."""
    from pagedattn.kernels import KVWrite, paged_attention, store_kv

    num_heads, num_kv_heads = heads
    d = 128
    g = torch.Generator().manual_seed(11)
    q_lens = [300, 77, 513, 1] if ON_GPU else [40, 9, 1]
    kv_lens = q_lens if causal else ([40, 700, 129, 3, 50] if ON_GPU else [5, 70, 3, 20])
    if not causal:
        q_lens = q_lens + [0]
    rows = sum(kv_lens)
    q = torch.randn(sum(q_lens), num_heads, d, generator=g).to(torch.bfloat16).to(DEVICE)
    k, v = (torch.randn(rows, num_kv_heads, d, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    qsl = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens) + 1)], dtype=torch.int32, device=DEVICE)
    ksl = torch.tensor([sum(kv_lens[:i]) for i in range(len(kv_lens) + 1)], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    num_blocks = rows // block_size + 8
    slots = torch.randperm(num_blocks * block_size, generator=g)[:rows]
    slots[::7] = -1  # padding rows: written nowhere
    slots = slots.to(DEVICE)
    dtype = torch.float8_e4m3fn if pages == "fp8" else torch.bfloat16
    sentinel = torch.randn(2, num_blocks, block_size, num_kv_heads, d, generator=g).to(dtype).to(DEVICE)
    scale_k, scale_v = (torch.tensor(s, device=DEVICE) for s in (0.5, 2.0))
    expected = sentinel.clone()
    store_kv(k, v, expected[0], expected[1], slots, scale_k, scale_v)
    cache = sentinel.clone()

    def launch(write):
        out = torch.full_like(q, float("nan"))
        paged_attention(q, k, v, out, query_start_loc=qsl, seq_lens=seq_lens, block_tables=None,
                        max_query_len=max(q_lens), max_seq_len=max(kv_lens), scale=d ** -0.5, causal=causal,
                        kv_start_loc=ksl, k_scale=scale_k, v_scale=scale_v, write=write)
        return out

    out = launch(KVWrite(k, v, cache[0], cache[1], slots))
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    torch.testing.assert_close(out, launch(None), atol=0, rtol=0)


def test_a_write_over_rows_writes_the_launchs_rows_a_slot_each():
    """Over contiguous rows `write` writes the launch's own rows: other rows, or a slot mapping
    that is not one slot a row, are refused."""
    from pagedattn.kernels import KVWrite, paged_attention

    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16, device=DEVICE)
    pages = torch.zeros(2, 1, 16, 1, 128, dtype=torch.bfloat16, device=DEVICE)  # K and V: one block of 16
    one = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(4, 1, 128, dtype=torch.bfloat16, device=DEVICE)

    def launch(write):
        paged_attention(q, rows, rows, torch.empty_like(q), query_start_loc=one,
                        seq_lens=torch.tensor([4], dtype=torch.int32, device=DEVICE), block_tables=None,
                        max_query_len=4, max_seq_len=4, scale=1.0, kv_start_loc=one, write=write)

    with pytest.raises(ValueError, match="write.key/value"):
        launch(KVWrite(rows.clone(), rows, pages[0], pages[1], torch.zeros(4, dtype=torch.int64, device=DEVICE)))
    with pytest.raises(ValueError, match="slot_mapping.shape"):
        launch(KVWrite(rows, rows, pages[0], pages[1], torch.zeros(3, dtype=torch.int64, device=DEVICE)))
