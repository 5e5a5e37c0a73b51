"""swap_blocks / copy_blocks on the (num_blocks, 2, block_size, Hkv, D) layout move whole
blocks: K and V of block src land in block dst, nothing else changes."""

from __future__ import annotations

import torch

NB, BS, HKV, D = 10, 16, 2, 64


def _cache(fi, device, seed, num_blocks=NB, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(fi.get_kv_cache_shape(num_blocks, BS, HKV, D), generator=g).to(dtype).to(device)


def test_layout(fi):
    assert fi.get_kv_cache_shape(NB, BS, HKV, D) == (NB, 2, BS, HKV, D)
    assert fi.kv_cache_block_dim == 0


def test_swap_blocks_gpu_cpu_both_ways(fi, cuda):
    pairs = [(1, 7), (4, 0), (9, 2)]
    for src_dev, dst_dev in ((cuda, "cpu"), ("cpu", cuda), (cuda, cuda)):
        src, dst = _cache(fi, src_dev, 1), _cache(fi, dst_dev, 2, num_blocks=NB + 3)
        before = dst.clone()
        fi.swap_blocks(src, dst, torch.tensor(pairs, dtype=torch.int64))
        expected = before.clone()
        for s, d in pairs:
            expected[d] = src[s].to(expected.device)  # K and V of the block: kv[blk] = [2, BS, Hkv, D]
        assert torch.equal(dst.cpu(), expected.cpu()), f"swap {src_dev} -> {dst_dev}"


def test_copy_blocks_every_layer(fi, cuda):
    caches = [_cache(fi, cuda, 10 + i, dtype=torch.float8_e4m3fn if i == 2 else torch.bfloat16) for i in range(3)]
    befores = [c.clone() for c in caches]
    pairs = [(0, 5), (3, 8), (3, 1)]
    fi.copy_blocks(caches, torch.tensor(pairs, dtype=torch.int64, device=cuda))
    for cache, before in zip(caches, befores):
        expected = before.clone()
        for s, d in pairs:
            expected[d] = before[s]
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
