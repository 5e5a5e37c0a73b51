"""Fused kernels for the layers around attention in a Llama-family decoder layer.

At decode batch sizes every elementwise op of a layer is a launch of a few microseconds over a
few hundred KB: an 8B model's 32 layers issued ~25 of them each, ~1-2 ms of a ~7 ms step.
Each kernel here replaces several, with the same rounding as the PyTorch ops they replace
(each result rounded to the model dtype where PyTorch rounds it), so the CPU path (PyTorch) and
the CUDA path (these) compute the same model:

- `rms_norm`: [residual add +] Llama RMSNorm, one program per row: `h = x + residual` in the
  model dtype, `normed = (h * rsqrt(mean(h^2) + eps))` in float32 cast to the model dtype,
  times `weight` (5 PyTorch launches, or 6 with the add);
- `rotary_`: NeoX-halves rotary embedding in place on [T, H, D] (q and k heads together),
  in float32, each output rounded once (PyTorch: 5 launches and a new tensor);
- `silu_and_mul`: `silu(gate) * up` of a stacked [T, 2I] projection (2 launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, check_tensor, next_pow2


@triton.jit
def rms_norm_row(h, w, n_cols, eps, dtype: tl.constexpr):
    """One row's RMSNorm: h [BLOCK] in the model dtype (zero past n_cols), weight w -> the normed
    row in `dtype`, rounded where PyTorch's `RMSNorm` rounds. `all_reduce` fuses it too."""
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    normed = (hf * inv).to(dtype)
    return (normed.to(tl.float32) * w.to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, rms_norm_row(x, w, n_cols, eps, out_ptr.dtype.element_ty), mask=mask)


def norm_warps(block: int) -> int:
    """Warps of a program that owns one row of `block` (a power of two) columns."""
    return min(16, max(1, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, N] (rows contiguous), weight: [N] in x's dtype -> normed [T, N]; with `residual`
    [T, N], returns (normed of x + residual, x + residual), the sum a new tensor."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(weight, "weight", ndim=1, dtypes=(x.dtype,), device=x.device)
    num_rows, n = x.shape
    check(weight.shape[0] == n, "weight.shape[0]", n, weight.shape[0])
    check(x.stride(1) == 1, "x.stride(1)", 1, x.stride(1))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_in = res_out = out  # never read or written without a residual
    if residual is not None:
        check_tensor(residual, "residual", ndim=2, dtypes=(x.dtype,), device=x.device)
        check(residual.shape == x.shape, "residual.shape", tuple(x.shape), tuple(residual.shape))
        check(residual.stride(1) == 1, "residual.stride(1)", 1, residual.stride(1))
        res_in, res_out = residual, torch.empty_like(out)
    if num_rows:
        block = next_pow2(n)
        _rms_norm_kernel[(num_rows,)](
            x, res_in, weight, out, res_out, n, float(eps),
            x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=norm_warps(block),
        )
    return out if residual is None else (out, res_out)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xh, stride_ct, stride_st,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)
    mask = (h < num_heads)[:, None] & d_ok[None, :]
    first = x_ptr + t * stride_xt + h.to(tl.int64)[:, None] * stride_xh + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, H, D] (head dim contiguous) in place by cos, sin: [T, D/2] (any row stride;
    a [T, 1, D/2] broadcast view is accepted), pairs (x[:D/2], x[D/2:]). Returns x."""
    check_tensor(x, "x", ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_size = x.shape
    check(head_size % 2 == 0, "head size", "even", head_size)
    check(x.stride(2) == 1, "x.stride(2)", 1, x.stride(2))
    half = head_size // 2
    cos, sin = (c.reshape(c.shape[0], -1) for c in (cos, sin))
    for name, c in (("cos", cos), ("sin", sin)):
        check_tensor(c, name, ndim=2, device=x.device)
        check(tuple(c.shape) == (num_tokens, half), f"{name}.shape", (num_tokens, half), tuple(c.shape))
        check(c.stride(1) == 1, f"{name}.stride(1)", 1, c.stride(1))
    if num_tokens and num_heads:
        block_h = min(next_pow2(num_heads), 16)
        _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            x, cos, sin, num_heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HALF=half, HALF_PAD=next_pow2(half), BLOCK_H=block_h, num_warps=4,
        )
    return x


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # rounded as F.silu's result
    tl.store(out_ptr + row * stride_o + cols,
             (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate then up, rows contiguous) -> silu(gate) * up, [T, I]."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    num_rows, two_n = x.shape
    check(two_n % 2 == 0, "x.shape[1]", "even (gate and up)", two_n)
    check(x.stride(1) == 1, "x.stride(1)", 1, x.stride(1))
    n = two_n // 2
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows and n:
        block = min(1024, next_pow2(n))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0),
                                                                 BLOCK=block, num_warps=4)
    return out
