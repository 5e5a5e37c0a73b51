"""Split-KV (FlashDecoding) scratch space and the reduction over splits.

When a step has too few (sequence, KV head, query tile) programs to fill the GPU, the paged
attention kernel also splits each sequence's key range into `num_splits` contiguous chunks.
Split `s` writes its normalised partial output `o_s` (float32) and its online-softmax state
(`m_s`, the largest score in base-2 units, -inf for an empty chunk; `l_s`, the sum of
2^(score - m_s), 0 when empty) into this workspace; the reduction then combines them:

    M = max_s m_s;  w_s = 2^(m_s - M) l_s;  out = sum_s w_s o_s / sum_s w_s;
    lse = ln 2 * (M + log2(sum_s w_s))      (all parts empty: out = 0, lse = -inf)

With attention sinks the splits leave the sink out and the reduction adds it once, as one more
part of weight 2^(sink log2(e) - M) and output 0 (`attention_program._add_sink`'s update).

The state is kept as (m, l), not folded into one log-sum-exp per split: at scores near 1e5 a
float32 LSE rounds to ~0.01, which would weigh equal splits unequally (FlashInfer's merge of
LSEs has that error); m_s - M is exact when the splits share their maximum.

The workspace is sized once from batch limits (so CUDA graphs keep fixed addresses) and passed
to every launch; steps with more tokens than it holds simply run unsplit, which is what they
want anyway since they already have many programs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedattn.intmath import cdiv

from pagedattn.device_profile import DeviceProfile

from ._common import check, check_tensor, next_pow2
from .launch import BoundKernel, bind
from .pdl import use_pdl


@dataclass(frozen=True)
class SplitKVWorkspace:
    """Caller-owned scratch for split-KV attention: `rows` (split, token) rows, one launch of T
    tokens in S splits using the first S * T of them, viewed as [S, T, ...].

    partial_out: [rows, Hq, D] float32
    partial_stats: [rows, Hq, 2] float32, each split's (m, l) (module docstring)
    max_splits: the most splits any launch takes from it
    """

    partial_out: torch.Tensor
    partial_stats: torch.Tensor
    max_splits: int

    @classmethod
    def allocate(cls, max_num_tokens: int, num_heads: int, head_size: int, max_splits: int,
                 device: torch.device | str) -> "SplitKVWorkspace":
        """Room for `max_splits` splits of `max_num_tokens` tokens (or more splits of fewer
        tokens, up to `max_splits`); `max_num_tokens` is usually the max number of sequences."""
        check(max_splits >= 1, "max_splits", ">= 1", max_splits)
        check(max_num_tokens >= 1, "max_num_tokens", ">= 1", max_num_tokens)
        rows = max_num_tokens * max_splits
        out = torch.empty(rows, num_heads, head_size, dtype=torch.float32, device=device)
        stats = torch.empty(rows, num_heads, 2, dtype=torch.float32, device=device)
        return cls(out, stats, max_splits)

    @property
    def rows(self) -> int:
        return self.partial_out.shape[0]

    def splits_for(self, num_tokens: int, num_heads: int, head_size: int) -> int:
        """The most splits a launch of this shape can take from the workspace (1: run unsplit)."""
        if self.partial_out.shape[1:] != (num_heads, head_size) or num_tokens < 1:
            return 1
        return max(1, min(self.max_splits, self.rows // num_tokens))

    def views(self, num_splits: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([S, T, Hq, D], [S, T, Hq, 2]) views of the rows one launch of T tokens in S splits uses."""
        used = num_splits * num_tokens
        check(used <= self.rows, "split-KV workspace rows", f">= {used}", self.rows)
        heads, dim = self.partial_out.shape[1:]
        return (self.partial_out[:used].view(num_splits, num_tokens, heads, dim),
                self.partial_stats[:used].view(num_splits, num_tokens, heads, 2))


# Split-KV pays only while (sequences x KV heads) leaves the GPU short of programs; the split
# policy (`choose_num_splits`) then aims at a few programs per SM, so split count times tokens
# stays small: ROWS_PER_SM per SM bound the scratch. MAX_SPLITS bounds forced counts (the
# policy stops at 64); the floor lets a forced `num_splits` work on small batches anywhere (and under
# the interpreter, which reports 1 SM).
MAX_SPLITS = 128
ROWS_PER_SM = 8
_MIN_ROWS = 256
SPLITS_BLOCK = 16  # splits the reduction merges per step
_shared: dict[tuple, SplitKVWorkspace] = {}


def shared_workspace(device: torch.device, num_heads: int, num_kv_heads: int,
                     head_size: int) -> SplitKVWorkspace:
    """The split-KV scratch every launch of this shape on `device` shares (launches run one at
    a time on a stream), allocated once and never replaced, so captured graphs keep its address."""
    key = (torch.device(device), num_heads, num_kv_heads, head_size)
    if key not in _shared:
        rows = max(ROWS_PER_SM * DeviceProfile.of(key[0]).num_sms, _MIN_ROWS)
        _shared[key] = SplitKVWorkspace.allocate(cdiv(rows, MAX_SPLITS), num_heads, head_size,
                                                 MAX_SPLITS, key[0])
    return _shared[key]


@triton.jit(do_not_specialize=["num_splits", "stride_po_s", "stride_ps_s"])  # per-step values: one variant
def _reduce_splits_kernel(
    part_out_ptr, part_stats_ptr, out_ptr, lse_ptr, sinks_ptr, num_splits,
    stride_po_s, stride_po_t, stride_po_h, stride_po_d,
    stride_ps_s, stride_ps_t, stride_ps_h, stride_ps_c,
    stride_o_t, stride_o_h, stride_o_d, stride_l_t, stride_l_h,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_BLOCK: tl.constexpr,
    WRITE_LSE: tl.constexpr, USE_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    """One (token, head): the splits in blocks of SPLITS_BLOCK with a running max, so up to
    MAX_SPLITS partials merge without holding them all in registers."""
    if PDL:  # launched early (pdl.py): wait for the splits' writes
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    m = tl.max(tl.full([SPLITS_BLOCK], float("-inf"), tl.float32), 0)
    w_sum = tl.sum(tl.zeros([SPLITS_BLOCK], tl.float32), 0)
    acc = tl.zeros([HEAD_PAD], tl.float32)
    for s0 in range(0, num_splits, SPLITS_BLOCK):
        s = s0 + tl.arange(0, SPLITS_BLOCK)
        s_ok = s < num_splits
        s64 = s.to(tl.int64)
        stats = part_stats_ptr + s64 * stride_ps_s + t * stride_ps_t + h * stride_ps_h
        m_s = tl.load(stats, mask=s_ok, other=float("-inf"))
        l_s = tl.load(stats + stride_ps_c, mask=s_ok, other=0.0)
        m_new = tl.maximum(m, tl.max(m_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)  # 0 while nothing was seen (m = -inf)
        w = tl.where(l_s > 0.0, tl.exp2(m_s - m_safe) * l_s, 0.0)  # 0 for empty splits
        o = tl.load(part_out_ptr + s64[:, None] * stride_po_s + t * stride_po_t
                    + h * stride_po_h + d[None, :] * stride_po_d,
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        w_sum = w_sum * alpha + tl.sum(w, 0)
        m = m_new
    if USE_SINKS:  # the head's sink: a part of output 0 (see the module docstring)
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        acc = acc * alpha
        w_sum = w_sum * alpha + tl.exp2(sink - m_safe)
        m = m_new
    acc = acc / tl.where(w_sum == 0.0, 1.0, w_sum)
    tl.store(out_ptr + t * stride_o_t + h * stride_o_h + d * stride_o_d,
             acc.to(out_ptr.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(lse_ptr + t * stride_l_t + h * stride_l_h,
                 tl.where(w_sum == 0.0, float("-inf"),
                          (m_safe + tl.log2(tl.where(w_sum == 0.0, 1.0, w_sum))) * 0.6931471805599453))


def reduce_splits(workspace: SplitKVWorkspace, num_splits: int, out: torch.Tensor,
                  lse: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> None:
    """Combine the first `num_splits` partials of `workspace` into `out` [T, Hq, D] (and `lse`
    [T, Hq] float32 when given), with the attention sinks `sinks` [Hq] (any float dtype, unit
    stride) when given. `T = out.shape[0]` rows of the workspace are read."""
    check_tensor(out, "out", ndim=3)
    num_tokens, num_heads, head_size = out.shape
    limit = workspace.splits_for(num_tokens, num_heads, head_size)
    check(1 <= num_splits <= limit, "num_splits",
          f"1..{limit} (a workspace of {workspace.rows} rows of [{num_heads}, {head_size}], "
          f"at most {workspace.max_splits} splits, for {num_tokens} tokens)", num_splits)
    if lse is not None:
        check_tensor(lse, "lse", ndim=2, dtypes=(torch.float32,), device=out.device)
        check(lse.shape == out.shape[:2], "lse.shape", tuple(out.shape[:2]), tuple(lse.shape))
    if sinks is not None:
        check_tensor(sinks, "sinks", ndim=1, device=out.device)
        check(sinks.is_floating_point() and sinks.shape[0] == num_heads and sinks.stride(0) == 1,
              "sinks", f"a float tensor [{num_heads}] of unit stride", f"{sinks.dtype} {list(sinks.shape)}")
    launch_reduce_splits(workspace, num_splits, out, lse, sinks=sinks)


@functools.lru_cache(maxsize=None)
def _reduce_kernel(head_size: int, splits_block: int, write_lse: bool, sinks: bool, pdl: bool) -> BoundKernel:
    return bind(_reduce_splits_kernel, dict(HEAD_SIZE=head_size, HEAD_PAD=next_pow2(head_size),
                                            SPLITS_BLOCK=splits_block, WRITE_LSE=write_lse, USE_SINKS=sinks,
                                            PDL=pdl),
                dict(num_warps=4, **({"launch_pdl": True} if pdl else {})))


def launch_reduce_splits(workspace: SplitKVWorkspace, num_splits: int, out: torch.Tensor,
                         lse: torch.Tensor | None = None, views: tuple | None = None,
                         sinks: torch.Tensor | None = None) -> None:
    """`reduce_splits` for arguments already checked (`paged_attention`'s plan); `views`: the
    workspace's `views(num_splits, T)` when the caller has them."""
    num_tokens, num_heads, head_size = out.shape
    if num_tokens == 0:
        return
    part_out, part_stats = views if views is not None else workspace.views(num_splits, num_tokens)
    lse_arg = lse if lse is not None else part_stats[0, :, :, 0]  # never written without lse
    kernel = _reduce_kernel(head_size, min(SPLITS_BLOCK, next_pow2(num_splits)), lse is not None,
                            sinks is not None, use_pdl(out.device))
    kernel((num_tokens, num_heads), part_out, part_stats, out, lse_arg,
           sinks if sinks is not None else lse_arg, num_splits,
           *part_out.stride(), *part_stats.stride(), *out.stride(), lse_arg.stride(0), lse_arg.stride(1))
