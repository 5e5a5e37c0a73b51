"""FlashAttention's paged entry points, running on pagedattn's Triton kernel.

    import pagedattn.flash_attn_interface as flash_attn
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, ...)

Same names, argument names, defaults, shapes and return values as Dao-AILab's flash-attn 2.x
(`flash_attn/flash_attn_interface.py`), forward only, on every device our kernels run on: CUDA
GPUs, and the CPU under `TRITON_INTERPRET=1` (slowly). Both calls are one launch of
`pagedattn.kernels.paged_attention` (plus the split-KV reduction, and the in-place store of new
keys/values for `flash_attn_with_kvcache`); nothing synchronises with the host, so both can be
captured in CUDA graphs.

`window_size=(left, right)` keeps the keys in [p - left, p + right] of a query at bottom-right
aligned position p (-1: unbounded), as FlashAttention's local attention does: with
`causal=False` on both sides (`(4, 3)`: 4 keys before the query, 3 after), with `causal=True`
on the left only (`right` must be 0 or -1). `causal=False, right=0` is the causal mask with a
left window and runs as one.

Differences from Dao-AILab's flash-attn 2.x (each refusal raises `NotImplementedError` naming
the argument; nothing is silently ignored):
- Only these two entry points (no `flash_attn_func`, packed-QKV/KV variants or
  `flash_attn_combine`).
- Forward only: `flash_attn_varlen_func` refuses inputs that require grad while grad mode is
  on. `deterministic` only concerns FlashAttention's backward; our forward is deterministic
  (the split count is a function of the shapes), so `deterministic=True` is accepted.
- Refused: `dropout_p != 0`; `rotary_cos`/`rotary_sin`; `alibi_slopes` of shape `[B, Hq]`;
  ALiBi without causal (FlashAttention's non-causal bias is `-slope * |p - j|`, the kernel's is
  `slope * (j - p)`, equal only for keys at or before the query); under causal, a window
  reaching past the query (`right > 0`; flash-attn 2.x sets it to 0 silently);
  `cache_batch_idx` with `block_table` (flash-attn refuses it too); `cache_leftpad` with
  `block_table` (likewise).
- `return_attn_probs=True` returns `(out, softmax_lse, None)`; flash-attn 2.x returns an empty
  tensor as the third item when `dropout_p == 0` (it never returns real probabilities then).
- A query that sees no key gets output 0 and LSE `-inf` (flash-attn 2.x writes `+inf`), or its
  sink's logit with `learnable_sink`.
- `num_splits` is a hint: 0 picks a split count, 1 disables splitting, n > 1 asks for n splits,
  capped at the split-KV scratch size (16) and ignored when the step has more tokens than the
  scratch holds. The result does not depend on it beyond float rounding.
- Non-paged caches for `flash_attn_with_kvcache` must flatten to rows
  (`k_cache.stride(0) == seqlen_cache * k_cache.stride(1)`, true of any contiguous cache);
  the page size of paged caches may be any integer >= 1 (flash-attn 2.x: a multiple of 256).
- Query dtypes float32/float16/bfloat16 (flash-attn 2.x: float16/bfloat16); any head size the
  kernel compiles (flash-attn: <= 256).
- Added, as in vLLM's flash-attn fork: `out=` on both calls (caller-owned output, for CUDA
  graphs), and FP8 caches (`float8_e4m3fn`/`float8_e5m2`, stored as value / scale) with the
  keyword-only `k_descale`/`v_descale`: one float32 scale each (a float or a one-element
  tensor; flash-attn 3's per-(batch, KV head) `[B, Hkv]` descales are refused unless they hold
  one element). New `k`/`v` appended to an FP8 cache are quantised with those scales.
- Added, as FA4 (`flash_attn.cute`) names it: keyword-only `learnable_sink`, attention sinks
  `[Hq]` float32/float16/bfloat16 (gpt-oss): one more logit per query head in the softmax's
  denominator, whose value is 0, not scaled or soft-capped; its LSE includes it.
- Non-causal calls (no difference in results or launches): one launch, in which each query row
  sees every key of its sequence (within a two-sided window, if any), as in flash-attn; a
  sequence with more queries than keys (cross attention over a short encoder side) gets every
  row, its first rows at negative bottom-right aligned positions, which only a window reads.
- The cache must have room for `cache_seqlens + seqlen_new` keys when `k`/`v` are appended, as
  flash-attn requires; it is not checked, since checking would synchronise.
Against flash-attn 3.x (`hopper/flash_attn_interface.py`): the signatures here are 2.x's.
3.x orders its arguments differently (pass them by keyword to use either), has no `dropout_p`,
`alibi_slopes` or `block_table` on `flash_attn_varlen_func`, calls the paged table
`page_table` on `flash_attn_with_kvcache`, and takes `seqused_q`/`seqused_k`, `qv`,
`q_descale`, `attention_chunk`, `scheduler_metadata`, `pack_gqa`, `sm_margin` and (kvcache)
`cu_seqlens_q`/`cu_seqlens_k_new`/`max_seqlen_q`/`rotary_seqlens`, which do not exist here (a
TypeError, never ignored); of its FP8 arguments only one-value `k_descale`/`v_descale` exist.
"""

from __future__ import annotations

import torch

from pagedattn.dtypes import FLOAT_DTYPES, FP8_DTYPES

__all__ = ["flash_attn_varlen_func", "flash_attn_with_kvcache"]

# ----------------------------------------------------------------------------- checks


def _expect(cond: bool, what: str, expected: object, got: object) -> None:
    if not cond:
        raise ValueError(f"{what}: expected {expected}, got {got}")


def _unsupported(name: str, got: object, why: str) -> NotImplementedError:
    return NotImplementedError(f"pagedattn.flash_attn_interface: {name}={got} is not supported "
                               f"({why})")


def _expect_tensor(t, name: str, shape: tuple, dtypes: tuple, device=None) -> None:
    """`shape` holds ints or None (any size) per dimension."""
    _expect(isinstance(t, torch.Tensor), name, "a torch.Tensor", type(t).__name__)
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    _expect(ok, f"{name}.shape", want, list(t.shape))
    _expect(t.dtype in dtypes, f"{name}.dtype", " or ".join(map(str, dtypes)), t.dtype)
    if device is not None:
        _expect(t.device == device, f"{name}.device", device, t.device)


def _int32_vector(t, name: str, length: int, device) -> torch.Tensor:
    _expect_tensor(t, name, (length,), (torch.int32,), device)
    return t if t.stride(0) == 1 else t.contiguous()


def _mask(causal: bool, window_size, alibi_slopes, num_heads: int, num_seqs: int, device):
    """FlashAttention's (causal, window_size, alibi_slopes) as the kernel's
    (causal, sliding_window (left, right) or None, alibi [Hq] float32 or None)."""
    _expect(len(window_size) == 2, "window_size", "(left, right)", window_size)
    left, right = (int(w) for w in window_size)
    _expect(left >= -1 and right >= -1, "window_size", "(left, right) with each >= -1",
            window_size)
    if causal:
        if right not in (-1, 0):
            raise _unsupported("window_size", tuple(window_size),
                               "with causal=True the window cannot reach past the query; "
                               "expected right in (-1, 0)")
    elif right == 0:
        causal = True  # (left, 0) is the causal mask with a left window, as in FlashAttention
    sliding_window = None if (left, right) == (-1, -1) else (left, right)
    if alibi_slopes is None:
        return causal, sliding_window, None
    _expect(isinstance(alibi_slopes, torch.Tensor), "alibi_slopes", "a float32 tensor [Hq]",
            type(alibi_slopes).__name__)
    if alibi_slopes.dim() == 2:
        _expect(tuple(alibi_slopes.shape) == (num_seqs, num_heads), "alibi_slopes.shape",
                f"[{num_heads}] or [{num_seqs}, {num_heads}]", list(alibi_slopes.shape))
        raise _unsupported("alibi_slopes", f"<tensor {list(alibi_slopes.shape)}>",
                           "per-sequence slopes [B, Hq]; the kernel takes one slope per head")
    _expect_tensor(alibi_slopes, "alibi_slopes", (num_heads,), (torch.float32,), device)
    if not causal:
        raise _unsupported("alibi_slopes", "<tensor>", "ALiBi needs causal=True: the kernel's "
                           "bias is slope * (key_pos - query_pos), FlashAttention's non-causal "
                           "bias is -slope * |key_pos - query_pos|")
    return causal, sliding_window, alibi_slopes.contiguous()


def _descale(descale, name: str, cache_dtype: torch.dtype, device):
    """A one-value FP8 descale as the kernel takes it (python float or 0-dim float32)."""
    if descale is None:
        return 1.0
    _expect(cache_dtype in FP8_DTYPES, name,
            f"None for a {cache_dtype} cache (descales apply to float8 caches)", "a scale")
    if not isinstance(descale, torch.Tensor):
        return float(descale)
    if descale.numel() != 1:
        raise _unsupported(name, f"<tensor {list(descale.shape)}>",
                           "one scale per cache; per-(batch, KV head) descales are not supported")
    _expect(descale.dtype == torch.float32, f"{name}.dtype", torch.float32, descale.dtype)
    _expect(descale.device == device, f"{name}.device", device, descale.device)
    return descale.reshape(())


# ----------------------------------------------------------------------------- the launch


def _attend(query, k, v, out, lse, *, query_start_loc, seq_lens, block_tables, kv_start_loc,
            max_query_len: int, max_seq_len: int, num_splits, **options) -> None:
    """One `paged_attention` launch over [T, Hq, D] `query` into `out` (and `lse` [T, Hq])."""
    from pagedattn.kernels import paged_attention, shared_workspace

    workspace = shared_workspace(query.device, query.shape[1], k.shape[-2], query.shape[2])
    if num_splits is not None and num_splits > 1:
        num_splits = min(num_splits, workspace.splits_for(*query.shape))
    paged_attention(query, k, v, out, query_start_loc=query_start_loc, seq_lens=seq_lens,
                    block_tables=block_tables, kv_start_loc=kv_start_loc,
                    max_query_len=max_query_len, max_seq_len=max_seq_len, lse=lse,
                    workspace=workspace, num_splits=num_splits, **options)


def _sinks(learnable_sink, num_heads: int, device) -> torch.Tensor | None:
    """`learnable_sink` as the kernel takes it: [Hq] of unit stride, or None."""
    if learnable_sink is None:
        return None
    _expect_tensor(learnable_sink, "learnable_sink", (num_heads,), FLOAT_DTYPES, device)
    return learnable_sink.contiguous()


def _kernel_options(q, k_dtype, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    num_seqs, k_descale, v_descale, learnable_sink) -> dict:
    causal, sliding_window, alibi = _mask(causal, window_size, alibi_slopes, q.shape[-2],
                                          num_seqs, q.device)
    return dict(
        scale=q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale),
        causal=causal, sliding_window=sliding_window, alibi_slopes=alibi,
        sinks=_sinks(learnable_sink, q.shape[-2], q.device),
        soft_cap=float(softcap) if softcap > 0 else None,  # flash-attn: <= 0 is off
        k_scale=_descale(k_descale, "k_descale", k_dtype, q.device),
        v_scale=_descale(v_descale, "v_descale", k_dtype, q.device))


# ----------------------------------------------------------------------------- varlen


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    deterministic=False, return_attn_probs=False, block_table=None, out=None, *,
    k_descale=None, v_descale=None, learnable_sink=None,
):
    """Ragged (variable-length) attention; keys contiguous, or paged with `block_table`.

    q: [total_q, Hq, D] float32/float16/bfloat16; sequence b's queries are rows
        cu_seqlens_q[b]..cu_seqlens_q[b+1], bottom-right aligned against its keys.
    k, v: [total_k, Hkv, D] (rows cu_seqlens_k[b]..cu_seqlens_k[b+1] are sequence b's keys),
        or with `block_table` a paged cache [num_blocks, block_size, Hkv, D]; q's dtype or a
        float8 dtype (read as stored * k_descale / v_descale).
    cu_seqlens_q, cu_seqlens_k: [B+1] int32 on q's device; with `block_table`,
        cu_seqlens_k[b+1] - cu_seqlens_k[b] is sequence b's key count, its keys the first ones
        of its block table (a chunked prefill over a cached prefix).
    max_seqlen_q, max_seqlen_k: host ints bounding the query and key lengths (the launch shape);
        as in FlashAttention, a max_seqlen_q below a sequence's query length leaves rows uncomputed.
    dropout_p: must be 0. softmax_scale: default D ** -0.5. causal: bottom-right aligned.
    window_size: (left, right), see the module doc. softcap: c in c * tanh(s / c); <= 0 is off.
    alibi_slopes: [Hq] float32, causal only. deterministic: accepted (see the module doc).
    return_attn_probs: also return the LSE. block_table: [B, max_blocks] int32.
    out: optional [total_q, Hq, D] in q's dtype, written and returned.
    k_descale, v_descale: FP8 scales (keyword-only extension, see the module doc).
    learnable_sink: optional [Hq] attention sinks (keyword-only extension, see the module doc).

    Returns out [total_q, Hq, D], or with `return_attn_probs` (out, softmax_lse, None) where
    softmax_lse is [Hq, total_q] float32, the natural log of each row's softmax denominator.
    """
    if dropout_p != 0:
        raise _unsupported("dropout_p", dropout_p, "inference only; expected 0.0")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)
                                       if isinstance(t, torch.Tensor)):
        raise _unsupported("q/k/v.requires_grad", True, "forward only; call it under "
                           "torch.no_grad() or torch.inference_mode()")
    _expect_tensor(q, "q", (None, None, None), FLOAT_DTYPES)
    device = q.device
    total_q, num_heads, head_size = q.shape
    paged = block_table is not None
    kv_shape = (None, None, None, head_size) if paged else (None, None, head_size)
    _expect_tensor(k, "k", kv_shape, (q.dtype,) + FP8_DTYPES, device)
    _expect_tensor(v, "v", tuple(k.shape), (k.dtype,), device)
    _expect_tensor(cu_seqlens_q, "cu_seqlens_q", (None,), (torch.int32,), device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    _expect(num_seqs >= 0, "cu_seqlens_q.shape", "[B+1]", list(cu_seqlens_q.shape))
    cu_seqlens_q = _int32_vector(cu_seqlens_q, "cu_seqlens_q", num_seqs + 1, device)
    cu_seqlens_k = _int32_vector(cu_seqlens_k, "cu_seqlens_k", num_seqs + 1, device)
    if paged:
        _expect_tensor(block_table, "block_table", (num_seqs, None), (torch.int32,), device)
        block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    else:
        _expect_tensor(out, "out", tuple(q.shape), (q.dtype,), device)
    options = _kernel_options(q, k.dtype, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, num_seqs, k_descale, v_descale, learnable_sink)
    lse = (torch.empty(num_heads, total_q, dtype=torch.float32, device=device)
           if return_attn_probs else None)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    _attend(q, k, v, out, None if lse is None else lse.t(),  # the kernel writes [T, Hq]
            query_start_loc=cu_seqlens_q,
            seq_lens=cu_seqlens_k[1:] - cu_seqlens_k[:-1],  # [B]
            block_tables=block_table, kv_start_loc=None if paged else cu_seqlens_k,
            max_query_len=max_seqlen_q, max_seq_len=max_seqlen_k,
            num_splits=None, **options)
    return (out, lse, None) if return_attn_probs else out


# ----------------------------------------------------------------------------- kvcache


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """[A, S, ...] as an [A * S, ...] view (never a copy: the caller writes through it)."""
    try:
        return t.flatten(0, 1) if t.shape[0] <= 1 else t.view(-1, *t.shape[2:])
    except RuntimeError:
        raise ValueError(f"{name}.stride(): expected dims 0 and 1 to flatten into rows "
                         f"(stride(0) == shape[1] * stride(1) = {t.shape[1] * t.stride(1)}), "
                         f"got strides {t.stride()}") from None


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
    alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, out=None, k_descale=None,
    v_descale=None, learnable_sink=None,
):
    """Attention of B sequences' Sq new queries over their KV cache (decode, multi-token decode),
    after appending the new `k`/`v` to the cache in place when given.

    q: [B, Sq, Hq, D] float32/float16/bfloat16; query i of sequence b sits at position
        seqlen_k - Sq + i, seqlen_k = cache_seqlens[b] + Sk_new (- cache_leftpad[b]).
    k_cache, v_cache: [B_cache, S_cache, Hkv, D] without `block_table` (row b, or
        cache_batch_idx[b], is sequence b's cache), or a paged cache
        [num_blocks, block_size, Hkv, D] with it; q's dtype or a float8 dtype.
    k, v: optional [B, Sk_new, Hkv, D] in q's dtype, written into the cache at positions
        cache_seqlens[b] .. cache_seqlens[b] + Sk_new - 1 before attending.
    rotary_cos, rotary_sin: must be None (rotary_interleaved then means nothing).
    cache_seqlens: int or [B] int32, keys already cached per sequence; None: the whole cache
        (S_cache, or block_table.shape[1] * block_size); required with k/v.
    cache_batch_idx: optional [B] int32 rows of a non-paged cache.
    cache_leftpad: optional [B] int32, where each sequence's keys start in a non-paged cache.
    block_table: [B, max_blocks] int32. softmax_scale, causal, window_size, softcap,
        alibi_slopes: as in `flash_attn_varlen_func`.
    num_splits: split-KV hint, 0 automatic (see the module doc).
    out: optional [B, Sq, Hq, D] in q's dtype whose first two dims flatten, written, returned.
    k_descale, v_descale: FP8 scales (keyword-only extension, see the module doc).
    learnable_sink: optional [Hq] attention sinks (keyword-only extension, see the module doc).

    Returns out [B, Sq, Hq, D], or with `return_softmax_lse` (out, softmax_lse) where
    softmax_lse is [B, Hq, Sq] float32, natural log.
    """
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if value is not None:
            raise _unsupported(name, "<tensor>", "rotary embedding is the model's job; apply it "
                               "to q and k before the call")
    _expect_tensor(q, "q", (None, None, None, None), FLOAT_DTYPES)
    device = q.device
    num_seqs, seqlen_q, num_heads, head_size = q.shape
    _expect_tensor(k_cache, "k_cache", (None, None, None, head_size), (q.dtype,) + FP8_DTYPES,
                   device)
    _expect_tensor(v_cache, "v_cache", tuple(k_cache.shape), (k_cache.dtype,), device)
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    paged = block_table is not None
    if paged:
        for name, value in (("cache_batch_idx", cache_batch_idx),
                            ("cache_leftpad", cache_leftpad)):
            if value is not None:
                raise _unsupported(name, "<tensor>", "with block_table (flash-attn refuses "
                                   "this combination too)")
        _expect_tensor(block_table, "block_table", (num_seqs, None), (torch.int32,), device)
        block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
        max_keys = block_table.shape[1] * page
    else:
        if cache_batch_idx is None:
            _expect(k_cache.shape[0] >= num_seqs, "k_cache.shape[0] without cache_batch_idx",
                    f">= {num_seqs} (q.shape[0])", k_cache.shape[0])
        max_keys = page
    _expect((k is None) == (v is None), "k, v", "both or neither",
            f"k={'a tensor' if k is not None else None}, v={'a tensor' if v is not None else None}")
    seqlen_new = 0
    if k is not None:
        _expect_tensor(k, "k", (num_seqs, None, num_kv_heads, head_size), (q.dtype,), device)
        _expect_tensor(v, "v", tuple(k.shape), (q.dtype,), device)
        seqlen_new = k.shape[1]
        _expect(cache_seqlens is not None, "cache_seqlens", "an int or [B] int32 tensor when k/v "
                "are appended", None)
    if cache_seqlens is None:
        cache_seqlens = torch.full((num_seqs,), max_keys, dtype=torch.int32, device=device)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((num_seqs,), cache_seqlens, dtype=torch.int32, device=device)
    else:
        cache_seqlens = _int32_vector(cache_seqlens, "cache_seqlens", num_seqs, device)
    _expect(isinstance(num_splits, int) and num_splits >= 0, "num_splits", "an int >= 0",
            num_splits)
    options = _kernel_options(q, k_cache.dtype, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, num_seqs, k_descale, v_descale, learnable_sink)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    else:
        _expect_tensor(out, "out", tuple(q.shape), (q.dtype,), device)
    if paged:
        cache_rows = None
    else:
        cache_rows = (torch.arange(num_seqs, dtype=torch.int32, device=device)
                      if cache_batch_idx is None
                      else _int32_vector(cache_batch_idx, "cache_batch_idx", num_seqs, device))
        if cache_leftpad is not None:
            cache_leftpad = _int32_vector(cache_leftpad, "cache_leftpad", num_seqs, device)

    if seqlen_new:
        _append(k, v, k_cache, v_cache, cache_seqlens, block_table, cache_rows, options)
    lse_rows = (torch.empty(num_seqs * seqlen_q, num_heads, dtype=torch.float32, device=device)
                if return_softmax_lse else None)
    if num_seqs * seqlen_q > 0:
        seq_lens = cache_seqlens + seqlen_new if seqlen_new else cache_seqlens  # [B]
        if paged:
            k_arg, v_arg, kv_start_loc = k_cache, v_cache, None
        else:
            k_arg, v_arg = _rows(k_cache, "k_cache"), _rows(v_cache, "v_cache")
            start = cache_rows * page  # [B] first row of each sequence's cache
            if cache_leftpad is not None:
                start = start + cache_leftpad
                seq_lens = seq_lens - cache_leftpad
            kv_start_loc = torch.cat([start, start[-1:]])  # [B+1] int32, the last unused
        _attend(q.reshape(num_seqs * seqlen_q, num_heads, head_size),
                k_arg, v_arg, _rows(out, "out"), lse_rows,
                query_start_loc=_query_starts(num_seqs, seqlen_q, device),
                seq_lens=seq_lens, block_tables=block_table, kv_start_loc=kv_start_loc,
                max_query_len=seqlen_q, max_seq_len=max_keys,
                num_splits=num_splits or None, **options)
    if not return_softmax_lse:
        return out
    lse = lse_rows.view(num_seqs, seqlen_q, num_heads).transpose(1, 2).contiguous()
    return out, lse  # [B, Hq, Sq]


_starts: dict[tuple, torch.Tensor] = {}


def _query_starts(num_seqs: int, seqlen_q: int, device) -> torch.Tensor:
    """int32 [B+1] `0, Sq, 2*Sq, ...`: made once per (B, Sq, device), not per call (a decode
    layer calls this every step)."""
    key = (num_seqs, seqlen_q, device)
    if key not in _starts:
        _starts[key] = torch.arange(0, num_seqs * seqlen_q + 1, seqlen_q, dtype=torch.int32, device=device)
    return _starts[key]


def _append(k, v, k_cache, v_cache, cache_seqlens, block_table, cache_rows, options) -> None:
    """Store new k/v [B, Sk_new, Hkv, D] at positions cache_seqlens[b] + i of each sequence."""
    from pagedattn.kernels import store_kv

    num_seqs, seqlen_new = k.shape[:2]
    page = k_cache.shape[1]
    pos = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)  # [B, Sk_new]
    if block_table is not None:
        slots = block_table.long().gather(1, pos // page) * page + pos % page
    else:
        slots = cache_rows.long()[:, None] * page + pos  # the cache as pages of S_cache tokens
    store_kv(k.reshape(num_seqs * seqlen_new, *k.shape[2:]),
             v.reshape(num_seqs * seqlen_new, *v.shape[2:]),
             k_cache, v_cache, slots.reshape(-1), options["k_scale"], options["v_scale"])
