"""pagedattn.flash_attn_interface against the dense float64 oracle.

The numeric cases follow vLLM's FlashAttention tests (query/KV heads, head sizes, block sizes,
soft caps, decode and varlen lengths, sliding windows, ALiBi, LSE, pages shuffled in a pool):
a reduced grid runs on the CPU under the Triton interpreter, the full grid (a pool of 32768
blocks) only with `--device cuda`. The `check_*` functions take the module under test, so
test_flash_attn_dao.py runs the same cases against Dao-AILab's flash_attn.

The grid's pool is built here, on the test device, because a 32768-block pool of junk is too
large to draw on the host as tests/paged_batch.py does; the append and FP8 tests, whose pools
are small, use that builder.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from oracle import (assert_attention_close, dense_attention_with_lse,  # noqa: E402
                    fp8_quantize, tolerance_for)
from paged_batch import make_paged_batch, raw_bits  # noqa: E402
from paged_kernel import POOL_LAYOUT, kernel_args  # noqa: E402
from pairwise import all_pairs  # noqa: E402

LSE_ATOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}

# The reduced grid (CPU). vLLM's: decode kv lengths [1328, 18, 463] and [1, 54, 293, 70];
# varlen (query_len, kv_len) [(1, 1328), (5, 18), (129, 463)].
HEADS = [(4, 4), (8, 2)]
SOFT_CAPS = [None, 10.0]
DECODE_KV_LENS = [133, 18, 46]
VARLEN_LENS = [(1, 133), (5, 18), (29, 46)]
# variant -> (window_size, use ALiBi); (20, 0) is a 21-key sliding window
VARIANTS = {"plain": ((-1, -1), False), "window": ((20, 0), False), "alibi": ((-1, -1), True)}
CPU_POOL_BLOCKS = 64


@pytest.fixture
def flash_attn():
    """The module under test (test_flash_attn_dao.py swaps in Dao-AILab's)."""
    import pagedattn.flash_attn_interface as module

    return module


# ----------------------------------------------------------------------------- the pool


@dataclass
class Pool:
    """Sequences' keys/values scattered over shuffled pages of a pool full of junk."""

    k_cache: torch.Tensor      # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32; padding entries name a junk block
    keys: list                 # per sequence [kv_len, Hkv, D], what the pool holds
    values: list


def make_pool(kv_lens, *, num_blocks, block_size, num_kv_heads, head_size, dtype, device,
              seed=0) -> Pool:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = (torch.randn(shape, device=device) * 50).to(dtype)
    v_cache = (torch.randn(shape, device=device) * 50).to(dtype)
    need = [-(-n // block_size) for n in kv_lens]
    assert sum(need) < num_blocks, f"expected a pool of > {sum(need)} blocks, got {num_blocks}"
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width, junk = max(need), perm[-1]
    tables, keys, values, at = [], [], [], 0
    for n, blocks in zip(kv_lens, need):
        table = perm[at:at + blocks]
        at += blocks
        k = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype).to(device)
        v = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype).to(device)
        for i, block in enumerate(table):  # the test's own scatter
            rows = slice(i * block_size, min(n, (i + 1) * block_size))
            k_cache[block, :rows.stop - rows.start] = k[rows]
            v_cache[block, :rows.stop - rows.start] = v[rows]
        tables.append(table + [junk] * (width - blocks))
        keys.append(k)
        values.append(v)
    block_table = torch.tensor(tables, dtype=torch.int32, device=device)
    return Pool(k_cache, v_cache, block_table, keys, values)


def reference(queries, pool_keys, pool_values, *, scale, causal=True, window_size=(-1, -1),
              soft_cap=None, alibi=None, sinks=None):
    """Per sequence oracle: (out [sum Lq, Hq, D], lse [sum Lq, Hq]) float64 CPU."""
    outs, lses = [], []
    for q, k, v in zip(queries, pool_keys, pool_values):
        o, lse = dense_attention_with_lse(
            q.cpu(), k.cpu(), v.cpu(), scale=scale, causal=causal, window=tuple(window_size),
            logits_soft_cap=soft_cap, alibi_slopes=None if alibi is None else alibi.cpu(),
            sinks=None if sinks is None else sinks.cpu())
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _options(variant, num_heads, device, soft_cap):
    window_size, use_alibi = VARIANTS[variant]
    alibi = (torch.rand(num_heads, generator=torch.Generator().manual_seed(3)) * 0.3
             ).to(device) if use_alibi else None
    return dict(window_size=window_size, alibi_slopes=alibi, softcap=soft_cap or 0.0)


def _row_groups(lens):
    groups, at = [], 0
    for n in lens:
        groups.append((at, at + n))
        at += n
    return groups


def _cu(lens, device):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- checks


def check_varlen_paged(fa, device, *, heads, head_size, block_size, soft_cap, variant, lens,
                       dtype, num_blocks):
    """flash_attn_varlen_func over a paged pool: a chunk of each sequence's last query_len
    tokens over its cached prefix, causal."""
    hq, hkv = heads
    q_lens, kv_lens = [q for q, _ in lens], [k for _, k in lens]
    pool = make_pool(kv_lens, num_blocks=num_blocks, block_size=block_size, num_kv_heads=hkv,
                     head_size=head_size, dtype=dtype, device=device)
    q = torch.randn(sum(q_lens), hq, head_size, device=device).to(dtype)
    options = _options(variant, hq, device, soft_cap)
    scale = head_size ** -0.5
    res = fa.flash_attn_varlen_func(
        q, pool.k_cache, pool.v_cache, _cu(q_lens, device), _cu(kv_lens, device),
        max(q_lens), max(kv_lens), causal=True, return_attn_probs=True,
        block_table=pool.block_table, **options)
    out, lse = res[0], res[1]
    groups = _row_groups(q_lens)
    ref_out, ref_lse = reference([q[a:b] for a, b in groups], pool.keys, pool.values,
                                 scale=scale, window_size=options["window_size"],
                                 soft_cap=soft_cap, alibi=options["alibi_slopes"])
    assert tuple(lse.shape) == (hq, sum(q_lens)), f"expected LSE [Hq, total_q], got {lse.shape}"
    assert_attention_close(out, ref_out, tolerance_for(dtype), groups)
    torch.testing.assert_close(lse.t().double().cpu(), ref_lse, atol=LSE_ATOL[dtype], rtol=1e-4)


def check_kvcache_paged(fa, device, *, heads, head_size, block_size, soft_cap, variant, kv_lens,
                        dtype, num_blocks, seqlen_q=1, num_splits=0):
    """flash_attn_with_kvcache decode (or seqlen_q-token decode) over a paged pool."""
    hq, hkv = heads
    pool = make_pool(kv_lens, num_blocks=num_blocks, block_size=block_size, num_kv_heads=hkv,
                     head_size=head_size, dtype=dtype, device=device)
    num_seqs = len(kv_lens)
    q = torch.randn(num_seqs, seqlen_q, hq, head_size, device=device).to(dtype)
    options = _options(variant, hq, device, soft_cap)
    out, lse = fa.flash_attn_with_kvcache(
        q, pool.k_cache, pool.v_cache,
        cache_seqlens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_table=pool.block_table, causal=True, num_splits=num_splits,
        return_softmax_lse=True, **options)
    ref_out, ref_lse = reference(list(q), pool.keys, pool.values, scale=head_size ** -0.5,
                                 window_size=options["window_size"], soft_cap=soft_cap,
                                 alibi=options["alibi_slopes"])
    assert tuple(out.shape) == tuple(q.shape)
    assert tuple(lse.shape) == (num_seqs, hq, seqlen_q)
    assert_attention_close(out.reshape(-1, hq, head_size), ref_out, tolerance_for(dtype),
                           _row_groups([seqlen_q] * num_seqs))
    torch.testing.assert_close(lse.transpose(1, 2).reshape(-1, hq).double().cpu(), ref_lse,
                               atol=LSE_ATOL[dtype], rtol=1e-4)


def check_varlen_contiguous(fa, device, *, heads, head_size, soft_cap, causal, lens, dtype):
    """flash_attn_varlen_func over ragged contiguous K/V (bottom-right causal, or not)."""
    hq, hkv = heads
    q_lens, kv_lens = [q for q, _ in lens], [k for _, k in lens]
    q = torch.randn(sum(q_lens), hq, head_size, device=device).to(dtype)
    k = torch.randn(sum(kv_lens), hkv, head_size, device=device).to(dtype)
    v = torch.randn(sum(kv_lens), hkv, head_size, device=device).to(dtype)
    out = fa.flash_attn_varlen_func(q, k, v, _cu(q_lens, device), _cu(kv_lens, device),
                                    max(q_lens), max(kv_lens), causal=causal,
                                    softcap=soft_cap or 0.0)
    qg, kg = _row_groups(q_lens), _row_groups(kv_lens)
    ref_out, _ = reference([q[a:b] for a, b in qg], [k[a:b] for a, b in kg],
                           [v[a:b] for a, b in kg], scale=head_size ** -0.5, causal=causal,
                           soft_cap=soft_cap)
    assert_attention_close(out, ref_out, tolerance_for(dtype), qg)


# ----------------------------------------------------------------------------- the CPU grid


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_varlen_paged(flash_attn, device, heads, soft_cap, variant):
    check_varlen_paged(flash_attn, device, heads=heads, head_size=128, block_size=16,
                       soft_cap=soft_cap, variant=variant, lens=VARLEN_LENS,
                       dtype=torch.float32, num_blocks=CPU_POOL_BLOCKS)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_kvcache_decode_paged(flash_attn, device, heads, soft_cap, variant):
    check_kvcache_paged(flash_attn, device, heads=heads, head_size=128, block_size=16,
                        soft_cap=soft_cap, variant=variant, kv_lens=DECODE_KV_LENS,
                        dtype=torch.float32, num_blocks=CPU_POOL_BLOCKS)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_kvcache_multi_token_decode_splits(flash_attn, device, num_splits):
    check_kvcache_paged(flash_attn, device, heads=(8, 2), head_size=64, block_size=16,
                        soft_cap=None, variant="plain", kv_lens=DECODE_KV_LENS,
                        dtype=torch.bfloat16, num_blocks=CPU_POOL_BLOCKS, seqlen_q=3,
                        num_splits=num_splits)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_varlen_contiguous(flash_attn, device, heads, causal):
    # (3, 2): more queries than keys; causal leaves the first row empty (output 0)
    check_varlen_contiguous(flash_attn, device, heads=heads, head_size=64, soft_cap=10.0,
                            causal=causal, lens=[(7, 40), (5, 18), (3, 2)],
                            dtype=torch.float32)


# ----------------------------------------------------------------------------- the GPU grid


# every pair of values of these five factors meets in some row: 12 rows, not the 108 of the
# full product (each row compiles its own specialisations, 45-75 s of an H100 run)
FULL_GRID = all_pairs(heads=[(4, 4), (8, 2), (16, 2)], head_size=[128, 256], block_size=[16, 32],
                      soft_cap=[None, 10.0, 50.0], variant=list(VARIANTS))


@pytest.mark.cuda_only
@pytest.mark.parametrize("row", FULL_GRID, ids=lambda r: "-".join(map(str, r.values())))
def test_full_grid(flash_attn, device, row):
    heads, head_size, block_size, soft_cap, variant = row.values()
    common = dict(heads=heads, head_size=head_size, block_size=block_size, soft_cap=soft_cap,
                  variant=variant, dtype=torch.bfloat16, num_blocks=32768)
    check_varlen_paged(flash_attn, device, lens=[(1, 1328), (5, 18), (129, 463)], **common)
    for kv_lens in ([1328, 18, 463], [1, 54, 293, 70]):
        check_kvcache_paged(flash_attn, device, kv_lens=kv_lens, **common)
    check_kvcache_paged(flash_attn, device, kv_lens=[1328, 18, 463], seqlen_q=4, **common)
    for causal in (True, False):
        check_varlen_contiguous(flash_attn, device, heads=heads, head_size=head_size,
                                soft_cap=soft_cap, causal=causal,
                                lens=[(1, 1328), (5, 18), (129, 463)], dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- append in place


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_kvcache_appends_in_place(flash_attn, device, kv_cache_dtype):
    """New k/v land at positions cache_seqlens.. of each sequence's pages (quantised with the
    descales for FP8), every other byte of the pool is untouched, and the attention sees them."""
    lens = [(35, 2), (0, 2), (17, 2)]  # (context_len, query_len): 2 new tokens per sequence
    batch = make_paged_batch(POOL_LAYOUT, lens, num_heads=8, num_kv_heads=2, head_size=64,
                             block_size=16, dtype=torch.bfloat16, device=device,
                             kv_cache_dtype=kv_cache_dtype)
    args = kernel_args(batch)
    k_cache, v_cache = args.k_cache, args.v_cache
    before = batch.kv_cache.clone()
    num_seqs, hkv, d = len(lens), batch.num_kv_heads, batch.head_size
    scales = {}
    if batch.fp8:
        scales = dict(k_descale=torch.tensor(batch.k_scale, device=device),
                      v_descale=torch.tensor(batch.v_scale, device=device))
    out = flash_attn.flash_attn_with_kvcache(
        batch.query.view(num_seqs, 2, batch.num_heads, d), k_cache, v_cache,
        k=batch.key.view(num_seqs, 2, hkv, d), v=batch.value.view(num_seqs, 2, hkv, d),
        cache_seqlens=torch.tensor([c for c, _ in lens], dtype=torch.int32, device=device),
        block_table=args.block_tables, causal=True, **scales)

    expected = before
    slots = batch.step_slots()
    for which, new, scale in ((0, batch.key, batch.k_scale), (1, batch.value, batch.v_scale)):
        stored = fp8_quantize(new, scale, batch.cache_dtype) if batch.fp8 else new
        for i, slot in enumerate(slots):
            batch.layout.slot(expected, which, slot).copy_(stored[i])
    assert torch.equal(raw_bits(batch.kv_cache), raw_bits(expected)), \
        "the pool differs from the expected bytes (new tokens misplaced or other slots touched)"
    ref_out, _ = batch.reference(scale=d ** -0.5)
    assert_attention_close(out.reshape(-1, batch.num_heads, d), ref_out,
                           tolerance_for(batch.dtype, batch.fp8), batch.row_ranges())


def test_kvcache_contiguous_cache(flash_attn, device):
    """A [B_cache, S_cache, Hkv, D] cache with cache_batch_idx, cache_leftpad and appended k/v:
    sequence b owns row cache_batch_idx[b]; its keys are positions cache_leftpad[b] ..
    cache_seqlens[b] + Sk_new - 1; other rows and positions stay as they were."""
    hq, hkv, d, s_cache, seqlen_q = 8, 2, 64, 48, 3
    rows, leftpad, seqlens = [3, 0, 4], [2, 0, 5], [20, 9, 30]
    k_cache = torch.randn(5, s_cache, hkv, d, device=device)
    v_cache = torch.randn(5, s_cache, hkv, d, device=device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(3, seqlen_q, hq, d, device=device)
    k_new = torch.randn(3, seqlen_q, hkv, d, device=device)
    v_new = torch.randn(3, seqlen_q, hkv, d, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    out, lse = flash_attn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=torch.tensor(seqlens, **i32),
        cache_batch_idx=torch.tensor(rows, **i32), cache_leftpad=torch.tensor(leftpad, **i32),
        causal=True, window_size=(25, 0), return_softmax_lse=True)

    for b, (row, n) in enumerate(zip(rows, seqlens)):
        before_k[row, n:n + seqlen_q] = k_new[b]
        before_v[row, n:n + seqlen_q] = v_new[b]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    ref_out, ref_lse = reference(
        list(q), [k_cache[r, p:n + seqlen_q] for r, p, n in zip(rows, leftpad, seqlens)],
        [v_cache[r, p:n + seqlen_q] for r, p, n in zip(rows, leftpad, seqlens)],
        scale=d ** -0.5, window_size=(25, 0))
    assert_attention_close(out.reshape(-1, hq, d), ref_out, tolerance_for(torch.float32))
    torch.testing.assert_close(lse.transpose(1, 2).reshape(-1, hq).double().cpu(), ref_lse,
                               atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("cache_seqlens", [None, 21], ids=["whole_cache", "int"])
def test_kvcache_not_causal(flash_attn, device, cache_seqlens):
    """Without causal every query sees every cached key (None: the whole S_cache)."""
    hq, hkv, d, s_cache = 4, 4, 64, 40
    k_cache = torch.randn(2, s_cache, hkv, d, device=device)
    v_cache = torch.randn(2, s_cache, hkv, d, device=device)
    q = torch.randn(2, 3, hq, d, device=device)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                             softmax_scale=0.1)
    n = s_cache if cache_seqlens is None else cache_seqlens
    ref_out, _ = reference(list(q), list(k_cache[:, :n]), list(v_cache[:, :n]), scale=0.1,
                           causal=False)
    assert_attention_close(out.reshape(-1, hq, d), ref_out, tolerance_for(torch.float32))


def test_varlen_paged_fp8_cache(flash_attn, device):
    batch = make_paged_batch(POOL_LAYOUT, [(40, 9), (0, 12), (20, 1)], num_heads=4,
                             num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float16,
                             device=device, kv_cache_dtype="fp8_e5m2", write_step=True)
    args = kernel_args(batch)
    q_lens = [q for _, q in batch.lens]
    out = flash_attn.flash_attn_varlen_func(
        batch.query, args.k_cache, args.v_cache, args.query_start_loc,
        _cu(batch.seq_lens, device), args.max_query_len, args.max_seq_len, causal=True,
        block_table=args.block_tables, k_descale=torch.tensor([batch.k_scale], device=device),
        v_descale=batch.v_scale)
    ref_out, _ = batch.reference(scale=batch.head_size ** -0.5)
    assert_attention_close(out, ref_out, tolerance_for(batch.dtype, True), _row_groups(q_lens))


def test_varlen_out_and_causal_window_aliases(flash_attn, device):
    """`out=` is written and returned; causal=False with window (left, 0) is the causal window,
    as (left, -1) is under causal=True."""
    q, k, v = (torch.randn(9, 4, 32, device=device) for _ in range(3))
    cu = _cu([4, 5], device)
    out = torch.empty_like(q)
    res = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=False,
                                            window_size=(2, 0), out=out)
    assert res is out
    same = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True,
                                             window_size=(2, -1))
    torch.testing.assert_close(out, same, atol=0, rtol=0)
    ref_out, _ = reference([q[:4], q[4:]], [k[:4], k[4:]], [v[:4], v[4:]], scale=32 ** -0.5,
                           window_size=(2, 0))
    assert_attention_close(out, ref_out, tolerance_for(torch.float32))


@pytest.mark.parametrize("window_size", [(4, 3), (5, -1), (-1, 2), (0, 0)], ids=str)
def test_varlen_two_sided_window(flash_attn, device, window_size):
    """Bidirectional local attention (an encoder's): causal=False with window_size=(left, right)
    keeps the keys in [p - left, p + right], -1 unbounded; over contiguous rows, where queries
    and keys are the same tokens, and over pages, bottom-right aligned (2 queries of 20 keys)."""
    lens = [17, 40, 3]
    q, k, v = (torch.randn(sum(lens), 4, 32, device=device) for _ in range(3))
    cu = _cu(lens, device)
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=False,
                                            window_size=window_size)
    groups = _row_groups(lens)
    ref_out, _ = reference([q[a:b] for a, b in groups], [k[a:b] for a, b in groups],
                           [v[a:b] for a, b in groups], scale=32 ** -0.5, causal=False,
                           window_size=window_size)
    assert_attention_close(out, ref_out, tolerance_for(torch.float32), groups)
    pool = make_pool([20, 9], num_blocks=12, block_size=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32, device=device)
    qd = torch.randn(2, 2, 4, 32, device=device)
    out, lse = flash_attn.flash_attn_with_kvcache(
        qd, pool.k_cache, pool.v_cache, cache_seqlens=torch.tensor([20, 9], dtype=torch.int32, device=device),
        block_table=pool.block_table, causal=False, window_size=window_size, return_softmax_lse=True)
    ref_out, ref_lse = reference(list(qd), pool.keys, pool.values, scale=32 ** -0.5, causal=False,
                                 window_size=window_size)
    assert_attention_close(out.reshape(-1, 4, 32), ref_out, tolerance_for(torch.float32))
    torch.testing.assert_close(lse.transpose(1, 2).reshape(-1, 4).double().cpu(), ref_lse,
                               atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_learnable_sink(flash_attn, device, num_splits):
    """FA4's `learnable_sink` [Hq]: one more logit per head in the softmax's denominator, in the
    output and the LSE, unsplit and split, decode and varlen (the last head's sink is -inf:
    no change)."""
    sinks = torch.tensor([0.5, -1.0, 3.0, float("-inf")], device=device)
    pool = make_pool(DECODE_KV_LENS, num_blocks=CPU_POOL_BLOCKS, block_size=16, num_kv_heads=2,
                     head_size=64, dtype=torch.float32, device=device)
    q = torch.randn(len(DECODE_KV_LENS), 1, 4, 64, device=device)
    out, lse = flash_attn.flash_attn_with_kvcache(
        q, pool.k_cache, pool.v_cache, cache_seqlens=torch.tensor(DECODE_KV_LENS, dtype=torch.int32, device=device),
        block_table=pool.block_table, causal=True, num_splits=num_splits, return_softmax_lse=True,
        learnable_sink=sinks)
    ref_out, ref_lse = reference(list(q), pool.keys, pool.values, scale=64 ** -0.5, sinks=sinks)
    assert_attention_close(out.reshape(-1, 4, 64), ref_out, tolerance_for(torch.float32))
    torch.testing.assert_close(lse[..., 0].double().cpu(), ref_lse, atol=1e-3, rtol=1e-4)
    q_lens = [q_len for q_len, _ in VARLEN_LENS]
    qv = torch.randn(sum(q_lens), 4, 64, device=device)
    keys = [k[:n] for k, (_, n) in zip(pool.keys, VARLEN_LENS)]
    values = [v[:n] for v, (_, n) in zip(pool.values, VARLEN_LENS)]
    out, lse, _ = flash_attn.flash_attn_varlen_func(
        qv, pool.k_cache, pool.v_cache, _cu(q_lens, device), _cu([n for _, n in VARLEN_LENS], device),
        max(q_lens), max(n for _, n in VARLEN_LENS), causal=True, block_table=pool.block_table,
        return_attn_probs=True, learnable_sink=sinks)
    groups = _row_groups(q_lens)
    ref_out, ref_lse = reference([qv[a:b] for a, b in groups], keys, values, scale=64 ** -0.5, sinks=sinks)
    assert_attention_close(out, ref_out, tolerance_for(torch.float32), groups)
    torch.testing.assert_close(lse.t().double().cpu(), ref_lse, atol=1e-3, rtol=1e-4)


# ----------------------------------------------------------------------------- refusals


def _varlen_args(device, **change):
    """A valid flash_attn_varlen_func call (2 sequences, paged when block_table is given)."""
    i32 = dict(dtype=torch.int32, device=device)
    args = dict(q=torch.randn(6, 4, 32, device=device), k=torch.randn(9, 2, 32, device=device),
                v=torch.randn(9, 2, 32, device=device), cu_seqlens_q=torch.tensor([0, 2, 6], **i32),
                cu_seqlens_k=torch.tensor([0, 4, 9], **i32), max_seqlen_q=4, max_seqlen_k=5,
                causal=True)
    args.update(change)
    return args


def _kvcache_args(device, **change):
    """A valid flash_attn_with_kvcache call over a paged cache (2 sequences)."""
    i32 = dict(dtype=torch.int32, device=device)
    args = dict(q=torch.randn(2, 1, 4, 32, device=device),
                k_cache=torch.randn(6, 16, 2, 32, device=device),
                v_cache=torch.randn(6, 16, 2, 32, device=device),
                cache_seqlens=torch.tensor([5, 20], **i32),
                block_table=torch.tensor([[4, 0], [2, 5]], **i32), causal=True)
    args.update(change)
    return args


def _slopes(*shape):
    return lambda device: torch.full(shape, 0.1, device=device)


def _fp8(device):
    return torch.zeros(9, 2, 32, device=device).to(torch.float8_e4m3fn)


# (function, {argument: value or fn(device)}, message fragment)
UNSUPPORTED = {
    "dropout_p": ("varlen", dict(dropout_p=0.1), "dropout_p"),
    "requires_grad": ("varlen", dict(q=lambda d: torch.randn(6, 4, 32, device=d,
                                                             requires_grad=True)), "requires_grad"),
    "window_right_under_causal": ("varlen", dict(window_size=(-1, 3)), "window_size"),
    "alibi_per_sequence": ("varlen", dict(alibi_slopes=_slopes(2, 4)), "alibi_slopes"),
    "alibi_not_causal": ("varlen", dict(causal=False, alibi_slopes=_slopes(4)), "alibi_slopes"),
    "descale_per_head": ("varlen", dict(k=_fp8, v=_fp8, k_descale=lambda d: torch.ones(
        2, 2, device=d)), "k_descale"),
    "rotary_cos": ("kvcache", dict(rotary_cos=lambda d: torch.ones(32, 8, device=d)),
                   "rotary_cos"),
    "rotary_sin": ("kvcache", dict(rotary_sin=lambda d: torch.ones(32, 8, device=d)),
                   "rotary_sin"),
    "cache_batch_idx_paged": ("kvcache", dict(cache_batch_idx=lambda d: torch.tensor(
        [1, 0], dtype=torch.int32, device=d)), "cache_batch_idx"),
    "cache_leftpad_paged": ("kvcache", dict(cache_leftpad=lambda d: torch.tensor(
        [1, 0], dtype=torch.int32, device=d)), "cache_leftpad"),
    "kvcache_alibi_per_sequence": ("kvcache", dict(alibi_slopes=_slopes(2, 4)), "alibi_slopes"),
}


def _call(module, which, device, change):
    change = {k: v(device) if callable(v) else v for k, v in change.items()}
    if which == "varlen":
        return module.flash_attn_varlen_func(**_varlen_args(device, **change))
    return module.flash_attn_with_kvcache(**_kvcache_args(device, **change))


def test_valid_calls_run(flash_attn, device):
    assert _call(flash_attn, "varlen", device, {}).shape == (6, 4, 32)
    assert _call(flash_attn, "kvcache", device, {}).shape == (2, 1, 4, 32)


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_raises_naming_the_argument(flash_attn, device, case):
    which, change, name = UNSUPPORTED[case]
    with pytest.raises(NotImplementedError, match=name):
        _call(flash_attn, which, device, change)


def _strided_cache(device):
    return torch.randn(2, 64, 2, 32, device=device)[:, :16]  # rows do not flatten


BAD = {
    "q_2d": ("varlen", dict(q=lambda d: torch.randn(6, 128, device=d)), "q.shape"),
    "q_int": ("varlen", dict(q=lambda d: torch.ones(6, 4, 32, dtype=torch.int32, device=d)),
              "q.dtype"),
    "k_head_size": ("varlen", dict(k=lambda d: torch.randn(9, 2, 16, device=d)), "k.shape"),
    "v_shape": ("varlen", dict(v=lambda d: torch.randn(8, 2, 32, device=d)), "v.shape"),
    "k_dtype": ("varlen", dict(k=lambda d: torch.randn(9, 2, 32, device=d).half()), "k.dtype"),
    "cu_seqlens_int64": ("varlen", dict(cu_seqlens_q=lambda d: torch.tensor([0, 2, 6], device=d)),
                         "cu_seqlens_q.dtype"),
    "cu_seqlens_k_length": ("varlen", dict(cu_seqlens_k=lambda d: torch.tensor(
        [0, 9], dtype=torch.int32, device=d)), "cu_seqlens_k.shape"),
    "block_table_rows": ("varlen", dict(k=lambda d: torch.randn(4, 16, 2, 32, device=d),
                                        v=lambda d: torch.randn(4, 16, 2, 32, device=d),
                                        block_table=lambda d: torch.zeros(3, 1, dtype=torch.int32,
                                                                          device=d)),
                         "block_table.shape"),
    "out_dtype": ("varlen", dict(out=lambda d: torch.empty(6, 4, 32, device=d).half()),
                  "out.dtype"),
    "window_size_len": ("varlen", dict(window_size=(1, 2, 3)), "window_size"),
    "window_size_below_minus_one": ("varlen", dict(window_size=(-2, 0)), "window_size"),
    "alibi_length": ("varlen", dict(alibi_slopes=_slopes(3)), "alibi_slopes.shape"),
    "alibi_float64": ("varlen", dict(alibi_slopes=lambda d: torch.ones(4, dtype=torch.float64,
                                                                       device=d)),
                      "alibi_slopes.dtype"),
    "descale_float_cache": ("varlen", dict(k_descale=2.0), "k_descale"),
    "learnable_sink_length": ("varlen", dict(learnable_sink=lambda d: torch.zeros(3, device=d)),
                              "learnable_sink.shape"),
    "learnable_sink_int": ("kvcache", dict(learnable_sink=lambda d: torch.zeros(4, dtype=torch.int32,
                                                                                device=d)),
                           "learnable_sink.dtype"),
    "kvcache_q_3d": ("kvcache", dict(q=lambda d: torch.randn(2, 4, 32, device=d)), "q.shape"),
    "kvcache_k_without_v": ("kvcache", dict(k=lambda d: torch.randn(2, 1, 2, 32, device=d)),
                            "k, v"),
    "kvcache_k_without_seqlens": ("kvcache", dict(
        k=lambda d: torch.randn(2, 1, 2, 32, device=d),
        v=lambda d: torch.randn(2, 1, 2, 32, device=d), cache_seqlens=None), "cache_seqlens"),
    "kvcache_k_batch": ("kvcache", dict(k=lambda d: torch.randn(3, 1, 2, 32, device=d),
                                        v=lambda d: torch.randn(3, 1, 2, 32, device=d)),
                        "k.shape"),
    "kvcache_seqlens_length": ("kvcache", dict(cache_seqlens=lambda d: torch.tensor(
        [5], dtype=torch.int32, device=d)), "cache_seqlens.shape"),
    "kvcache_v_cache_shape": ("kvcache", dict(v_cache=lambda d: torch.randn(6, 8, 2, 32,
                                                                            device=d)),
                              "v_cache.shape"),
    "kvcache_batch_cache_too_small": ("kvcache", dict(
        block_table=None, k_cache=lambda d: torch.randn(1, 16, 2, 32, device=d),
        v_cache=lambda d: torch.randn(1, 16, 2, 32, device=d)), "k_cache.shape"),
    "kvcache_rows_do_not_flatten": ("kvcache", dict(block_table=None, k_cache=_strided_cache,
                                                    v_cache=_strided_cache), "k_cache.stride"),
    "kvcache_num_splits": ("kvcache", dict(num_splits=-1), "num_splits"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_say_expected_got(flash_attn, device, case):
    which, change, name = BAD[case]
    with pytest.raises(ValueError, match="expected") as err:
        _call(flash_attn, which, device, change)
    assert name in str(err.value), f"expected the message to name {name!r}, got {err.value}"
