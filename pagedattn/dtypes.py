"""Cache dtype names and the float dtypes every layer shares (a leaf module: torch only).

attention/, the cache ops, kernels/ and the engine config all read these; nothing here
imports from the package.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_FP8_BY_NAME = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_NAMES = ("auto", *_FP8_BY_NAME)


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Map a cache dtype name to the torch dtype of the cache tensor.

    `"auto"` is the model dtype; `"fp8"`/`"fp8_e4m3"` is `float8_e4m3fn`; `"fp8_e5m2"` is `float8_e5m2`.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return _FP8_BY_NAME[kv_cache_dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"expected kv_cache_dtype in {list(KV_CACHE_DTYPE_NAMES)}, got {kv_cache_dtype!r}"
        ) from None
