"""Backend.swap_blocks and Backend.copy_blocks: exact, K and V, other blocks untouched."""

import pytest
import torch

from paged_batch import CacheLayout, make_garbage_cache, raw_bits

NB, BS, HKV, D = 12, 4, 2, 16
CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
                "fp16": torch.float16}


def _pool(backend, dtype, device, seed, num_blocks=NB, block_size=BS, num_kv_heads=HKV,
          head_size=D):
    layout = CacheLayout(backend, num_blocks, block_size, num_kv_heads, head_size)
    g = torch.Generator().manual_seed(seed)
    return layout, make_garbage_cache(layout.shape, dtype, device, g)


def _assert_blocks(layout_src, src, layout_dst, dst_before, dst, pairs):
    """dst == dst_before except block d of each (s, d) pair, which now equals src's block s."""
    expected = dst_before.clone()
    for s, d in pairs:
        for which in (0, 1):
            layout_dst.block(expected, d)[which].copy_(layout_src.block(src, s)[which].to(
                expected.device))
    diff = raw_bits(dst.cpu()) != raw_bits(expected.cpu())
    assert not bool(diff.any()), f"{int(diff.sum())} bytes differ after the copy of {pairs}"


def _directions(device):
    dirs = [("cpu", "cpu")]
    if device.type == "cuda":
        dirs += [(str(device), "cpu"), ("cpu", str(device)), (str(device), str(device))]
    return dirs


@pytest.mark.parametrize("dtype", list(CACHE_DTYPES.values()), ids=list(CACHE_DTYPES))
def test_swap_blocks_every_direction(backend, device, dtype):
    for src_dev, dst_dev in _directions(device):
        lay, src = _pool(backend, dtype, torch.device(src_dev), 1)
        lay2, dst = _pool(backend, dtype, torch.device(dst_dev), 2, num_blocks=NB + 3)
        src_before, dst_before = src.clone(), dst.clone()
        pairs = [(0, 14), (5, 2), (11, 0), (7, 9)]
        backend.swap_blocks(src, dst, torch.tensor(pairs, dtype=torch.int64))
        assert torch.equal(raw_bits(src), raw_bits(src_before)), "swap_blocks changed its source"
        _assert_blocks(lay, src, lay2, dst_before, dst, pairs)


@pytest.mark.cuda_only
@pytest.mark.parametrize("direction", ["to_cpu", "to_device", "on_device"])
def test_swap_blocks_across_devices(backend, device, direction):
    src_dev, dst_dev = {"to_cpu": (device, "cpu"), "to_device": ("cpu", device),
                        "on_device": (device, device)}[direction]
    # megabytes per block set, so an asynchronous copy that is not waited for shows up
    big = dict(num_blocks=64, block_size=16, num_kv_heads=8, head_size=128)
    lay, src = _pool(backend, torch.bfloat16, torch.device(src_dev), 3, **big)
    lay2, dst = _pool(backend, torch.bfloat16, torch.device(dst_dev), 4, **big)
    dst_before = dst.clone()
    pairs = [(i, 63 - i) for i in range(0, 64, 2)]
    backend.swap_blocks(src, dst, torch.tensor(pairs, dtype=torch.int64))
    _assert_blocks(lay, src, lay2, dst_before, dst, pairs)


def test_swap_blocks_empty_mapping(backend, device):
    lay, src = _pool(backend, torch.float32, device, 5)
    _, dst = _pool(backend, torch.float32, device, 6)
    before = dst.clone()
    backend.swap_blocks(src, dst, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(dst, before)


@pytest.mark.parametrize("dtype", list(CACHE_DTYPES.values()), ids=list(CACHE_DTYPES))
def test_copy_blocks_every_layer(backend, device, dtype):
    pools = [_pool(backend, dtype, device, 10 + i) for i in range(3)]
    caches = [c for _, c in pools]
    before = [c.clone() for c in caches]
    # one source copied to two destinations (copy-on-write fork), and a plain copy
    pairs = [(1, 6), (1, 8), (3, 0), (10, 11)]
    backend.copy_blocks(caches, torch.tensor(pairs, dtype=torch.int64, device=device))
    for (lay, cache), old in zip(pools, before):
        _assert_blocks(lay, old, lay, old, cache, pairs)


def test_copy_blocks_empty_mapping(backend, device):
    lay, cache = _pool(backend, torch.float32, device, 20)
    before = cache.clone()
    backend.copy_blocks([cache], torch.empty(0, 2, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)
