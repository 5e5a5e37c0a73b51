"""Host-side helpers shared by the kernel launchers (no Triton kernels here).

`INTERPRET` is read once, at import: the kernels must know at compile time whether they run
under `TRITON_INTERPRET=1`, because the interpreter computes bf16 (and bf16/fp16 `tl.dot`)
wrongly; interpreted kernels upcast every loaded value to float32 instead.
"""

from __future__ import annotations

import os

import torch

from pagedattn.dtypes import FLOAT_DTYPES, FP8_DTYPES  # noqa: F401  (the launchers' dtype checks)

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def check(cond: bool, what: str, expected: object, got: object) -> None:
    """Raise ValueError('<what>: expected X, got Y') unless `cond` holds."""
    if not cond:
        raise ValueError(f"{what}: expected {expected}, got {got}")


def check_tensor(t: torch.Tensor, name: str, *, ndim: int | None = None,
                 dtypes: tuple[torch.dtype, ...] | None = None,
                 device: torch.device | None = None) -> None:
    """`check` for a tensor argument's type, rank, dtype and device. Every launch runs this on
    each of its tensors, so the messages are formatted only on failure (host time per layer)."""
    if not isinstance(t, torch.Tensor):
        check(False, name, "a torch.Tensor", type(t).__name__)
    if ndim is not None and t.dim() != ndim:
        check(False, f"{name}.dim()", ndim, f"{t.dim()} (shape {tuple(t.shape)})")
    if dtypes is not None and t.dtype not in dtypes:
        check(False, f"{name}.dtype", " or ".join(map(str, dtypes)), t.dtype)
    if device is not None and t.device != device:
        check(False, f"{name}.device", device, t.device)


def scale_tensor(scale: float | torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """A 0-dim float32 device tensor holding the FP8 scale.

    Backends pass tensors (a pointer load keeps CUDA graphs valid when the value changes); a
    python float is accepted for convenience and costs one small allocation.
    """
    if isinstance(scale, torch.Tensor):
        check(scale.numel() == 1, f"{name}.numel()", 1, scale.numel())
        check(scale.dtype == torch.float32, f"{name}.dtype", torch.float32, scale.dtype)
        check(scale.device == device, f"{name}.device", device, scale.device)
        return scale
    return torch.full((), float(scale), dtype=torch.float32, device=device)
