"""The xFormers biases the `xformers` backend builds from a step's metadata, checked on the CPU
without xFormers' kernels: each bias is materialised by xFormers itself (`materialize()`),
applied densely (softmax(scale * q.k + bias) v, float64) and compared with the dense oracle,
over the named batch shapes of cases.py.

- fresh prompts over the step's own K/V: block-diagonal causal, local for a sliding window,
  per-sequence ALiBi tensor biases (with and without a window);
- every part of every shape over the paged pool (chunks over a cached prefix, decodes): the
  paged block-diagonal causal-with-offset padded-keys bias, through the part's block tables;
- encoder / cross attention: block-diagonal over the step's rows, and the paged padded-keys
  bias through the cross block tables.

Needs `xformers` importable (CI: pip install --no-deps xformers==0.0.35); skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xformers.ops.fmha.attn_bias",
                    reason="xformers is not installed (pip install --no-deps xformers==0.0.35)")

import pagedattn  # noqa: E402
from cases import alibi_slopes_for, shapes  # noqa: E402
from oracle import dense_attention  # noqa: E402
from paged_batch import make_paged_batch  # noqa: E402
from pagedattn.backends import xformers_bias  # noqa: E402
from pagedattn.backends import xformers_fmha  # noqa: E402
from pagedattn.backends.xformers_backend import XFormersBackend  # noqa: E402
from xformers.ops.fmha import attn_bias as XB  # noqa: E402
from xformers.ops.fmha.attn_bias import PagedBlockDiagonalCausalWithOffsetPaddedKeysMask  # noqa: E402

D = 16
SCALE = D ** -0.5


def apply_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(SCALE * q.k + bias) v in float64. q: [Tq, Hq, D]; k, v: [Nk, Hkv, D];
    bias: [Tq, Nk] or [Hq, Tq, Nk] (-inf: not seen). Returns [Tq, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    q, k, v = (x.double() for x in (q, k, v))
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * SCALE + bias.double()
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def batch_for(lens, shape, **options):
    return make_paged_batch(XFormersBackend, lens, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                            head_size=D, block_size=shape.block_size, dtype=torch.float32, write_step=True,
                            **options)


def materialize_paged(bias, part, num_blocks: int) -> torch.Tensor:
    """The paged bias over the pool's slots [Tq, num_blocks * block_size]. xFormers materialises
    a block table's padding entries too (the builder pads with block 0, which may be a real
    block of the sequence), so the table handed to `materialize` names a block past the pool
    there instead, and those columns are cut off (blocks past the largest named are not seen)."""
    tables = bias.block_tables.clone()
    bs = part.block_size
    for b, n in enumerate(part.seq_lens):
        tables[b, -(-n // bs):] = num_blocks
    bias = type(bias)(q_seqinfo=bias.q_seqinfo, k_seqinfo=bias.k_seqinfo, block_tables=tables, page_size=bs)
    logical = (bias.q_seqinfo.seqstart_py[-1], tables.shape[0] * tables.shape[1] * bs)
    mask = bias.materialize(logical)  # [Tq, (largest block id + 1) * bs]
    width = min(mask.shape[1], num_blocks * bs)
    out = mask.new_full((logical[0], num_blocks * bs), float("-inf"))
    out[:, :width] = mask[:, :width]
    return out


# ----------------------------------------------------------------------------- fresh prompts

FRESH = [s for s in shapes() if any(c == 0 for c, _ in s.lens)]
OPTIONS = {"plain": {}, "window5": {"sliding_window": 5}, "window17": {"sliding_window": 17},
           "alibi": {"alibi": True}, "alibi_window5": {"alibi": True, "sliding_window": 5}}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("shape", FRESH, ids=str)
def test_fresh_prompt_biases_match_oracle(shape, option):
    lens = [(0, q) for c, q in shape.lens if c == 0]
    batch = batch_for(lens, shape)
    md = XFormersBackend.get_builder_cls()(shape.block_size, "cpu").build(batch.scheduled())
    assert md.fresh_prefills and md.num_decode_tokens == 0
    window = OPTIONS[option].get("sliding_window")
    slopes = alibi_slopes_for(shape.num_heads) if OPTIONS[option].get("alibi") else None
    ref, _ = batch.reference(scale=SCALE, sliding_window=window, alibi_slopes=slopes)
    rows = batch.row_ranges()
    if slopes is None:
        bias = xformers_bias.block_diagonal(XB, md.query_lens, md.seq_lens, causal=True, sliding_window=window,
                                            device=torch.device("cpu"))
        n = md.num_prefill_tokens
        out = apply_dense(batch.query, batch.key, batch.value, bias.materialize((n, n)))
    else:
        hkv, g = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
        biases = xformers_bias.alibi(XB, torch.tensor(slopes), md.query_lens, num_kv_heads=hkv,
                                     sliding_window=window, dtype=torch.float32)
        out = torch.cat([apply_dense(batch.query[a:b], batch.key[a:b], batch.value[a:b],
                                     bias.materialize((1, hkv, g, b - a, b - a)).flatten(0, 2))
                         for bias, (a, b) in zip(biases, rows)])
    # the ALiBi term is a float32 tensor (xFormers adds it in the query's dtype)
    tol = 1e-9 if slopes is None else 1e-6
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_causal_block_diagonal_needs_fresh_prompts():
    with pytest.raises(ValueError, match="fresh prompts"):
        xformers_bias.block_diagonal(XB, [2, 3], [5, 3], causal=True, sliding_window=None, device=torch.device("cpu"))


# ----------------------------------------------------------------------------- the paged pool


@pytest.mark.parametrize("shape", shapes(), ids=str)
def test_paged_biases_match_oracle(shape):
    """Each part of the step (prefills, decodes), as the backend splits it, through its tables."""
    batch = batch_for(shape.lens, shape, slack_blocks=shape.slack_blocks)
    md = XFormersBackend.get_builder_cls()(shape.block_size, "cpu").build(batch.scheduled())
    ref, _ = batch.reference(scale=SCALE)
    num_blocks = batch.layout.num_blocks
    k_pool, v_pool = (batch.layout.kv(batch.kv_cache, i).flatten(0, 1) for i in (0, 1))  # [num_blocks*bs, Hkv, D]
    parts = [(md.prefill_metadata, slice(0, md.num_prefill_tokens)),
             (md.decode_metadata, slice(md.num_prefill_tokens, md.num_tokens))]
    checked = 0
    for part, rows in parts:
        if part is None:
            continue
        bias = xformers_bias.paged(XB, part.query_lens, part.seq_lens, part.block_tables, part.block_size, causal=True)
        assert isinstance(bias, PagedBlockDiagonalCausalWithOffsetPaddedKeysMask)
        out = apply_dense(batch.query[rows], k_pool, v_pool, materialize_paged(bias, part, num_blocks))
        torch.testing.assert_close(out, ref[rows], atol=1e-9, rtol=1e-9)
        checked += rows.stop - rows.start
    assert checked == md.num_tokens


# ----------------------------------------------------------------------------- encoders, cross attention

# (decoder query_len, encoder_len): more decoder queries than encoder tokens in the second
CROSS = [(3, 9), (5, 2), (1, 17), (4, 16)]


def test_encoder_block_diagonal_matches_oracle():
    g = torch.Generator().manual_seed(1)
    q_lens, kv_lens = [q for q, _ in CROSS], [k for _, k in CROSS]
    q = torch.randn(sum(q_lens), 4, D, generator=g)
    k, v = (torch.randn(sum(kv_lens), 2, D, generator=g) for _ in range(2))
    bias = xformers_bias.block_diagonal(XB, q_lens, kv_lens, causal=False, sliding_window=None,
                                        device=torch.device("cpu"))
    out = apply_dense(q, k, v, bias.materialize((sum(q_lens), sum(kv_lens))))
    qs, ks = [0], [0]
    for a, b in CROSS:
        qs.append(qs[-1] + a), ks.append(ks[-1] + b)
    ref = torch.cat([dense_attention(q[qs[i]:qs[i + 1]], k[ks[i]:ks[i + 1]], v[ks[i]:ks[i + 1]], scale=SCALE,
                                     causal=False) for i in range(len(CROSS))])
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_cross_paged_bias_matches_oracle(block_size):
    """Decoder queries over the encoder's K/V through the cross tables (shuffled blocks)."""
    g = torch.Generator().manual_seed(2)
    hq, hkv = 4, 2
    need = [-(-e // block_size) for _, e in CROSS]
    num_blocks = 2 * sum(need) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    seqs, enc_k, enc_v = [], [], []
    for (ql, el), n in zip(CROSS, need):
        dec_table, cross_table = [free.pop() for _ in range(-(-ql // block_size))], [free.pop() for _ in range(n)]
        seqs.append(pagedattn.ScheduledSeq(ql, ql, dec_table, encoder_len=el, cross_block_table=cross_table))
        enc_k.append(torch.randn(el, hkv, D, generator=g)), enc_v.append(torch.randn(el, hkv, D, generator=g))
    md = XFormersBackend.get_builder_cls()(block_size, "cpu").build(seqs)
    pool = torch.randn(XFormersBackend.get_kv_cache_shape(num_blocks, block_size, hkv, D), generator=g) * 50
    k_pool, v_pool = (pool[i].view(num_blocks * block_size, hkv, D) for i in (0, 1))
    slots = md.cross_slot_mapping
    k_pool[slots], v_pool[slots] = torch.cat(enc_k), torch.cat(enc_v)
    q = torch.randn(md.num_tokens, hq, D, generator=g)

    bias = xformers_bias.paged(XB, md.query_lens, md.encoder_seq_lens, md.cross_block_tables, block_size, causal=False)
    part = _CrossPart(block_size, md.encoder_seq_lens)
    out = apply_dense(q, k_pool, v_pool, materialize_paged(bias, part, num_blocks))
    ref, at = [], 0
    for (ql, _), k, v in zip(CROSS, enc_k, enc_v):
        ref.append(dense_attention(q[at:at + ql], k, v, scale=SCALE, causal=False))
        at += ql
    torch.testing.assert_close(out, torch.cat(ref), atol=1e-9, rtol=1e-9)


class _CrossPart:
    """What `materialize_paged` reads of a part, for the cross tables (keys: the encoder's)."""

    def __init__(self, block_size: int, seq_lens: list[int]):
        self.block_size, self.seq_lens = block_size, seq_lens


# ----------------------------------------------------------------------------- provider


def test_cpu_runs_our_kernels_and_says_why(monkeypatch):
    monkeypatch.delenv(xformers_fmha.ENV_VAR, raising=False)
    xformers_fmha.choose.cache_clear()
    fmha = xformers_fmha.choose("cpu")
    assert fmha.module is None and fmha.why_not["xformers"] == "no cpu kernels"
    if not torch.cuda.is_available():
        assert XFormersBackend.provider().startswith("pagedattn.kernels")
        assert "no cpu kernels" in XFormersBackend.provider()
    xformers_fmha.choose.cache_clear()


@pytest.mark.parametrize("name,role", [("cutlass", "step"), ("flash", "step"), ("triton_splitk", "paged")])
def test_smoke_test_reports_instead_of_raising(name, role):
    """The operator check behind `provider()` (run at import of the test suite, by `pagedattn
    info`) answers with a reason on a device the operator refuses; it never raises."""
    from xformers.ops import fmha

    why = xformers_fmha.smoke_test(fmha, getattr(fmha, name).FwOp, role, torch.device("cpu"))
    assert "does not run here" in why, why


def test_a_pinned_provider_that_cannot_run_makes_the_backend_unavailable(monkeypatch):
    from pagedattn.backends import xformers_backend

    monkeypatch.setenv(xformers_fmha.ENV_VAR, "bogus")
    xformers_fmha.choose.cache_clear()
    try:
        assert any("expected one of xformers, mslk, ours" in r for r in xformers_backend.unavailable_reasons())
        if not torch.cuda.is_available():
            monkeypatch.setenv(xformers_fmha.ENV_VAR, "mslk")
            xformers_fmha.choose.cache_clear()
            assert any("mslk" in r for r in xformers_backend.unavailable_reasons())
    finally:
        xformers_fmha.choose.cache_clear()


def test_a_pinned_provider_that_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setenv(xformers_fmha.ENV_VAR, "mslk")
    xformers_fmha.choose.cache_clear()
    try:
        with pytest.raises(xformers_fmha.ProviderUnavailableError, match="mslk"):
            xformers_fmha.choose("cpu")
        monkeypatch.setenv(xformers_fmha.ENV_VAR, "ours")
        xformers_fmha.choose.cache_clear()
        assert xformers_fmha.choose("cpu").describe().startswith("pagedattn.kernels (our Triton kernels) for every "
                                                                 "part (pinned by")
    finally:
        xformers_fmha.choose.cache_clear()
