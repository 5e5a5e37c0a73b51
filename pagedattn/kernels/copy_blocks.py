"""Copy KV-cache blocks within each layer's cache (copy-on-write for forked sequences).

Each layer's cache is `[2, num_blocks, *block_shape]` (K then V) with each block's contents
contiguous. One launch per layer, grid (pairs, K/V, chunks of a block): program (i, kv, c)
copies chunk c of block `src_to_dst[i, 0]` to block `src_to_dst[i, 1]` of `kv_cache[kv]`, with
int64 addresses. Launching per layer (rather than one launch over a device table of layer base
pointers) needs no host-to-device copy of pointers and no allocation, and lets layers differ in
dtype or shape; the pair list is read on the device, so there is no host synchronisation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check, check_tensor, next_pow2

_CHUNK = 4096


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, src_to_dst_ptr, stride_kv, stride_block, stride_pair, stride_col, block_numel,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1).to(tl.int64)
    src = tl.load(src_to_dst_ptr + i * stride_pair).to(tl.int64)
    dst = tl.load(src_to_dst_ptr + i * stride_pair + stride_col).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    base = cache_ptr + kv * stride_kv
    x = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, x, mask=mask)


def copy_blocks(kv_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """For every layer cache in `kv_caches` ([2, num_blocks, ...], block contents contiguous),
    copy block src_to_dst[i, 0] to block src_to_dst[i, 1] for K and V.

    src_to_dst: [N, 2] int64 on the caches' device. Sources and destinations must not overlap.
    """
    check_tensor(src_to_dst, "src_to_dst", ndim=2, dtypes=(torch.int64,))
    check(src_to_dst.shape[1] == 2, "src_to_dst.shape[1]", 2, src_to_dst.shape[1])
    num_pairs = src_to_dst.shape[0]
    for layer, cache in enumerate(kv_caches):
        name = f"kv_caches[{layer}]"
        check_tensor(cache, name, device=src_to_dst.device)
        check(cache.dim() >= 3 and cache.shape[0] == 2, f"{name}.shape",
              "[2, num_blocks, ...]", tuple(cache.shape))
        block_shape = cache.shape[2:]
        block_numel = math.prod(block_shape)
        contiguous = [math.prod(block_shape[j + 1:]) for j in range(len(block_shape))]
        check(all(s == c or n == 1 for s, c, n in zip(cache.stride()[2:], contiguous,
                                                      block_shape)),
              f"{name}.stride()[2:] (contiguous block contents)", tuple(contiguous),
              tuple(cache.stride()[2:]))
        if num_pairs == 0 or block_numel == 0:
            continue
        chunk = min(_CHUNK, next_pow2(block_numel))
        grid = (num_pairs, 2, triton.cdiv(block_numel, chunk))
        _copy_blocks_kernel[grid](
            cache, src_to_dst, cache.stride(0), cache.stride(1), src_to_dst.stride(0),
            src_to_dst.stride(1), block_numel, CHUNK=chunk, num_warps=4,
        )
