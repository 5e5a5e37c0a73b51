"""Prefill attention for Hopper (sm_90), written in Gluon (Triton's explicit-layout dialect).

The portable kernel (`paged_attention.py`) is FlashAttention-2's loop: each key tile's two
matrix products and its softmax run one after the other, so the tensor cores wait while the
exponentials are computed (53-60% of the bf16 matmul rate on an H100). Here the products are
Hopper's asynchronous warpgroup MMAs, issued FlashAttention-3's way (its "intra-warpgroup
overlap"): while the softmax of key tile j runs on the CUDA cores, the tensor cores compute
tile j-1's P @ V, and tile j+1's S = Q K^T is issued before tile j's softmax is read back.

Per program (query tile x KV head, the portable kernel's grid and GQA packing: BLOCK_M rows =
BLOCK_Q tokens x GROUP query heads sharing one KV head, longest causal tiles first; a mixed
step's decodes, one tile each, interleaved evenly among the prefill tiles so that their key
reads run beside the prefill's products):
- Q and key/value tiles go to shared memory, STAGES tiles in a ring: tile j-1's values (in the
  P V product), tile j, and STAGES - 2 tiles in flight. Over pages (any page size) by `cp.async`,
  a tile's block ids loaded one iteration before its copies are issued; each thread copies RPT
  consecutive rows, which share a page wherever the page size is a multiple of RPT: one block id,
  one 64-bit page address and compile-time row offsets a thread (the in-page row strides are
  constexpr), and masks on the last tile only. Contiguous keys (a step's own rows) by TMA, one
  bulk copy a tile, its slot's mbarrier completing when it lands.
- Iteration j: wait for tile j's copies; one barrier (every warpgroup is past iteration j-1,
  so tile j-2's slot is free: issue tile j + STAGES - 2 into it); issue S_j = Q K_j^T, then
  O += P_{j-1} V_{j-1}; wait for S_j only; online softmax of S_j (base 2, the scale folded into
  the exponent's FMA, masks only on tiles that need them) while P V runs; wait for it; rescale O.
  The loop is bound by issue slots (ncu: ~0.43 instructions a cycle a scheduler, "wait" stalls
  first), so every instruction a tile costs counts (docs/PERF.md, "ninth session").
- Output normalised by the softmax sum, stored in 16-byte rows; optional natural-log LSE.

Scope (everything else takes the portable kernel; `supported` says which): 16-bit queries and
caches of the same dtype, head sizes 64 and 128 over pages (128 over contiguous keys), causal or
not, no sliding window, ALiBi, soft cap or FP8, unsplit; Triton 3.6 on sm_90.
`PAGEDATTN_GLUON=0` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from ._common import INTERPRET, next_pow2

try:  # Gluon's Hopper API as of Triton 3.6; older Tritons lack it and keep the portable kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # one CTA-wide barrier: `thread_barrier` up to Triton 3.6, `barrier` from 3.7
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    GLUON = False

ENABLED: bool = os.environ.get("PAGEDATTN_GLUON", "1") != "0"
HEAD_SIZES = (64, 128)
LOG2E = 1.4426950408889634
# Gluon's API changes between Triton releases (3.7 renamed `thread_barrier`, 3.9 refuses this
# kernel's ring allocation); the kernel is checked against 3.6, the GPU machine's Triton.
TRITON_VERSIONS = ("3.6.",)

# (BLOCK_N keys per tile, STAGES, num_warps) by head size and the longest sequence; BLOCK_M = 16 x
# num_warps rows (one 16-row MMA slab per warp). Shared memory: Q (BLOCK_M x D) + STAGES x (K, V)
# tiles: 224 KiB for (128, 3, 8) at head size 128 (one program an SM), 112 KiB for (64, 3, 4)
# (two). Fitted on the H100 against the portable kernel (docs/PERF.md, "Gluon prefill"): the
# two-program tile is faster up to 4k keys (e.g. 16x1k paged: 273 vs 253 TFLOP/s), the
# 128-key one from 16k (1x16k: 413 vs 363).
SHORT_TILE = (64, 3, 4)
LONG_TILE = (128, 3, 8)
LONG_FROM = {128: 8192}  # head size -> keys from which LONG_TILE wins (head size 64: never)
# Contiguous keys (a step of fresh prompts, read from its own rows by TMA) take this kernel at
# these head sizes, at every length (H100, 32/8/128 against the portable kernel: 16x1k 378 vs 278
# TFLOP/s, 4x4k 462 vs 422, 1x16k 504 vs 473 with LONG_TILE; docs/PERF.md, "Gluon prefill" and
# "ninth session"). Head size 64 keeps the portable kernel there, as fast.
CONTIGUOUS_HEAD_SIZES = (128,)


def choose_tile(head_size: int, max_seq_len: int) -> tuple[int, int, int]:
    start = LONG_FROM.get(head_size)
    return LONG_TILE if start is not None and max_seq_len >= start else SHORT_TILE


def unavailable_reason(device: torch.device) -> str | None:
    """Why this kernel cannot run on `device` (None: it can, for the launches `supported` takes)."""
    if not GLUON:
        return "this Triton has no Gluon Hopper API"
    if not ENABLED:
        return "PAGEDATTN_GLUON=0"
    if INTERPRET:
        return "Gluon kernels do not run under TRITON_INTERPRET"
    if not triton.__version__.startswith(TRITON_VERSIONS):
        return f"checked against Triton {'/'.join(v + 'x' for v in TRITON_VERSIONS)}, found {triton.__version__}"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "needs an sm_90 GPU (H100/H200)"
    return None


@functools.lru_cache(maxsize=None)
def _runs_on(device: torch.device) -> bool:
    return unavailable_reason(device) is None


def supported(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, paged: bool, group: int,
              max_query_len: int, max_seq_len: int, sliding_window, alibi_slopes, soft_cap, num_splits) -> bool:
    """Whether a launch takes this kernel: a prefill-like step (more rows than a decode tile)
    over paged keys, or over contiguous keys where that is faster (CONTIGUOUS_*: heads adjacent
    in a row, as TMA reads them), on an H100/H200, within the scope above, heads of unit stride
    and 16-element strides (cp.async and TMA move 16 bytes; Triton specialises strides divisible
    by 16)."""
    head_size = query.shape[-1]
    keys_ok = paged or (head_size in CONTIGUOUS_HEAD_SIZES and k_cache.shape[0] > 0
                        and k_cache.stride(-2) == head_size and v_cache.stride(-2) == head_size)
    return (keys_ok and head_size in HEAD_SIZES and next_pow2(max_query_len * group) > 64 and group <= 16
            and query.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == query.dtype
            and sliding_window is None and alibi_slopes is None and soft_cap is None
            and num_splits in (None, 1) and _runs_on(query.device)
            and all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(x % 16 == 0 for x in t.stride()[:-1])
                    for t in (query, k_cache, v_cache)))


if GLUON:

    @gluon.jit
    def _issue_pages(k_slot, v_slot, k_base, v_base, ids, t, key_hi, r, d, stride_kb, stride_vb,
                     STRIDE_KS: gl.constexpr, STRIDE_VS: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_SIZE: gl.constexpr, RPT: gl.constexpr, ALIGNED: gl.constexpr, MASKED: gl.constexpr):
        """Keys over pages: cp.async key tile t and its value tile (block ids `ids`, one a row,
        rows `r` of the tile, columns `d`) into their ring slots. ALIGNED: a thread's RPT rows
        lie in one page, so they are one address and compile-time offsets (the row strides in a
        page are constants). MASKED (the last tile): rows past the key range read nothing and
        fill with zeros."""
        n = t * BLOCK_N + r
        block = ids.to(gl.int64)
        if ALIGNED:
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
    def _issue_tma(k_desc, v_desc, k_smem, v_smem, ready, t, kv_row0, kvh, HEAD: gl.constexpr,
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
    def _block_ids(bt_row_ptr, t, key_hi, r, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, RPT: gl.constexpr,
                   ALIGNED: gl.constexpr):
        """Block ids of key tile t's rows `r` (block 0 past the key range: its rows are not read).
        ALIGNED: every row of a thread's RPT reads its group's first row's id, one load."""
        if ALIGNED:
            n = t * BLOCK_N + r // RPT * RPT
        else:
            n = t * BLOCK_N + r
        return gl.load(bt_row_ptr + n // BLOCK_SIZE, mask=n < key_hi, other=0)

    @gluon.jit
    def _scores(s_acc, t, q_pos, key_hi, n_full, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
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
    def _step(j, p, m_i, l_i, acc, ids_next, q_smem, k_smem, v_smem, ready, s_zero, q_pos, qk_scale, n_tiles, n_full,
              key_hi, k_base, v_base, bt_row_ptr, r_kv, d_kv, stride_kb, stride_vb, kv_row0, kvh,
              STRIDE_KS: gl.constexpr, STRIDE_VS: gl.constexpr, HEAD: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, RPT: gl.constexpr, ALIGNED: gl.constexpr,
              CAUSAL: gl.constexpr, PAGED: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
              s_layout: gl.constexpr):
        """Iteration j of the key loop: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together,
        tile j's online softmax while the second runs; returns tile j's P and the running state."""
        dtype: gl.constexpr = q_smem.dtype
        # Tile j landed (its copy group is the oldest pending); after the barrier every
        # warpgroup has finished iteration j-1, so tile j-2's slot is free for tile
        # j + STAGES - 2. Contiguous tiles: TMA, and tile j's barrier.
        if PAGED:
            async_copy.wait_group(STAGES - 3)
            fence_async_shared()
        _cta_barrier()
        nxt = j + STAGES - 2
        if PAGED:
            slot = nxt % STAGES
            if nxt < n_tiles - 1:  # rows all in range: no mask
                _issue_pages(k_smem.index(slot), v_smem.index(slot), k_base, v_base, ids_next, nxt, key_hi, r_kv,
                             d_kv, stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, BLOCK_N, BLOCK_SIZE, RPT, ALIGNED,
                             False)
            elif nxt < n_tiles:
                _issue_pages(k_smem.index(slot), v_smem.index(slot), k_base, v_base, ids_next, nxt, key_hi, r_kv,
                             d_kv, stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, BLOCK_N, BLOCK_SIZE, RPT, ALIGNED,
                             True)
            async_copy.commit_group()
            ids_next = _block_ids(bt_row_ptr, nxt + 1, key_hi, r_kv, BLOCK_N, BLOCK_SIZE, RPT, ALIGNED)
        else:
            if nxt < n_tiles:
                _issue_tma(k_base, v_base, k_smem, v_smem, ready, nxt, kv_row0, kvh, HEAD, BLOCK_N, STAGES)
            mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)

        s_tok = warpgroup_mma(q_smem, k_smem.index(j % STAGES).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index((j - 1) % STAGES), acc, is_async=True)
        s_acc, p_op = warpgroup_mma_wait(1, deps=(s_tok, p_op))
        s = _scores(s_acc, j, q_pos, key_hi, n_full, BLOCK_N, CAUSAL, s_layout)
        # base-2 exponent of the scaled scores: max on the raw scores (the scale is positive),
        # scale and subtraction in one FMA
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(gl.fma(s, qk_scale, -m_safe[:, None]))
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 1)
        # p and l_i ride through the wait: nothing then sinks the exponentials below it (LLVM
        # would, to their next use), so they run while the P V product does
        acc, p_op, p, l_i = warpgroup_mma_wait(0, deps=(o_tok, p_op, p, l_i))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        return p, m_new, l_i, acc, ids_next

    @gluon.jit(do_not_specialize=["num_seqs", "num_tiles", "num_decodes", "stride_bt"])
    def _hopper_prefill_kernel(
        q_ptr, k_src, v_src, out_ptr, lse_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, kv_start_loc_ptr,
        qk_scale, num_seqs, num_tiles, num_decodes,
        stride_qt, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_ot, stride_oh, stride_lt, stride_lh, stride_bt,
        HEAD: gl.constexpr, GROUP: gl.constexpr, NUM_KV_HEADS: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STRIDE_KS: gl.constexpr, STRIDE_VS: gl.constexpr,
        STAGES: gl.constexpr, SEARCH_STEPS: gl.constexpr, CAUSAL: gl.constexpr, PAGED: gl.constexpr,
        WRITE_LSE: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        BLOCK_Q: gl.constexpr = BLOCK_M // GROUP
        # Accumulator layouts of the two products (warps stacked along the rows, 16 each), the
        # register operand P of the second, and a 16-byte-per-thread layout for global memory.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        TPD: gl.constexpr = HEAD // 8
        io_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // TPD, TPD],
                                                   warps_per_cta=[num_warps, 1], order=[1, 0])
        row_io: gl.constexpr = gl.SliceLayout(1, io_layout)
        col_io: gl.constexpr = gl.SliceLayout(0, io_layout)
        # Key/value tiles over pages: each thread copies RPT consecutive rows; where they lie in
        # one page (ALIGNED), a tile costs a thread one block id and one 64-bit product.
        RPT: gl.constexpr = BLOCK_N // (32 // TPD * num_warps)
        ALIGNED: gl.constexpr = BLOCK_SIZE % RPT == 0
        kv_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[RPT, 8], threads_per_warp=[32 // TPD, TPD],
                                                   warps_per_cta=[num_warps, 1], order=[1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        # Program -> (sequence, query tile, KV head), as the portable kernel numbers them: the
        # query tiles of the first num_seqs sequences, longest causal rows first, with the
        # num_decodes decodes after them (one tile each) interleaved evenly among them, so that
        # their key reads overlap the prefill tiles' products instead of following them.
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
        if q0 < q_len:
            seq_len = gl.load(seq_lens_ptr + b)
            p_first = seq_len - q_len + q0
            p_last = seq_len - q_len + gl.minimum(q0 + BLOCK_Q, q_len) - 1
            if CAUSAL:
                key_hi = p_last + 1
                full_hi = p_first + 1  # keys every row of the tile sees
            else:
                key_hi = seq_len
                full_hi = seq_len
            n_tiles = gl.cdiv(key_hi, BLOCK_N)
            n_full = full_hi // BLOCK_N
            bt_row_ptr = block_tables_ptr + b.to(gl.int64) * stride_bt
            kv_row0 = b.to(gl.int64) * 0
            if not PAGED:
                kv_row0 = gl.load(kv_start_loc_ptr + b).to(gl.int64)
            d_io = gl.arange(0, HEAD, layout=col_io)
            r_kv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
            d_kv = gl.arange(0, HEAD, layout=gl.SliceLayout(0, kv_layout))
            if PAGED:  # the head's rows
                k_base = k_src + kvh.to(gl.int64) * stride_kh
                v_base = v_src + kvh.to(gl.int64) * stride_vh
            else:  # TMA descriptors
                k_base = k_src
                v_base = v_src

            q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD], dtype))
            kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
            k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_smem_layout)
            v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_smem_layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())  # TMA tiles
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)

            # Q rows: token q0 + r // GROUP, head kvh * GROUP + r % GROUP (padding rows read nothing).
            r_io = gl.arange(0, BLOCK_M, layout=row_io)
            tok_io = (q_begin + q0 + r_io // GROUP).to(gl.int64)
            head_io = (kvh * GROUP + r_io % GROUP).to(gl.int64)
            # rows past BLOCK_Q tokens' heads (128 rows of GROUP = 3: 126 used) are padding
            row_ok_io = (r_io < BLOCK_Q * GROUP) & (q0 + r_io // GROUP < q_len)
            q_rows = tok_io * stride_qt + head_io * stride_qh
            async_copy.async_copy_global_to_shared(q_smem, q_ptr + q_rows[:, None] + d_io[None, :],
                                                   mask=row_ok_io[:, None])

            # Prologue: tiles 0 .. STAGES-2 in flight (over pages, tile 0's copy group carries
            # Q; contiguous tiles come by TMA), the next tile's block ids loading.
            if not PAGED:
                async_copy.commit_group()
            for t0 in gl.static_range(STAGES - 1):
                if t0 < n_tiles:
                    if PAGED:
                        ids = _block_ids(bt_row_ptr, t0, key_hi, r_kv, BLOCK_N, BLOCK_SIZE, RPT, ALIGNED)
                        _issue_pages(k_smem.index(t0), v_smem.index(t0), k_base, v_base, ids, t0, key_hi, r_kv, d_kv,
                                     stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, BLOCK_N, BLOCK_SIZE, RPT,
                                     ALIGNED, True)
                    else:
                        _issue_tma(k_src, v_src, k_smem, v_smem, ready, t0, kv_row0, kvh, HEAD, BLOCK_N, STAGES)
                if PAGED:
                    async_copy.commit_group()
            ids_next = _block_ids(bt_row_ptr, STAGES - 1, key_hi, r_kv, BLOCK_N, BLOCK_SIZE, RPT,
                                  ALIGNED)  # unused over contiguous keys

            r_s = gl.arange(0, BLOCK_M, layout=row_s)
            q_pos = gl.where((r_s < BLOCK_Q * GROUP) & (q0 + r_s // GROUP < q_len), seq_len - q_len + q0 + r_s // GROUP,
                             -1)
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
            acc = gl.zeros([BLOCK_M, HEAD], gl.float32, o_layout)

            # Tile 0: its scores alone.
            if PAGED:
                async_copy.wait_group(STAGES - 2)
            else:
                async_copy.wait_group(0)  # Q
            fence_async_shared()
            _cta_barrier()
            if not PAGED:
                mbarrier.wait(ready.index(0), 0)
            s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_acc = warpgroup_mma_wait(0, deps=(s_tok,))
            s = _scores(s_acc, 0, q_pos, key_hi, n_full, BLOCK_N, CAUSAL, s_layout)
            m_i = gl.max(s, 1) * qk_scale
            m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)
            p = gl.exp2(gl.fma(s, qk_scale, -m_safe[:, None]))
            l_i = gl.sum(p, 1)

            for j in range(1, n_tiles):
                p, m_i, l_i, acc, ids_next = _step(
                    j, p, m_i, l_i, acc, ids_next, q_smem, k_smem, v_smem, ready, s_zero, q_pos, qk_scale, n_tiles,
                    n_full, key_hi, k_base, v_base, bt_row_ptr, r_kv, d_kv, stride_kb, stride_vb, kv_row0, kvh,
                    STRIDE_KS, STRIDE_VS, HEAD, BLOCK_N, BLOCK_SIZE, STAGES, RPT, ALIGNED, CAUSAL, PAGED, o_layout,
                    p_layout, s_layout)

            p_op = gl.convert_layout(p.to(dtype), p_layout)
            o_tok = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
            async_copy.wait_group(0)

            l_o = gl.convert_layout(l_i, row_o)
            empty = l_o == 0.0
            o = acc / gl.where(empty, 1.0, l_o)[:, None]
            o_io = gl.convert_layout(o.to(dtype), io_layout)
            out_rows = tok_io * stride_ot + head_io * stride_oh
            gl.store(out_ptr + out_rows[:, None] + d_io[None, :], o_io, mask=row_ok_io[:, None])
            if WRITE_LSE:  # natural-log LSE of the scaled scores (m_i, l_i are base 2)
                m_o = gl.convert_layout(m_i, row_o)
                lse = gl.where(empty, float("-inf"), (m_o + gl.log2(gl.where(empty, 1.0, l_o))) * 0.6931471805599453)
                r_o = gl.arange(0, BLOCK_M, layout=row_o)
                tok_o = (q_begin + q0 + r_o // GROUP).to(gl.int64)
                head_o = (kvh * GROUP + r_o % GROUP).to(gl.int64)
                gl.store(lse_ptr + tok_o * stride_lt + head_o * stride_lh, lse,
                         mask=(r_o < BLOCK_Q * GROUP) & (q0 + r_o // GROUP < q_len))


def hopper_prefill(query, k_cache, v_cache, out, *, query_start_loc, seq_lens, block_tables, scale, causal,
                   lse, kv_start_loc, max_seq_len: int, search_steps: int, num_decodes: int = 0,
                   max_decode_query_len: int = 0, tile: tuple[int, int, int] | None = None) -> None:
    """Launch the kernel; `paged_attention` has checked every argument and `supported` holds.
    `num_decodes`: the last sequences that are decodes of at most `max_decode_query_len` tokens
    (as `paged_attention` takes them): interleaved among the prefill tiles where one tile holds
    each. `tile` forces (BLOCK_N, STAGES, num_warps) for tuning runs."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    num_seqs = query_start_loc.shape[0] - 1
    block_n, stages, num_warps = tile or choose_tile(head_size, max_seq_len)
    if block_n not in (32, 64, 128) or stages < 3 or num_warps not in (4, 8):
        raise ValueError(f"expected a tile (BLOCK_N in 32/64/128, >= 3 stages, 4 or 8 warps), got {tile}")
    block_m = 16 * num_warps
    block_q = max(1, block_m // group)
    if not (0 < num_decodes < num_seqs and max_decode_query_len <= block_q):
        num_decodes = 0  # decodes, if any, are query tiles like the others
    num_heavy = num_seqs - num_decodes
    num_tiles = (num_tokens - num_decodes) // block_q + num_heavy  # >= the prefill sequences' tiles
    paged = kv_start_loc is None
    if paged:
        kv = (block_tables, seq_lens, *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0))
        block_size = k_cache.shape[1]
        k_src, v_src = k_cache, v_cache
    else:  # contiguous rows [total_kv, Hkv, D], read by TMA as [total_kv, Hkv * D] tiles
        kv = (seq_lens, kv_start_loc, 0, 0, 0, 0, 0, 0, 0)
        block_size = 1
        layout = gl.NVMMASharedLayout.get_default_for([block_n, head_size], gl.float16)  # 16-bit
        k_src, v_src = (TensorDescriptor(x, [x.shape[0], num_kv_heads * head_size], [x.stride(0), 1],
                                         [block_n, head_size], layout) for x in (k_cache, v_cache))
    bt, kv_start, skb, sks, skh, svb, svs, svh, sbt = kv
    lse_arg = lse if lse is not None else seq_lens.view(-1, 1)
    _hopper_prefill_kernel[((num_tiles + num_decodes) * num_kv_heads,)](
        query, k_src, v_src, out, lse_arg, query_start_loc, seq_lens, bt, kv_start,
        float(scale) * LOG2E, num_heavy, num_tiles, num_decodes,
        query.stride(0), query.stride(1), skb, skh, svb, svh,
        out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1), sbt,
        HEAD=head_size, GROUP=group, NUM_KV_HEADS=num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, STRIDE_KS=sks, STRIDE_VS=svs, STAGES=stages, SEARCH_STEPS=search_steps,
        CAUSAL=bool(causal), PAGED=paged,
        WRITE_LSE=lse is not None, num_warps=num_warps,
    )
