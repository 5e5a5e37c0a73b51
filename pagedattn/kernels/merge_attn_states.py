"""Merge two partial attention results by their log-sum-exp (cascade / chunked attention).

Each part is a softmax-normalised output over a disjoint set of keys together with the
natural-log LSE of its scores. One program per (token, head):

    m = max(lse_a, lse_b);  w_a = exp(lse_a - m);  w_b = exp(lse_b - m)
    out = (w_a * out_a + w_b * out_b) / (w_a + w_b);  lse = m + log(w_a + w_b)

An empty part has LSE -inf and weight 0. Some libraries report +inf for an empty part, so +inf
is read as -inf too. Both parts empty: out = 0, lse = -inf. Math in float32. `split_kv.py`
reduces FlashDecoding splits with the same formula over more than two parts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, check_tensor, next_pow2


@triton.jit
def _merge_attn_states_kernel(
    out_ptr, out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_lse_ptr,
    stride_o_t, stride_o_h, stride_o_d, stride_a_t, stride_a_h, stride_a_d,
    stride_b_t, stride_b_h, stride_b_d,
    stride_la_t, stride_la_h, stride_lb_t, stride_lb_h, stride_lo_t, stride_lo_h,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    lse_a = tl.load(lse_a_ptr + t * stride_la_t + h * stride_la_h).to(tl.float32)
    lse_b = tl.load(lse_b_ptr + t * stride_lb_t + h * stride_lb_h).to(tl.float32)
    lse_a = tl.where(lse_a == float("inf"), float("-inf"), lse_a)
    lse_b = tl.where(lse_b == float("inf"), float("-inf"), lse_b)
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    w_sum = w_a + w_b
    inv = 1.0 / tl.where(w_sum == 0.0, 1.0, w_sum)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    o_a = tl.load(out_a_ptr + t * stride_a_t + h * stride_a_h + d * stride_a_d, mask=d_ok,
                  other=0.0).to(tl.float32)
    o_b = tl.load(out_b_ptr + t * stride_b_t + h * stride_b_h + d * stride_b_d, mask=d_ok,
                  other=0.0).to(tl.float32)
    o = (o_a * (w_a * inv) + o_b * (w_b * inv))
    tl.store(out_ptr + t * stride_o_t + h * stride_o_h + d * stride_o_d,
             o.to(out_ptr.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        tl.store(out_lse_ptr + t * stride_lo_t + h * stride_lo_h,
                 tl.where(w_sum == 0.0, float("-inf"),
                          m_safe + tl.log(tl.where(w_sum == 0.0, 1.0, w_sum))))


def merge_attn_states(
    out: torch.Tensor,
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out_lse: torch.Tensor | None = None,
) -> None:
    """Write the merge of parts a and b into `out` (and `out_lse` when given).

    out, out_a, out_b: [T, H, D] float32/float16/bfloat16 (may differ), any strides; `out` may
        alias `out_a` or `out_b`.
    lse_a, lse_b: [T, H] float32, natural log, -inf (or +inf) for an empty part.
    out_lse: optional [T, H] float32 output (may alias lse_a or lse_b).
    """
    check_tensor(out, "out", ndim=3, dtypes=FLOAT_DTYPES)
    device = out.device
    num_tokens, num_heads, head_size = out.shape
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        check_tensor(t, name, ndim=3, dtypes=FLOAT_DTYPES, device=device)
        check(t.shape == out.shape, f"{name}.shape", tuple(out.shape), tuple(t.shape))
    lses = [("lse_a", lse_a), ("lse_b", lse_b)]
    if out_lse is not None:
        lses.append(("out_lse", out_lse))
    for name, t in lses:
        check_tensor(t, name, ndim=2, dtypes=(torch.float32,), device=device)
        check(t.shape == out.shape[:2], f"{name}.shape", tuple(out.shape[:2]), tuple(t.shape))
    if num_tokens == 0 or num_heads == 0:
        return
    lse_o = out_lse if out_lse is not None else lse_a  # never written without out_lse
    _merge_attn_states_kernel[(num_tokens, num_heads)](
        out, out_a, lse_a, out_b, lse_b, lse_o,
        *out.stride(), *out_a.stride(), *out_b.stride(),
        *lse_a.stride(), *lse_b.stride(), *lse_o.stride(),
        HEAD_SIZE=head_size, HEAD_PAD=next_pow2(head_size), WRITE_LSE=out_lse is not None,
        num_warps=1 if head_size <= 128 else 2,
    )
