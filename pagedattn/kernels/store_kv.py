"""Write a step's new keys and values into the paged KV cache.

Algorithm: one program per (token t, group of KV heads). It loads `slot = slot_mapping[t]`;
`slot < 0` is padding and writes nothing. Otherwise the token goes to block
`slot // block_size`, offset `slot % block_size`; all address arithmetic is int64 so pools of
more than 2^31 elements work. Float caches store the value cast to the cache dtype; FP8 caches
store `clamp(x / scale, -fp8_max, fp8_max)` cast to FP8 (round to nearest even), with the scale
read from a 0-dim device tensor so a captured CUDA graph sees scale updates. Under
TRITON_INTERPRET the value is first rounded to the FP8 grid in float32, because the
interpreter's own cast misrounds (the GPU's cvt instruction does not). The row write
(`_write_rows`) is shared with the attention kernel, whose decode programs may write their own
new rows (`paged_attention`'s `write`, a `KVWrite`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, FP8_DTYPES, INTERPRET, check, check_tensor, next_pow2,
                      scale_tensor)
from .launch import BoundKernel, bind
from .pdl import use_pdl


@triton.jit
def _round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 `x` (already within the finite range) to the nearest FP8 value, ties to
    even, staying in float32. Used only under the interpreter, whose float -> fp8 cast misrounds
    when rounding carries into the exponent; exact FP8 values it casts exactly."""
    exp = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, MIN_EXP)  # subnormals share the smallest normal exponent's step
    step = ((exp - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |y| < 2^22 to even
    return ((x / step + magic) - magic) * step


@triton.jit
def _write_rows(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    tok, head, ok,
    stride_key_t, stride_key_h, stride_key_d,
    stride_value_t, stride_value_h, stride_value_d,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_s, stride_vc_h, stride_vc_d,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Write rows (token `tok[r]`, KV head `head[r]`) where `ok[r]`, each to the slot
    `slot_mapping[tok[r]]` (< 0: nowhere): the store of `_store_kv_kernel`, and of an attention
    program that writes its own new rows (`paged_attention`'s `write`)."""
    tok64 = tok.to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok64, mask=ok, other=-1).to(tl.int64)
    ok = ok & (slot >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d64 = tl.arange(0, HEAD_PAD).to(tl.int64)[None, :]
    h64 = head.to(tl.int64)[:, None]
    mask = ok[:, None] & (d64 < HEAD_SIZE)
    k = tl.load(key_ptr + tok64[:, None] * stride_key_t + h64 * stride_key_h + d64 * stride_key_d, mask=mask)
    v = tl.load(value_ptr + tok64[:, None] * stride_value_t + h64 * stride_value_h
                + d64 * stride_value_d, mask=mask)
    if FP8:
        # IEEE division (div_rn), as the PyTorch store: `/` compiles to an approximate divide
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -FP8_MAX, FP8_MAX)
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -FP8_MAX, FP8_MAX)
        if INTERPRETED:
            k = _round_to_fp8_grid(k, FP8_MANTISSA_BITS, FP8_MIN_EXP)
            v = _round_to_fp8_grid(v, FP8_MANTISSA_BITS, FP8_MIN_EXP)
    k_dst = k_cache_ptr + (block * stride_kc_b + offset * stride_kc_s)[:, None] + h64 * stride_kc_h \
        + d64 * stride_kc_d
    v_dst = v_cache_ptr + (block * stride_vc_b + offset * stride_vc_s)[:, None] + h64 * stride_vc_h \
        + d64 * stride_vc_d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_key_t, stride_key_h, stride_key_d,
    stride_value_t, stride_value_h, stride_value_d,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_s, stride_vc_h, stride_vc_d,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr, FP8_MIN_EXP: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the attention kernel after this one may launch now (pdl.py); it waits for our writes
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok = tl.program_id(0) + h * 0
    _write_rows(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                tok, h, h < NUM_KV_HEADS,
                stride_key_t, stride_key_h, stride_key_d, stride_value_t, stride_value_h, stride_value_d,
                stride_kc_b, stride_kc_s, stride_kc_h, stride_kc_d,
                stride_vc_b, stride_vc_s, stride_vc_h, stride_vc_d,
                HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, FP8, FP8_MAX, FP8_MANTISSA_BITS, FP8_MIN_EXP, INTERPRETED)


class KVWrite(NamedTuple):
    """Rows a launch also writes into pages (`paged_attention`'s `write`), as
    `store_kv(*write, k_scale, v_scale)` would: key, value [T, Hkv, D] into k_cache, v_cache
    [num_blocks, block_size, Hkv, D] at `slot_mapping` [T] int64 (-1: nowhere). A launch over
    pages writes its step's new rows into the caches it reads (before reading them); a launch
    over contiguous rows writes those rows (its keys and values) into the pages."""

    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


def fp8_constants(cache_dtype: torch.dtype) -> dict:
    """The FP8 format constexprs of `_write_rows` for a cache of `cache_dtype` (unused by float
    caches, whose FP8 flag is False)."""
    fp8 = cache_dtype in FP8_DTYPES
    return dict(FP8_MAX=float(torch.finfo(cache_dtype).max) if fp8 else 0.0,
                FP8_MANTISSA_BITS=3 if cache_dtype == torch.float8_e4m3fn else 2,
                FP8_MIN_EXP=-6 if cache_dtype == torch.float8_e4m3fn else -14, INTERPRETED=INTERPRET)


def check_store(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Refuse arguments `store_kv` cannot take (shapes, dtypes, devices), with the reason."""
    check_tensor(key, "key", ndim=3, dtypes=FLOAT_DTYPES)
    device = key.device
    check_tensor(value, "value", ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check(value.shape == key.shape, "value.shape", tuple(key.shape), tuple(value.shape))
    num_tokens = key.shape[0]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(cache, name, ndim=4, dtypes=FLOAT_DTYPES + FP8_DTYPES, device=device)
        check(cache.shape[2:] == key.shape[1:], f"{name}.shape[2:] (Hkv, D)",
              tuple(key.shape[1:]), tuple(cache.shape[2:]))
    check(v_cache.shape == k_cache.shape, "v_cache.shape", tuple(k_cache.shape),
          tuple(v_cache.shape))
    check(v_cache.dtype == k_cache.dtype, "v_cache.dtype", k_cache.dtype, v_cache.dtype)
    check_tensor(slot_mapping, "slot_mapping", ndim=1, dtypes=(torch.int64,), device=device)
    check(slot_mapping.shape[0] == num_tokens, "slot_mapping.shape[0]", num_tokens,
          slot_mapping.shape[0])
    check(slot_mapping.stride(0) == 1 or num_tokens <= 1, "slot_mapping.stride(0)", 1,
          slot_mapping.stride(0))


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Scatter `key`/`value` into the cache at `slot_mapping`, in place.

    key, value: [T, Hkv, D] float32/float16/bfloat16, any strides.
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], the model dtype or float8_e4m3fn /
        float8_e5m2, any strides (e.g. `kv_cache[0]`, or FlashInfer's `kv[:, 0]`).
    slot_mapping: [T] int64; slot -1 writes nothing.
    k_scale, v_scale: 0-dim float32 device tensors (or python floats); used by FP8 caches only.
    """
    check_store(key, value, k_cache, v_cache, slot_mapping)
    launch_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def launch_store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float | torch.Tensor = 1.0,
                    v_scale: float | torch.Tensor = 1.0) -> None:
    """`store_kv` for arguments `check_store` has already taken (a caller that checked them
    itself: `paged_attention`'s `store`), without checking them again."""
    device = key.device
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0 or k_cache.numel() == 0:
        return
    if k_cache.dtype in FP8_DTYPES:
        k_scale_t = scale_tensor(k_scale, "k_scale", device)
        v_scale_t = scale_tensor(v_scale, "v_scale", device)
    else:
        k_scale_t = v_scale_t = slot_mapping  # never read
    head_pad = next_pow2(head_size)
    block_h = min(next_pow2(num_kv_heads), max(1, 4096 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    kernel = _store_kernel(num_kv_heads, head_size, block_h, k_cache.shape[1], k_cache.dtype, use_pdl(key.device))
    kernel(grid, key, value, k_cache, v_cache, slot_mapping, k_scale_t, v_scale_t,
           *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride())


@functools.lru_cache(maxsize=None)
def _store_kernel(num_kv_heads: int, head_size: int, block_h: int, block_size: int, cache_dtype: torch.dtype,
                  pdl: bool) -> BoundKernel:
    return bind(_store_kv_kernel, dict(
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, BLOCK_H=block_h, HEAD_PAD=next_pow2(head_size),
        BLOCK_SIZE=block_size, FP8=cache_dtype in FP8_DTYPES, **fp8_constants(cache_dtype), PDL=pdl),
        dict(num_warps=1 if INTERPRET else 4))
