"""ENCODER, ENCODER_ONLY and ENCODER_DECODER (cross) attention against the oracle.

An encoder-decoder step shares one metadata between the encoder's self-attention (over
`encoder_len` tokens per sequence), the decoder's self-attention and the cross-attention,
whose K/V go to `cross_slot_mapping` (from each sequence's `cross_block_table`) at prefill
and are read back through `cross_block_tables` at decode.
"""

import math

import pytest
import torch

import pagedattn
from cases import KERNEL_GRID, refusal_guard, skip_refused_dtype, skip_unsupported_head_size
from oracle import assert_attention_close, assert_outputs_differ, dense_attention, tolerance_for
from paged_batch import CacheLayout, allocate_tables, make_garbage_cache, raw_bits, slot_of

AT = pagedattn.AttentionType
HQ, HKV, D, BS = 4, 2, 64, 8
ENC_LENS = [7, 12, 3, 16]
DEC_LENS = [5, 9, 1, 4]  # decoder prompt lengths (prefill step)


class EncDec:
    """Two pools (decoder self-attention and cross-attention), shuffled, full of junk."""

    def __init__(self, backend, device, dtype, seed=0):
        skip_unsupported_head_size(backend, D)
        skip_refused_dtype(backend, device, dtype)
        self.backend, self.device, self.dtype = backend, device, dtype
        g = torch.Generator().manual_seed(seed)
        # decoder tables leave room for one decode step
        nb, self.tables, _ = allocate_tables([math.ceil((n + 1) / BS) for n in DEC_LENS], 3, g)
        cnb, self.cross_tables, self.cross_spare = allocate_tables(
            [math.ceil(n / BS) for n in ENC_LENS], 3, g)
        self.layout = CacheLayout(backend, nb, BS, HKV, D)
        self.cross_layout = CacheLayout(backend, cnb, BS, HKV, D)
        self.cache = make_garbage_cache(self.layout.shape, dtype, device, g)
        self.cross_cache = make_garbage_cache(self.cross_layout.shape, dtype, device, g)
        self.g = g

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.dtype).to(self.device)

    def seqs(self, decode: bool):
        return [pagedattn.ScheduledSeq(n + 1 if decode else n, 1 if decode else n, t,
                                       encoder_len=e, cross_block_table=ct)
                for n, e, t, ct in zip(DEC_LENS, ENC_LENS, self.tables, self.cross_tables)]

    def build(self, decode: bool):
        with refusal_guard(self.backend, f"block_size={BS}"):
            builder = self.backend.get_builder_cls()(BS, self.device)
        return builder.build(self.seqs(decode))

    def impl(self, attn_type, **opts):
        with refusal_guard(self.backend, f"attn_type={attn_type} {opts}"):
            return self.backend.get_impl_cls()(HQ, D, D ** -0.5, HKV, attn_type=attn_type, **opts)


def _ranges(lens):
    at, out = 0, []
    for n in lens:
        out.append((at, at + n))
        at += n
    return out


def _bidirectional_ref(q, k, v, lens, window=None):
    return torch.cat([dense_attention(q[a:b].cpu(), k[a:b].cpu(), v[a:b].cpu(), scale=D ** -0.5,
                                      causal=False, query_pos=torch.arange(b - a), window=window)
                      for a, b in _ranges(lens)])


def _flat(x):
    return x.reshape(x.shape[0], -1)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["model_dtype", "bf16"])
def test_encoder_self_attention(backend, device, model_dtype, dtype):
    ed = EncDec(backend, device, dtype or model_dtype, seed=40)
    md = ed.build(decode=False)
    assert md.num_encoder_tokens == sum(ENC_LENS)
    t = sum(ENC_LENS)
    q, k, v = ed.randn(t, HQ, D), ed.randn(t, HKV, D), ed.randn(t, HKV, D)
    before = ed.cache.clone()
    out = ed.impl(AT.ENCODER).forward(_flat(q), _flat(k), _flat(v), ed.cache, md)
    assert out.shape == (t, HQ * D)
    assert_attention_close(out, _bidirectional_ref(q, k, v, ENC_LENS), tolerance_for(ed.dtype),
                           _ranges(ENC_LENS), what="encoder attention")
    assert torch.equal(raw_bits(ed.cache), raw_bits(before)), "ENCODER must not touch the cache"


@pytest.mark.parametrize("empty_cache", [False, True], ids=["cache", "no_cache"])
def test_encoder_only(backend, device, model_dtype, empty_cache):
    """Bidirectional over each sequence's query tokens; the cache is neither read nor written."""
    ed = EncDec(backend, device, model_dtype, seed=41)
    lens = DEC_LENS
    seqs = [pagedattn.ScheduledSeq(n, n, t) for n, t in zip(lens, ed.tables)]
    with refusal_guard(backend, f"block_size={BS}"):
        md = backend.get_builder_cls()(BS, device).build(seqs)
    t = sum(lens)
    q, k, v = ed.randn(t, HQ, D), ed.randn(t, HKV, D), ed.randn(t, HKV, D)
    cache = torch.empty(0, dtype=ed.dtype, device=device) if empty_cache else ed.cache
    before = cache.clone()
    out = ed.impl(AT.ENCODER_ONLY).forward(_flat(q), _flat(k), _flat(v), cache, md)
    assert_attention_close(out, _bidirectional_ref(q, k, v, lens), tolerance_for(ed.dtype),
                           _ranges(lens), what="encoder-only attention")
    assert torch.equal(raw_bits(cache), raw_bits(before)), "ENCODER_ONLY must not touch the cache"


def test_encoder_only_differs_from_causal(backend, device, model_dtype):
    ed = EncDec(backend, device, model_dtype, seed=42)
    seqs = [pagedattn.ScheduledSeq(n, n, t) for n, t in zip(DEC_LENS, ed.tables)]
    with refusal_guard(backend, f"block_size={BS}"):
        md = backend.get_builder_cls()(BS, device).build(seqs)
    t = sum(DEC_LENS)
    q, k, v = ed.randn(t, HQ, D), ed.randn(t, HKV, D), ed.randn(t, HKV, D)
    enc = ed.impl(AT.ENCODER_ONLY).forward(_flat(q), _flat(k), _flat(v), ed.cache.clone(), md)
    dec = ed.impl(AT.DECODER).forward(_flat(q), _flat(k), _flat(v), ed.cache.clone(), md)
    assert float((enc - dec).abs().max()) > 1e-3, "ENCODER_ONLY must not be causal"


@pytest.mark.parametrize("window", [(3, 2), (-1, 4)], ids=str)
@pytest.mark.parametrize("attn_type", [AT.ENCODER, AT.ENCODER_ONLY], ids=lambda t: t.name)
def test_two_sided_window(backend, device, model_dtype, attn_type, window):
    """Bidirectional local attention (FlashAttention's window_size=(left, right), -1 unbounded):
    a query at position p sees its sequence's keys in [p - left, p + right]; the option moves
    the output."""
    ed = EncDec(backend, device, model_dtype, seed=45)
    if attn_type is AT.ENCODER:
        lens, md = ENC_LENS, ed.build(decode=False)
    else:
        lens = DEC_LENS
        with refusal_guard(backend, f"block_size={BS}"):
            md = backend.get_builder_cls()(BS, device).build(
                [pagedattn.ScheduledSeq(n, n, t) for n, t in zip(lens, ed.tables)])
    t = sum(lens)
    q, k, v = ed.randn(t, HQ, D), ed.randn(t, HKV, D), ed.randn(t, HKV, D)
    out = ed.impl(attn_type, sliding_window=window).forward(_flat(q), _flat(k), _flat(v), ed.cache, md)
    assert_attention_close(out, _bidirectional_ref(q, k, v, lens, window), tolerance_for(ed.dtype), _ranges(lens),
                           what=f"{attn_type.name} window_size={window}")
    full = ed.impl(attn_type).forward(_flat(q), _flat(k), _flat(v), ed.cache, md)
    assert_outputs_differ(out, full, 1e-3, f"sliding_window={window} on {attn_type.name}")


def test_cross_attention_prefill_then_decode(backend, device, model_dtype):
    ed = EncDec(backend, device, model_dtype, seed=43)
    impl = ed.impl(AT.ENCODER_DECODER)
    enc_t, dec_t = sum(ENC_LENS), sum(DEC_LENS)
    enc_k, enc_v = ed.randn(enc_t, HKV, D), ed.randn(enc_t, HKV, D)
    cross_before = ed.cross_cache.clone()

    # prefill: decoder prompt queries over the encoder output, K/V stored at cross slots
    md = ed.build(decode=False)
    expected_slots = [slot_of(ct, p, BS) for ct, n in zip(ed.cross_tables, ENC_LENS)
                      for p in range(n)]
    assert md.cross_slot_mapping.dtype == torch.int64
    assert md.cross_slot_mapping.cpu().tolist() == expected_slots
    q = ed.randn(dec_t, HQ, D)
    out = impl.forward(_flat(q), _flat(enc_k), _flat(enc_v), ed.cross_cache, md)
    ref = torch.cat([dense_attention(q[a:b].cpu(), enc_k[c:e].cpu(), enc_v[c:e].cpu(),
                                     scale=D ** -0.5, causal=False, query_pos=torch.zeros(b - a))
                     for (a, b), (c, e) in zip(_ranges(DEC_LENS), _ranges(ENC_LENS))])
    assert_attention_close(out, ref, tolerance_for(ed.dtype), _ranges(DEC_LENS),
                           what="cross-attention prefill")
    lay = ed.cross_layout
    for i, s in enumerate(expected_slots):
        assert torch.equal(lay.slot(ed.cross_cache, 0, s), enc_k[i]), f"cross K at slot {s}"
        assert torch.equal(lay.slot(ed.cross_cache, 1, s), enc_v[i]), f"cross V at slot {s}"
    for blk in ed.cross_spare:
        for which in (0, 1):
            assert torch.equal(lay.block(ed.cross_cache, blk)[which],
                               lay.block(cross_before, blk)[which]), f"spare block {blk}"

    # decode: one query per sequence, key = value = None, K/V read through cross tables
    md2 = ed.build(decode=True)
    assert md2.cross_block_tables.dtype == torch.int32
    q2 = ed.randn(len(DEC_LENS), HQ, D)
    cache_after_prefill = ed.cross_cache.clone()
    out2 = impl.forward(_flat(q2), None, None, ed.cross_cache, md2)
    ref2 = torch.cat([dense_attention(q2[i:i + 1].cpu(), enc_k[c:e].cpu(), enc_v[c:e].cpu(),
                                      scale=D ** -0.5, causal=False, query_pos=[0])
                      for i, (c, e) in enumerate(_ranges(ENC_LENS))])
    assert_attention_close(out2, ref2, tolerance_for(ed.dtype), what="cross-attention decode")
    assert torch.equal(ed.cross_cache, cache_after_prefill), "decode must not write the cross cache"


def test_encoder_decoder_metadata_fields(backend, device, model_dtype):
    ed = EncDec(backend, device, model_dtype, seed=44)
    md = ed.build(decode=False)
    assert md.num_encoder_tokens == sum(ENC_LENS)
    assert list(md.encoder_seq_lens) == ENC_LENS
    assert md.encoder_seq_lens_tensor.dtype == torch.int32
    assert md.encoder_seq_lens_tensor.cpu().tolist() == ENC_LENS
    assert md.max_encoder_seq_len == max(ENC_LENS)
    tables = md.cross_block_tables.cpu()
    assert tables.dtype == torch.int32 and tables.shape[0] == len(ENC_LENS)
    for row, ct in zip(tables.tolist(), ed.cross_tables):
        assert row[:len(ct)] == ct


@pytest.mark.parametrize("heads", [pytest.param((1, 1), id="mha1"),
                                   pytest.param((16, 16), id="mha16", marks=KERNEL_GRID),
                                   pytest.param((8, 2), id="gqa")])
@pytest.mark.parametrize("from_cache", [True, False], ids=["cache", "step"])
def test_cross_attention_with_more_queries_than_encoder_tokens(backend, device, model_dtype, heads,
                                                               from_cache):
    """Cross attention is not causal: every decoder query sees every encoder key, also when a
    sequence has more decoder queries than encoder tokens (no row is padding by position)."""
    hq, hkv = heads
    d = 64
    skip_unsupported_head_size(backend, d)
    skip_refused_dtype(backend, device, model_dtype)
    bs = 16
    layout = CacheLayout(backend, 8, bs, hkv, d)
    g = torch.Generator().manual_seed(7)
    cache = make_garbage_cache(layout.shape, model_dtype, device, g)
    # (decoder queries, encoder tokens): 2 over 1, 9 over 3, and one that fits, 2 over 5
    parts = [(2, 1), (9, 3), (2, 5)]
    seqs = [pagedattn.ScheduledSeq(n, n, [i], encoder_len=e, cross_block_table=[5 + i])
            for i, (n, e) in enumerate(parts)]
    t, te = sum(n for n, _ in parts), sum(e for _, e in parts)
    q = torch.randn(t, hq, d, generator=g).to(model_dtype).to(device)
    k = torch.randn(te, hkv, d, generator=g).to(model_dtype).to(device)
    v = torch.randn(te, hkv, d, generator=g).to(model_dtype).to(device)
    with refusal_guard(backend, f"heads={heads}"):
        impl = backend.get_impl_cls()(hq, d, d ** -0.5, hkv, attn_type=AT.ENCODER_DECODER)
    with refusal_guard(backend, f"block_size={bs}"):
        md = backend.get_builder_cls()(bs, device).build(seqs)
    kv_cache = cache if from_cache else torch.empty(0, dtype=model_dtype, device=device)
    out = impl.forward(q, k, v, kv_cache, md).view(t, hq, d)
    qs, ks = 0, 0
    for n, e in parts:
        ref = dense_attention(q[qs:qs + n].cpu(), k[ks:ks + e].cpu(), v[ks:ks + e].cpu(),
                              scale=d ** -0.5, causal=False)
        assert_attention_close(out[qs:qs + n], ref, tolerance_for(model_dtype),
                               what=f"{n} decoder queries over {e} encoder tokens")
        qs, ks = qs + n, ks + e
