"""Split-KV (FlashDecoding) scratch space and the reduction over splits.

When a step has too few (sequence, KV head, query tile) programs to fill the GPU, the paged
attention kernel also splits each sequence's key range into `num_splits` contiguous chunks.
Split `s` writes its normalised partial output `o_s` (float32) and its log-sum-exp `lse_s`
(natural log; -inf for an empty chunk) into this workspace; the reduction then combines them
with the same math as `merge_attn_states`:

    m = max_s lse_s;  w_s = exp(lse_s - m);  out = sum_s w_s o_s / sum_s w_s;
    lse = m + log(sum_s w_s)            (all parts empty: out = 0, lse = -inf)

The workspace is sized once from batch limits (so CUDA graphs keep fixed addresses) and passed
to every launch; steps with more tokens than it holds simply run unsplit, which is what they
want anyway since they already have many programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedattn.intmath import cdiv

from ._common import check, check_tensor, next_pow2, num_sms


@dataclass(frozen=True)
class SplitKVWorkspace:
    """Caller-owned scratch for split-KV attention.

    partial_out: [max_splits, max_num_tokens, Hq, D] float32
    partial_lse: [max_splits, max_num_tokens, Hq] float32
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @classmethod
    def allocate(cls, max_num_tokens: int, num_heads: int, head_size: int, max_splits: int,
                 device: torch.device | str) -> "SplitKVWorkspace":
        """Size for decode-like steps: `max_num_tokens` is usually the max number of sequences."""
        check(max_splits >= 1, "max_splits", ">= 1", max_splits)
        out = torch.empty(max_splits, max_num_tokens, num_heads, head_size,
                          dtype=torch.float32, device=device)
        lse = torch.empty(max_splits, max_num_tokens, num_heads, dtype=torch.float32,
                          device=device)
        return cls(out, lse)

    @property
    def max_splits(self) -> int:
        return self.partial_out.shape[0]

    @property
    def max_num_tokens(self) -> int:
        return self.partial_out.shape[1]

    def fits(self, num_tokens: int, num_heads: int, head_size: int) -> bool:
        return (num_tokens <= self.max_num_tokens and self.partial_out.shape[2] == num_heads
                and self.partial_out.shape[3] == head_size)


# Split-KV pays only while (sequences x KV heads) leaves the GPU short of programs; the
# kernel's policy stops splitting at 2 programs per SM, which bounds the tokens the scratch
# holds. The floor lets a forced `num_splits` work on small batches anywhere (and under the
# interpreter, which reports 1 SM).
MAX_SPLITS = 16
_MIN_TOKENS = 16
_shared: dict[tuple, SplitKVWorkspace] = {}


def shared_workspace(device: torch.device, num_heads: int, num_kv_heads: int,
                     head_size: int) -> SplitKVWorkspace:
    """The split-KV scratch every launch of this shape on `device` shares (launches run one at
    a time on a stream), allocated once and never replaced, so captured graphs keep its address."""
    key = (torch.device(device), num_heads, num_kv_heads, head_size)
    if key not in _shared:
        tokens = max(cdiv(2 * num_sms(key[0]), num_kv_heads), _MIN_TOKENS)
        _shared[key] = SplitKVWorkspace.allocate(tokens, num_heads, head_size, MAX_SPLITS, key[0])
    return _shared[key]


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits,
    stride_po_s, stride_po_t, stride_po_h, stride_po_d,
    stride_pl_s, stride_pl_t, stride_pl_h,
    stride_o_t, stride_o_h, stride_o_d, stride_l_t, stride_l_h,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_PAD)
    s_ok = s < num_splits
    lse = tl.load(part_lse_ptr + s.to(tl.int64) * stride_pl_s + t * stride_pl_t + h * stride_pl_h,
                  mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for empty splits
    w_sum = tl.sum(w, 0)
    o = tl.load(part_out_ptr + s.to(tl.int64)[:, None] * stride_po_s + t * stride_po_t
                + h * stride_po_h + d[None, :] * stride_po_d,
                mask=s_ok[:, None] & (d < HEAD_SIZE)[None, :], other=0.0)
    acc = tl.sum(o * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)
    tl.store(out_ptr + t * stride_o_t + h * stride_o_h + d * stride_o_d,
             acc.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)
    if WRITE_LSE:
        tl.store(lse_ptr + t * stride_l_t + h * stride_l_h,
                 tl.where(w_sum == 0.0, float("-inf"),
                          m_safe + tl.log(tl.where(w_sum == 0.0, 1.0, w_sum))))


def reduce_splits(workspace: SplitKVWorkspace, num_splits: int, out: torch.Tensor,
                  lse: torch.Tensor | None = None) -> None:
    """Combine the first `num_splits` partials of `workspace` into `out` [T, Hq, D] (and `lse`
    [T, Hq] float32 when given). `T = out.shape[0]` rows of the workspace are read."""
    check_tensor(out, "out", ndim=3)
    num_tokens, num_heads, head_size = out.shape
    check(workspace.fits(num_tokens, num_heads, head_size), "workspace.partial_out.shape",
          f"[>= {num_splits}, >= {num_tokens}, {num_heads}, {head_size}]",
          tuple(workspace.partial_out.shape))
    check(1 <= num_splits <= workspace.max_splits, "num_splits",
          f"1..{workspace.max_splits}", num_splits)
    if lse is not None:
        check_tensor(lse, "lse", ndim=2, dtypes=(torch.float32,), device=out.device)
        check(lse.shape == out.shape[:2], "lse.shape", tuple(out.shape[:2]), tuple(lse.shape))
    if num_tokens == 0:
        return
    lse_arg = lse if lse is not None else workspace.partial_lse
    _reduce_splits_kernel[(num_tokens, num_heads)](
        workspace.partial_out, workspace.partial_lse, out, lse_arg, num_splits,
        *workspace.partial_out.stride(), *workspace.partial_lse.stride(),
        *out.stride(), lse_arg.stride(0), lse_arg.stride(1),
        HEAD_SIZE=head_size, HEAD_PAD=next_pow2(head_size), SPLITS_PAD=next_pow2(num_splits),
        WRITE_LSE=lse is not None, num_warps=4,
    )
