"""GPU-only kernel tests: realistic shapes in bf16/fp16, pools over 2^31 elements, CUDA graphs.

Skipped without CUDA. Tolerances against the float64 oracle (relative L2 error): 1e-2 for
bf16, 2e-3 for fp16.
"""

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from graph_harness import capture  # noqa: E402
from oracle import rel_l2  # noqa: E402
from paged_batch import CacheLayout, slot_of  # noqa: E402
from paged_kernel import POOL_LAYOUT, attend, kernel_args, kernel_batch, oracle_options  # noqa: E402

from pagedattn.kernels import SplitKVWorkspace, copy_blocks, paged_attention, store_kv  # noqa: E402
from pagedattn.device_profile import DeviceProfile  # noqa: E402
from pagedattn.kernels.paged_attention_config import (choose_num_splits,  # noqa: E402
                                                      choose_tile)

DEVICE = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (context_len, query_len) per sequence
MIXED = [(400, 300), (0, 64), (0, 17), (896, 4), (0, 1), (1499, 1), (32, 1)]


def make(lens, *, num_heads, num_kv_heads, head_size, block_size=16, dtype=torch.bfloat16,
         **options):
    return kernel_batch(lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_size=head_size, block_size=block_size, dtype=dtype, device=DEVICE,
                        **options)


def check(batch, **kernel_options):
    scale = batch.head_size ** -0.5
    extra = {}
    if batch.fp8:
        extra = dict(k_scale=torch.tensor(batch.k_scale, device=DEVICE),
                     v_scale=torch.tensor(batch.v_scale, device=DEVICE))
    out, lse = attend(kernel_args(batch), scale=scale, **extra, **kernel_options)
    torch.cuda.synchronize()
    ref, ref_lse = batch.reference(scale=scale, **oracle_options(kernel_options))
    err = rel_l2(out, ref)
    assert err <= TOL[batch.dtype], err
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=2e-3, rtol=1e-3)
    return out


@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_head_sizes(head_size, dtype):
    check(make(MIXED, num_heads=8, num_kv_heads=2, head_size=head_size, dtype=dtype))


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_block_sizes(block_size):
    check(make(MIXED, num_heads=32, num_kv_heads=8, head_size=128, block_size=block_size))


def test_options_long_sequences():
    batch = make(MIXED, num_heads=16, num_kv_heads=4, head_size=128)
    slopes = torch.linspace(0.01, 0.3, 16, device=DEVICE)
    check(batch, sliding_window=256)
    check(batch, alibi_slopes=slopes)
    check(batch, soft_cap=30.0)
    check(batch, sliding_window=100, alibi_slopes=slopes, soft_cap=10.0)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache(kv_cache_dtype, dtype):
    check(make(MIXED, num_heads=32, num_kv_heads=8, head_size=128, dtype=dtype,
               kv_cache_dtype=kv_cache_dtype, k_scale=0.05, v_scale=2.5))


@pytest.mark.parametrize("num_seqs", [1, 4, 64])
def test_decode_split_kv_auto(num_seqs):
    batch = make([(3999 - 37 * i, 1) for i in range(num_seqs)], num_heads=32, num_kv_heads=8,
                 head_size=128)
    ws = SplitKVWorkspace.allocate(num_seqs, 32, 128, 16, DEVICE)
    tile = choose_tile(head_size=128, group=4, max_query_len=1, elem_bytes=2, interpret=False)
    splits = choose_num_splits(num_seqs=num_seqs, num_kv_heads=8, max_query_len=1,
                               max_seq_len=4000, block_q=tile.block_q, block_n=tile.block_n,
                               num_sms=DeviceProfile.of(DEVICE).num_sms, max_splits=16)
    if num_seqs == 1:
        assert splits > 1
    out = check(batch, workspace=ws)
    unsplit, _ = attend(kernel_args(batch), scale=128 ** -0.5)
    assert rel_l2(out, unsplit) < 5e-3


def test_pool_over_2_pow_31_elements():
    """Blocks past element 2^31 of a pool: store, attend, and copy must address them."""
    num_kv_heads, head_size, block_size = 8, 128, 16
    per_block = block_size * num_kv_heads * head_size
    first_high = (1 << 31) // per_block + 1           # first block wholly past 2^31 elements
    num_blocks = first_high + 64
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        small = make([(260, 40), (332, 1)], num_heads=32, num_kv_heads=num_kv_heads,
                     head_size=head_size, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                     k_scale=1.0, v_scale=1.0)
        layout = CacheLayout(POOL_LAYOUT, num_blocks, block_size, num_kv_heads, head_size)
        kv_cache = torch.zeros(layout.shape, dtype=small.cache_dtype, device=DEVICE)
        k_cache, v_cache = layout.kv(kv_cache, 0), layout.kv(kv_cache, 1)
        # the same sequences with every block id moved to the high end of the pool, their
        # tokens written there by store_kv (exact: the values already sit on the cache's grid)
        tables = [[b + first_high for b in t] for t in small.block_tables]
        new_k, new_v = small.new_kv(from_cache=True)
        for i, ((a, b), seq_len) in enumerate(zip(small.row_ranges(), small.seq_lens)):
            key = torch.cat([small.hist_k[i], new_k[a:b]]).to(torch.bfloat16).to(DEVICE)
            value = torch.cat([small.hist_v[i], new_v[a:b]]).to(torch.bfloat16).to(DEVICE)
            slots = torch.tensor([slot_of(tables[i], p, block_size) for p in range(seq_len)],
                                 device=DEVICE)
            store_kv(key, value, k_cache, v_cache, slots, torch.tensor(1.0, device=DEVICE),
                     torch.tensor(1.0, device=DEVICE))
        batch = dataclasses.replace(small, layout=layout, kv_cache=kv_cache, block_tables=tables)
        assert max(max(t) for t in tables) * per_block >= 1 << 31
        check(batch)
        # copy the first high block to the last block of the pool and compare
        src_blk, dst_blk = tables[0][0], num_blocks - 1
        copy_blocks([kv_cache], torch.tensor([[src_blk, dst_blk]], device=DEVICE))
        assert torch.equal(kv_cache[:, dst_blk].float(), kv_cache[:, src_blk].float())
        del kv_cache, k_cache, v_cache, batch
        torch.cuda.empty_cache()


def test_cuda_graph_replay_matches_eager():
    """Decode with split-KV and FP8 scales captured once, replayed with new lengths/scales."""
    num_seqs, width = 8, 160
    geometry = dict(num_heads=32, num_kv_heads=8, head_size=128, kv_cache_dtype="fp8_e4m3")
    # the replayed step: longer sequences, other tables, query and scales, in a pool of the
    # same shape as the captured one
    second = make([(2299 + 7 * i, 1) for i in range(num_seqs)], seed=9, k_scale=0.25,
                  v_scale=3.0, **geometry)
    pool = sum(len(t) for t in second.block_tables) + len(second.spare_blocks)
    lens = [(1999 + 13 * i, 1) for i in range(num_seqs)]
    first = make(lens, k_scale=0.5, v_scale=1.5, **geometry,
                 spare_blocks=pool - sum(math.ceil((c + q) / 16) for c, q in lens))
    assert first.kv_cache.shape == second.kv_cache.shape
    args = kernel_args(first, table_width=width)
    ws = SplitKVWorkspace.allocate(num_seqs, 32, 128, 8, DEVICE)
    k_scale = torch.tensor(first.k_scale, device=DEVICE)
    v_scale = torch.tensor(first.v_scale, device=DEVICE)
    out = torch.empty_like(args.query)

    def step():
        paged_attention(args.query, args.k_cache, args.v_cache, out,
                        query_start_loc=args.query_start_loc, seq_lens=args.seq_lens,
                        block_tables=args.block_tables, max_query_len=1,
                        max_seq_len=width * 16, scale=0.1, k_scale=k_scale, v_scale=v_scale,
                        workspace=ws)

    graph = capture(step)
    new = kernel_args(second, table_width=width)
    first.kv_cache.copy_(second.kv_cache)
    for name in ("query", "seq_lens", "block_tables"):
        getattr(args, name).copy_(getattr(new, name))
    k_scale.fill_(second.k_scale)
    v_scale.fill_(second.v_scale)
    graph.replay()
    replayed = out.clone()
    step()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, out, atol=0, rtol=0)
    ref, _ = second.reference(scale=0.1)
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
