"""TMA (Hopper's bulk tensor copy) descriptors for contiguous K/V, where a launch can use them.

A fresh prompt's keys and values are rows of the step's own [tokens, Hkv, D] tensors (the
`kv_start_loc` form of `paged_attention`), so a key tile of one KV head is a [BLOCK_N, D] box
of the 2-D view [tokens, Hkv * D]: one bulk copy instead of BLOCK_N x D computed addresses.
Paged caches do not qualify: a 16-token page holds less than a key tile, and Hopper's copy
engine has no gather (FlashAttention 3 also gathers paged keys with cp.async at small pages).
"""

from __future__ import annotations

import functools

import torch

from ._common import INTERPRET

_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _descriptor_class():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton without host-side descriptors
        return None
    return TensorDescriptor


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, tile) -> tuple[object, object]:
    """(k, v) descriptors of [BLOCK_N, D] boxes over [tokens, Hkv * D], or (None, None) where
    the copy engine cannot read them: off Hopper, under the interpreter, FP8 or float32 rows,
    head sizes that are not a power of two, heads not packed in a row, unaligned rows."""
    cls = _descriptor_class()
    if cls is None or INTERPRET or not _hopper(k.device):
        return None, None
    if not all(_fits(t) for t in (k, v)):
        return None, None
    tokens, heads, size = k.shape
    return tuple(cls(t, [tokens, heads * size], [t.stride(0), 1], [tile.block_n, size]) for t in (k, v))


def _fits(t: torch.Tensor) -> bool:
    size = t.shape[-1]
    return (t.dtype in _DTYPES and t.dim() == 3 and t.shape[0] > 0 and size in (64, 128, 256)
            and t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == size) and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)
