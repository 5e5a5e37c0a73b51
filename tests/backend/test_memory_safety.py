"""Memory safety of a step: block ids outside the pool are refused before anything is written,
padding rows made by `advance_step` write nothing, and impossible cache geometries are refused.

Every backend, through the public contract only (API.md sections 1-3).
"""

import re

import pytest
import torch

import pagedattn
from cases import Shape, make_scenario, refusal_guard, small_head_size
from paged_batch import CacheLayout, cache_values, make_garbage_cache, raw_bits, slot_of

AT = pagedattn.AttentionType
NUM_BLOCKS, BS, HQ, HKV = 7, 4, 4, 2
BAD_IDS = {"num_blocks": NUM_BLOCKS, "num_blocks+2": NUM_BLOCKS + 2, "1e6": 10 ** 6}


def _pool(backend, device, dtype, kv_cache_dtype, head_size):
    """A junk-filled pool of NUM_BLOCKS blocks in the backend's layout."""
    layout = CacheLayout(backend, NUM_BLOCKS, BS, HKV, head_size)
    cache_dtype = pagedattn.kv_cache_dtype(kv_cache_dtype, dtype)
    return make_garbage_cache(layout.shape, cache_dtype, device, torch.Generator().manual_seed(5))


def _randn(device, dtype, *shape):
    return torch.randn(*shape).to(dtype).to(device)


def _assert_refused(call, bad: int, cache: torch.Tensor) -> None:
    """`call()` raises IndexError naming `bad` and the pool size, and leaves `cache` as it was."""
    before = cache.clone()
    with pytest.raises(IndexError) as info:
        call()
    msg = str(info.value)
    for what, n in (("block id", bad), ("pool size", NUM_BLOCKS)):
        assert re.search(rf"\b{n}\b", msg), f"the error should name the {what} {n}: {msg!r}"
    changed = int((raw_bits(cache) != raw_bits(before)).sum())
    assert changed == 0, f"a refused step wrote the cache ({changed} bytes changed)"


# (seq_len, query_len, block table) per sequence; BAD stands for the out-of-range block id
DECODER_STEPS = {
    "prefill": [(6, 6, [0, "BAD"])],                    # writes into the bad block
    "decode": [(6, 1, ["BAD", 1])],                     # reads it; writes a good slot
    "mixed": [(3, 3, [2]), (6, 1, [3, "BAD"])],         # the decode writes into it
    "mixed_read": [(3, 3, [2]), (7, 1, ["BAD", 4])],    # the decode reads it
}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("bad", list(BAD_IDS.values()), ids=list(BAD_IDS))
@pytest.mark.parametrize("step", list(DECODER_STEPS))
def test_block_id_outside_the_pool_is_refused(backend, device, model_dtype, step, bad,
                                              kv_cache_dtype):
    d = small_head_size(backend)
    cache = _pool(backend, device, model_dtype, kv_cache_dtype, d)
    seqs = [pagedattn.ScheduledSeq(n, q, [bad if b == "BAD" else b for b in table])
            for n, q, table in DECODER_STEPS[step]]
    md = backend.get_builder_cls()(BS, device).build(seqs)
    with refusal_guard(backend, f"kv_cache_dtype={kv_cache_dtype}, head_size={d}"):
        impl = backend.get_impl_cls()(HQ, d, d ** -0.5, HKV, kv_cache_dtype=kv_cache_dtype)
    t = sum(q for _, q, _ in DECODER_STEPS[step])
    q, k, v = (_randn(device, model_dtype, t, h * d) for h in (HQ, HKV, HKV))
    _assert_refused(lambda: impl.forward(q, k, v, cache, md), bad, cache)


@pytest.mark.parametrize("bad", list(BAD_IDS.values()), ids=list(BAD_IDS))
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_cross_block_id_outside_the_pool_is_refused(backend, device, model_dtype, phase, bad):
    """ENCODER_DECODER: the prefill writes the encoder's K/V through `cross_block_table`, the
    decode reads them back through it; a bad id there is refused the same way."""
    d = small_head_size(backend)
    cross_cache = _pool(backend, device, model_dtype, "auto", d)
    encoder_len = 6
    if phase == "prefill":
        seq = pagedattn.ScheduledSeq(3, 3, [0], encoder_len=encoder_len,
                                     cross_block_table=[1, bad])
    else:
        seq = pagedattn.ScheduledSeq(4, 1, [0], encoder_len=encoder_len,
                                     cross_block_table=[bad, 1])
    with refusal_guard(backend, "attn_type=ENCODER_DECODER"):
        impl = backend.get_impl_cls()(HQ, d, d ** -0.5, HKV, attn_type=AT.ENCODER_DECODER)
    md = backend.get_builder_cls()(BS, device).build([seq])
    q = _randn(device, model_dtype, seq.query_len, HQ * d)
    if phase == "prefill":
        k, v = (_randn(device, model_dtype, encoder_len, HKV * d) for _ in range(2))
    else:
        k = v = None
    _assert_refused(lambda: impl.forward(q, k, v, cross_cache, md), bad, cross_cache)


def test_advance_step_padding_row_writes_nothing(backend, device, model_dtype):
    """Without graph padding, `advance_step(num_queries=B-1)` makes the last row padding: its
    slot becomes -1 and the next forward writes only the real rows' new slots."""
    shape = Shape("decodes", ((3, 1), (6, 1), (9, 1)), block_size=4)
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype,
                       head_size=small_head_size(backend), seed=91, lookahead=1)
    b = len(shape.lens)
    impl = sc.impl()
    md = sc.build()
    if not hasattr(md, "advance_step"):
        assert backend is not pagedattn.get_backend("torch")
        pytest.skip(f"{backend.get_name()} metadata has no advance_step")
    sc.forward(impl, md)  # step 0 writes every sequence's token at position context_len
    tokens = torch.zeros(b, dtype=torch.int64, device=device)
    positions = torch.tensor([c for c, _ in shape.lens], dtype=torch.int64, device=device)
    sampled = torch.ones(b - 1, 1, dtype=torch.int64, device=device)
    md.advance_step(tokens, positions, sampled, shape.block_size, num_seqs=b, num_queries=b - 1)
    new_slots = [slot_of(t, c + 1, shape.block_size)
                 for t, (c, _) in zip(sc.block_tables[:b - 1], shape.lens)]
    assert md.slot_mapping.cpu().tolist() == new_slots + [-1]

    q, k, v = (_randn(device, model_dtype, b, h, sc.head_size)
               for h in (sc.num_heads, sc.num_kv_heads, sc.num_kv_heads))
    expected = sc.kv_cache.clone()
    for which, x, scale in ((0, k, sc.k_scale), (1, v, sc.v_scale)):
        stored, _ = cache_values(x.cpu(), sc.cache_dtype, scale)
        for i, slot in enumerate(new_slots):
            sc.layout.slot(expected, which, slot).copy_(stored[i])
    sc.forward(impl, md, query=q, key=k, value=v)
    changed = raw_bits(sc.kv_cache) != raw_bits(expected)
    assert not bool(changed.any()), (
        f"{int(changed.sum())} bytes of the pool differ from the real rows' writes "
        f"(the padding row wrote somewhere)")


@pytest.mark.parametrize("args", [
    (4, 0, 2, 16), (4, -1, 2, 16), (-1, 16, 2, 16), (4, 16, 0, 16), (4, 16, -2, 16),
    (4, 16, 2, 0), (4, 16, 2, -8),
], ids=["block_size=0", "block_size<0", "num_blocks<0", "kv_heads=0", "kv_heads<0",
        "head_size=0", "head_size<0"])
def test_impossible_cache_geometry_is_refused(backend, args):
    with pytest.raises(ValueError):
        backend.get_kv_cache_shape(*args)
