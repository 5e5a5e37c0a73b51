"""Decoder self-attention over the named batch shapes, against the dense oracle.

The grid is cut to stay fast on a CPU: every shape at D=64 fp32, every head size on two
shapes, every dtype on three. Each run also checks that the step's K/V landed in their slots
and that nothing else in the pool (spare blocks included) changed.
"""

import pytest
import torch

from cases import make_scenario, shapes
from oracle import DTYPES

HEAD_SIZES = [64, 80, 96, 128, 256]


def _run_and_check(sc):
    out = sc.run()
    sc.check(out)
    sc.check_cache_writes()
    sc.check_spare_blocks_untouched()


@pytest.mark.parametrize("shape", shapes(), ids=str)
def test_catalogue(backend, device, model_dtype, shape):
    """Every named shape at D=64 in the default dtype (fp32 unless the backend refuses it)."""
    _run_and_check(make_scenario(backend, shape, head_size=64, device=device, dtype=model_dtype))


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("shape", shapes("mixed", "gqa_8to1", "many_decodes"), ids=str)
def test_head_sizes(backend, device, model_dtype, shape, head_size):
    _run_and_check(make_scenario(backend, shape, head_size=head_size, device=device,
                                 dtype=model_dtype, seed=1))


@pytest.mark.parametrize("dtype", [DTYPES["fp16"], DTYPES["bf16"]], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", shapes("mixed", "single_decode", "chunked_prefill",
                                         "block_boundaries", "gqa_8to1"), ids=str)
def test_half_dtypes(backend, device, shape, dtype):
    _run_and_check(make_scenario(backend, shape, head_size=128, dtype=dtype, device=device,
                                 seed=2))


def test_query_as_three_dims(backend, device, model_dtype):
    """query may be [T, Hq, D]; the result is [T, Hq*D] either way."""
    sc = make_scenario(backend, shapes("mixed")[0], device=device, dtype=model_dtype, seed=3)
    md = sc.build()
    out = sc.impl().forward(sc.query, sc.key.flatten(1), sc.value.flatten(1), sc.kv_cache, md,
                            k_scale=1.0, v_scale=1.0)
    sc.check(out)


def test_key_value_as_views_of_fused_qkv(backend, device, model_dtype):
    """Models split one fused qkv projection: key/value are strided views, not copies."""
    sc = make_scenario(backend, shapes("mixed")[0], device=device, dtype=model_dtype, seed=4)
    hq, hkv, d = sc.num_heads, sc.num_kv_heads, sc.head_size
    qkv = torch.cat([sc.query.flatten(1), sc.key.flatten(1), sc.value.flatten(1)], dim=1)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    assert not k.is_contiguous()
    out = sc.impl().forward(q, k, v, sc.kv_cache, sc.build(), k_scale=1.0, v_scale=1.0)
    sc.check(out)
    sc.check_cache_writes()


def test_same_metadata_serves_every_layer(backend, device, model_dtype):
    """One build per step, shared by all layers: two layers' caches, one metadata."""
    a = make_scenario(backend, shapes("mixed")[0], device=device, dtype=model_dtype, seed=5)
    b = make_scenario(backend, shapes("mixed")[0], device=device, dtype=model_dtype, seed=5,
                      data_seed=6)
    assert a.block_tables == b.block_tables and not torch.equal(a.query, b.query)
    md = a.build()
    impl = a.impl()
    for sc in (a, b, a):
        sc.reset_cache()
        out = sc.forward(impl, md)
        sc.check(out)
