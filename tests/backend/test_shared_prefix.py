"""Cascade attention through `pagedattn.Attention`: the sequences of a step share their first
blocks; the layer attends them once for every query (`build_shared_prefix`, read as
cross-attention) and each sequence's suffix apart (`build` over its table without them), merged
by their LSEs, against the oracle over each sequence's whole history.

The batch is a prefill chunk beside decodes (a mixed step) whose histories begin with the same
SHARED blocks: every query lies after them. Options: plain; sinks with a soft cap (the sink
joins the suffix's denominator only); an FP8 cache (both parts read it with the layer's scales).
"""

import pytest
import torch

import pagedattn
from cases import Shape, make_scenario

LENS = ((40, 5), (37, 1), (52, 1), (33, 1))  # (context_len, query_len): all contexts >= SHARED blocks
SHARED = 2  # blocks of 16
OPTIONS = {
    "plain": {},
    "sinks_softcap": dict(sinks=[0.5, -1.0, 2.0, 0.0], logits_soft_cap=8.0),
    "fp8": dict(kv_cache_dtype="fp8_e5m2"),
}


def _shared_scenario(backend, device, dtype, kv_cache_dtype="auto", seed=90):
    """A mixed step whose sequences' first SHARED blocks are sequence 0's (tables and histories)."""
    sc = make_scenario(backend, Shape("shared_prefix", LENS), device=device, dtype=dtype, seed=seed,
                       kv_cache_dtype=kv_cache_dtype, magnitude=2.0 if kv_cache_dtype != "auto" else 1.0)
    shared, n = list(sc.block_tables[0][:SHARED]), SHARED * sc.block_size
    for i in range(1, len(LENS)):
        sc.block_tables[i] = shared + list(sc.block_tables[i][SHARED:])
        sc.hist_k[i][:n] = sc.hist_k[0][:n]
        sc.hist_v[i][:n] = sc.hist_v[0][:n]
    sc.seqs = sc.scheduled()
    return sc


def _layer(sc, backend_name, **opts):
    sinks = opts.pop("sinks", None)
    if sinks is not None:
        opts["sinks"] = torch.tensor(sinks, dtype=torch.float32, device=sc.device)
    return pagedattn.Attention(sc.num_heads, sc.head_size, sc.default_scale, sc.num_kv_heads, backend=backend_name,
                               kv_cache_dtype=sc.kv_cache_dtype, k_scale=sc.k_scale, v_scale=sc.v_scale,
                               dtype=sc.dtype, **opts)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_shared_prefix_apart_equals_whole(backend, backend_name, device, model_dtype, option):
    opts = dict(OPTIONS[option])
    sc = _shared_scenario(backend, device, model_dtype, kv_cache_dtype=opts.pop("kv_cache_dtype", "auto"))
    layer = _layer(sc, backend_name, **opts)
    if layer.prefix_impl is None:
        pytest.skip(f"{backend_name}: {layer.cascade_refusal}")
    builder = sc.builder(layers=[layer.impl, layer.prefix_impl])
    bs = sc.block_size
    suffix = builder.build([pagedattn.ScheduledSeq(s.seq_len - SHARED * bs, s.query_len, s.block_table[SHARED:])
                            for s in sc.seqs])
    prefix = builder.build_shared_prefix(sc.num_tokens, sc.block_tables[0][:SHARED])
    q, k, v = (t.flatten(1) for t in (sc.query, sc.key, sc.value))
    with pagedattn.forward_context(suffix, [sc.kv_cache], shared_prefix=[prefix]):
        out = layer(q, k, v)
    sc.check(out, **{name: value for name, value in opts.items()})
    sc.check_cache_writes()  # the suffix part wrote the step's K/V, the prefix part nothing


def test_shared_prefix_metadata(backend, device, model_dtype):
    """One prefill of the step's query tokens with no block of its own, over the prefix blocks
    as its cross keys; refusals say what was expected."""
    sc = _shared_scenario(backend, device, model_dtype)
    builder = sc.builder()
    md = builder.build_shared_prefix(6, [3, 1])
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens, md.num_encoder_tokens) == (1, 6, 0, 0)
    assert md.encoder_seq_lens == [2 * sc.block_size] and md.max_encoder_seq_len == 2 * sc.block_size
    assert md.cross_block_tables.tolist() == [[3, 1]] and md.max_cross_block_id == 3
    assert md.query_start_loc.tolist() == [0, 6] and md.encoder_seq_start_loc.tolist() == [0, 2 * sc.block_size]
    assert md.slot_mapping.tolist() == [-1] * 6 and md.block_tables.shape == (1, 0)
    for args, match in (((0, [1]), "num_query_tokens"), ((True, [1]), "num_query_tokens"),
                        ((4, []), "at least one prefix block"), ((4, [1, -2]), "prefix block ids")):
        with pytest.raises(ValueError, match=match):
            builder.build_shared_prefix(*args)
    with pytest.raises(ValueError, match="without a sliding window"):
        sc.builder(builder_window=32).build_shared_prefix(4, [1])


def test_layers_that_cannot_split_say_why(backend, backend_name, device, model_dtype):
    """ALiBi, a window, cross-attention: no prefix impl, and a context that hands one a shared
    prefix is refused with the reason."""
    sc = _shared_scenario(backend, device, model_dtype)
    refused = {"ALiBi": dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]), "sliding window": dict(sliding_window=24)}
    for reason, opts in refused.items():
        try:
            layer = _layer(sc, backend_name, **opts)
        except NotImplementedError:  # the backend refuses the option itself
            continue
        assert layer.prefix_impl is None and reason in layer.cascade_refusal
        md = sc.build()
        prefix = sc.builder().build_shared_prefix(sc.num_tokens, sc.block_tables[0][:SHARED])
        q, k, v = (t.flatten(1) for t in (sc.query, sc.key, sc.value))
        with pagedattn.forward_context(md, [sc.kv_cache], shared_prefix=[prefix]):
            with pytest.raises(ValueError, match="cannot attend a shared prefix apart"):
                layer(q, k, v)
    with pytest.raises(ValueError, match="one shared_prefix per kv_cache"):
        with pagedattn.forward_context(sc.build(), [sc.kv_cache], shared_prefix=[None, None]):
            pass
