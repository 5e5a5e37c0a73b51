"""GPU-only kernel tests: realistic shapes in bf16/fp16, pools over 2^31 elements, CUDA graphs.

Skipped without CUDA. Tolerances against the float64 oracle (relative L2 error): 1e-2 for
bf16, 2e-3 for fp16.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernel_oracle import make_paged_batch, reference_paged, rel_l2  # noqa: E402

from pagedattn.kernels import (SplitKVWorkspace, copy_blocks, paged_attention,  # noqa: E402
                               store_kv)
from pagedattn.kernels._common import num_sms  # noqa: E402
from pagedattn.kernels.paged_attention_config import (choose_num_splits,  # noqa: E402
                                                      choose_tile)

DEVICE = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
MIXED = [(300, 700), (64, 64), (17, 17), (4, 900), (1, 1500), (1, 33), (1, 1)]


def attend(batch, *, workspace=None, num_splits=None, **kw):
    out = torch.empty_like(batch.query)
    lse = torch.empty(batch.query.shape[:2], device=DEVICE)
    paged_attention(batch.query, batch.k_cache, batch.v_cache, out,
                    query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                    block_tables=batch.block_tables, max_query_len=max(batch.query_lens),
                    max_seq_len=max(batch.seq_len_list), lse=lse, workspace=workspace,
                    num_splits=num_splits, **kw)
    return out, lse


def check(batch, dtype, *, k_scale=1.0, v_scale=1.0, **kw):
    scale = batch.query.shape[-1] ** -0.5
    extra = {}
    if batch.k_cache.element_size() == 1:
        extra = dict(k_scale=torch.tensor(k_scale, device=DEVICE),
                     v_scale=torch.tensor(v_scale, device=DEVICE))
    out, lse = attend(batch, scale=scale, **extra, **kw)
    torch.cuda.synchronize()
    oracle_kw = {k: v for k, v in kw.items() if k not in ("workspace", "num_splits")}
    ref, ref_lse = reference_paged(batch, scale=scale, k_scale=k_scale, v_scale=v_scale,
                                   **oracle_kw)
    err = rel_l2(out, ref)
    assert err <= TOL[dtype], err
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=2e-3, rtol=1e-3)
    return out


@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_head_sizes(head_size, dtype):
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_size=head_size,
                             block_size=16, dtype=dtype, device=DEVICE)
    check(batch, dtype)


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_block_sizes(block_size):
    batch = make_paged_batch(MIXED, num_heads=32, num_kv_heads=8, head_size=128,
                             block_size=block_size, dtype=torch.bfloat16, device=DEVICE)
    check(batch, torch.bfloat16)


def test_options_long_sequences():
    batch = make_paged_batch(MIXED, num_heads=16, num_kv_heads=4, head_size=128,
                             block_size=16, dtype=torch.bfloat16, device=DEVICE)
    slopes = torch.linspace(0.01, 0.3, 16, device=DEVICE)
    check(batch, torch.bfloat16, sliding_window=256)
    check(batch, torch.bfloat16, alibi_slopes=slopes)
    check(batch, torch.bfloat16, soft_cap=30.0)
    check(batch, torch.bfloat16, sliding_window=100, alibi_slopes=slopes, soft_cap=10.0)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache(cache_dtype, dtype):
    batch = make_paged_batch(MIXED, num_heads=32, num_kv_heads=8, head_size=128,
                             block_size=16, dtype=dtype, cache_dtype=cache_dtype,
                             device=DEVICE)
    check(batch, dtype, k_scale=0.05, v_scale=2.5)


@pytest.mark.parametrize("num_seqs", [1, 4, 64])
def test_decode_split_kv_auto(num_seqs):
    seqs = [(1, 4000 - 37 * i) for i in range(num_seqs)]
    batch = make_paged_batch(seqs, num_heads=32, num_kv_heads=8, head_size=128,
                             block_size=16, dtype=torch.bfloat16, device=DEVICE)
    ws = SplitKVWorkspace.allocate(num_seqs, 32, 128, 16, DEVICE)
    tile = choose_tile(head_size=128, group=4, max_query_len=1, elem_bytes=2, interpret=False)
    splits = choose_num_splits(num_seqs=num_seqs, num_kv_heads=8, max_query_len=1,
                               max_seq_len=4000, block_q=tile.block_q,
                               num_sms=num_sms(torch.device(DEVICE)), max_splits=16)
    if num_seqs == 1:
        assert splits > 1
    out = check(batch, torch.bfloat16, workspace=ws)
    unsplit, _ = attend(batch, scale=128 ** -0.5)
    assert rel_l2(out, unsplit) < 5e-3


def test_pool_over_2_pow_31_elements():
    """Blocks past element 2^31 of a pool: store, attend, and copy must address them."""
    num_kv_heads, head_size, block_size = 8, 128, 16
    per_block = block_size * num_kv_heads * head_size
    first_high = (1 << 31) // per_block + 1           # first block wholly past 2^31 elements
    num_blocks = first_high + 64
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size,
                               dtype=cache_dtype, device=DEVICE)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        seqs = [(40, 300), (1, 333)]
        small = make_paged_batch(seqs, num_heads=32, num_kv_heads=num_kv_heads,
                                 head_size=head_size, block_size=block_size,
                                 dtype=torch.bfloat16, device=DEVICE)
        # move every block id to the high end of the pool and write the tokens with store_kv
        tables = small.block_tables.long() + first_high
        for b, (_, seq_len) in enumerate(seqs):
            pos = torch.arange(seq_len, device=DEVICE)
            slots = tables[b, pos // block_size] * block_size + pos % block_size
            src = small.block_tables[b].long()[pos // block_size]
            key = small.k_cache[src, pos % block_size]        # [seq_len, Hkv, D]
            value = small.v_cache[src, pos % block_size]
            store_kv(key, value, k_cache, v_cache, slots, torch.tensor(1.0, device=DEVICE),
                     torch.tensor(1.0, device=DEVICE))
        batch = dataclasses.replace(small, k_cache=k_cache, v_cache=v_cache,
                                    block_tables=tables.int())
        assert int(tables.max()) * per_block >= 1 << 31
        ref_small = reference_paged(small, scale=head_size ** -0.5)[0]
        if cache_dtype == torch.bfloat16:  # the high blocks hold exactly the small pool's data
            out = check(batch, torch.bfloat16)
            assert rel_l2(out, ref_small) <= 1e-2
        else:
            check(batch, torch.bfloat16, k_scale=1.0, v_scale=1.0)
        # copy the first high block to the last block of the pool and compare
        src_blk, dst_blk = int(tables[0, 0]), num_blocks - 1
        copy_blocks([kv_cache], torch.tensor([[src_blk, dst_blk]], device=DEVICE))
        assert torch.equal(kv_cache[:, dst_blk].float(), kv_cache[:, src_blk].float())
        del kv_cache, k_cache, v_cache, batch
        torch.cuda.empty_cache()


def test_cuda_graph_replay_matches_eager():
    """Decode with split-KV and FP8 scales captured once, replayed with new lengths/scales."""
    num_seqs, width = 8, 160
    seqs = [(1, 2000 + 13 * i) for i in range(num_seqs)]
    batch = make_paged_batch(seqs, num_heads=32, num_kv_heads=8, head_size=128,
                             block_size=16, dtype=torch.bfloat16,
                             cache_dtype=torch.float8_e4m3fn, device=DEVICE, extra_blocks=400)
    tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=DEVICE)
    tables[:, :batch.block_tables.shape[1]] = batch.block_tables
    batch.block_tables = tables
    ws = SplitKVWorkspace.allocate(num_seqs, 32, 128, 8, DEVICE)
    k_scale = torch.tensor(0.5, device=DEVICE)
    v_scale = torch.tensor(1.5, device=DEVICE)
    out = torch.empty_like(batch.query)

    def step():
        paged_attention(batch.query, batch.k_cache, batch.v_cache, out,
                        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                        block_tables=batch.block_tables, max_query_len=1,
                        max_seq_len=width * 16, scale=0.1, k_scale=k_scale, v_scale=v_scale,
                        workspace=ws)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # new step: longer sequences, different query, different scales
    g = torch.Generator().manual_seed(9)
    batch.seq_lens.copy_(torch.tensor([2300 + 7 * i for i in range(num_seqs)],
                                      dtype=torch.int32))
    blocks = torch.randperm(batch.k_cache.shape[0], generator=g)[:num_seqs * width]
    batch.block_tables.copy_(blocks.view(num_seqs, width).int())
    batch.query.copy_(torch.randn(batch.query.shape, generator=g).to(torch.bfloat16))
    k_scale.fill_(0.25)
    v_scale.fill_(3.0)
    graph.replay()
    replayed = out.clone()
    step()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, out, atol=0, rtol=0)
    batch.seq_len_list = batch.seq_lens.tolist()
    ref, _ = reference_paged(batch, scale=0.1, k_scale=0.25, v_scale=3.0)
    assert rel_l2(replayed, ref) <= 1e-2


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_stores_are_bit_identical_everywhere(cache_dtype):
    """The Triton store, the PyTorch store (float or tensor scale) and a CPU division all keep
    the same FP8 bits: x / scale is IEEE float32 division on every path (an approximate divide,
    or CUDA's reciprocal multiply for python numbers, flips some FP8 roundings)."""
    from pagedattn import kv_cache

    g = torch.Generator().manual_seed(0)
    t, h, d, scale = 1 << 14, 4, 64, 0.0371
    key = (torch.randn(t, h, d, generator=g) * 3).to(torch.bfloat16)
    fmax = torch.finfo(cache_dtype).max
    expect = (key.float() / torch.tensor(scale)).clamp(-fmax, fmax).to(cache_dtype).view(torch.uint8)
    slots = torch.arange(t, device=DEVICE)
    k, v = key.to(DEVICE), key.to(DEVICE)
    stores = {"triton": lambda kc, vc, s: store_kv(k, v, kc, vc, slots, s, s),
              "torch": lambda kc, vc, s: kv_cache.store_kv(k, v, kc, vc, slots, s, s)}
    for name, store in stores.items():
        for s in (scale, torch.tensor(scale, device=DEVICE)):
            kc = torch.zeros(t // 16, 16, h, d, dtype=cache_dtype, device=DEVICE)
            vc = torch.zeros_like(kc)
            store(kc, vc, s)
            got = kc.view(torch.uint8).reshape(t, h, d).cpu()
            assert torch.equal(got, expect), (
                f"{name} store with a {type(s).__name__} scale: {int((got != expect).sum())} FP8 values differ")
