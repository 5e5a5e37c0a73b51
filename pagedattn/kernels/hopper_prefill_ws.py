"""The warp-specialised Gluon prefill kernel for Hopper (head size 128; `hopper_prefill.py`
launches it and owns the policy, the scope and the checks).

FlashAttention-3's division of labour, without its ping-pong (measured: no gain here, see
docs/PERF.md, "Gluon kernel tiles"; 2026-11-26, 3b17081):
- a producer warpgroup copies Q (cp.async), then key/value tile t into ring slot t % STAGES
  once every consumer has handed that slot back (`empty`), completing its `full` mbarrier:
  over pages by cp.async (each producer thread's copies arrive on it when they land), over
  contiguous keys by TMA (bytes expected); over contiguous keys it may also write its tile's
  own rows into the paged cache (`store_rows`) while the consumers finish;
- one or two consumer warpgroups, 64 query rows each, run the intra-warpgroup overlapped loop of
  the one-warpgroup kernel: wait for tile j; issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}; the
  softmax of S_j while the second runs; hand tile j-1's slot back once it is done;
- in a mixed launch on one consumer, a decode program (a few query rows: GROUP x its tokens)
  swaps the operands instead (`decode_tiles`): S^T = K Q^T and O^T += V^T P^T over 8-32 query
  columns, so its products are 1/8 of a 64-row tile's (2k chunk + 64 decodes: 332.5 against
  346 us on the H100, 6c37aaf, 2026-11-26; docs/PERF.md, "Mixed steps").
There is no CTA barrier in the loop, and the copies' instructions leave the consumers' issue
slots. `setmaxnreg` moves registers: 40 a producer thread (56 if it stores rows), the rest to the
consumers (216 with one consumer at two programs an SM, 232 with two at one). ptxas reports the
launch's 168 but allocates each partition within its own count (the consumers' SASS uses R227).
At 24 the producer spilled where GROUP is 3, and the kernel died on an illegal instruction (H100).
64-key tiles: 128-key ones, even without spills (a producer at 24 leaves the consumers 240),
measured 9-12% slower (docs/PERF.md, "What was tried and not kept"; 2026-11-26, d7224da).

Constexprs are bound in a closure (`ws_kernel` builds one kernel per configuration): a
partition's arguments reach it as run-time values in Triton 3.6, constexprs included.
"""

from __future__ import annotations

import functools

from .hopper_parts import GLUON

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .hopper_parts import (async_copy, block_ids, cta_barrier, fence_async_shared, first_softmax, issue_pages,
                               issue_tma, mbarrier, overlapped_tile, program_tile, scores, warpgroup_mma,
                               warpgroup_mma_wait)

PRODUCER_WARPS = 4  # one warpgroup: `setmaxnreg` moves registers between whole warpgroups
# Registers a producer thread keeps (ptxas compiles its code within them: fewer spill, see
# below); 56 when it also stores rows (`store_rows`: at 40 or 48 it spilled where GROUP is 3 or 5).
PRODUCER_REGS = 40
STORING_PRODUCER_REGS = 56
REGS_PER_LANE = 65536 // 32  # an SM's register file, per lane of its warps


def swapped_decode_rows(decode_rows: int, *, consumers: int, block_n: int, head: int) -> int:
    """The query columns (`decode_rows` rounded up to 8) of the swapped decode body
    (`decode_tiles`) if it can take a mixed launch's decodes of that many rows, else 0: one
    consumer, and P^T [columns, BLOCK_N] fitting in Q's buffer after the query columns."""
    cols = max(8, decode_rows)
    return cols if consumers == 1 and 2 * cols <= ROWS and block_n <= head else 0


def consumer_regs(producer_regs: int, consumer_warps: int) -> int:
    """A worker consumer's request with one program an SM: what the producer leaves, a multiple
    of 8 (`setmaxnreg`'s granule); the first consumer gets the same."""
    return (REGS_PER_LANE - PRODUCER_WARPS * producer_regs) // consumer_warps // 8 * 8
ROWS = 64  # query rows a consumer warpgroup computes


@functools.lru_cache(maxsize=None)
def ws_kernel(*, head: int, group: int, num_kv_heads: int, block_n: int, block_size: int, stride_ks: int,
              stride_vs: int, stages: int, search_steps: int, causal: bool, paged: bool, write_lse: bool,
              consumers: int, store_block_size: int = 0, decode_rows: int = 0):
    """The kernel for one configuration (`consumers` warpgroups of ROWS query rows); launch it
    with num_warps=4 (the first consumer runs in the kernel's own warps). `store_block_size` > 0
    (contiguous keys only): the producer also writes its tile's key/value rows into a paged
    cache of that page size (`store_rows`). `decode_rows` > 0 (one consumer): a mixed launch's
    decode programs, whose query rows fit that many, take the swapped-operand body
    (`decode_tiles`)."""
    HEAD = gl.constexpr(head)
    GROUP = gl.constexpr(group)
    NUM_KV_HEADS = gl.constexpr(num_kv_heads)
    BLOCK_N = gl.constexpr(block_n)
    BLOCK_SIZE = gl.constexpr(block_size)
    STRIDE_KS = gl.constexpr(stride_ks)
    STRIDE_VS = gl.constexpr(stride_vs)
    STAGES = gl.constexpr(stages)
    SEARCH_STEPS = gl.constexpr(search_steps)
    CAUSAL = gl.constexpr(causal)
    PAGED = gl.constexpr(paged)
    WRITE_LSE = gl.constexpr(write_lse)
    CONSUMERS = gl.constexpr(consumers)
    storing = store_block_size > 0
    STORE = gl.constexpr(storing)
    assert decode_rows in (0, swapped_decode_rows(decode_rows, consumers=consumers, block_n=block_n, head=head)), \
        "the swapped decode body runs in one consumer, its P^T in the rows of Q's buffer"
    DEC_N = gl.constexpr(max(8, decode_rows))
    SWAP_DECODES = gl.constexpr(decode_rows > 0)
    STORE_BLOCK_SIZE = gl.constexpr(max(1, store_block_size))
    M = gl.constexpr(ROWS)
    BLOCK_Q = gl.constexpr(max(1, ROWS * consumers // group))
    P_WARPS = gl.constexpr(PRODUCER_WARPS)
    p_regs = STORING_PRODUCER_REGS if storing else PRODUCER_REGS
    P_REGS = gl.constexpr(p_regs)
    C_REGS = gl.constexpr(consumer_regs(p_regs, 4 * consumers))
    P_THREADS = gl.constexpr(PRODUCER_WARPS * 32)
    FULL_COUNT = gl.constexpr(PRODUCER_WARPS * 32 if paged else 1)  # cp.async: every producer thread arrives
    # A consumer's layouts: the two products' accumulators (4 warps stacked along the rows), P
    # as the second's register operand, 16 bytes a thread for global memory.
    S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, block_n, 16]))
    O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, head, 16]))
    P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
    # The swapped decode body's: S^T [keys, DEC_N] and O^T [HEAD, DEC_N] accumulators.
    ST_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, max(8, decode_rows), 16]))
    tpd = head // 8
    IO_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // tpd, tpd],
                                              warps_per_cta=[4, 1], order=[1, 0]))
    # The producer's: Q rows, and key/value rows (RPT consecutive rows a thread; where they
    # share a page, one block id and one page address a thread: `issue_pages`).
    PIO_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // tpd, tpd],
                                               warps_per_cta=[PRODUCER_WARPS, 1], order=[1, 0]))
    rpt = max(1, block_n // (32 // tpd * PRODUCER_WARPS))
    RPT = gl.constexpr(rpt)
    KV_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[rpt, 8], threads_per_warp=[32 // tpd, tpd],
                                              warps_per_cta=[PRODUCER_WARPS, 1], order=[1, 0]))

    @gluon.jit
    def store_rows(k_rows, v_rows, slot_ptr, kc_ptr, vc_ptr, row0, lo, hi, kvh, stride_rt, stride_rh, stride_cb,
                   stride_cs, stride_ch):
        """Write contiguous key/value rows row0 + lo .. row0 + hi - 1 of head kvh into the paged
        caches at their slots (`slot_ptr`, one a row; -1: nowhere), as `store_kv` does for a
        16-bit cache. 8 rows a pass (16 bytes a thread): few registers, and a pass's loads come
        from L2 (the key tiles have just been read)."""
        rows_per_pass: gl.constexpr = 32 // (HEAD // 8) * P_WARPS
        r_io = gl.arange(0, rows_per_pass, layout=gl.SliceLayout(1, PIO_LAYOUT))
        d_io = gl.arange(0, HEAD, layout=gl.SliceLayout(0, PIO_LAYOUT))
        for r0 in range(lo, hi, rows_per_pass):
            row = row0 + r0 + r_io
            slot = gl.load(slot_ptr + row, mask=r0 + r_io < hi, other=-1)
            ok = (slot >= 0)[:, None]
            src = (row * stride_rt + kvh * stride_rh)[:, None] + d_io[None, :]
            dst = ((slot // STORE_BLOCK_SIZE) * stride_cb + (slot % STORE_BLOCK_SIZE) * stride_cs
                   + kvh * stride_ch)[:, None] + d_io[None, :]
            gl.store(kc_ptr + dst, gl.load(k_rows + src, mask=ok), mask=ok)
            gl.store(vc_ptr + dst, gl.load(v_rows + src, mask=ok), mask=ok)

    @gluon.jit
    def producer(q_smem, k_smem, v_smem, full, empty, q_bar, q_ptr, k_src, v_src, bt_row_ptr, q_begin, q0, q_len,
                 key_hi, n_tiles, kv_row0, kvh, stride_qt, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                 k_rows, v_rows, slot_ptr, kc_ptr, vc_ptr, store_lo, store_hi, stride_cb, stride_cs, stride_ch):
        # Q: token q0 + r // GROUP, head kvh * GROUP + r % GROUP (padding rows read nothing)
        r_io = gl.arange(0, M, layout=gl.SliceLayout(1, PIO_LAYOUT))
        d_io = gl.arange(0, HEAD, layout=gl.SliceLayout(0, PIO_LAYOUT))
        for c in gl.static_range(CONSUMERS):
            r = c * M + r_io
            tok = (q_begin + q0 + r // GROUP).to(gl.int64)
            hd = (kvh * GROUP + r % GROUP).to(gl.int64)
            ok = (r < BLOCK_Q * GROUP) & (q0 + r // GROUP < q_len)
            async_copy.async_copy_global_to_shared(q_smem.index(c), q_ptr + (tok * stride_qt + hd * stride_qh)[:, None]
                                                   + d_io[None, :], mask=ok[:, None])
        async_copy.mbarrier_arrive(q_bar, increment_count=False)
        if PAGED:
            k_base = k_src + kvh.to(gl.int64) * stride_kh
            v_base = v_src + kvh.to(gl.int64) * stride_vh
            r_kv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, KV_LAYOUT))
            d_kv = gl.arange(0, HEAD, layout=gl.SliceLayout(0, KV_LAYOUT))
            ids = block_ids(bt_row_ptr, 0, key_hi, r_kv, BLOCK_N, BLOCK_SIZE, RPT)
            for t in range(n_tiles):
                s = t % STAGES
                # the slot's previous tile (t - STAGES) handed back by every consumer (a fresh
                # barrier passes the wait for the phase before its first)
                mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
                if t < n_tiles - 1:  # rows all in range: no mask
                    issue_pages(k_smem.index(s), v_smem.index(s), k_base, v_base, ids, t, key_hi, r_kv, d_kv,
                                stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, BLOCK_N, BLOCK_SIZE, RPT, False)
                else:
                    issue_pages(k_smem.index(s), v_smem.index(s), k_base, v_base, ids, t, key_hi, r_kv, d_kv,
                                stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, BLOCK_N, BLOCK_SIZE, RPT, True)
                async_copy.mbarrier_arrive(full.index(s), increment_count=False)
                ids = block_ids(bt_row_ptr, t + 1, key_hi, r_kv, BLOCK_N, BLOCK_SIZE, RPT)
        else:
            for t in range(n_tiles):
                mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
                issue_tma(k_src, v_src, k_smem, v_smem, full, t, kv_row0, kvh, HEAD, BLOCK_N, STAGES)
            if STORE:  # while the consumers finish the ring's last tiles
                store_rows(k_rows, v_rows, slot_ptr, kc_ptr, vc_ptr, kv_row0, store_lo, store_hi, kvh.to(gl.int64),
                           stride_kb, stride_kh, stride_cb, stride_cs, stride_ch)
        async_copy.wait_group(0)

    @gluon.jit
    def decode_tiles(qc, k_smem, v_smem, full, empty, out_ptr, lse_ptr, q_begin, q_len, seq_len, key_hi, n_full,
                     n_tiles, kvh, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh):
        """A decode program (its GROUP x q_len query rows fit DEC_N): the products with operands
        swapped, S^T = K Q^T and O^T += V^T P^T, so the tensor cores compute DEC_N query
        columns instead of 64 rows (a decode's 4 of 64 rows wasted 15/16 of its products).
        The softmax runs down the key axis; P^T goes through shared memory (an MMA's second
        operand), in the rows of Q's buffer after the query rows (two programs an SM leave no
        room for another buffer)."""
        dtype: gl.constexpr = qc.dtype
        COL: gl.constexpr = gl.SliceLayout(0, ST_LAYOUT)
        KEY: gl.constexpr = gl.SliceLayout(1, ST_LAYOUT)
        c_s = gl.arange(0, DEC_N, layout=COL)
        q_pos = gl.where(c_s // GROUP < q_len, seq_len - q_len + c_s // GROUP, -1)
        qd = qc.slice(0, DEC_N)  # the program's query rows (rows past them: zeros)
        pb = qc.slice(DEC_N, DEC_N).slice(0, BLOCK_N, dim=1)  # P^T [DEC_N, BLOCK_N], keys along a row
        s_zero = gl.zeros([BLOCK_N, DEC_N], gl.float32, ST_LAYOUT)
        acc = gl.zeros([HEAD, DEC_N], gl.float32, ST_LAYOUT)
        m_i = gl.full([DEC_N], float("-inf"), gl.float32, COL)
        l_i = gl.zeros([DEC_N], gl.float32, COL)
        for j in range(n_tiles):
            slot = j % STAGES
            mbarrier.wait(full.index(slot), (j // STAGES) & 1)
            if PAGED:
                fence_async_shared()
            s_tok = warpgroup_mma(k_smem.index(slot), qd.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s_tok,))
            if j >= n_full:
                n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=KEY)
                if CAUSAL:
                    s = gl.where(n[:, None] <= q_pos[None, :], s, float("-inf"))
                else:
                    s = gl.where((n < key_hi)[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0) * qk_scale)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(gl.fma(s, qk_scale, -m_safe[None, :]))
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, 0)
            m_i = m_new
            acc = acc * alpha[None, :]
            pb.store(gl.permute(p.to(dtype), (1, 0)))
            fence_async_shared()
            cta_barrier()  # every warp's share of P^T is in shared memory before the product reads it
            o_tok = warpgroup_mma(v_smem.index(slot).permute((1, 0)), pb.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
            cta_barrier()  # and every warp's product is done with it before the next tile's P^T
            mbarrier.arrive(empty.index(slot))
        empty_col = l_i == 0.0
        o = acc / gl.where(empty_col, 1.0, l_i)[None, :]
        d = gl.arange(0, HEAD, layout=KEY)
        tok = (q_begin + c_s // GROUP).to(gl.int64)
        hd = (kvh * GROUP + c_s % GROUP).to(gl.int64)
        ok = c_s // GROUP < q_len
        gl.store(out_ptr + (tok * stride_ot + hd * stride_oh)[None, :] + d[:, None], o.to(dtype), mask=ok[None, :])
        if WRITE_LSE:
            lse = gl.where(empty_col, float("-inf"), (m_i + gl.log2(gl.where(empty_col, 1.0, l_i))) * 0.6931471805599453)
            gl.store(lse_ptr + tok * stride_lt + hd * stride_lh, lse, mask=ok)

    @gluon.jit
    def prefill_tiles(c, q_smem, k_smem, v_smem, full, empty, out_ptr, lse_ptr, q_begin, q0, q_len, seq_len, key_hi,
                      n_full, n_tiles, kvh, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh):
        """Consumer c's query rows of a prefill tile (or of a decode without `decode_tiles`): the
        overlapped loop."""
        dtype: gl.constexpr = q_smem.dtype
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        r_s = c * M + gl.arange(0, M, layout=ROW_S)
        q_pos = gl.where((r_s < BLOCK_Q * GROUP) & (q0 + r_s // GROUP < q_len), seq_len - q_len + q0 + r_s // GROUP,
                         -1)
        s_zero = gl.zeros([M, BLOCK_N], gl.float32, S_LAYOUT)
        acc = gl.zeros([M, HEAD], gl.float32, O_LAYOUT)
        m_i = gl.full([M], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([M], gl.float32, ROW_S)
        qc = q_smem.index(c)
        if n_tiles > 0:
            mbarrier.wait(full.index(0), 0)
            if PAGED:
                fence_async_shared()
            s_tok = warpgroup_mma(qc, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_acc = warpgroup_mma_wait(0, deps=(s_tok,))
            p, m_i, l_i = first_softmax(scores(s_acc, 0, q_pos, key_hi, n_full, BLOCK_N, CAUSAL, S_LAYOUT), qk_scale)
            for j in range(1, n_tiles):
                slot = j % STAGES
                mbarrier.wait(full.index(slot), (j // STAGES) & 1)
                if PAGED:
                    fence_async_shared()
                p, m_new, l_i, acc, alpha = overlapped_tile(qc, k_smem.index(slot), v_smem.index((j - 1) % STAGES), p,
                                                            m_i, l_i, acc, s_zero, j, q_pos, key_hi, n_full, qk_scale,
                                                            BLOCK_N, CAUSAL, S_LAYOUT, P_LAYOUT)
                mbarrier.arrive(empty.index((j - 1) % STAGES))  # tile j-1's slot is free
                acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
                m_i = m_new
            p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
            o_tok = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
        l_o = gl.convert_layout(l_i, ROW_O)
        empty_row = l_o == 0.0
        o = acc / gl.where(empty_row, 1.0, l_o)[:, None]
        # O leaves through this consumer's Q rows (read for the last time above): 16-byte rows
        # out, and no layout-conversion scratch (two programs an SM fit with one consumer)
        qc.store(o.to(dtype))
        cta_barrier()
        o_io = qc.load(IO_LAYOUT)
        r_io = c * M + gl.arange(0, M, layout=gl.SliceLayout(1, IO_LAYOUT))
        d_io = gl.arange(0, HEAD, layout=gl.SliceLayout(0, IO_LAYOUT))
        tok_io = (q_begin + q0 + r_io // GROUP).to(gl.int64)
        head_io = (kvh * GROUP + r_io % GROUP).to(gl.int64)
        ok_io = (r_io < BLOCK_Q * GROUP) & (q0 + r_io // GROUP < q_len)
        gl.store(out_ptr + (tok_io * stride_ot + head_io * stride_oh)[:, None] + d_io[None, :], o_io,
                 mask=ok_io[:, None])
        if WRITE_LSE:  # natural-log LSE of the scaled scores (m_i, l_i are base 2)
            m_o = gl.convert_layout(m_i, ROW_O)
            lse = gl.where(empty_row, float("-inf"),
                           (m_o + gl.log2(gl.where(empty_row, 1.0, l_o))) * 0.6931471805599453)
            r_o = c * M + gl.arange(0, M, layout=ROW_O)
            tok_o = (q_begin + q0 + r_o // GROUP).to(gl.int64)
            head_o = (kvh * GROUP + r_o % GROUP).to(gl.int64)
            gl.store(lse_ptr + tok_o * stride_lt + head_o * stride_lh, lse,
                     mask=(r_o < BLOCK_Q * GROUP) & (q0 + r_o // GROUP < q_len))

    @gluon.jit
    def consumer(c, q_smem, k_smem, v_smem, full, empty, q_bar, out_ptr, lse_ptr, q_begin, q0, q_len, seq_len,
                 key_hi, n_full, n_tiles, kvh, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh, is_decode):
        mbarrier.wait(q_bar, 0)
        fence_async_shared()  # cp.async wrote Q through the generic proxy; the MMAs read it through the async one
        if SWAP_DECODES:
            if is_decode:
                decode_tiles(q_smem.index(c), k_smem, v_smem, full, empty, out_ptr, lse_ptr, q_begin, q_len, seq_len,
                             key_hi, n_full, n_tiles, kvh, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh)
            else:
                prefill_tiles(c, q_smem, k_smem, v_smem, full, empty, out_ptr, lse_ptr, q_begin, q0, q_len, seq_len,
                              key_hi, n_full, n_tiles, kvh, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh)
        else:
            prefill_tiles(c, q_smem, k_smem, v_smem, full, empty, out_ptr, lse_ptr, q_begin, q0, q_len, seq_len, key_hi,
                          n_full, n_tiles, kvh, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh)

    @gluon.jit(do_not_specialize=["num_seqs", "num_tiles", "num_decodes", "stride_bt"])
    def kernel(q_ptr, k_src, v_src, out_ptr, lse_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
               kv_start_loc_ptr, qk_scale, num_seqs, num_tiles, num_decodes, stride_qt, stride_qh, stride_kb, stride_kh,
               stride_vb, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh, stride_bt, k_rows, v_rows, slot_ptr,
               kc_ptr, vc_ptr, stride_cb, stride_cs, stride_ch):
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        kvh, b, q_begin, q_len, q0 = program_tile(query_start_loc_ptr, num_seqs, num_tiles, num_decodes, NUM_KV_HEADS,
                                                  BLOCK_Q, SEARCH_STEPS)
        seq_len = gl.load(seq_lens_ptr + b)
        if CAUSAL:
            key_hi = seq_len - q_len + gl.minimum(q0 + BLOCK_Q, q_len)  # past the tile's last row's position
            full_hi = seq_len - q_len + q0 + 1  # keys every row of the tile sees
        else:  # every row sees every key, whatever its position (cross attention's may be < 0)
            key_hi = seq_len
            full_hi = seq_len
        n_tiles = gl.where(q0 < q_len, gl.cdiv(key_hi, BLOCK_N), 0)  # a surplus program copies and computes nothing
        n_full = full_hi // BLOCK_N
        bt_row_ptr = block_tables_ptr + b.to(gl.int64) * stride_bt
        kv_row0 = b.to(gl.int64) * 0
        if not PAGED:
            kv_row0 = gl.load(kv_start_loc_ptr + b).to(gl.int64)
        # Rows this program stores (STORE): its tile's own positions; the first tile also those
        # before the first query, and a sequence without queries all its rows, so that every row
        # of the sequence is written once.
        first_pos = seq_len - q_len + q0
        store_lo = gl.where(q0 == 0, 0, gl.maximum(first_pos, 0))
        store_hi = gl.where((q0 < q_len) | (q0 == 0), gl.minimum(seq_len - q_len + gl.minimum(q0 + BLOCK_Q, q_len),
                                                                  seq_len), 0)
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, M, HEAD],
                                           gl.NVMMASharedLayout.get_default_for([M, HEAD], dtype))
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_smem_layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=FULL_COUNT)
            mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival a consumer warpgroup
        mbarrier.init(q_bar, count=P_THREADS)
        pargs = (q_smem, k_smem, v_smem, full, empty, q_bar, q_ptr, k_src, v_src, bt_row_ptr, q_begin, q0, q_len,
                 key_hi, n_tiles, kv_row0, kvh, stride_qt, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                 k_rows, v_rows, slot_ptr, kc_ptr, vc_ptr, store_lo, store_hi, stride_cb, stride_cs, stride_ch)
        cargs = (q_smem, k_smem, v_smem, full, empty, q_bar, out_ptr, lse_ptr, q_begin, q0, q_len, seq_len, key_hi,
                 n_full, n_tiles, kvh, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh, b >= num_seqs)
        if CONSUMERS == 1:
            gl.warp_specialize([(consumer, (0, ) + cargs), (producer, pargs)], [P_WARPS], [P_REGS])
        else:
            gl.warp_specialize([(consumer, (0, ) + cargs), (consumer, (1, ) + cargs), (producer, pargs)],
                               [4, P_WARPS], [C_REGS, P_REGS])

    return kernel
