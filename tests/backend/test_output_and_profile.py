"""Caller-owned `output=` and the memory-profiling call with an empty cache."""

import pytest
import torch

from cases import KERNEL_GRID, grid, make_scenario, shapes
from oracle import tolerance_for


@pytest.mark.parametrize("shape", grid(shapes("mixed", "many_decodes"), kernel_grid=shapes("many_decodes")))
def test_output_is_written_in_place(backend, device, model_dtype, shape):
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype, seed=30)
    poisoned = torch.full((sc.num_tokens, sc.num_heads * sc.head_size), float("nan"),
                          dtype=sc.dtype, device=device)
    ptr = poisoned.data_ptr()
    out = sc.forward(sc.impl(), sc.build(), output=poisoned)
    assert out.data_ptr() == ptr, "the result must be written into `output`, not a new tensor"
    assert poisoned.data_ptr() == ptr
    assert bool(torch.isfinite(poisoned).all()), "some rows of `output` were never written"
    sc.check(poisoned)
    sc.check_cache_writes()


def test_output_matches_fresh_result(backend, device, model_dtype):
    sc = make_scenario(backend, shapes("mixed")[0], device=device, dtype=model_dtype, seed=31)
    fresh = sc.run()
    sc.reset_cache()
    buf = torch.full_like(fresh, 1e4)
    sc.forward(sc.impl(), sc.build(), output=buf)
    tol = tolerance_for(sc.dtype).atol / 100
    torch.testing.assert_close(buf, fresh, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("lens", [pytest.param(((0, 40), (0, 7), (0, 1)), id="three_prompts"),
                                  pytest.param(((0, 300),), id="one_prompt", marks=KERNEL_GRID)])
def test_profiling_call_with_empty_cache(backend, device, model_dtype, lens, kv_cache_dtype):
    """A profile run passes a cache with numel 0: no store, plain causal prefill."""
    from cases import Shape

    shape = Shape("profile", lens)
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype,
                       kv_cache_dtype=kv_cache_dtype, seed=32)
    empty = torch.empty(0, dtype=sc.cache_dtype, device=device)
    out = sc.forward(sc.impl(), sc.build(), kv_cache=empty)
    assert empty.numel() == 0
    # no context, so the new tokens are the whole sequence; an FP8 backend may read them raw
    sc.check(out)
    assert torch.equal(sc.kv_cache.view(torch.uint8), sc.initial_cache.view(torch.uint8))
