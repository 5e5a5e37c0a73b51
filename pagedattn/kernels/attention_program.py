"""One program of `paged_attention` (paged_attention.py has the algorithm): the online-softmax
update over key tiles (`_attend_tiles`), the body that maps a program to its query rows and key
range and writes its output or split state (`_attend_program`, instantiated with the launch's
prefill tile and, in a mixed launch, again with its decode tile), and their elementwise helpers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .store_kv import _write_rows


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates cleanly to +-1 (exp overflow gives inf -> 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _add_sink(acc, l_i, m_i, sinks_ptr, head, row_ok):
    """The attention sink of each row's head joins its online-softmax state: one more score,
    `sinks[head]` (natural-log units, as given: not scaled or capped), whose value is 0, so it
    adds to the sum `l_i` only. State in base 2 (m_i the running max of score * log2(e));
    m_i = -inf (no key seen) leaves acc = 0 and l_i = 2^0 = 1: the row's output is 0 and its
    LSE the sink. A sink of -inf changes nothing."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_safe), m_new


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
def _load_tile(ptrs, n_ok, d_ok, MASK: tl.constexpr, EVEN_D: tl.constexpr, EVICT: tl.constexpr):
    """[BLOCK_N, HEAD_PAD] key/value tile; unmasked interior tiles of full heads load plainly.
    EVICT: the L2 eviction hint ("" none, "evict_first" for keys read once)."""
    if MASK:
        x = tl.load(ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0, eviction_policy=EVICT)
    elif EVEN_D:
        x = tl.load(ptrs, eviction_policy=EVICT)
    else:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0, eviction_policy=EVICT)
    return x


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, j_start, j_end,
    k_ptr, v_ptr, bt_row_ptr, kv_row0, kvh, qk_scale, soft_cap, slope, q_pos, win_left, win_right,
    key_lo, key_hi,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    PAGED: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    STAGES: tl.constexpr, EVICT: tl.constexpr,
):
    """Online-softmax update over key tiles [j_start, j_end) (units of BLOCK_N keys).
    MASK: apply per-row causal/window/length masks; loads are masked to [key_lo, key_hi).
    USE_WINDOW: a row at position p sees keys in [p - win_left, p + win_right] (the right
    bound only without CAUSAL, where the causal mask is tighter).
    STAGES: the loop's software-pipeline depth (None: the launch's num_stages)."""
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    kh_off = kvh.to(tl.int64) * stride_kh
    vh_off = kvh.to(tl.int64) * stride_vh
    for j in tl.range(j_start, j_end, num_stages=STAGES):
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
                       MASK, HEAD_SIZE == HEAD_PAD, EVICT)
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
                keep = keep & (n[None, :] >= q_pos[:, None] - win_left)
                if not CAUSAL:
                    keep = keep & (n[None, :] <= q_pos[:, None] + win_right)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_ptr + vh_off + v_off[:, None] + d[None, :] * stride_vd, n_ok, d_ok,
                       MASK, HEAD_SIZE == HEAD_PAD, EVICT)
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


@triton.jit
def _attend_program(
    b, q_begin, q_len, q0, kvh, split,
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_out_ptr, part_stats_ptr,
    seq_lens_ptr, block_tables_ptr, kv_start_loc_ptr, alibi_slopes_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
    sm_scale, soft_cap, win_left, win_right, num_splits, split_min_tiles,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_po_s, stride_po_t, stride_po_h, stride_po_d,
    stride_ps_s, stride_ps_t, stride_ps_h, stride_ps_c,
    stride_bt,
    new_k_ptr, new_v_ptr, new_slot_ptr,
    stride_nk_t, stride_nk_h, stride_nk_d, stride_nv_t, stride_nv_h, stride_nv_d,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr, EVICT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, FP8_KV: tl.constexpr, PAGED: tl.constexpr,
    WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    STORE_NEW: tl.constexpr, NEW_ROWS: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr, FP8_MIN_EXP: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One program's work: queries q0..q0+BLOCK_Q of sequence b (rows q_begin.. of `q`, q_len
    of them) times the GROUP query heads of KV head kvh, over split `split` of its keys. The
    tile shape is constexpr, so a kernel may call this with two shapes (mixed launches).
    STORE_NEW (launches where each sequence's queries are one tile): the program first writes
    the new rows (`new_k_ptr`/`new_v_ptr`, row t the key/value of query row t, at
    `new_slot_ptr[t]`) of head kvh whose positions lie in its split's key range, the only
    programs that read them, as a [NEW_ROWS >= BLOCK_Q, HEAD_PAD] tile; FP8_* as `store_kv`'s
    `_write_rows` takes them."""
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

    # Key range of this query tile (the union of its rows' ranges), then its unmasked middle
    # (the keys every row sees), in units of BLOCK_N keys.
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
        key_lo = tl.maximum(p_first - win_left, 0)
        full_lo = tl.maximum(p_last - win_left, 0)
        if not CAUSAL:  # a two-sided window also ends win_right keys past each row
            key_hi = tl.minimum(p_last + win_right + 1, seq_len)
            full_hi = tl.minimum(p_first + win_right + 1, seq_len)
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
    if STORE_NEW:
        # the new rows at positions in [s_lo, s_hi) key tiles: this split is their only reader
        i = tl.arange(0, NEW_ROWS)
        pos = seq_len - q_len + q0 + i
        mine = (i < BLOCK_Q) & (q0 + i < q_len) & (pos >= s_lo * BLOCK_N) & (pos < s_hi * BLOCK_N)
        _write_rows(new_k_ptr, new_v_ptr, k_ptr, v_ptr, new_slot_ptr, k_scale_ptr, v_scale_ptr,
                    q_begin + q0 + i, kvh + i * 0, mine,
                    stride_nk_t, stride_nk_h, stride_nk_d, stride_nv_t, stride_nv_h, stride_nv_d,
                    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                    HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, FP8_KV, FP8_MAX, FP8_MANTISSA_BITS, FP8_MIN_EXP,
                    INTERPRETED)
        tl.debug_barrier()  # every thread's writes before any thread's loads of them

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # masked head (window edge), unmasked middle, masked tail (causal diagonal / length)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, s_lo, tl.minimum(j_full_lo, s_hi),
        k_ptr, v_ptr, bt_row_ptr, kv_row0, kvh, qk_scale, soft_cap, slope, q_pos, win_left, win_right,
        key_lo, key_hi, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        HEAD_SIZE, HEAD_PAD, BLOCK_N, BLOCK_SIZE, True, CAUSAL, USE_WINDOW, USE_ALIBI,
        USE_SOFTCAP, PAGED, UPCAST, IEEE, STAGES, EVICT)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, tl.maximum(s_lo, j_full_lo), tl.minimum(s_hi, j_full_hi),
        k_ptr, v_ptr, bt_row_ptr, kv_row0, kvh, qk_scale, soft_cap, slope, q_pos, win_left, win_right,
        key_lo, key_hi, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        HEAD_SIZE, HEAD_PAD, BLOCK_N, BLOCK_SIZE, False, CAUSAL, USE_WINDOW, USE_ALIBI,
        USE_SOFTCAP, PAGED, UPCAST, IEEE, STAGES, EVICT)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, tl.maximum(s_lo, j_full_hi), s_hi,
        k_ptr, v_ptr, bt_row_ptr, kv_row0, kvh, qk_scale, soft_cap, slope, q_pos, win_left, win_right,
        key_lo, key_hi, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        HEAD_SIZE, HEAD_PAD, BLOCK_N, BLOCK_SIZE, True, CAUSAL, USE_WINDOW, USE_ALIBI,
        USE_SOFTCAP, PAGED, UPCAST, IEEE, STAGES, EVICT)

    if USE_SINKS and not SPLIT:  # split launches: the reduction adds the sink, once (split_kv.py)
        acc, l_i, m_i = _add_sink(acc, l_i, m_i, sinks_ptr, head, row_ok)
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
