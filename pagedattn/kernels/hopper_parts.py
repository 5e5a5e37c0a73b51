"""Gluon pieces shared by the two Hopper prefill kernels (`hopper_prefill.py`, one warpgroup
per program; `hopper_prefill_ws.py`, warp-specialised): key/value tile copies over pages
(cp.async) and over contiguous rows (TMA), block ids, score masks, the online softmax, and the
program -> (sequence, query tile, KV head) map. Gluon functions cannot call `@triton.jit` ones,
so the portable kernel's map has its own copy in `attention_program.py`.

Gluon's API as of Triton 3.6; older Tritons lack it (`GLUON` False) and keep the portable kernel.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    # one CTA-wide barrier (a partition's, inside warp_specialize): `thread_barrier` up to
    # Triton 3.6, `barrier` from 3.7
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    GLUON = False

LOG2E = 1.4426950408889634

if GLUON:

    @gluon.jit
    def issue_pages(k_slot, v_slot, k_base, v_base, ids, t, key_hi, r, d, stride_kb, stride_vb,
                    STRIDE_KS: gl.constexpr, STRIDE_VS: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_SIZE: gl.constexpr, RPT: gl.constexpr, MASKED: gl.constexpr):
        """Keys over pages: cp.async key tile t and its value tile (block ids `ids`, one a row,
        rows `r` of the tile, columns `d`; RPT consecutive rows a thread) into their ring
        slots. Where the page size is a multiple of RPT, a thread's rows lie in one page, so they
        are one address and compile-time offsets (the row strides in a page are constants).
        MASKED (the last tile): rows past the key range read nothing and fill with zeros."""
        n = t * BLOCK_N + r
        block = ids.to(gl.int64)
        if BLOCK_SIZE % RPT == 0:
            within = (t * BLOCK_N + r // RPT * RPT) % BLOCK_SIZE  # the thread's first row's, one a thread
            k_row = (k_base + (block * stride_kb + within * STRIDE_KS))[:, None] + d[None, :]
            v_row = (v_base + (block * stride_vb + within * STRIDE_VS))[:, None] + d[None, :]
            k_ptrs = k_row + ((r % RPT) * STRIDE_KS)[:, None]
            v_ptrs = v_row + ((r % RPT) * STRIDE_VS)[:, None]
        else:
            within = n % BLOCK_SIZE
            k_ptrs = (k_base + (block * stride_kb + within * STRIDE_KS))[:, None] + d[None, :]
            v_ptrs = (v_base + (block * stride_vb + within * STRIDE_VS))[:, None] + d[None, :]
        if MASKED:
            ok = (n < key_hi)[:, None]
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs, mask=ok)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs, mask=ok)
        else:
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs)

    @gluon.jit
    def issue_tma(k_desc, v_desc, k_smem, v_smem, ready, t, kv_row0, kvh, HEAD: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Contiguous keys: key tile t and its value tile by TMA into ring slot t % STAGES,
        completing the slot's `ready` barrier. Rows past the sequence are the next sequence's
        (or zeros past the tensor): finite, and masked out of the scores."""
        slot = t % STAGES
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * BLOCK_N * HEAD * 2)
        row = (kv_row0 + t * BLOCK_N).to(gl.int32)
        tma.async_copy_global_to_shared(k_desc, [row, kvh * HEAD], bar, k_smem.index(slot))
        tma.async_copy_global_to_shared(v_desc, [row, kvh * HEAD], bar, v_smem.index(slot))

    @gluon.jit
    def block_ids(bt_row_ptr, t, key_hi, r, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, RPT: gl.constexpr):
        """Block ids of key tile t's rows `r` (block 0 past the key range: its rows are not read).
        Where a thread's RPT rows share a page (`issue_pages`), they read their first row's id:
        one load."""
        if BLOCK_SIZE % RPT == 0:
            n = t * BLOCK_N + r // RPT * RPT
        else:
            n = t * BLOCK_N + r
        return gl.load(bt_row_ptr + n // BLOCK_SIZE, mask=n < key_hi, other=0)

    @gluon.jit
    def scores(s_acc, t, q_pos, key_hi, n_full, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                layout: gl.constexpr):
        """Scores of key tile t, unscaled (the scale folds into the exponent's FMA); tiles from
        `n_full` on carry the causal/length mask."""
        s = s_acc
        if t >= n_full:
            n = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            if CAUSAL:
                keep = n[None, :] <= q_pos[:, None]
            else:  # every row sees every key, whatever its position (cross attention's may be < 0)
                keep = (n < key_hi)[None, :]
            s = gl.where(keep, s, float("-inf"))
        return s

    @gluon.jit
    def first_softmax(s, qk_scale):
        """Base-2 softmax state of the first key tile's raw scores `s`: (p, m, l)."""
        m = gl.max(s, 1) * qk_scale
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        p = gl.exp2(gl.fma(s, qk_scale, -m_safe[:, None]))
        return p, m, gl.sum(p, 1)

    @gluon.jit
    def online_softmax(s, m_i, l_i, qk_scale):
        """One key tile's update of the running state: (p, m_new, l_new, alpha), alpha the factor
        on the previous tiles' output. The max is taken on the raw scores (the scale is
        positive), scale and subtraction in one FMA."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(gl.fma(s, qk_scale, -m_safe[:, None]))
        alpha = gl.exp2(m_i - m_safe)
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def overlapped_tile(q_smem, k_tile, v_prev, p, m_i, l_i, acc, s_zero, j, q_pos, key_hi, n_full, qk_scale,
                        BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr):
        """Key tile j's step of the loop, FlashAttention-3's intra-warpgroup overlap: issue
        S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, wait for S_j only, run tile j's online
        softmax while the second product runs, wait for it. Returns (p, m_new, l_new, O, alpha):
        O is not yet rescaled by alpha, so the caller can first hand tile j-1's slot back."""
        dtype: gl.constexpr = q_smem.dtype
        s_tok = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_prev, acc, is_async=True)
        s_acc, p_op = warpgroup_mma_wait(1, deps=(s_tok, p_op))
        s = scores(s_acc, j, q_pos, key_hi, n_full, BLOCK_N, CAUSAL, s_layout)
        p, m_new, l_i, alpha = online_softmax(s, m_i, l_i, qk_scale)
        # p and l_i ride through the wait: nothing then sinks the exponentials below it (LLVM
        # would, to their next use), so they run while the P V product does
        acc, p_op, p, l_i = warpgroup_mma_wait(0, deps=(o_tok, p_op, p, l_i))
        return p, m_new, l_i, acc, alpha

    @gluon.jit
    def program_tile(query_start_loc_ptr, num_seqs, num_tiles, num_decodes, NUM_KV_HEADS: gl.constexpr,
                     BLOCK_Q: gl.constexpr, SEARCH_STEPS: gl.constexpr):
        """This program's (KV head, sequence, its first query row, query rows, tile's first row),
        as the portable kernel numbers them: the query tiles of the first num_seqs sequences,
        longest causal rows first, with the num_decodes decodes after them (one tile each)
        interleaved evenly among them, so that their key reads overlap the prefill tiles'
        products instead of following them. A surplus program has q0 >= q_len."""
        kvh = gl.program_id(0) % NUM_KV_HEADS
        slot = (gl.program_id(0) // NUM_KV_HEADS).to(gl.int64)
        decodes_upto = (slot + 1) * num_decodes // (num_tiles + num_decodes)  # decodes in slots 0..slot
        decodes_before = slot * num_decodes // (num_tiles + num_decodes)
        is_decode = decodes_upto > decodes_before
        pid = (num_tiles - 1 - (slot - decodes_upto)).to(gl.int32)
        lo = pid * 0
        hi = lo + num_seqs
        for _ in gl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = gl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid
            lo = gl.where(go_right, mid, lo)
            hi = gl.where(go_right, hi, mid)
        b = gl.where(is_decode, num_seqs + decodes_before.to(gl.int32), lo)
        q_begin = gl.load(query_start_loc_ptr + b)
        q_len = gl.load(query_start_loc_ptr + b + 1) - q_begin
        q0 = gl.where(is_decode, 0, (pid - (q_begin // BLOCK_Q + b)) * BLOCK_Q)
        return kvh, b, q_begin, q_len, q0
