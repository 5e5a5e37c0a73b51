"""store_kv, copy_blocks and advance_step against plain PyTorch indexing."""

import pytest
import torch

pytest.importorskip("triton")

from pagedattn.kernels import advance_step, copy_blocks, store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _store_case(dtype, cache_dtype, block_size, *, strided_inputs, flashinfer_layout):
    g = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_size, num_blocks = 9, 3, 80, 12
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_size, generator=g) * 3
    if strided_inputs:  # slices of a fused [T, 2*Hkv, D] projection: non-contiguous along T
        key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    else:
        key, value = kv[:, :num_kv_heads].contiguous(), kv[:, num_kv_heads:].contiguous()
    key, value = key.to(dtype).to(DEVICE), value.to(dtype).to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    if flashinfer_layout:
        cache = torch.randn(num_blocks, 2, *shape[1:], generator=g).to(cache_dtype).to(DEVICE)
        k_cache, v_cache = cache[:, 0], cache[:, 1]
    else:
        cache = torch.randn(2, *shape, generator=g).to(cache_dtype).to(DEVICE)
        k_cache, v_cache = cache[0], cache[1]
    total = num_blocks * block_size
    slots = torch.randperm(total, generator=g)[:num_tokens]
    slots[[2, 5]] = -1
    return key, value, k_cache, v_cache, slots.to(DEVICE)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_store_kv_exact_for_float_caches(block_size, dtype, layout):
    key, value, k_cache, v_cache, slots = _store_case(
        dtype, dtype, block_size, strided_inputs=layout == "strided",
        flashinfer_layout=layout == "strided")
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[s // block_size, s % block_size] = key[t]
            expect_v[s // block_size, s % block_size] = value[t]
    store_kv(key, value, k_cache, v_cache, slots, 1.0, 1.0)
    assert torch.equal(k_cache, expect_k)  # also: untouched blocks and -1 slots unchanged
    assert torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_fp8_quantises_with_scales(cache_dtype, dtype):
    key, value, k_cache, v_cache, slots = _store_case(
        dtype, cache_dtype, 5, strided_inputs=True, flashinfer_layout=False)
    key[0, 0, 0] = 1e6  # saturates to the finite max, never inf/nan
    key[1] *= torch.logspace(-9, 3, key.shape[-1], device=DEVICE).to(dtype)  # subnormals..large
    before_k, before_v = k_cache.float().clone(), v_cache.float().clone()
    k_scale = torch.tensor(0.25, device=DEVICE)
    v_scale = torch.tensor(3.0, device=DEVICE)
    store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    fmax = torch.finfo(cache_dtype).max
    written, got, want = set(), [], []
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            blk, off = s // 5, s % 5
            written.add((blk, off))
            for cache, x, scale in ((k_cache, key, 0.25), (v_cache, value, 3.0)):
                got.append(cache[blk, off].double().cpu())
                want.append((x[t].double().cpu() / scale).clamp(-fmax, fmax))
    got, want = torch.stack(got), torch.stack(want)
    rounded = want.to(cache_dtype).double()
    # round to nearest even, like torch; the fp32 divide rounds once more than this float64
    # reference, which may flip a rare tie
    assert (got == rounded).double().mean() > 0.99
    step = 2.0 ** -3 if cache_dtype == torch.float8_e4m3fn else 2.0 ** -2
    torch.testing.assert_close(got, want, rtol=step, atol=2e-3)
    assert float(k_cache[slots[0] // 5, slots[0] % 5, 0, 0].float()) == fmax
    for blk in range(k_cache.shape[0]):
        for off in range(5):
            if (blk, off) not in written:
                assert torch.equal(k_cache[blk, off].float(), before_k[blk, off])
                assert torch.equal(v_cache[blk, off].float(), before_v[blk, off])


def test_store_kv_rejects_mismatched_shapes():
    key, value, k_cache, v_cache, slots = _store_case(
        torch.float32, torch.float32, 5, strided_inputs=False, flashinfer_layout=False)
    with pytest.raises(ValueError, match="expected"):
        store_kv(key[:, :2], value[:, :2], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="expected"):
        store_kv(key, value, k_cache, v_cache, slots.int())


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
def test_copy_blocks_every_layer(cache_dtype):
    g = torch.Generator().manual_seed(2)
    caches = [torch.randn(2, 6, 5, 2, 24, generator=g).to(cache_dtype).to(DEVICE)
              for _ in range(3)]
    caches.append(torch.randn(6, 2, 5, 2, 24, generator=g).to(cache_dtype).to(DEVICE)
                  .transpose(0, 1))  # FlashInfer's layout seen as [2, nb, ...]
    pairs = torch.tensor([[0, 3], [4, 1], [0, 5]], dtype=torch.int64)
    expect = [c.clone() for c in caches]
    for e in expect:
        for src, dst in pairs.tolist():
            e[:, dst] = e[:, src]
    copy_blocks(caches, pairs.to(DEVICE))
    for c, e in zip(caches, expect):
        assert torch.equal(c.float(), e.float())


def test_advance_step_matches_host_recomputation():
    block_size, num_seqs, num_queries = 5, 6, 4
    g = torch.Generator().manual_seed(4)
    seq_lens = torch.tensor([4, 5, 9, 1, 7, 3], dtype=torch.int32)  # new token crosses blocks
    tables = torch.randperm(40, generator=g)[:num_seqs * 3].view(num_seqs, 3).int()
    tokens = torch.randint(0, 100, (num_seqs,), generator=g)
    positions = (seq_lens - 1).long()
    context = seq_lens - 1
    slots = torch.full((num_seqs,), 123, dtype=torch.int64)
    sampled = torch.randint(0, 100, (num_queries, 1), generator=g)
    d = [x.clone().to(DEVICE) for x in (tokens, positions, sampled, seq_lens, context, slots,
                                         tables)]
    for _ in range(2):  # two steps, as multi-step decoding does
        advance_step(*d, block_size=block_size, num_queries=num_queries)
    new_len = seq_lens[:num_queries] + 2
    assert torch.equal(d[0][:num_queries].cpu(), sampled[:, 0])
    assert torch.equal(d[0][num_queries:].cpu(), tokens[num_queries:])
    assert torch.equal(d[1].cpu(), torch.cat([positions[:num_queries] + 2,
                                              positions[num_queries:]]))
    assert torch.equal(d[3].cpu(), torch.cat([new_len, seq_lens[num_queries:]]))
    assert torch.equal(d[4].cpu(), torch.cat([context[:num_queries] + 2, context[num_queries:]]))
    want_slots = [int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                  for b, n in enumerate(new_len.tolist())] + [-1] * (num_seqs - num_queries)
    assert d[5].cpu().tolist() == want_slots
