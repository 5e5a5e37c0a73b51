"""Variable-length attention over a paged KV cache: decode, multi-token decode, prefill over a
cached prefix and mixed batches, in one launch.

Semantics (the library's reference): query token i of sequence b (0 <= i < query_len_b) sits at
absolute position p = seq_len_b - query_len_b + i (bottom-right aligned). Score s = scale * q.k;
soft cap c: s = c * tanh(s / c); ALiBi: s += slope_h * (key_pos - p); causal: keys <= p;
sliding window W: keys > p - W; non-causal: all keys < seq_len_b. Softmax in float32.

Algorithm (FlashAttention-2 with GQA packing and FlashDecoding splits):
- Grid (query tiles x KV heads, splits). Sequence b owns query tiles
  `query_start_loc[b] // BLOCK_Q + b ...`; this start is strictly increasing in b, covers
  ceil(query_len_b / BLOCK_Q) tiles and bounds the grid by T // BLOCK_Q + B, so a program
  finds its sequence with a fixed-length binary search and surplus tiles return at once.
  When `max_query_len` <= BLOCK_Q (decode, short multi-token decode) every sequence has one
  tile: the grid has B tiles and tile b is sequence b, no search (8 dependent loads a program).
- GQA packing: the program's tile holds BLOCK_Q query tokens times the GROUP = Hq / Hkv query
  heads that share its KV head (row r = token r // GROUP, head r % GROUP), so every key/value
  tile is loaded once and goes through one `tl.dot` for all of them.
- Key range: causal programs stop after their last token's position, a sliding window starts
  the loop at the first tile any row needs (earlier blocks are never touched). The range is cut
  into an unmasked middle (every row sees every key) and masked edges, so the hot loop carries
  no mask arithmetic. Keys are gathered through the block table, with int64 addresses; with
  `kv_start_loc` the keys are rows of contiguous [total_kv, Hkv, D] tensors instead.
- Online softmax in base 2 (log2(e) folded into the score scale); FP8 caches are read raw and
  converted to the query dtype (to fp16 for bf16 queries, which are scaled by a power of two
  into fp16's range: FP8 converts to fp16 natively, to bf16 only through fp16 or fp32), with
  k_scale folded into the score scale and v_scale applied to the normalised output.
- Split-KV: with num_splits > 1 each split takes a contiguous share of the key tiles and writes
  (normalised output, LSE) to the caller's `SplitKVWorkspace`; `reduce_splits` merges them.
  The count is a runtime argument: one compiled variant serves every count (1 to 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, FP8_DTYPES, INTERPRET, check, check_tensor, next_pow2,
                      num_sms, scale_tensor)
from .paged_attention_config import choose_num_splits, choose_tile, forced_tile, split_min_tiles
from .pdl import launch_options, use_pdl
from .split_kv import SplitKVWorkspace, reduce_splits


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates cleanly to +-1 (exp overflow gives inf -> 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _fp16_operand(q):
    """bf16 `q` as an fp16 operand for FP8 keys and values, which convert to fp16 natively.
    Scaled by 2^e so that its largest magnitude lands in [2^15, 2^16): every bf16 value scales
    exactly, nothing reaches fp16's 65504, and only elements under 2^-29 of the largest become
    fp16 subnormals (absolute error at most 2^-40 of the largest). Returns (q * 2^e in fp16,
    2^-e), e built from exponent bits (no rounding anywhere)."""
    qf = q.to(tl.float32)
    m = tl.max(tl.max(tl.abs(qf), 1), 0)
    e = 15 - (((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127)  # 15 - floor(log2 m)
    e = tl.minimum(tl.maximum(e, -126), 126)  # m = 0 or subnormal: 2^126, q stays 0 or tiny
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return (qf * up).to(tl.float16), down


@triton.jit
def _load_tile(ptrs, n_ok, d_ok, MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """[BLOCK_N, HEAD_PAD] key/value tile; unmasked interior tiles of full heads load plainly."""
    if MASK:
        x = tl.load(ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return x


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, j_start, j_end,
    k_ptr, v_ptr, bt_row_ptr, kv_row0, kvh, qk_scale, soft_cap, slope, q_pos, window,
    key_lo, key_hi,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    PAGED: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Online-softmax update over key tiles [j_start, j_end) (units of BLOCK_N keys).
    MASK: apply per-row causal/window/length masks; loads are masked to [key_lo, key_hi)."""
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    kh_off = kvh.to(tl.int64) * stride_kh
    vh_off = kvh.to(tl.int64) * stride_vh
    for j in range(j_start, j_end):
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = (n >= key_lo) & (n < key_hi)  # only used by MASK tiles
        if PAGED:
            if MASK:
                block = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=n_ok, other=0)
            else:
                block = tl.load(bt_row_ptr + n // BLOCK_SIZE)
            block = block.to(tl.int64)
            within = (n % BLOCK_SIZE).to(tl.int64)
            k_off = block * stride_kb + within * stride_ks
            v_off = block * stride_vb + within * stride_vs
        else:
            row = kv_row0 + n.to(tl.int64)
            k_off = row * stride_ks
            v_off = row * stride_vs
        k = _load_tile(k_ptr + kh_off + k_off[:, None] + d[None, :] * stride_kd, n_ok, d_ok,
                       MASK, HEAD_SIZE == HEAD_PAD)
        if UPCAST:
            k = k.to(tl.float32)
        else:
            k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if USE_SOFTCAP:
            s = soft_cap * _tanh(s * qk_scale / soft_cap) * 1.4426950408889634
        else:
            s = s * (qk_scale * 1.4426950408889634)
        if USE_ALIBI:
            s += slope[:, None] * (n[None, :] - q_pos[:, None]).to(tl.float32)
        if MASK:
            if CAUSAL:
                keep = n[None, :] <= q_pos[:, None]
            else:
                # every row sees every key, whatever its position (a row may sit before the
                # first key when a sequence has more queries than keys: cross attention)
                keep = (n < key_hi)[None, :]
            if USE_WINDOW:
                keep = keep & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_ptr + vh_off + v_off[:, None] + d[None, :] * stride_vd, n_ok, d_ok,
                       MASK, HEAD_SIZE == HEAD_PAD)
        if UPCAST:
            v = v.to(tl.float32)
        else:
            v = v.to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


# Integer arguments that change from step to step are not specialised on (Triton compiles a
# variant per value class: == 1, divisible by 16, other): a server's steps would otherwise meet
# new classes mid-run and stall for a compilation each (seconds on an H100). Besides the counts:
# the block table's row stride (its width) and the split scratch's outer strides (an unsplit
# launch passes `num_seqs` there). The builder aligns its views, so pointers keep one class too.
@triton.jit(do_not_specialize=["window", "num_seqs", "num_tiles", "num_splits", "split_min_tiles", "stride_bt",
                               "stride_po_s", "stride_ps_s"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_out_ptr, part_stats_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, kv_start_loc_ptr,
    alibi_slopes_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale, soft_cap, window, num_seqs, num_tiles, num_splits, split_min_tiles,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_po_s, stride_po_t, stride_po_h, stride_po_d,
    stride_ps_s, stride_ps_t, stride_ps_h, stride_ps_c,
    stride_bt,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, ONE_TILE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, FP8_KV: tl.constexpr, PAGED: tl.constexpr,
    WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched early (pdl.py): wait for the store's writes, let the reduction launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Axis 0 enumerates (query tile, KV head), KV heads fastest and the last query tiles -
    # the longest causal rows - first, so heavy programs start early and the tail is short.
    kvh = tl.program_id(0) % NUM_KV_HEADS
    pid = num_tiles - 1 - tl.program_id(0) // NUM_KV_HEADS
    split = tl.program_id(1)

    if ONE_TILE:  # every sequence's queries fit one tile: tile pid is sequence pid
        b = pid
        q_begin = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_begin
        q0 = pid * 0
    else:
        # Largest b with query_start_loc[b] // BLOCK_Q + b <= pid (strictly increasing in b).
        lo = pid * 0
        hi = lo + num_seqs
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        b = lo
        q_begin = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_begin
        q0 = (pid - (q_begin // BLOCK_Q + b)) * BLOCK_Q
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)

    r = tl.arange(0, BLOCK_M)
    q_idx = q0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = tl.where(row_ok, seq_len - q_len + q_idx, -1)  # absolute position; -1: padding row
    tok = (q_begin + q_idx).to(tl.int64)
    head64 = head.to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head64[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    qk_scale = sm_scale
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        if not UPCAST:
            if q.dtype == tl.bfloat16:  # fp8 -> fp16 is native (cvt.rn.f16x2.e4m3x2), -> bf16 is not
                q, q_unscale = _fp16_operand(q)
                qk_scale = qk_scale * q_unscale
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_slopes_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634

    # Key range of this query tile, then its unmasked middle, in units of BLOCK_N keys.
    p_first = seq_len - q_len + q0
    p_last = seq_len - q_len + tl.minimum(q0 + BLOCK_Q, q_len) - 1
    if CAUSAL:
        key_hi = p_last + 1
        full_hi = p_first + 1
    else:
        key_hi = seq_len
        full_hi = seq_len
    key_lo = p_first * 0
    full_lo = key_lo
    if USE_WINDOW:
        key_lo = tl.maximum(p_first - window + 1, 0)
        full_lo = tl.maximum(p_last - window + 1, 0)
    j_lo = key_lo // BLOCK_N
    j_hi = tl.cdiv(key_hi, BLOCK_N)
    j_full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), j_lo), j_hi)
    j_full_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N, j_full_lo), j_hi)
    per_split = tl.cdiv(j_hi - j_lo, num_splits)
    if tl.cdiv(seq_len, BLOCK_N) < split_min_tiles:  # too short to split: split 0 takes every tile
        per_split = j_hi - j_lo
    s_lo = tl.minimum(j_lo + split * per_split, j_hi)
    s_hi = tl.minimum(s_lo + per_split, j_hi)

    bt_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
    kv_row0 = b.to(tl.int64) * 0
    if not PAGED:
        kv_row0 = tl.load(kv_start_loc_ptr + b).to(tl.int64)

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # masked head (window edge), unmasked middle, masked tail (causal diagonal / length)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, s_lo, tl.minimum(j_full_lo, s_hi),
        k_ptr, v_ptr, bt_row_ptr, kv_row0, kvh, qk_scale, soft_cap, slope, q_pos, window,
        key_lo, key_hi, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        HEAD_SIZE, HEAD_PAD, BLOCK_N, BLOCK_SIZE, True, CAUSAL, USE_WINDOW, USE_ALIBI,
        USE_SOFTCAP, PAGED, UPCAST, IEEE)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, tl.maximum(s_lo, j_full_lo), tl.minimum(s_hi, j_full_hi),
        k_ptr, v_ptr, bt_row_ptr, kv_row0, kvh, qk_scale, soft_cap, slope, q_pos, window,
        key_lo, key_hi, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        HEAD_SIZE, HEAD_PAD, BLOCK_N, BLOCK_SIZE, False, CAUSAL, USE_WINDOW, USE_ALIBI,
        USE_SOFTCAP, PAGED, UPCAST, IEEE)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, tl.maximum(s_lo, j_full_hi), s_hi,
        k_ptr, v_ptr, bt_row_ptr, kv_row0, kvh, qk_scale, soft_cap, slope, q_pos, window,
        key_lo, key_hi, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        HEAD_SIZE, HEAD_PAD, BLOCK_N, BLOCK_SIZE, True, CAUSAL, USE_WINDOW, USE_ALIBI,
        USE_SOFTCAP, PAGED, UPCAST, IEEE)

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if FP8_KV:
        o = o * tl.load(v_scale_ptr)
    if not SPLIT:
        tl.store(out_ptr + tok[:, None] * stride_ot + head64[:, None] * stride_oh
                 + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=io_mask)
        if WRITE_LSE:  # natural-log LSE of the scaled scores (m_i, l_i are base 2)
            lse = tl.where(empty, float("-inf"),
                           (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
            tl.store(lse_ptr + tok * stride_lt + head64 * stride_lh, lse, mask=row_ok)
    else:  # the online-softmax state (m, l) as it is: the reduction merges it (split_kv.py)
        split64 = split.to(tl.int64)
        tl.store(part_out_ptr + split64 * stride_po_s + tok[:, None] * stride_po_t
                 + head64[:, None] * stride_po_h + d[None, :] * stride_po_d, o, mask=io_mask)
        stats = part_stats_ptr + split64 * stride_ps_s + tok * stride_ps_t + head64 * stride_ps_h
        tl.store(stats, m_i, mask=row_ok)
        tl.store(stats + stride_ps_c, l_i, mask=row_ok)


def search_steps(num_seqs: int) -> int:
    """Steps of the kernel's binary search for its sequence: enough for `num_seqs`, rounded up
    to a multiple of 4 (at least 8), so one compiled variant serves every batch of up to 255
    sequences (surplus steps leave the search where it is)."""
    return max(8, -(-num_seqs.bit_length() // 4) * 4)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor | None,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    soft_cap: float | None = None,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    lse: torch.Tensor | None = None,
    workspace: SplitKVWorkspace | None = None,
    kv_start_loc: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of `query` over the paged cache, written into `out` (returned).

    query: [T, Hq, D] float32/float16/bfloat16; tokens of sequence b are rows
        query_start_loc[b]..query_start_loc[b+1] (prefills and decodes in any order).
    k_cache, v_cache: [num_blocks, block_size, Hkv, D] in the query dtype or float8_e4m3fn /
        float8_e5m2 (read as stored * k_scale / v_scale), any strides. With `kv_start_loc`
        they are instead contiguous-by-rows [total_kv, Hkv, D] tensors.
    out: [T, Hq, D] in the query dtype, caller-owned.
    query_start_loc: [B+1] int32. seq_lens: [B] int32, keys per sequence (context + query).
    block_tables: [B, W] int32 physical block ids (None with `kv_start_loc`).
    max_query_len, max_seq_len: host ints bounding the batch (tile, grid and split choice);
        max_query_len must be >= every sequence's query length (a decode-like launch gives
        each sequence one query tile), max_seq_len only steers speed.
    scale: score scale. causal: bottom-right aligned causal mask (False: all keys < seq_len).
    sliding_window: W keys up to and including the query's own position (causal only).
    alibi_slopes: [Hq] float32. soft_cap: c in c * tanh(s / c).
    k_scale, v_scale: 0-dim float32 device tensors (python floats cost an allocation); FP8 only.
    lse: optional [T, Hq] float32 output, natural-log log-sum-exp of each row's scores.
    workspace: split-KV scratch; without it (or when it holds no 2 splits of T tokens) the
        launch is unsplit.
    kv_start_loc: [B+1] int32; sequence b's keys are rows kv_start_loc[b] + (0..seq_lens[b]-1).
    num_splits: force the split count (tests, tuning); needs a workspace when > 1.
    tile: force (BLOCK_N keys per step, num_warps, num_stages[, BLOCK_M rows]) instead
        of the policy's (`paged_attention_config.choose_tile`; tuning); without BLOCK_M the
        query tile stays the policy's.
    """
    check_tensor(query, "query", ndim=3, dtypes=FLOAT_DTYPES)
    device = query.device
    num_tokens, num_heads, head_size = query.shape
    check_tensor(out, "out", ndim=3, dtypes=(query.dtype,), device=device)
    check(out.shape == query.shape, "out.shape", tuple(query.shape), tuple(out.shape))
    paged = kv_start_loc is None
    cache_ndim = 4 if paged else 3
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(cache, name, ndim=cache_ndim, device=device,
                     dtypes=(query.dtype,) + FP8_DTYPES)
        check(cache.shape[-1] == head_size, f"{name}.shape[-1] (head size)", head_size,
              cache.shape[-1])
    check(v_cache.shape == k_cache.shape, "v_cache.shape", tuple(k_cache.shape),
          tuple(v_cache.shape))
    check(v_cache.dtype == k_cache.dtype, "v_cache.dtype", k_cache.dtype, v_cache.dtype)
    num_kv_heads = k_cache.shape[-2]
    check(num_kv_heads >= 1 and num_heads % num_kv_heads == 0, "num query heads",
          f"a multiple of num_kv_heads={num_kv_heads}", num_heads)
    check_tensor(query_start_loc, "query_start_loc", ndim=1, dtypes=(torch.int32,),
                 device=device)
    num_seqs = query_start_loc.shape[0] - 1
    check(num_seqs >= 0, "query_start_loc.shape[0]", ">= 1", query_start_loc.shape[0])
    check_tensor(seq_lens, "seq_lens", ndim=1, dtypes=(torch.int32,), device=device)
    check(seq_lens.shape[0] == num_seqs, "seq_lens.shape[0]", num_seqs, seq_lens.shape[0])
    if paged:
        check_tensor(block_tables, "block_tables", ndim=2, dtypes=(torch.int32,), device=device)
        check(block_tables.shape[0] == num_seqs, "block_tables.shape[0]", num_seqs,
              block_tables.shape[0])
        check(block_tables.stride(1) == 1 or block_tables.shape[1] <= 1,
              "block_tables.stride(1)", 1, block_tables.stride(1))
        block_size = k_cache.shape[1]
        bt_arg, bt_stride, kv_start_arg = block_tables, block_tables.stride(0), query_start_loc
        kv_strides = (*k_cache.stride(), *v_cache.stride())
    else:
        check(block_tables is None, "block_tables with kv_start_loc", None, "a tensor")
        check_tensor(kv_start_loc, "kv_start_loc", ndim=1, dtypes=(torch.int32,), device=device)
        check(kv_start_loc.shape[0] == num_seqs + 1, "kv_start_loc.shape[0]", num_seqs + 1,
              kv_start_loc.shape[0])
        block_size = 1
        bt_arg, bt_stride, kv_start_arg = seq_lens, 0, kv_start_loc
        kv_strides = (0, *k_cache.stride(), 0, *v_cache.stride())
    if sliding_window is not None:
        check(causal, "sliding_window with causal=False", "causal=True", "causal=False")
        check(sliding_window >= 1, "sliding_window", ">= 1", sliding_window)
    if alibi_slopes is not None:
        check_tensor(alibi_slopes, "alibi_slopes", ndim=1, dtypes=(torch.float32,),
                     device=device)
        check(alibi_slopes.shape[0] == num_heads, "alibi_slopes.shape[0]", num_heads,
              alibi_slopes.shape[0])
    if soft_cap is not None:
        check(soft_cap > 0, "soft_cap", "> 0", soft_cap)
    if lse is not None:
        check_tensor(lse, "lse", ndim=2, dtypes=(torch.float32,), device=device)
        check(lse.shape == query.shape[:2], "lse.shape", tuple(query.shape[:2]),
              tuple(lse.shape))
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("kv_start_loc", kv_start_loc), ("alibi_slopes", alibi_slopes)):
        if t is not None:
            check(t.stride(0) == 1 or t.shape[0] <= 1, f"{name}.stride(0)", 1, t.stride(0))
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    sms = num_sms(device)
    chosen = choose_tile(head_size=head_size, group=group, max_query_len=max_query_len,
                         elem_bytes=query.element_size(), interpret=INTERPRET, max_seq_len=max_seq_len,
                         num_seqs=num_seqs, num_kv_heads=num_kv_heads, num_sms=sms, paged=paged)
    tile = chosen if tile is None else forced_tile(chosen, *tile, group=group, interpret=INTERPRET)
    limit = 1 if workspace is None else workspace.splits_for(num_tokens, num_heads, head_size)
    min_tiles = 0  # a forced count splits every sequence
    if num_splits is None:
        num_splits = 1 if limit < 2 else choose_num_splits(
            num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_query_len=max_query_len,
            max_seq_len=max_seq_len, block_q=tile.block_q, block_n=tile.block_n,
            num_sms=sms, max_splits=limit, kv_elem_bytes=k_cache.element_size())
        min_tiles = split_min_tiles(num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_query_len=max_query_len,
                                    block_q=tile.block_q, num_sms=sms)
    elif num_splits > 1:
        check(num_splits <= limit, "workspace for num_splits",
              f"a SplitKVWorkspace with room for {num_splits} splits of {num_tokens} tokens, "
              f"{num_heads} heads of size {head_size}",
              None if workspace is None else
              f"{limit} splits ({workspace.rows} rows of {tuple(workspace.partial_out.shape[1:])}, "
              f"max_splits {workspace.max_splits})")
    fp8 = k_cache.dtype in FP8_DTYPES
    k_scale_t = scale_tensor(k_scale, "k_scale", device) if fp8 else seq_lens
    v_scale_t = scale_tensor(v_scale, "v_scale", device) if fp8 else seq_lens
    if num_splits > 1:
        part_out, part_stats = workspace.views(num_splits, num_tokens)
    else:
        part_out, part_stats = out.unsqueeze(0), seq_lens.view(1, -1, 1, 1)  # never written
    lse_arg = lse if lse is not None else seq_lens.view(-1, 1)  # never written without lse

    # Decode-like launches (every sequence's queries within one tile, as `max_query_len` bounds
    # them) map tile b to sequence b; otherwise tiles are numbered as the kernel's search expects.
    one_tile = max_query_len <= tile.block_q
    num_tiles = num_seqs if one_tile else num_tokens // tile.block_q + num_seqs  # >= what every sequence needs
    grid = (num_tiles * num_kv_heads, num_splits)
    pdl = use_pdl(device)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, lse_arg, part_out, part_stats,
        query_start_loc, seq_lens, bt_arg, kv_start_arg,
        alibi_slopes if alibi_slopes is not None else seq_lens, k_scale_t, v_scale_t,
        float(scale), float(soft_cap or 0.0), int(sliding_window or 0), num_seqs, num_tiles,
        num_splits, min_tiles,
        *query.stride(), *kv_strides, *out.stride(), lse_arg.stride(0), lse_arg.stride(1),
        *part_out.stride(), *part_stats.stride(), bt_stride,
        HEAD_SIZE=head_size, HEAD_PAD=max(16, next_pow2(head_size)), GROUP=group,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_Q=tile.block_q, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_SIZE=block_size, SPLIT=num_splits > 1, ONE_TILE=one_tile, SEARCH_STEPS=search_steps(num_seqs),
        CAUSAL=bool(causal), USE_WINDOW=sliding_window is not None,
        USE_ALIBI=alibi_slopes is not None, USE_SOFTCAP=soft_cap is not None, FP8_KV=fp8,
        PAGED=paged, WRITE_LSE=lse is not None, UPCAST=INTERPRET,
        IEEE=query.dtype == torch.float32, PDL=pdl,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(device),
    )
    if num_splits > 1:
        reduce_splits(workspace, num_splits, out, lse)
    return out
