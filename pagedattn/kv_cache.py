"""KV-cache operations in PyTorch: store K/V at slots (FP8 quantisation), swap and copy blocks.

All are free of host synchronisation, so they run inside CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.dtypes import FP8_DTYPES


def quantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the cache's dtype: FP8 caches hold `x / scale` saturated to the finite range.

    The division is IEEE float32 division by the float32 scale on every device and path, so
    all backends store the same bits: a python float is made a device tensor first, because
    PyTorch divides a CUDA tensor by a python number as a multiplication by its reciprocal,
    which rounds differently in the last bit and can flip an FP8 rounding.
    """
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    if not isinstance(scale, torch.Tensor):
        scale = torch.full((), float(scale), dtype=torch.float32, device=x.device)
    fmax = torch.finfo(dtype).max
    return (x.float() / scale.float()).clamp_(-fmax, fmax).to(dtype)


def dequantize(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Float32 values of cache entries: FP8 entries are multiplied back by `scale`."""
    return x.float() * scale if x.dtype in FP8_DTYPES else x.float()


@dataclass(frozen=True)
class StorePlan:
    """Where `store_kv` writes each token of a step. It depends on the slot mapping only, so a
    step can compute it once and every layer reuse it."""

    blocks: torch.Tensor  # int64 [T]
    offsets: torch.Tensor  # int64 [T]
    rows: torch.Tensor | None  # int64 [T] source token of each write (a padding row repeats a real
    # row); None: no slot is padding
    any_real: torch.Tensor | None  # bool []; False when every slot is padding (writes keep the slots)


def plan_store(slot_mapping: torch.Tensor, block_size: int, all_real: bool = False) -> StorePlan:
    """The `StorePlan` of `slot_mapping` (int64 [T], -1 = padding), with no host synchronisation.

    `all_real`: the caller knows (on the host) that no slot is padding; writes then need no guard.
    """
    if all_real:
        return StorePlan(slot_mapping // block_size, slot_mapping % block_size, None, None)
    valid = slot_mapping >= 0
    # Padding rows rewrite a real row (same slot, same value), or, with no real row, the
    # current content of slot 0: duplicate writes of equal values are harmless and need no
    # data-dependent shapes.
    rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    rows = torch.where(valid, rows, valid.to(torch.int8).argmax())
    slots = slot_mapping[rows].clamp_(min=0)
    return StorePlan(slots // block_size, slots % block_size, rows, valid.any())


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    plan: StorePlan | None = None,
) -> None:
    """Write token `t` of `key`/`value` at slot `slot_mapping[t]`; slots of -1 write nothing.

    Args:
        key, value: [T, Hkv, D].
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], any strides.
        slot_mapping: int64 [T].
        plan: `plan_store(slot_mapping, block_size)`, when the caller keeps it for the step.
    """
    t = slot_mapping.shape[0]
    if key.shape[0] != t or value.shape[0] != t:
        raise ValueError(f"expected key/value of {t} tokens (the slot mapping's), got {key.shape[0]}/{value.shape[0]}")
    if t == 0:
        return
    if plan is None:
        plan = plan_store(slot_mapping, k_cache.shape[1])
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        raw = raw_bytes(cache)
        if plan.rows is None:
            raw.index_put_((plan.blocks, plan.offsets), raw_bytes(quantize(src, scale, cache.dtype)))
            continue
        new = raw_bytes(quantize(src.index_select(0, plan.rows), scale, cache.dtype))
        new = torch.where(plan.any_real, new, raw[plan.blocks, plan.offsets])
        raw.index_put_((plan.blocks, plan.offsets), new)


def raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """FP8 caches as bytes: indexing ops lack FP8 kernels on some devices, and copies are bitwise."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def _check_mapping(mapping: torch.Tensor, name: str) -> None:
    if mapping.dtype != torch.int64 or mapping.dim() != 2 or mapping.shape[1] != 2:
        raise ValueError(f"expected {name} int64 [N, 2], got {mapping.dtype} {list(mapping.shape)}")


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor, block_dim: int) -> None:
    """Copy whole blocks (K and V) from `src` to `dst`, which may live on different devices.

    `src_to_dst`: int64 [N, 2] on the CPU; `block_dim` is the layout's block dimension.
    """
    _check_mapping(src_to_dst, "src_to_dst")
    if src_to_dst.device.type != "cpu":
        raise ValueError(f"expected src_to_dst on the CPU, got {src_to_dst.device}")
    if src.dtype != dst.dtype:
        raise TypeError(f"expected caches of one dtype, got {src.dtype} and {dst.dtype}")
    rest = lambda x: x.shape[:block_dim] + x.shape[block_dim + 1 :]  # noqa: E731
    if rest(src) != rest(dst):
        raise ValueError(f"expected caches that differ only in num_blocks, got {list(src.shape)} and {list(dst.shape)}")
    if src_to_dst.numel() == 0:
        return
    s, d = src_to_dst[:, 0], src_to_dst[:, 1]
    for name, idx, cache in (("source", s, src), ("destination", d, dst)):
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= cache.shape[block_dim]:
            raise IndexError(f"expected {name} blocks in [0, {cache.shape[block_dim]}), got [{lo}, {hi}]")
    blocks = raw_bytes(src).index_select(block_dim, s.to(src.device))
    # Host-to-device copies may run ahead; a device-to-host copy must land before the CPU
    # `index_copy_` reads it, so it is a blocking one.
    blocks = blocks.to(dst.device, non_blocking=dst.device.type != "cpu")
    raw_bytes(dst).index_copy_(block_dim, d.to(dst.device), blocks)


def copy_blocks(kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor, block_dim: int) -> None:
    """Within every layer's cache, copy block `src_to_dists[i, 0]` to `src_to_dists[i, 1]`.

    `src_to_dists`: int64 [N, 2] on the caches' device (ids are not range-checked: that
    would synchronise; out-of-range ids fail inside the indexing op).
    """
    _check_mapping(src_to_dists, "src_to_dists")
    if src_to_dists.numel() == 0:
        return
    s, d = src_to_dists[:, 0], src_to_dists[:, 1]
    for cache in kv_caches:
        if cache.device != src_to_dists.device:
            raise ValueError(f"expected src_to_dists on the caches' device {cache.device}, got {src_to_dists.device}")
        raw = raw_bytes(cache)
        raw.index_copy_(block_dim, d, raw.index_select(block_dim, s))
