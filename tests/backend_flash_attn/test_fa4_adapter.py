"""FA4's adapter (`flash_attn_providers.FA4Api`) on the CPU, over the fake FA4 (fake_fa4.py):
FlashAttention 2's calls as the backend makes them, mapped onto FA4's arguments, against the
dense oracle (paged decode, paged prefill over a prefix, ragged prompts, windows, soft cap, LSE),
and the arguments FA4 lacks refused by name."""

from __future__ import annotations

import pytest
import torch

import fake_fa4
from oracle import assert_attention_close, dense_attention_with_lse, tolerance_for
from pagedattn.backends.flash_attn_providers import FA4Api

DTYPE, BS, HQ, HKV, D = torch.bfloat16, 16, 8, 2, 64
WINDOWS = {"none": (-1, -1), "window": (20, 0)}
LSE_ATOL = 2e-2


@pytest.fixture
def fa4():
    fake_fa4.calls.clear()
    return FA4Api(fake_fa4.flash_attn_varlen_func)


def _pool(kv_lens, seed=0):
    """Shuffled pages holding each sequence's keys/values, the rest junk: (k_cache, v_cache,
    block_table [B, W] int32, keys, values)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in kv_lens]
    num_blocks = sum(need) + 3
    k_cache = (torch.randn(num_blocks, BS, HKV, D, generator=g) * 50).to(DTYPE)
    v_cache = (torch.randn(num_blocks, BS, HKV, D, generator=g) * 50).to(DTYPE)
    perm, at, tables, keys, values = torch.randperm(num_blocks, generator=g).tolist(), 0, [], [], []
    for n, blocks in zip(kv_lens, need):
        table = perm[at:at + blocks]
        at += blocks
        k, v = (torch.randn(n, HKV, D, generator=g).to(DTYPE) for _ in range(2))
        for i, block in enumerate(table):
            rows = slice(i * BS, min(n, (i + 1) * BS))
            k_cache[block, :rows.stop - rows.start], v_cache[block, :rows.stop - rows.start] = k[rows], v[rows]
        tables.append(table + [perm[-1]] * (max(need) - blocks))
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), keys, values


def _cu(lens):
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _reference(queries, keys, values, *, causal=True, window=(-1, -1), soft_cap=None, sinks=None):
    outs, lses = [], []
    for q, k, v in zip(queries, keys, values):
        o, lse = dense_attention_with_lse(q, k, v, scale=D ** -0.5, causal=causal, window=window,
                                          logits_soft_cap=soft_cap, sinks=sinks)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)  # [sum Lq, Hq, D], [sum Lq, Hq]


def _groups(lens):
    starts = _cu(lens).tolist()
    return list(zip(starts[:-1], starts[1:]))


@pytest.mark.parametrize("soft_cap", [None, 10.0], ids=str)
@pytest.mark.parametrize("window", list(WINDOWS))
def test_paged_decode(fa4, window, soft_cap):
    kv_lens = [33, 18, 46]
    k_cache, v_cache, table, keys, values = _pool(kv_lens)
    q = torch.randn(3, 1, HQ, D).to(DTYPE)
    out = torch.empty_like(q)
    res, lse = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(kv_lens, dtype=torch.int32),
                                           block_table=table, softmax_scale=D ** -0.5, causal=True,
                                           window_size=WINDOWS[window], softcap=soft_cap or 0.0,
                                           return_softmax_lse=True, out=out)
    assert res is out, "expected the caller's out= to be written and returned"
    ref, ref_lse = _reference(list(q), keys, values, window=WINDOWS[window], soft_cap=soft_cap)
    assert_attention_close(out.view(-1, HQ, D), ref, tolerance_for(DTYPE), _groups([1] * 3))
    assert lse.shape == (3, HQ, 1), f"expected FlashAttention's kvcache LSE [B, Hq, Sq], got {list(lse.shape)}"
    torch.testing.assert_close(lse.transpose(1, 2).reshape(-1, HQ).double(), ref_lse, atol=LSE_ATOL, rtol=1e-4)
    call = fake_fa4.calls[-1]
    assert call["page_table"] is table and call["cu_seqlens_k"] is None
    assert call["q_shape"] == (3, 1, HQ, D), "decode goes to FA4 as batched q [B, Sq, Hq, D]"
    assert call["window_size"] == ((None, None) if window == "none" else (20, 0))
    assert call["softcap"] == (soft_cap or 0.0)


@pytest.mark.parametrize("window", list(WINDOWS))
def test_paged_prefill_over_a_prefix(fa4, window):
    lens = [(1, 33), (5, 18), (29, 46)]  # (query_len, kv_len): each chunk the last query_len of kv_len
    q_lens, kv_lens = [a for a, _ in lens], [b for _, b in lens]
    k_cache, v_cache, table, keys, values = _pool(kv_lens, seed=1)
    q = torch.randn(sum(q_lens), HQ, D).to(DTYPE)
    out, lse, probs = fa4.flash_attn_varlen_func(q, k_cache, v_cache, _cu(q_lens), _cu(kv_lens), max(q_lens),
                                                 max(kv_lens), causal=True, window_size=WINDOWS[window],
                                                 softcap=50.0, return_attn_probs=True, block_table=table)
    groups = _groups(q_lens)
    ref, ref_lse = _reference([q[a:b] for a, b in groups], keys, values, window=WINDOWS[window], soft_cap=50.0)
    assert_attention_close(out, ref, tolerance_for(DTYPE), groups)
    assert probs is None and lse.shape == (HQ, sum(q_lens)), "expected (out, lse [Hq, total_q], None)"
    torch.testing.assert_close(lse.t().double(), ref_lse, atol=LSE_ATOL, rtol=1e-4)
    call = fake_fa4.calls[-1]
    assert call["seqused_k"].tolist() == kv_lens and call["cu_seqlens_k"] is None
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (29, 46)


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_contiguous(fa4, causal):
    q_lens = kv_lens = [7, 1, 12]
    q, k, v = (torch.randn(20, h, D).to(DTYPE) for h in (HQ, HKV, HKV))
    out = torch.empty_like(q)
    res = fa4.flash_attn_varlen_func(q, k, v, _cu(q_lens), _cu(kv_lens), 12, 12, causal=causal, out=out)
    assert res is out
    groups = _groups(q_lens)
    ref, _ = _reference([q[a:b] for a, b in groups], [k[a:b] for a, b in groups], [v[a:b] for a, b in groups],
                        causal=causal)
    assert_attention_close(out, ref, tolerance_for(DTYPE), groups)
    call = fake_fa4.calls[-1]
    assert call["page_table"] is None and call["cu_seqlens_k"] is not None and call["return_lse"] is False


def test_window_without_causal_is_fa4s_local_window(fa4):
    """FlashAttention's (left, 0) without causal is causal with a left window; FA4 reads the
    same (left, 0), and (-1, 0) as right = 0 alone (causal), never left = -1."""
    q, k, v = (torch.randn(9, h, D).to(DTYPE) for h in (HQ, HKV, HKV))
    cu = _cu([9])
    for window, fa4_window, ref_window in (((3, 0), (3, 0), (3, 0)), ((-1, 0), (None, 0), (-1, -1))):
        out = fa4.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, window_size=window)
        assert fake_fa4.calls[-1]["window_size"] == fa4_window
        ref, _ = _reference([q], [k], [v], causal=True, window=ref_window)
        assert_attention_close(out, ref, tolerance_for(DTYPE), [(0, 9)])


def test_learnable_sink_and_two_sided_window(fa4):
    """Attention sinks reach FA4 as its `learnable_sink` (decode and varlen), and a two-sided
    window without causal as FA4's (left, right) local window."""
    sinks = torch.linspace(-1.0, 2.0, HQ)
    kv_lens = [33, 18]
    k_cache, v_cache, table, keys, values = _pool(kv_lens, seed=2)
    q = torch.randn(2, 1, HQ, D).to(DTYPE)
    out, lse = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(kv_lens, dtype=torch.int32),
                                           block_table=table, softmax_scale=D ** -0.5, causal=True,
                                           return_softmax_lse=True, learnable_sink=sinks)
    assert fake_fa4.calls[-1]["learnable_sink"] is sinks
    ref, ref_lse = _reference(list(q), keys, values, sinks=sinks)
    assert_attention_close(out.view(-1, HQ, D), ref, tolerance_for(DTYPE), _groups([1, 1]))
    torch.testing.assert_close(lse[..., 0].double(), ref_lse, atol=LSE_ATOL, rtol=1e-4)
    qv, kv, vv = (torch.randn(20, h, D).to(DTYPE) for h in (HQ, HKV, HKV))
    cu = _cu([12, 8])
    out = fa4.flash_attn_varlen_func(qv, kv, vv, cu, cu, 12, 12, causal=False, window_size=(4, 3),
                                     learnable_sink=sinks)
    call = fake_fa4.calls[-1]
    assert call["window_size"] == (4, 3) and call["learnable_sink"] is sinks
    groups = _groups([12, 8])
    ref, _ = _reference([qv[a:b] for a, b in groups], [kv[a:b] for a, b in groups], [vv[a:b] for a, b in groups],
                        causal=False, window=(4, 3), sinks=sinks)
    assert_attention_close(out, ref, tolerance_for(DTYPE), groups)


ARGS = {
    "alibi_slopes": ("varlen", dict(alibi_slopes=torch.ones(HQ))),
    "dropout_p": ("varlen", dict(dropout_p=0.1)),
    "k_descale": ("varlen", dict(k_descale=1.0)),
    "k": ("kvcache", dict(k=torch.zeros(1, 1, HKV, D, dtype=DTYPE), v=torch.zeros(1, 1, HKV, D, dtype=DTYPE))),
    "rotary_cos": ("kvcache", dict(rotary_cos=torch.zeros(4, 8))),
    "cache_batch_idx": ("kvcache", dict(cache_batch_idx=torch.zeros(1, dtype=torch.int32))),
}


@pytest.mark.parametrize("name", list(ARGS))
def test_arguments_fa4_lacks_are_refused_by_name(fa4, name):
    which, change = ARGS[name]
    q = torch.zeros(1, HQ, D, dtype=DTYPE)
    cache = torch.zeros(2, BS, HKV, D, dtype=DTYPE)
    with pytest.raises(NotImplementedError, match=name):
        if which == "varlen":
            fa4.flash_attn_varlen_func(q, cache, cache, _cu([1]), _cu([3]), 1, 3, causal=True,
                                       block_table=torch.zeros(1, 1, dtype=torch.int32), **change)
        else:
            fa4.flash_attn_with_kvcache(q[None], cache, cache, cache_seqlens=3,
                                        block_table=torch.zeros(1, 1, dtype=torch.int32), **change)
    assert not fake_fa4.calls, "a refused argument must not reach FA4"
