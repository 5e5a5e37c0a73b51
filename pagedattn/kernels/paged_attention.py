"""Variable-length attention over a paged KV cache: decode, multi-token decode, prefill over a
cached prefix and mixed batches, in one launch.

Semantics (the library's reference): query token i of sequence b (0 <= i < query_len_b) sits at
absolute position p = seq_len_b - query_len_b + i (bottom-right aligned). Score s = scale * q.k;
soft cap c: s = c * tanh(s / c); ALiBi: s += slope_h * (key_pos - p); causal: keys <= p;
sliding window W: keys > p - W; non-causal: all keys < seq_len_b, within a two-sided window
(left, right) keys in [p - left, p + right]. Softmax in float32, over the keys and, with
attention sinks, one more score per query head, `sinks[h]`, whose value is 0.

Algorithm (FlashAttention-2 with GQA packing and FlashDecoding splits):
- Grid (query tiles x KV heads, splits), KV heads fastest. Sequence b owns query tiles
  `query_start_loc[b] // BLOCK_Q + b ...`; this start is strictly increasing in b, covers
  ceil(query_len_b / BLOCK_Q) tiles and bounds the grid by T // BLOCK_Q + B, so a program
  finds its sequence with a fixed-length binary search and surplus tiles return at once.
  When `max_query_len` <= BLOCK_Q (decode, short multi-token decode) every sequence has one
  tile: the grid has B tiles and tile b is sequence b, no search (8 dependent loads a program).
- Mixed launches (a prefill-tiled step whose last `num_decodes` sequences are decodes): the
  per-program work is one jitted body with constexpr tile shapes, instantiated twice. Prefill
  sequences keep the search over their tiles; each decode gets one program of a decode tile
  (16 rows for GQA <= 16, its own key tile and pipeline depth, the launch's warps) instead of a
  128-row tile it would fill 4 rows of. Grid slots are the prefill tiles (longest first) and the
  decodes: the first `mix_lead` slots are tiles, the rest interleave tiles and decodes evenly, so
  the decodes' memory-bound streaming runs beside the prefill's matmuls (`MIXED_PREFILL_LEAD`);
  decode programs read their keys (once) with an L2 evict-first hint, sparing the prefill's
  keys, which each of its query tiles reads again.
- GQA packing: the program's tile holds BLOCK_Q query tokens times the GROUP = Hq / Hkv query
  heads that share its KV head (row r = token r // GROUP, head r % GROUP), so every key/value
  tile is loaded once and goes through one `tl.dot` for all of them.
- Key range: causal programs stop after their last token's position, a sliding window starts
  the loop at the first tile any row needs (earlier blocks are never touched), a two-sided
  window also stops it after the last key any row sees. The range is cut into an unmasked
  middle (every row sees every key) and masked edges, so the hot loop carries no mask
  arithmetic. Keys are gathered through the block table, with int64 addresses; with
  `kv_start_loc` the keys are rows of contiguous [total_kv, Hkv, D] tensors instead.
- Online softmax in base 2 (log2(e) folded into the score scale); an attention sink joins the
  state once, in the epilogue (`attention_program._add_sink`), or in the reduction of a split
  launch; the LSE (natural log) includes it. FP8 caches are read raw and converted to the
  query dtype (to fp16 for bf16 queries, which are scaled by a power of two into fp16's range:
  FP8 converts to fp16 natively, to bf16 only through fp16 or fp32), with k_scale folded into
  the score scale and v_scale applied to the normalised output.
- Split-KV: with num_splits > 1 each split takes a contiguous share of the key tiles and writes
  (normalised output, LSE) to the caller's `SplitKVWorkspace`; `reduce_splits` merges them.
  The count is a runtime argument: one compiled variant serves every count (1 to 128).
- On an H100/H200 a prefill-like launch over pages (mixed ones included), or one over
  contiguous keys at head size 128, that fits `hopper_prefill.takes` (16-bit, head size
  64/128, no window, ALiBi, soft cap, sinks or FP8) runs the Gluon kernel of `hopper_prefill.py`
  instead: asynchronous warpgroup MMAs, warp-specialised at head size 128, about 1.5x this loop
  over pages (docs/PERF.md, "Paged causal prefill"; 283c65b and 3b17081, 2026-11-26). A forced
  `tile` keeps this kernel.
- `write` (one `KVWrite`: rows, pages, slots): a launch writes the step's new K/V into the pages
  itself where it can, and the plan says who does (`Store`). Over pages, decode programs write
  their own key range's rows before reading them (76cbdff); over a step's own contiguous rows
  (fresh prompts) the warp-specialised kernel's producer writes them while the products run
  (6defd2d, 2026-11-26); otherwise `store_kv` runs first.
The per-program body lives in attention_program.py.

Host side: `paged_attention` checks its arguments, then plans (`attention_plan.plan_attention`:
tiles clamped to the device's shared memory, splits, grid, who writes the new K/V; memoised per
distinct launch) and runs the plan (`run_plan`: launches only, through `launch.BoundKernel`,
which skips Triton's per-call argument binding). Backends call `launch_facts`, `plan_attention`
and `run_plan` themselves, having checked the step once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedattn.device_profile import DeviceProfile

from ._common import FLOAT_DTYPES, FP8_DTYPES, INTERPRET, check, check_tensor, next_pow2, scale_tensor
from .attention_plan import AttentionPlan, LaunchFacts, Store, plan_attention
from .attention_program import _attend_program
from . import hopper_prefill
from .launch import BoundKernel, bind
from .pdl import use_pdl_on
from .split_kv import SplitKVWorkspace, launch_reduce_splits
from .store_kv import KVWrite, check_store, fp8_constants, launch_store_kv


# Integer arguments that change from step to step are not specialised on (Triton compiles a
# variant per value class: == 1, divisible by 16, other): a server's steps would otherwise meet
# new classes mid-run and stall for a compilation each (seconds on an H100). Besides the counts
# (sequences, tiles, decodes and where they start in a mixed launch, splits): the block table's
# row stride (its width) and the split scratch's outer strides (an unsplit launch passes
# `num_seqs` there). The builder aligns its views, so pointers keep one class too.
@triton.jit(do_not_specialize=["window_left", "window_right", "num_seqs", "num_tiles", "num_decodes", "mix_lead",
                               "num_splits", "split_min_tiles", "stride_bt", "stride_po_s", "stride_ps_s"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_out_ptr, part_stats_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, kv_start_loc_ptr,
    alibi_slopes_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
    sm_scale, soft_cap, window_left, window_right, num_seqs, num_tiles, num_decodes, mix_lead, num_splits,
    split_min_tiles,
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
    NUM_KV_HEADS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MIXED: tl.constexpr,
    DEC_BLOCK_Q: tl.constexpr, DEC_BLOCK_M: tl.constexpr, DEC_BLOCK_N: tl.constexpr,
    DEC_STAGES: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, ONE_TILE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, FP8_KV: tl.constexpr, PAGED: tl.constexpr,
    WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    STORE_NEW: tl.constexpr, NEW_ROWS: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr, FP8_MIN_EXP: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """`num_seqs` and `num_tiles` count the sequences and query tiles of the BLOCK_Q tile; a
    MIXED launch adds `num_decodes` sequences after them, one DEC_BLOCK_Q tile each."""
    if PDL:  # launched early (pdl.py): wait for the store's writes, let the reduction launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Axis 0 enumerates (slot, KV head), KV heads fastest. Slots are query tiles, the last ones -
    # the longest causal rows - first, so heavy programs start early and the tail is short.
    kvh = tl.program_id(0) % NUM_KV_HEADS
    slot = tl.program_id(0) // NUM_KV_HEADS
    split = tl.program_id(1)
    pid = num_tiles - 1 - slot
    if MIXED:
        # Slots [0, mix_lead) are query tiles; the rest interleave the remaining tiles and the
        # decodes evenly: slot mix_lead + u holds a decode iff the count
        # floor((u + 1) * num_decodes / mixed_slots) steps there.
        mixed_slots = num_tiles - mix_lead + num_decodes
        u = tl.maximum(slot - mix_lead, 0).to(tl.int64)
        decodes_upto = (u + 1) * num_decodes // mixed_slots  # decodes in mixed slots 0..u
        decodes_before = u * num_decodes // mixed_slots
        in_mix = slot >= mix_lead
        is_decode = in_mix & (decodes_upto > decodes_before)
        pid = num_tiles - 1 - (slot - tl.where(in_mix, decodes_upto, 0)).to(tl.int32)

    if MIXED and is_decode:  # (constexpr False unless MIXED: one body compiled)
        # decode number `decodes_before`: one query tile of the decode shape
        b = num_seqs + decodes_before.to(tl.int32)
        q_begin = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_begin
        _attend_program(
            b, q_begin, q_len, b * 0, kvh, split,
            q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_out_ptr, part_stats_ptr,
            seq_lens_ptr, block_tables_ptr, kv_start_loc_ptr, alibi_slopes_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
            sm_scale, soft_cap, window_left, window_right, num_splits, split_min_tiles,
            stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
            stride_lt, stride_lh, stride_po_s, stride_po_t, stride_po_h, stride_po_d,
            stride_ps_s, stride_ps_t, stride_ps_h, stride_ps_c, stride_bt,
            new_k_ptr, new_v_ptr, new_slot_ptr,
            stride_nk_t, stride_nk_h, stride_nk_d, stride_nv_t, stride_nv_h, stride_nv_d,
            HEAD_SIZE, HEAD_PAD, GROUP, DEC_BLOCK_Q, DEC_BLOCK_M, DEC_BLOCK_N,
            DEC_STAGES, "evict_first",  # streamed once: keep the prefill's keys in L2 instead
            BLOCK_SIZE, SPLIT, CAUSAL, USE_WINDOW, USE_ALIBI, USE_SOFTCAP, USE_SINKS, FP8_KV, PAGED,
            WRITE_LSE, UPCAST, IEEE, STORE_NEW, NEW_ROWS, FP8_MAX, FP8_MANTISSA_BITS, FP8_MIN_EXP,
            INTERPRETED)
    else:
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
        _attend_program(
            b, q_begin, q_len, q0, kvh, split,
            q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_out_ptr, part_stats_ptr,
            seq_lens_ptr, block_tables_ptr, kv_start_loc_ptr, alibi_slopes_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
            sm_scale, soft_cap, window_left, window_right, num_splits, split_min_tiles,
            stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
            stride_lt, stride_lh, stride_po_s, stride_po_t, stride_po_h, stride_po_d,
            stride_ps_s, stride_ps_t, stride_ps_h, stride_ps_c, stride_bt,
            new_k_ptr, new_v_ptr, new_slot_ptr,
            stride_nk_t, stride_nk_h, stride_nk_d, stride_nv_t, stride_nv_h, stride_nv_d,
            HEAD_SIZE, HEAD_PAD, GROUP, BLOCK_Q, BLOCK_M, BLOCK_N, None, "",
            BLOCK_SIZE, SPLIT, CAUSAL, USE_WINDOW, USE_ALIBI, USE_SOFTCAP, USE_SINKS, FP8_KV, PAGED,
            WRITE_LSE, UPCAST, IEEE, STORE_NEW, NEW_ROWS, FP8_MAX, FP8_MANTISSA_BITS, FP8_MIN_EXP,
            INTERPRETED)


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
    sliding_window: int | tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    lse: torch.Tensor | None = None,
    workspace: SplitKVWorkspace | None = None,
    kv_start_loc: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile: tuple[int, int, int] | None = None,
    num_decodes: int = 0,
    max_decode_query_len: int = 1,
    decode_tile: tuple[int, ...] | None = None,
    write: KVWrite | None = None,
    profile: DeviceProfile | None = None,
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
    sliding_window: W keys up to and including the query's own position (causal only), or
        FlashAttention's `window_size` (left, right): keys in [p - left, p + right], -1
        unbounded on that side; right > 0 only with causal=False (causal: 0 or -1).
    alibi_slopes: [Hq] float32. soft_cap: c in c * tanh(s / c).
    sinks: [Hq] float32/float16/bfloat16, unit stride: attention sinks, one more score per
        query head in the softmax's denominator (its value is 0), not scaled or capped.
    k_scale, v_scale: 0-dim float32 device tensors (python floats cost an allocation); FP8 only.
    lse: optional [T, Hq] float32 output, natural-log log-sum-exp of each row's scores (and of
        its head's sink): -inf for a row that sees no key and has no sink.
    workspace: split-KV scratch; without it (or when it holds no 2 splits of T tokens) the
        launch is unsplit.
    kv_start_loc: [B+1] int32; sequence b's keys are rows kv_start_loc[b] + (0..seq_lens[b]-1).
    num_splits: force the split count (tests, tuning); needs a workspace when > 1.
    tile: force (BLOCK_N keys per step, num_warps, num_stages[, BLOCK_M rows]) instead
        of the policy's (`paged_attention_config.choose_tile`; tuning); without BLOCK_M the
        query tile stays the policy's.
    num_decodes: how many of the last sequences are decodes, each with at most
        `max_decode_query_len` query tokens (a bound the launch relies on, as on max_query_len;
        a mixed step's decodes follow its prefills: the metadata's `num_seqs - num_prefills`).
        When the launch's tile is prefill-shaped and the decodes fit a smaller one, they get
        programs of that decode tile (`choose_mixed_decode_tile`) in the same launch; the
        result is the same either way. 0: every sequence takes the launch's tile.
    decode_tile: force (BLOCK_N, num_stages[, BLOCK_M rows]) of those decode programs (tuning);
        only for a launch that gives its decodes their own tile (warps are the launch's).
    write: rows to write into pages as `store_kv(*write, k_scale, v_scale)` would (`KVWrite`).
        Over pages: the step's new rows (row t the key/value of query row t) into the launch's
        own k_cache/v_cache, before they are read (causal launches only); where each sequence's
        queries are one tile (decodes) each program writes its own key range's rows first,
        saving the store launch. Over contiguous rows (`kv_start_loc`): the launch's own
        key/value rows into the pages (the launch reads no pages, so the order does not
        matter); the warp-specialised Gluon kernel writes them from its producer while the
        products run (`hopper_prefill.stores_rows`). Otherwise `store_kv` runs first. The
        programs write only their sequences' rows: rows outside them must have slot -1.
    profile: the device's `DeviceProfile` (default: `DeviceProfile.of(query.device)`); tiles and
        kernels follow it (compile tests pass other GPUs' profiles).

    The launch is planned once per distinct shape (`attention_plan.plan_attention`, memoised);
    backends that plan once a step call `run_plan` with their plan.
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
    window = window_size(sliding_window, causal)
    if sinks is not None:
        check_tensor(sinks, "sinks", ndim=1, dtypes=FLOAT_DTYPES, device=device)
        check(sinks.shape[0] == num_heads, "sinks.shape[0]", num_heads, sinks.shape[0])
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
                    ("kv_start_loc", kv_start_loc), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None:
            check(t.stride(0) == 1 or t.shape[0] <= 1, f"{name}.stride(0)", 1, t.stride(0))
    if write is not None:
        check_write(write, k_cache, v_cache, paged=paged, causal=causal, num_tokens=num_tokens)
    check(0 <= num_decodes <= num_seqs, "num_decodes", f"0..{num_seqs} (the sequences)", num_decodes)
    check(max_decode_query_len >= 1, "max_decode_query_len", ">= 1", max_decode_query_len)
    profile = profile if profile is not None else DeviceProfile.of(device)
    split_limit = 1 if workspace is None else workspace.splits_for(num_tokens, num_heads, head_size)
    if num_splits is not None and num_splits > 1:
        check(num_splits <= split_limit, "workspace for num_splits",
              f"a SplitKVWorkspace with room for {num_splits} splits of {num_tokens} tokens, "
              f"{num_heads} heads of size {head_size}",
              None if workspace is None else
              f"{split_limit} splits ({workspace.rows} rows of {tuple(workspace.partial_out.shape[1:])}, "
              f"max_splits {workspace.max_splits})")
    facts = launch_facts(profile, query, k_cache, v_cache, num_seqs=num_seqs, max_query_len=max_query_len,
                         max_seq_len=max_seq_len, num_decodes=num_decodes, max_decode_query_len=max_decode_query_len,
                         paged=paged, causal=causal, window=window is not None,
                         alibi=alibi_slopes is not None, soft_cap=soft_cap is not None, lse=lse is not None,
                         split_limit=split_limit, write=write, tile=tile, decode_tile=decode_tile,
                         num_splits=num_splits, sinks=sinks is not None)
    run_plan(plan_attention(facts), query, k_cache, v_cache, out, query_start_loc=query_start_loc,
             seq_lens=seq_lens, block_tables=block_tables, kv_start_loc=kv_start_loc, scale=scale,
             window=window, alibi_slopes=alibi_slopes, soft_cap=soft_cap, sinks=sinks, k_scale=k_scale,
             v_scale=v_scale, lse=lse, workspace=workspace, write=write)
    return out


def check_write(write: KVWrite, k_cache, v_cache, *, paged: bool, causal: bool, num_tokens: int) -> None:
    """`paged_attention`'s `write` against its launch: over pages it writes into the launch's own
    caches, a row per query row; over contiguous rows it writes the launch's own rows."""
    check_store(*write)
    if paged:
        check(_same(write.k_cache, k_cache) and _same(write.v_cache, v_cache), "write.k_cache/v_cache",
              "the launch's k_cache/v_cache (a paged launch writes its new rows where it reads)", "other tensors")
        check(causal, "write with causal=False", "causal=True (new rows end their sequences)", "causal=False")
        check(write.key.shape[0] == num_tokens, "write.key.shape[0]", f"{num_tokens} (a row per query row)",
              write.key.shape[0])
    else:
        check(_same(write.key, k_cache) and _same(write.value, v_cache), "write.key/value",
              "the launch's contiguous key/value rows (a launch over rows writes those rows)", "other tensors")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements: one storage, offset, shape and strides (views made twice compare equal)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def launch_facts(profile: DeviceProfile, query, k_cache, v_cache, *, num_seqs: int, max_query_len: int,
                 max_seq_len: int, num_decodes: int, max_decode_query_len: int, paged: bool, causal: bool,
                 window: bool, alibi: bool, soft_cap: bool, lse: bool, split_limit: int, write: KVWrite | None,
                 tile=None, decode_tile=None, num_splits=None, sinks: bool = False) -> LaunchFacts:
    """The `LaunchFacts` of a launch over these tensors (query [T, Hq, D]; the caches, or the
    contiguous key/value rows with `paged` False), with the options as host values."""
    store = write is not None and not paged  # contiguous rows into pages of write's block size
    num_tokens, num_heads, head_size = query.shape
    # decode-like launches never take the Gluon kernels: their layout is not looked at
    gluon_layout = (profile.wgmma and next_pow2(max_query_len * num_heads // k_cache.shape[-2]) > 64
                    and hopper_prefill.layout_ok(query, k_cache, v_cache, paged=paged))
    return LaunchFacts(
        profile, num_tokens, num_seqs, max_query_len, max_seq_len, num_decodes, max_decode_query_len, num_heads,
        k_cache.shape[-2], head_size, query.dtype, k_cache.dtype, k_cache.shape[1] if paged else 1, paged,
        bool(causal), window, alibi, soft_cap, lse, split_limit, write.k_cache.shape[1] if store else 0,
        write is not None and paged, gluon_layout, store and gluon_layout and hopper_prefill.stores_rows(query, write),
        (*k_cache.stride(), *v_cache.stride()), tile, decode_tile, num_splits, sinks)


def run_plan(plan: AttentionPlan, query, k_cache, v_cache, out, *, query_start_loc, seq_lens, block_tables,
             kv_start_loc, scale, window, alibi_slopes, soft_cap, sinks, k_scale, v_scale, lse, workspace,
             write) -> None:
    """Launch `plan` over these tensors: arguments as `paged_attention` takes them, checked, of
    the plan's facts (the backends call this with a plan of the step), the window as
    `window_size` gives it. Launches only."""
    f = plan.facts
    if plan.store is Store.FIRST:
        launch_store_kv(*write, k_scale, v_scale)  # rows to pages, checked
    if plan.empty:
        return
    if plan.gluon is not None:
        hopper_prefill.run_hopper(
            plan.gluon, query, k_cache, v_cache, out, query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_tables=block_tables, scale=scale, lse=lse, kv_start_loc=kv_start_loc,
            write=write if plan.store is Store.KERNEL else None)
        return
    fp8 = f.kv_dtype in FP8_DTYPES
    k_scale_t = scale_tensor(k_scale, "k_scale", query.device) if fp8 else seq_lens
    v_scale_t = scale_tensor(v_scale, "v_scale", query.device) if fp8 else seq_lens
    num_splits = plan.num_splits
    if num_splits > 1:
        part_out, part_stats = workspace.views(num_splits, f.num_tokens)
        part_strides = (*part_out.stride(), *part_stats.stride())
    else:  # never written: any pointers
        part_out, part_stats, part_strides = out, seq_lens, _NO_STRIDES[:8]
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else _NO_STRIDES[:2]
    lse_arg = lse if lse is not None else seq_lens  # never written without lse
    if f.paged:
        bt_arg, bt_stride, kv_start_arg = block_tables, block_tables.stride(0), query_start_loc
        kv_strides = f.kv_strides
    else:
        bt_arg, bt_stride, kv_start_arg = seq_lens, 0, kv_start_loc
        kv_strides = (0, *f.kv_strides[:3], 0, *f.kv_strides[3:])
    fused = plan.store is Store.KERNEL
    new_k, new_v, new_slots = (write.key, write.value, write.slot_mapping) if fused else (query, query, seq_lens)
    kernel = plan.bound.get(_paged_attention_kernel)  # keyed by the function: tests swap it for a recorder
    if kernel is None:
        kernel = plan.bound[_paged_attention_kernel] = _bind_attend(plan)
    kernel(plan.grid,
           query, k_cache, v_cache, out, lse_arg, part_out, part_stats,
           query_start_loc, seq_lens, bt_arg, kv_start_arg,
           alibi_slopes if alibi_slopes is not None else seq_lens, k_scale_t, v_scale_t,
           sinks if sinks is not None else seq_lens, float(scale), float(soft_cap or 0.0),
           *_window_args(window), plan.num_heavy, plan.num_tiles,
           plan.num_mixed, plan.mix_lead, num_splits, plan.min_tiles,
           *query.stride(), *kv_strides, *out.stride(), *lse_strides, *part_strides, bt_stride,
           new_k, new_v, new_slots, *new_k.stride()[:3], *new_v.stride()[:3])
    if num_splits > 1:
        launch_reduce_splits(workspace, num_splits, out, lse, (part_out, part_stats), sinks)


_NO_STRIDES = (0,) * 8  # the strides of a tensor argument the launch never reads
_UNBOUNDED = 1 << 30  # a window side of -1: farther than any position (int32 arithmetic in the kernel)


def window_size(sliding_window: int | tuple[int, int] | None, causal: bool) -> tuple[int, int] | None:
    """`paged_attention`'s `sliding_window` as FlashAttention's `window_size` (left, right): keys
    in [p - left, p + right], -1 unbounded; None for no window. An int W is (W - 1, 0), causal
    launches only; a causal launch takes right 0 or -1 (the causal mask ends the keys at p
    either way)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, int):
        check(causal, "sliding_window W with causal=False", "causal=True (or a (left, right) window)",
              "causal=False")
        check(sliding_window >= 1, "sliding_window", ">= 1", sliding_window)
        return (sliding_window - 1, 0)
    check(len(sliding_window) == 2 and all(isinstance(w, int) and w >= -1 for w in sliding_window),
          "sliding_window", "an int >= 1 or (left, right) ints >= -1", sliding_window)
    left, right = sliding_window
    if causal:
        check(right in (-1, 0), "sliding_window with causal=True", "right 0 or -1 (keys end at the query)",
              sliding_window)
        right = 0
    return None if (left, right) == (-1, -1) or (causal and left == -1) else (left, right)


def _window_args(window: tuple[int, int] | None) -> tuple[int, int]:
    """The kernel's (window_left, window_right): key offsets before and after a row's position."""
    if window is None:
        return 0, 0
    return tuple(_UNBOUNDED if w < 0 else w for w in window)


def _bind_attend(plan: AttentionPlan) -> BoundKernel:
    """The attention kernel with the plan's constexprs and launch options."""
    f, tile = plan.facts, plan.tile
    dec = plan.decode_tile or tile  # not mixed: the decode body is not compiled, its constexprs follow the tile
    pdl = use_pdl_on(f.profile)
    constexprs = dict(
        HEAD_SIZE=f.head_size, HEAD_PAD=max(16, next_pow2(f.head_size)), GROUP=f.num_heads // f.num_kv_heads,
        NUM_KV_HEADS=f.num_kv_heads,
        BLOCK_Q=tile.block_q, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, MIXED=plan.decode_tile is not None,
        DEC_BLOCK_Q=dec.block_q, DEC_BLOCK_M=dec.block_m, DEC_BLOCK_N=dec.block_n,
        DEC_STAGES=dec.num_stages,
        BLOCK_SIZE=f.block_size, SPLIT=plan.num_splits > 1, ONE_TILE=plan.one_tile,
        SEARCH_STEPS=plan.search_steps,
        CAUSAL=f.causal, USE_WINDOW=f.window, USE_ALIBI=f.alibi, USE_SOFTCAP=f.soft_cap, USE_SINKS=f.sinks,
        FP8_KV=f.kv_dtype in FP8_DTYPES, PAGED=f.paged, WRITE_LSE=f.lse, UPCAST=INTERPRET,
        IEEE=f.q_dtype == torch.float32, PDL=pdl, STORE_NEW=plan.store is Store.KERNEL,
        NEW_ROWS=next_pow2(tile.block_q), **fp8_constants(f.kv_dtype))
    options = dict(num_warps=tile.num_warps, num_stages=tile.num_stages, **({"launch_pdl": True} if pdl else {}))
    return bind(_paged_attention_kernel, constexprs, options)
