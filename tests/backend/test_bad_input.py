"""Bad input raises a clear exception at the right place, never wrong numbers."""

import re

import pytest
import torch

import pagedattn
from cases import Shape, is_reference_backend, make_scenario, refusal_guard, shapes

MIXED = shapes("mixed")[0]
ERRORS = (ValueError, TypeError, NotImplementedError)


@pytest.fixture
def sc(backend, device, model_dtype):
    return make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=80)


def _fwd(sc, q, k, v, md=None, cache=None):
    return sc.impl().forward(q, k, v, sc.kv_cache if cache is None else cache,
                             md if md is not None else sc.build(), k_scale=1.0, v_scale=1.0)


def test_integer_query(sc):
    q = torch.ones(sc.num_tokens, sc.num_heads * sc.head_size, dtype=torch.int32,
                   device=sc.device)
    with pytest.raises(ERRORS):
        _fwd(sc, q, sc.key.flatten(1), sc.value.flatten(1))


def test_declared_query_dtype_is_checked(backend):
    impl = backend.get_impl_cls()(4, 64, 0.125, 2)
    with pytest.raises(TypeError, match="query dtype"):
        impl.set_query_dtype(torch.int32)


def _other_dtype(dtype):
    return torch.float16 if dtype != torch.float16 else torch.bfloat16


def test_query_dtype_differs_from_auto_cache(sc):
    other = _other_dtype(sc.dtype)
    with pytest.raises(ERRORS, match=r"(?i)dtype"):
        _fwd(sc, sc.query.flatten(1).to(other), sc.key.flatten(1).to(other),
             sc.value.flatten(1).to(other))
    assert torch.equal(sc.kv_cache, sc.initial_cache), "a refused call must not write the cache"


def test_key_dtype_differs_from_query(sc):
    with pytest.raises(ERRORS):
        other = _other_dtype(sc.dtype)
        _fwd(sc, sc.query.flatten(1), sc.key.flatten(1).to(other), sc.value.flatten(1).to(other))


def test_query_rows_differ_from_metadata(sc):
    q, k, v = (t.flatten(1) for t in (sc.query, sc.key, sc.value))
    with pytest.raises(ERRORS):
        _fwd(sc, q[:-1], k[:-1], v[:-1])
    assert torch.equal(sc.kv_cache, sc.initial_cache)


def test_key_rows_differ_from_query(sc):
    q, k, v = (t.flatten(1) for t in (sc.query, sc.key, sc.value))
    with pytest.raises(ERRORS):
        _fwd(sc, q, k[:-1], v[:-1])


def test_wrong_head_width(sc):
    q, k, v = (t.flatten(1) for t in (sc.query, sc.key, sc.value))
    with pytest.raises(ERRORS):
        _fwd(sc, q[:, :-1], k, v)
    with pytest.raises(ERRORS):
        _fwd(sc, q, torch.cat([k, k], dim=1), torch.cat([v, v], dim=1))


def test_wrong_cache_shape(sc):
    q, k, v = (t.flatten(1) for t in (sc.query, sc.key, sc.value))
    with pytest.raises(ERRORS):
        _fwd(sc, q, k, v, cache=sc.kv_cache.flatten()[:-1].clone())


def test_heads_not_a_multiple_of_kv_heads(backend):
    with pytest.raises(ValueError, match="6|4"):
        backend.get_impl_cls()(6, 64, 0.125, 4)


@pytest.mark.parametrize("kwargs,what", [
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=-3), "sliding_window"),
    (dict(sliding_window=(4, 3)), "sliding_window"),  # a DECODER's window cannot reach past the query
    (dict(sliding_window=(-2, 0)), "sliding_window"),
    (dict(sliding_window=(1, 2, 3)), "sliding_window"),
    (dict(sliding_window=True), "sliding_window"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    (dict(alibi_slopes=[0.5, 0.25, 0.125]), "alibi"),
])
def test_invalid_option_values_raise_at_construction(backend, kwargs, what):
    with pytest.raises((ValueError, TypeError)):
        backend.get_impl_cls()(4, 64, 0.125, 2, **kwargs)


OPTIONS = {
    "sliding_window": (dict(sliding_window=16), ("sliding", "window")),
    "alibi": (dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]), ("alibi",)),
    "soft_cap": (dict(logits_soft_cap=30.0), ("soft", "cap")),
    "fp8": (dict(kv_cache_dtype="fp8_e4m3"), ("fp8", "kv_cache_dtype")),
    "fp8_e5m2": (dict(kv_cache_dtype="fp8_e5m2"), ("fp8", "e5m2", "kv_cache_dtype")),
    "encoder": (dict(attn_type=pagedattn.AttentionType.ENCODER), ("encoder", "attn_type")),
    "encoder_only": (dict(attn_type=pagedattn.AttentionType.ENCODER_ONLY),
                     ("encoder", "attn_type")),
    "cross": (dict(attn_type=pagedattn.AttentionType.ENCODER_DECODER),
              ("encoder", "cross", "attn_type")),
    "alibi+window": (dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625], sliding_window=8),
                     ("alibi", "sliding", "window")),
    "sinks": (dict(sinks=torch.zeros(4)), ("sinks",)),
    "two_sided_window": (dict(attn_type=pagedattn.AttentionType.ENCODER_ONLY, sliding_window=(4, 3)),
                         ("window", "encoder")),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_refusals_name_the_option_and_backend(backend, name):
    """Every option is either accepted or refused at construction, with a message naming it."""
    kwargs, words = OPTIONS[name]
    try:
        backend.get_impl_cls()(4, 64, 0.125, 2, **kwargs)
    except (NotImplementedError, ValueError) as e:
        assert not is_reference_backend(backend), f"the torch backend refused {name}: {e}"
        msg = str(e).lower()
        assert any(w in msg for w in words), f"refusal of {name} does not name it: {e}"
        bname = backend.get_name().lower()
        assert bname in msg or bname.replace("_", "") in msg.replace("_", ""), (
            f"refusal of {name} does not name the backend {bname}: {e}")


@pytest.mark.parametrize("attn_type,kwargs", [
    (pagedattn.AttentionType.ENCODER_DECODER, dict(sliding_window=8)),
    (pagedattn.AttentionType.ENCODER_DECODER, dict(sliding_window=(4, 3))),
    (pagedattn.AttentionType.ENCODER_DECODER, dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625])),
], ids=["cross+window", "cross+two_sided_window", "cross+alibi"])
def test_undefined_option_combinations_raise_at_construction(backend, attn_type, kwargs):
    """API.md defines windows and ALiBi where query and key positions compare (self-attention,
    windows reaching past the query in bidirectional attention only); in cross-attention the
    option would be silently meaningless, so it is refused."""
    with pytest.raises((ValueError, NotImplementedError)):
        backend.get_impl_cls()(4, 64, 0.125, 2, attn_type=attn_type, **kwargs)


def test_fp8_impl_with_an_unquantised_cache(backend, device, model_dtype):
    # the cache in the model dtype
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=82)
    with refusal_guard(backend, "an FP8 KV cache"):  # FA4 as flash_attn's provider has none on Hopper
        impl = backend.get_impl_cls()(sc.num_heads, sc.head_size, 0.125, sc.num_kv_heads,
                                      kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ERRORS):
        impl.forward(sc.query.flatten(1), sc.key.flatten(1), sc.value.flatten(1), sc.kv_cache,
                     sc.build())


def test_decode_before_prefill(backend, device):
    with pytest.raises(ValueError):
        backend.get_builder_cls()(16, device).build([
            pagedattn.ScheduledSeq(10, 1, [0]),    # a decode ...
            pagedattn.ScheduledSeq(5, 5, [1]),     # ... listed before a prefill
        ])


def test_block_table_too_short(backend, device):
    with pytest.raises(ValueError):
        backend.get_builder_cls()(16, device).build([pagedattn.ScheduledSeq(33, 33, [0, 1])])


def test_block_table_too_short_for_decode(backend, device):
    with pytest.raises(ValueError):
        backend.get_builder_cls()(4, device).build([pagedattn.ScheduledSeq(9, 1, [3, 4])])


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, 2**31], ids=["negative", "float", "str", "None", "past_int32"])
def test_bad_block_id_is_named(backend, device, bad):
    """The builder checks block ids in bulk; a bad one is still named, with its sequence."""
    seqs = [pagedattn.ScheduledSeq(5, 5, [0]), pagedattn.ScheduledSeq(20, 1, [1, bad])]
    with pytest.raises(ValueError, match=rf"sequence 1: expected block ids .*got {re.escape(repr(bad))}"):
        backend.get_builder_cls()(16, device).build(seqs)


def test_first_error_in_order_is_raised(backend, device):
    """A bad block id in sequence 0 is named before a short table in sequence 1."""
    seqs = [pagedattn.ScheduledSeq(5, 5, [1.5]), pagedattn.ScheduledSeq(40, 1, [0])]
    with pytest.raises(ValueError, match="sequence 0: expected block ids"):
        backend.get_builder_cls()(16, device).build(seqs)


@pytest.mark.parametrize("seq_len,query_len", [(4, 0), (3, 5), (0, 0)])
def test_impossible_lengths(backend, device, seq_len, query_len):
    with pytest.raises(ValueError):
        backend.get_builder_cls()(16, device).build(
            [pagedattn.ScheduledSeq(seq_len, query_len, [0])])


def test_graph_padding_smaller_than_batch(backend, device):
    seqs = [pagedattn.ScheduledSeq(5, 1, [i]) for i in range(4)]
    with pytest.raises(ValueError):
        backend.get_builder_cls()(16, device).build(seqs, cuda_graph_pad_to=2)


def test_graph_padding_of_a_prefill_batch(backend, device):
    seqs = [pagedattn.ScheduledSeq(5, 5, [0])]
    with pytest.raises(ValueError):
        backend.get_builder_cls()(16, device).build(seqs, cuda_graph_pad_to=4)


def test_bad_block_size(backend, device):
    with pytest.raises(ValueError):
        backend.get_builder_cls()(0, device)


def test_unknown_backend_name():
    with pytest.raises(pagedattn.BackendUnavailableError, match="torch"):
        pagedattn.get_backend("nope")


def test_kv_cache_dtype_mapping():
    f = pagedattn.kv_cache_dtype
    assert f("auto", torch.bfloat16) == torch.bfloat16
    assert f("fp8", torch.float16) == torch.float8_e4m3fn
    assert f("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert f("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError):
        f("int4", torch.float16)


def test_cross_attention_decode_needs_cross_tables(backend, device, model_dtype):
    """key=None is only meaningful for cross-attention; a decoder layer must refuse it."""
    sc = make_scenario(backend, Shape("d", ((8, 1),)), device=device, dtype=model_dtype, seed=81)
    with pytest.raises(ERRORS):
        sc.impl().forward(sc.query.flatten(1), None, None, sc.kv_cache, sc.build())


def test_set_layers_refuses_what_is_not_this_backends_impl(sc):
    """`builder.set_layers` / `state.set_layers` take the model's impls of this backend only."""
    impl = sc.impl()
    builder = sc.backend.get_builder_cls()(sc.block_size, sc.device)
    state = sc.backend.get_state_cls()(4, 8, sc.block_size, sc.device)
    for target in (builder, state):
        target.set_layers([impl])  # the right kind: accepted
        with pytest.raises(TypeError, match="index 1"):
            target.set_layers([impl, "not an impl"])
    other = pagedattn.get_backend("torch").get_impl_cls()(2, 16, 1.0)
    if sc.backend.get_name() != "torch":
        with pytest.raises(TypeError, match=sc.backend.get_name()):
            builder.set_layers([other])
