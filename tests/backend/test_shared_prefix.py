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
from cases import Shape, make_scenario, refusal_guard
from paged_batch import raw_bits

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


def _suffix(sc, builder):
    """The step's metadata over each sequence's table without the SHARED blocks."""
    bs = sc.block_size
    return builder.build([pagedattn.ScheduledSeq(s.seq_len - SHARED * bs, s.query_len, s.block_table[SHARED:])
                          for s in sc.seqs])


def _split_layer(sc, backend_name):
    """A plain layer with its shared-prefix impl, and a builder told both (skips a backend that cannot split)."""
    layer = _layer(sc, backend_name)
    if layer.prefix_impl is None:
        pytest.skip(f"{backend_name}: {layer.cascade_refusal}")
    return layer, sc.builder(layers=[layer.impl, layer.prefix_impl])


def _assert_refused(sc, call, error, match) -> None:
    """`call()` raises `error` matching `match`, and the cache is as it was before the step."""
    with pytest.raises(error, match=match):
        call()
    assert torch.equal(raw_bits(sc.kv_cache), raw_bits(sc.initial_cache)), "a refused step wrote the cache"


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
    with refusal_guard(backend, option):  # FlashInfer 0.7.2 applies sinks on Blackwell only
        layer = _layer(sc, backend_name, **opts)
    if layer.prefix_impl is None:
        pytest.skip(f"{backend_name}: {layer.cascade_refusal}")
    builder = sc.builder(layers=[layer.impl, layer.prefix_impl])
    suffix = _suffix(sc, builder)
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
                        ((4, []), "at least one prefix block"), ((4, [1, -2]), "prefix block ids"),
                        ((4, [True, 0]), r"got True in \[True, 0\]"), ((4, torch.tensor([True])), "got True"),
                        ((4, [2**31]), rf"\[0, 2\*\*31\), got {2**31}"), ((4, [1.5]), "got 1.5")):
        with pytest.raises(ValueError, match=match):
            builder.build_shared_prefix(*args)
    for blocks in (None, "12", 3):
        with pytest.raises(TypeError, match="expected prefix_blocks a sequence of block ids"):
            builder.build_shared_prefix(4, blocks)
    md = builder.build_shared_prefix(torch.tensor(6), torch.tensor([3, 1]))  # tensors' values, kept as host ints
    assert md.num_prefill_tokens == 6 and type(md.max_cross_block_id) is int and md.max_cross_block_id == 3
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


def test_prefix_blocks_outside_the_pool_are_refused_before_anything_runs(backend, backend_name, device,
                                                                         model_dtype):
    """The prefix's block ids are checked against the pool (the prefix impl's check, from the
    metadata's host ints) before the suffix writes the step's K/V: nothing is written."""
    sc = _shared_scenario(backend, device, model_dtype)
    layer, builder = _split_layer(sc, backend_name)
    num_blocks = sc.layout.num_blocks
    q, k, v = (t.flatten(1) for t in (sc.query, sc.key, sc.value))
    for bad in (num_blocks, num_blocks + 2):
        prefix = builder.build_shared_prefix(sc.num_tokens, [sc.block_tables[0][0], bad])
        with pagedattn.forward_context(_suffix(sc, builder), [sc.kv_cache], shared_prefix=[prefix]):
            _assert_refused(sc, lambda: layer(q, k, v), IndexError, rf"\[0, {num_blocks}\).* got block {bad}\b")


def test_a_shared_prefix_of_another_step_is_refused(backend, backend_name, device, model_dtype):
    """A prefix built for another number of query tokens or another block size, a step's own
    metadata in its place, or no metadata at all: refused with both values, nothing written."""
    sc = _shared_scenario(backend, device, model_dtype)
    layer, builder = _split_layer(sc, backend_name)
    shared, t, bs = sc.block_tables[0][:SHARED], sc.num_tokens, sc.block_size
    half = backend.get_builder_cls()(bs // 2, device).build_shared_prefix(t, shared)
    q, k, v = (t_.flatten(1) for t_ in (sc.query, sc.key, sc.value))
    refused = [
        (builder.build_shared_prefix(t - 1, shared), ValueError, rf"step's {t} query tokens .* got {t - 1}"),
        (builder.build_shared_prefix(t + 3, shared), ValueError, rf"step's {t} query tokens .* got {t + 3}"),
        (half, ValueError, rf"block_size {bs}, got {t} and {bs // 2}"),
        (_suffix(sc, builder), ValueError, r"expected a shared prefix's metadata .* got a step's"),
        (list(shared), TypeError, "got list"),
    ]
    for prefix, error, match in refused:
        with pagedattn.forward_context(_suffix(sc, builder), [sc.kv_cache], shared_prefix=[prefix]):
            _assert_refused(sc, lambda: layer(q, k, v), error, match)


def test_only_cross_attention_reads_a_shared_prefix(backend, backend_name, device, model_dtype):
    """A shared prefix's metadata has no block for its queries (block tables [1, 0] under
    seq_lens [T]): a DECODER impl given it, directly or as the step's metadata of a cascade,
    refuses it rather than read past that table."""
    sc = _shared_scenario(backend, device, model_dtype)
    layer, builder = _split_layer(sc, backend_name)
    prefix = builder.build_shared_prefix(sc.num_tokens, sc.block_tables[0][:SHARED])
    q, k, v = (t.flatten(1) for t in (sc.query, sc.key, sc.value))
    match = r"for DECODER attention, got a shared prefix's"
    _assert_refused(sc, lambda: layer.impl.forward(q, k, v, sc.kv_cache, prefix), ValueError, match)
    with pagedattn.forward_context(prefix, [sc.kv_cache]):
        _assert_refused(sc, lambda: layer(q, k, v), ValueError, match)
