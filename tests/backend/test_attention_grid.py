"""Decoder self-attention over the named batch shapes, against the dense oracle.

The grid: every shape at D=64 fp32, every head size on three shapes, fp16 and bf16 on five.
Under the Triton interpreter (the CPU) flash_attn and xformers, which run the triton backend's
kernel behind their own adapters, take the cells that cover their adapters' paths (fresh
prompts, chunks over a cached prefix, decodes, mixed steps, odd pages, every head size and
dtype once: `KERNEL_GRID` marks the rest), and the triton backend every cell but those whose
kernel path another cell takes (`GPU_ONLY_GRID`; conftest.py); on CUDA every backend takes
every cell. Each run also checks that the step's K/V landed in their slots and that nothing
else in the pool (spare blocks included) changed.
"""

import pytest
import torch

from cases import GPU_ONLY_GRID, KERNEL_GRID, grid, make_scenario, shapes
from oracle import DTYPES

HEAD_SIZES = [64, 80, 96, 128, 256]


def _run_and_check(sc):
    out = sc.run()
    sc.check(out)
    sc.check_cache_writes()
    sc.check_spare_blocks_untouched()


# mha_decode_long: the kernel's long decode, which the adapters hand over as the shorter ones;
# long_prefill: a fresh prompt of many query tiles, which the triton backend reads from the step's
# rows as it does the 300 of test_profiling_call_with_empty_cache[one_prompt]
@pytest.mark.parametrize("shape", grid(shapes(), kernel_grid=shapes("mha_decode_long"),
                                       gpu_only=shapes("long_prefill")))
def test_catalogue(backend, device, model_dtype, shape):
    """Every named shape at D=64 in the default dtype (fp32 unless the backend refuses it)."""
    _run_and_check(make_scenario(backend, shape, head_size=64, device=device, dtype=model_dtype))


def _head_size_cells():
    """mixed (prefill tiles and decode programs in one launch) at every head size on every
    backend; gqa_8to1 and many_decodes at a padded (80) and the largest (256) on the triton
    backend, the rest on CUDA (D=64 of every shape: test_catalogue)."""
    for shape in shapes("mixed", "gqa_8to1", "many_decodes"):
        for d in HEAD_SIZES:
            marks = () if shape.name == "mixed" else KERNEL_GRID if d in (80, 256) else GPU_ONLY_GRID
            yield pytest.param(shape, d, id=f"{shape}-{d}", marks=marks)


@pytest.mark.parametrize("shape, head_size", list(_head_size_cells()))
def test_head_sizes(backend, device, model_dtype, shape, head_size):
    _run_and_check(make_scenario(backend, shape, head_size=head_size, device=device,
                                 dtype=model_dtype, seed=1))


@pytest.mark.parametrize("dtype", [DTYPES["fp16"], DTYPES["bf16"]], ids=["fp16", "bf16"])
# block_boundaries and gqa_8to1 in fp16/bf16: their masks and packing are the fp32 ones (test_catalogue)
@pytest.mark.parametrize("shape", grid(shapes("mixed", "single_decode", "chunked_prefill", "block_boundaries",
                                              "gqa_8to1"),
                                       kernel_grid=shapes("chunked_prefill"),
                                       gpu_only=shapes("block_boundaries", "gqa_8to1")))
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
