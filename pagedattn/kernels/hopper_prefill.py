"""Prefill attention for Hopper (sm_90), written in Gluon (Triton's explicit-layout dialect).

The portable kernel (`paged_attention.py`) is FlashAttention-2's loop: each key tile's two
matrix products and its softmax run one after the other, so the tensor cores wait while the
exponentials are computed (53-60% of the bf16 matmul rate on an H100). Here the products are
Hopper's asynchronous warpgroup MMAs, issued FlashAttention-3's way (its "intra-warpgroup
overlap"): while the softmax of key tile j runs on the CUDA cores, the tensor cores compute
tile j-1's P @ V, and tile j+1's S = Q K^T is issued before tile j's softmax is read back.

Two kernels share that loop and the grid (query tile x KV head, the portable kernel's GQA
packing: BLOCK_M rows = BLOCK_Q tokens x GROUP query heads sharing one KV head, longest causal
tiles first; a mixed step's decodes, one tile each, interleaved evenly among the prefill tiles
so that their key reads run beside the prefill's products):
- head size 128: `hopper_prefill_ws.py`, warp-specialised. A producer warpgroup fills a ring of
  key/value tiles and completes mbarriers; one or two consumer warpgroups (64 query rows each)
  run the loop and hand slots back by mbarriers, with registers moved to them (`setmaxnreg`).
  A mixed launch's decodes run with swapped operands (query columns, not rows); over a step's
  own rows the producer can also write them into the paged cache (`write`).
  1.05-1.16x the kernel below at head size 128 (docs/PERF.md, "Gluon kernel tiles"; 3b17081).
- head size 64: the kernel here, one program of 4 warps (one warpgroup) doing both: key/value
  tiles over pages (any page size) by `cp.async` into a ring of STAGES slots, a tile's block ids
  loaded one iteration before its copies are issued, each thread copying RPT consecutive rows
  (one block id, one 64-bit page address and compile-time row offsets where they share a page),
  masks on the last tile only; one CTA barrier an iteration frees the slot of tile j-2 for tile
  j + STAGES - 2. Its loop is bound by issue slots (ncu: ~0.43 instructions a cycle a
  scheduler; ncu on c0a67d3, 2026-11-26). At head size 64 it beats the warp-specialised
  kernel (e.g. 16x1k paged 258 vs 220 TFLOP/s): there the products are half as long, and a
  producer's hand-offs cost more than they hide.
Contiguous keys (a step's own rows) come by TMA, one bulk copy a tile, completing its slot's
mbarrier. Output normalised by the softmax sum, stored in 16-byte rows; optional natural-log LSE.

Scope (everything else takes the portable kernel; `supported` says which): 16-bit queries and
caches of the same dtype, head sizes 64 and 128 over pages (128 over contiguous keys), causal or
not, no sliding window, ALiBi, soft cap, attention sinks or FP8, unsplit; Triton 3.6 on sm_90.
Attention sinks route to the portable kernel rather than into these epilogues: the sink is one
term in the final normalisation (`attention_program._add_sink`), but three epilogues (this
kernel's, the warp-specialised kernel's rows and its swapped decode columns) would each need
it, and Gluon code is only compiled on the GPU machine's Triton; the LSE these kernels write
is the same as the portable kernel's.
`PAGEDATTN_GLUON=0` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from pagedattn.device_profile import DeviceProfile

from ._common import INTERPRET, next_pow2
from .hopper_parts import GLUON, LOG2E
from .launch import BoundKernel, bind
from .store_kv import KVWrite

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .hopper_parts import (async_copy, block_ids, cta_barrier, fence_async_shared, first_softmax, issue_pages,
                               issue_tma, mbarrier, overlapped_tile, program_tile, scores, warpgroup_mma,
                               warpgroup_mma_wait)
    from .hopper_prefill_ws import swapped_decode_rows, ws_kernel

ENABLED: bool = os.environ.get("PAGEDATTN_GLUON", "1") != "0"
HEAD_SIZES = (64, 128)
WS_HEAD_SIZES = (128,)  # head sizes the warp-specialised kernel takes
# Gluon's API changes between Triton releases (3.7 renamed `thread_barrier`, 3.9 refuses this
# kernel's ring allocation); the kernel is checked against 3.6, the GPU machine's Triton.
TRITON_VERSIONS = ("3.6.",)

# Tiles (BLOCK_N keys, STAGES, warps that compute): for the warp-specialised kernel, 4 or 8
# consumer warps (one or two warpgroups, 64 rows each; a producer warpgroup comes on top); for
# the one-warpgroup kernel, 4 or 8 warps (16 rows each). Fitted on the H100 (docs/PERF.md,
# "Gluon kernel tiles"; 3b17081, 2026-11-26): two consumers with 64-key tiles and 4 stages (one program an SM, 160 KiB of
# shared memory) beat one (two programs an SM) on every prefill-only case (32/8/128 paged
# 16x1k 316 vs 308 TFLOP/s, 4x4k 436 vs 419, 1x16k 498 vs 446); with decodes in the launch one
# consumer wins, its decodes on the swapped-operand body (8 query columns, not 64 or 128 rows:
# 2k chunk + 64 decodes 332.5 vs 376.5 us, 2 prompts of 2k + 8 decodes 206.8 vs 206.4; 6c37aaf).
WS_TILE = (64, 4, 8)
WS_MIXED_TILE = (64, 3, 4)
ONE_WARPGROUP_TILE = (64, 3, 4)
SMEM_BYTES = 227 * 1024  # shared memory one program may hold on an H100/H200
# Contiguous keys (a step of fresh prompts, read from its own rows by TMA) take this kernel at
# these head sizes; head size 64 keeps the portable kernel there, as fast.
CONTIGUOUS_HEAD_SIZES = (128,)


def choose_tile(head_size: int, num_decodes: int) -> tuple[int, int, int]:
    """The policy's tile for a launch (host ints only)."""
    if head_size in WS_HEAD_SIZES:
        return WS_MIXED_TILE if num_decodes > 0 else WS_TILE
    return ONE_WARPGROUP_TILE


def check_tile(tile: tuple[int, int, int], head_size: int) -> None:
    """Refuse a forced tile the kernel for `head_size` cannot run, with the reason."""
    block_n, stages, warps = tile
    ws = head_size in WS_HEAD_SIZES
    min_stages = 2 if ws else 3  # the one-warpgroup ring holds tile j-1, tile j and one in flight
    if block_n not in (32, 64, 128) or stages < min_stages or warps not in (4, 8):
        raise ValueError(f"expected a tile (BLOCK_N in 32/64/128, >= {min_stages} stages, 4 or 8 warps), got {tile}")
    rows = 64 * (warps // 4) if ws else 16 * warps
    smem = (rows + 2 * stages * block_n) * head_size * 2
    if smem > SMEM_BYTES - 1024:
        raise ValueError(f"tile {tile} needs {smem // 1024} KiB of shared memory at head size {head_size}; "
                         f"a program may hold {SMEM_BYTES // 1024 - 1}")


def unavailable_reason(device: torch.device | DeviceProfile) -> str | None:
    """Why this kernel cannot run on `device` (or a device of that profile; None: it can, for the
    launches `takes` takes)."""
    profile = device if isinstance(device, DeviceProfile) else DeviceProfile.of(device)
    if not GLUON:
        return "this Triton has no Gluon Hopper API"
    if not ENABLED:
        return "PAGEDATTN_GLUON=0"
    if INTERPRET:
        return "Gluon kernels do not run under TRITON_INTERPRET"
    if not triton.__version__.startswith(TRITON_VERSIONS):
        return f"checked against Triton {'/'.join(v + 'x' for v in TRITON_VERSIONS)}, found {triton.__version__}"
    if not profile.wgmma:
        return "needs an sm_90 GPU (H100/H200): warpgroup MMAs"
    return None


def layout_ok(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, paged: bool) -> bool:
    """Whether the tensors' layout lets this kernel run: heads of unit stride and 16-element
    strides, 16-byte aligned (cp.async and TMA move 16 bytes; Triton specialises strides
    divisible by 16); over contiguous keys, a row's heads adjacent (TMA reads [rows, Hkv * D])."""
    head_size = query.shape[-1]
    keys_ok = paged or (k_cache.shape[0] > 0 and k_cache.stride(-2) == head_size and v_cache.stride(-2) == head_size)
    return keys_ok and all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(x % 16 == 0 for x in t.stride()[:-1])
                           for t in (query, k_cache, v_cache))


def takes(profile: DeviceProfile, f) -> bool:
    """Whether a launch with facts `f` (an `attention_plan.LaunchFacts`) takes this kernel on a
    device of `profile`: a prefill-like step (more rows than a decode tile) over paged keys, or
    over contiguous keys at CONTIGUOUS_HEAD_SIZES, within the scope above."""
    group = f.num_heads // f.num_kv_heads
    return (f.gluon_layout and f.head_size in HEAD_SIZES and (f.paged or f.head_size in CONTIGUOUS_HEAD_SIZES)
            and next_pow2(f.max_query_len * group) > 64 and group <= 16
            and f.q_dtype in (torch.float16, torch.bfloat16) and f.kv_dtype == f.q_dtype
            and not (f.window or f.alibi or f.soft_cap or f.sinks) and f.num_splits in (None, 1)
            and unavailable_reason(profile) is None)


def supported(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, paged: bool, group: int,
              max_query_len: int, max_seq_len: int, sliding_window, alibi_slopes, soft_cap, num_splits) -> bool:
    """`takes` for a launch of these tensors on their device (tests and probes; `group` is
    the query heads over k_cache's KV heads)."""
    from .paged_attention import launch_facts

    f = launch_facts(DeviceProfile.of(query.device), query, k_cache, v_cache, num_seqs=1,
                     max_query_len=max_query_len, max_seq_len=max_seq_len, num_decodes=0, max_decode_query_len=1,
                     paged=paged, causal=True, window=sliding_window is not None, alibi=alibi_slopes is not None,
                     soft_cap=soft_cap is not None, lse=False, split_limit=1, write=None,
                     num_splits=num_splits)
    return takes(f.profile, f)


if GLUON:

    @gluon.jit
    def _step(j, p, m_i, l_i, acc, ids_next, q_smem, k_smem, v_smem, ready, s_zero, q_pos, qk_scale, n_tiles, n_full,
              key_hi, k_base, v_base, bt_row_ptr, r_kv, d_kv, stride_kb, stride_vb, kv_row0, kvh,
              STRIDE_KS: gl.constexpr, STRIDE_VS: gl.constexpr, HEAD: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, RPT: gl.constexpr,
              CAUSAL: gl.constexpr, PAGED: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
              s_layout: gl.constexpr):
        """Iteration j of the key loop: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together,
        tile j's online softmax while the second runs; returns tile j's P and the running state."""
        # Tile j landed (its copy group is the oldest pending); after the barrier every
        # warpgroup has finished iteration j-1, so tile j-2's slot is free for tile
        # j + STAGES - 2. Contiguous tiles: TMA, and tile j's barrier.
        if PAGED:
            async_copy.wait_group(STAGES - 3)
            fence_async_shared()
        cta_barrier()
        nxt = j + STAGES - 2
        if PAGED:
            slot = nxt % STAGES
            if nxt < n_tiles - 1:  # rows all in range: no mask
                issue_pages(k_smem.index(slot), v_smem.index(slot), k_base, v_base, ids_next, nxt, key_hi, r_kv,
                            d_kv, stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, BLOCK_N, BLOCK_SIZE, RPT,
                            False)
            elif nxt < n_tiles:
                issue_pages(k_smem.index(slot), v_smem.index(slot), k_base, v_base, ids_next, nxt, key_hi, r_kv,
                            d_kv, stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, BLOCK_N, BLOCK_SIZE, RPT,
                            True)
            async_copy.commit_group()
            ids_next = block_ids(bt_row_ptr, nxt + 1, key_hi, r_kv, BLOCK_N, BLOCK_SIZE, RPT)
        else:
            if nxt < n_tiles:
                issue_tma(k_base, v_base, k_smem, v_smem, ready, nxt, kv_row0, kvh, HEAD, BLOCK_N, STAGES)
            mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)

        p, m_new, l_i, acc, alpha = overlapped_tile(q_smem, k_smem.index(j % STAGES), v_smem.index((j - 1) % STAGES), p,
                                                    m_i, l_i, acc, s_zero, j, q_pos, key_hi, n_full, qk_scale, BLOCK_N,
                                                    CAUSAL, s_layout, p_layout)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        return p, m_new, l_i, acc, ids_next

    @gluon.jit(do_not_specialize=["num_seqs", "num_tiles", "num_decodes", "stride_bt"])
    def _one_warpgroup_kernel(
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
        # one page (`issue_pages`), a tile costs a thread one block id and one 64-bit product.
        RPT: gl.constexpr = BLOCK_N // (32 // TPD * num_warps)
        kv_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[RPT, 8], threads_per_warp=[32 // TPD, TPD],
                                                   warps_per_cta=[num_warps, 1], order=[1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        kvh, b, q_begin, q_len, q0 = program_tile(query_start_loc_ptr, num_seqs, num_tiles, num_decodes, NUM_KV_HEADS,
                                                  BLOCK_Q, SEARCH_STEPS)
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
                        ids = block_ids(bt_row_ptr, t0, key_hi, r_kv, BLOCK_N, BLOCK_SIZE, RPT)
                        issue_pages(k_smem.index(t0), v_smem.index(t0), k_base, v_base, ids, t0, key_hi, r_kv, d_kv,
                                    stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, BLOCK_N, BLOCK_SIZE, RPT, True)
                    else:
                        issue_tma(k_src, v_src, k_smem, v_smem, ready, t0, kv_row0, kvh, HEAD, BLOCK_N, STAGES)
                if PAGED:
                    async_copy.commit_group()
            ids_next = block_ids(bt_row_ptr, STAGES - 1, key_hi, r_kv, BLOCK_N, BLOCK_SIZE,
                                 RPT)  # unused over contiguous keys

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
            cta_barrier()
            if not PAGED:
                mbarrier.wait(ready.index(0), 0)
            s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_acc = warpgroup_mma_wait(0, deps=(s_tok,))
            p, m_i, l_i = first_softmax(scores(s_acc, 0, q_pos, key_hi, n_full, BLOCK_N, CAUSAL, s_layout), qk_scale)

            for j in range(1, n_tiles):
                p, m_i, l_i, acc, ids_next = _step(
                    j, p, m_i, l_i, acc, ids_next, q_smem, k_smem, v_smem, ready, s_zero, q_pos, qk_scale, n_tiles,
                    n_full, key_hi, k_base, v_base, bt_row_ptr, r_kv, d_kv, stride_kb, stride_vb, kv_row0, kvh,
                    STRIDE_KS, STRIDE_VS, HEAD, BLOCK_N, BLOCK_SIZE, STAGES, RPT, CAUSAL, PAGED, o_layout,
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


def stores_rows(query: torch.Tensor, write: KVWrite) -> bool:
    """Whether a launch over contiguous rows (`supported` holds) writes them into `write`'s
    pages itself: the warp-specialised kernel's producer can, into 16-bit pages of the query's
    dtype, with K and V of the same strides (rows and pages) and the head's elements adjacent."""
    k_pages, v_pages = write.k_cache, write.v_cache
    return (query.shape[-1] in WS_HEAD_SIZES and k_pages.dtype == query.dtype and k_pages.stride() == v_pages.stride()
            and k_pages.stride(-1) == 1 and write.key.stride() == write.value.stride())


@dataclass(eq=False)
class HopperPlan:
    """A launch of this kernel, decided (`plan_hopper`); `run_hopper` launches it."""

    tile: tuple[int, int, int]  # (BLOCK_N, STAGES, warps that compute)
    ws: bool  # the warp-specialised kernel
    block_m: int
    num_decodes: int  # decodes interleaved as their own programs (0: every sequence takes query tiles)
    decode_rows: int  # the swapped decode body's query columns (0: none)
    paged: bool
    block_size: int
    causal: bool
    write_lse: bool
    store_block_size: int  # > 0: the producer writes the rows into pages of this size
    search_steps: int
    head_size: int
    group: int
    num_kv_heads: int
    stride_ks: int
    stride_vs: int
    bound: BoundKernel | None = None


def plan_hopper(f, *, search_steps: int, tile: tuple[int, int, int] | None = None) -> HopperPlan:
    """The plan of a launch with facts `f` (`attention_plan.LaunchFacts`; `takes` holds).
    `tile` forces (BLOCK_N, STAGES, warps) for tuning runs (`check_tile` says which are valid)."""
    head_size, group = f.head_size, f.num_heads // f.num_kv_heads
    ws = head_size in WS_HEAD_SIZES
    num_decodes = f.num_decodes
    if tile is None:
        tile = choose_tile(head_size, num_decodes)
    check_tile(tile, head_size)
    block_n, stages, warps = tile
    block_m = 64 * (warps // 4) if ws else 16 * warps
    block_q = max(1, block_m // group)
    if not (0 < num_decodes < f.num_seqs and f.max_decode_query_len <= block_q):
        num_decodes = 0  # decodes, if any, are query tiles like the others
    # a mixed launch's decodes on one consumer: the swapped-operand body where their rows fit
    decode_rows = swapped_decode_rows(next_pow2(group * f.max_decode_query_len), consumers=warps // 4,
                                      block_n=block_n, head=head_size) if ws and num_decodes else 0
    ks, vs = f.kv_strides[:len(f.kv_strides) // 2], f.kv_strides[len(f.kv_strides) // 2:]
    store_block_size = f.store if f.gluon_store else 0
    return HopperPlan(tile, ws, block_m, num_decodes, decode_rows, f.paged, f.block_size, f.causal, f.lse,
                      store_block_size, search_steps, head_size, group, f.num_kv_heads,
                      ks[1] if f.paged else 0, vs[1] if f.paged else 0)


def run_hopper(plan: HopperPlan, query, k_cache, v_cache, out, *, query_start_loc, seq_lens, block_tables, scale,
               lse, kv_start_loc, write: KVWrite | None = None) -> None:
    """Launch `plan` over these tensors (checked by `paged_attention`, of the plan's facts).
    `write` (contiguous rows; the plan's facts say the producer can write them): the producer
    also writes each program's rows into its pages."""
    num_tokens = query.shape[0]
    num_seqs = query_start_loc.shape[0] - 1
    head_size, num_kv_heads = plan.head_size, plan.num_kv_heads
    block_n, stages, warps = plan.tile
    block_q = max(1, plan.block_m // plan.group)
    num_decodes = plan.num_decodes
    num_heavy = num_seqs - num_decodes
    num_tiles = (num_tokens - num_decodes) // block_q + num_heavy  # >= the prefill sequences' tiles
    if plan.paged:
        kv = (block_tables, seq_lens, *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0))
        k_src, v_src = k_cache, v_cache
    else:  # contiguous rows [total_kv, Hkv, D], read by TMA as [total_kv, Hkv * D] tiles (and by
        # the producer's row store, through their strides)
        kv = (seq_lens, kv_start_loc, k_cache.stride(0), 0, k_cache.stride(1), v_cache.stride(0), 0,
              v_cache.stride(1), 0)
        layout = gl.NVMMASharedLayout.get_default_for([block_n, head_size], gl.float16)  # 16-bit
        k_src, v_src = (TensorDescriptor(x, [x.shape[0], num_kv_heads * head_size], [x.stride(0), 1],
                                         [block_n, head_size], layout) for x in (k_cache, v_cache))
    bt, kv_start, skb, _, skh, svb, _, svh, sbt = kv
    lse_arg = lse if lse is not None else seq_lens.view(-1, 1)
    args = (query, k_src, v_src, out, lse_arg, query_start_loc, seq_lens, bt, kv_start,
            float(scale) * LOG2E, num_heavy, num_tiles, num_decodes,
            query.stride(0), query.stride(1), skb, skh, svb, svh,
            out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1), sbt)
    grid = ((num_tiles + num_decodes) * num_kv_heads,)
    if plan.ws:
        if write is not None:
            k_pages, v_pages, slots = write.k_cache, write.v_cache, write.slot_mapping
            store_args = (k_cache, v_cache, slots, k_pages, v_pages, *k_pages.stride()[:3])
        else:  # never read
            store_args = (query, query, seq_lens, query, query, 0, 0, 0)
        if plan.bound is None:
            kernel = ws_kernel(head=head_size, group=plan.group, num_kv_heads=num_kv_heads, block_n=block_n,
                               block_size=plan.block_size, stride_ks=plan.stride_ks, stride_vs=plan.stride_vs,
                               stages=stages, search_steps=plan.search_steps, causal=plan.causal, paged=plan.paged,
                               write_lse=plan.write_lse, consumers=warps // 4,
                               store_block_size=plan.store_block_size,
                               decode_rows=plan.decode_rows)
            # one consumer: two programs an SM, so the registers are split for two (128 a thread
            # at launch; `setmaxnreg` then moves them from the producer to the consumer)
            plan.bound = bind(kernel, {}, dict(num_warps=4, **({"maxnreg": 128} if warps == 4 else {})))
        plan.bound(grid, *args, *store_args)
        return
    if plan.bound is None:
        plan.bound = bind(_one_warpgroup_kernel, dict(
            HEAD=head_size, GROUP=plan.group, NUM_KV_HEADS=num_kv_heads, BLOCK_M=plan.block_m, BLOCK_N=block_n,
            BLOCK_SIZE=plan.block_size, STRIDE_KS=plan.stride_ks, STRIDE_VS=plan.stride_vs, STAGES=stages,
            SEARCH_STEPS=plan.search_steps, CAUSAL=plan.causal, PAGED=plan.paged, WRITE_LSE=plan.write_lse,
            num_warps=warps), {})
    plan.bound(grid, *args)


def hopper_prefill(query, k_cache, v_cache, out, *, query_start_loc, seq_lens, block_tables, scale, causal,
                   lse, kv_start_loc, max_seq_len: int, search_steps: int, num_decodes: int = 0,
                   max_decode_query_len: int = 0, tile: tuple[int, int, int] | None = None,
                   write: KVWrite | None = None) -> None:
    """Plan and launch this kernel in one call (tests and tuning runs; `paged_attention` plans
    once a step). Arguments as `paged_attention` takes them, checked; `supported` holds."""
    from .paged_attention import launch_facts

    f = launch_facts(DeviceProfile.of(query.device), query, k_cache, v_cache, num_seqs=query_start_loc.shape[0] - 1,
                     max_query_len=query.shape[0], max_seq_len=max_seq_len, num_decodes=num_decodes,
                     max_decode_query_len=max(1, max_decode_query_len), paged=kv_start_loc is None,
                     causal=causal, window=False, alibi=False, soft_cap=False, lse=lse is not None, split_limit=1,
                     write=write)
    plan = plan_hopper(f, search_steps=search_steps, tile=tile)
    run_hopper(plan, query, k_cache, v_cache, out, query_start_loc=query_start_loc, seq_lens=seq_lens,
               block_tables=block_tables, scale=scale, lse=lse, kv_start_loc=kv_start_loc, write=write)
