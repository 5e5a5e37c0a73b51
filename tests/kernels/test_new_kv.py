"""paged_attention's `write` over pages: a launch that writes the step's new rows into the cache itself.

Each case builds the pool WITHOUT the step's rows (garbage there), then compares one
`paged_attention(write=...)` call against `store_kv` followed by a plain launch: the same pool
bytes afterwards, the same output, and the oracle's output.
"""

import sys

import pytest
import torch

pytest.importorskip("triton")

from oracle import rel_l2  # noqa: E402
from paged_batch import make_paged_batch  # noqa: E402
from paged_kernel import POOL_LAYOUT, attend, kernel_args, oracle_options  # noqa: E402

from pagedattn.kernels import KVWrite, SplitKVWorkspace, store_kv  # noqa: E402
from pagedattn.kernels.store_kv import launch_store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

DECODES = {
    "single_decode": [(36, 1)],
    "many_decodes": [(0, 1), (15, 1), (16, 1), (69, 1), (4, 1)],
    "multi_token_decode": [(27, 3), (17, 2), (40, 4)],
}


def batch_of(lens, *, dtype=torch.float32, block_size=16, kv_cache_dtype="auto", num_heads=4,
             num_kv_heads=2):
    return make_paged_batch(POOL_LAYOUT, lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_size=32, block_size=block_size, dtype=dtype, device=DEVICE,
                            kv_cache_dtype=kv_cache_dtype, spare_blocks=3, write_step=False)


def scales_of(batch):
    if not batch.fp8:
        return {}
    return dict(k_scale=torch.tensor(batch.k_scale, device=DEVICE),
                v_scale=torch.tensor(batch.v_scale, device=DEVICE))


def slots_of(batch, pad: int = 0) -> torch.Tensor:
    return torch.tensor(batch.step_slots() + [-1] * pad, dtype=torch.int64, device=DEVICE)


def compare(batch, fused=True, **options):
    """Fused against store-then-attend on copies of one pool; returns the fused output.
    `fused`: whether the launch must write the rows itself (no `store_kv` launch before it)."""
    args = kernel_args(batch)
    scales = scales_of(batch)
    pool = batch.kv_cache.clone()
    new = KVWrite(batch.key, batch.value, args.k_cache, args.v_cache, slots_of(batch))
    launcher = sys.modules["pagedattn.kernels.paged_attention"]
    stores = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launcher, "launch_store_kv", lambda *a: stores.append(a) or launch_store_kv(*a))
        out, lse = attend(args, scale=0.3, write=new, **scales, **options)
    assert len(stores) == (0 if fused else 1)
    fused_pool = batch.kv_cache.clone()
    batch.kv_cache.copy_(pool)
    store_kv(batch.key, batch.value, args.k_cache, args.v_cache, new.slot_mapping, **scales)
    ref_out, ref_lse = attend(args, scale=0.3, **scales, **options)
    assert torch.equal(fused_pool.view(torch.uint8), batch.kv_cache.view(torch.uint8))
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    oracle_out, _ = batch.reference(scale=0.3, **oracle_options(options))
    assert rel_l2(out, oracle_out) <= TOL[batch.dtype]
    return out


@pytest.mark.parametrize("shape", list(DECODES))
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_decodes_write_their_rows(shape, block_size):
    compare(batch_of(DECODES[shape], block_size=block_size))


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("shape", ["many_decodes", "multi_token_decode"])
def test_each_split_writes_the_rows_of_its_range(num_splits, shape):
    # multi-token decodes of 3-4 rows straddle the splits' boundaries at some split counts
    batch = batch_of(DECODES[shape], block_size=5)
    ws = SplitKVWorkspace.allocate(batch.num_tokens, 4, 32, 8, DEVICE)
    compare(batch, workspace=ws, num_splits=num_splits, tile=(16, 4, 2))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rows_quantised_as_store_kv(kv_cache_dtype):
    compare(batch_of(DECODES["multi_token_decode"], dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype))


def test_window_and_gqa():
    batch = batch_of(DECODES["many_decodes"], num_heads=6, num_kv_heads=2, block_size=5)
    compare(batch, sliding_window=7)


def test_prefill_launch_stores_first():
    # a prompt of two query tiles (70 tokens, 64 a tile): its programs share keys, so the store runs first
    compare(batch_of([(0, 70), (32, 9), (12, 1)], block_size=5), fused=False)


def test_short_prefills_in_one_tile_write_their_rows():
    compare(batch_of([(0, 23), (32, 9), (12, 1)], block_size=5))


def test_padding_rows_with_slot_minus_one_write_nothing():
    batch = batch_of(DECODES["many_decodes"])
    args = kernel_args(batch)
    pad = 3  # a CUDA graph's padded rows: beyond the last sequence, slot -1
    query = torch.cat([args.query, torch.randn(pad, *args.query.shape[1:], device=DEVICE)])
    key = torch.cat([batch.key, torch.randn(pad, *batch.key.shape[1:], device=DEVICE)])
    value = torch.cat([batch.value, torch.randn(pad, *batch.value.shape[1:], device=DEVICE)])
    pool = batch.kv_cache.clone()
    store_kv(batch.key, batch.value, args.k_cache, args.v_cache, slots_of(batch))
    stored = batch.kv_cache.clone()
    batch.kv_cache.copy_(pool)
    args.query = query
    attend(args, scale=0.3, write=KVWrite(key, value, args.k_cache, args.v_cache, slots_of(batch, pad)))
    assert torch.equal(batch.kv_cache, stored)


def test_refused_with_the_reason():
    batch = batch_of(DECODES["many_decodes"])
    args = kernel_args(batch)
    slots = slots_of(batch)
    pages = args.k_cache, args.v_cache
    with pytest.raises(ValueError, match="write.key.shape"):
        attend(args, scale=0.3, write=KVWrite(batch.key[1:], batch.value[1:], *pages, slots[1:]))
    with pytest.raises(ValueError, match="slot_mapping"):
        attend(args, scale=0.3, write=KVWrite(batch.key, batch.value, *pages, slots.int()))
    with pytest.raises(ValueError, match="causal"):
        attend(args, scale=0.3, causal=False, write=KVWrite(batch.key, batch.value, *pages, slots))
    with pytest.raises(ValueError, match="the launch's k_cache"):  # a paged launch writes where it reads
        attend(args, scale=0.3, write=KVWrite(batch.key, batch.value, args.k_cache.clone(), args.v_cache, slots))
