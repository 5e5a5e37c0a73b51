"""Each impl option against the oracle, and each option must move the output.

API.md section 3: a backend option that changes nothing is a bug (DESIGN.md "Testing"), so
every option is run twice, on and off, on the same scenario. Under the Triton interpreter (the
CPU) the flash_attn and xformers adapters take each option once, the triton backend every value
(`KERNEL_GRID`, conftest.py); on CUDA every backend takes every value.
"""

import pytest
import torch

from cases import GPU_ONLY_GRID, KERNEL_GRID, alibi_slopes_for, grid, make_scenario, shapes
from oracle import assert_outputs_differ, tolerance_for

MIXED = shapes("mixed")[0]


def _on_and_off(sc, **opts):
    """Runs the step with `opts` and without; checks the first against the oracle."""
    on = sc.run(**opts)
    sc.check(on, **{k: v for k, v in opts.items() if k not in ("builder_window",)})
    sc.check_spare_blocks_untouched()
    sc.reset_cache()
    off = sc.run()
    return on, off


@pytest.mark.parametrize("window", grid([1, 3, 16, 40], kernel_grid=[3, 40]))
def test_sliding_window(backend, device, model_dtype, window):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=10)
    on, off = _on_and_off(sc, sliding_window=window, builder_window=window)
    assert_outputs_differ(on, off, 1e-3, f"sliding_window={window}")


@KERNEL_GRID
def test_sliding_window_wider_than_every_sequence_changes_nothing(backend, device, model_dtype):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=11)
    on, off = _on_and_off(sc, sliding_window=10_000, builder_window=10_000)
    tol = tolerance_for(sc.dtype).atol / 10
    torch.testing.assert_close(on, off, atol=tol, rtol=tol)


@KERNEL_GRID
def test_sliding_window_over_long_chunked_prefill(backend, device, model_dtype):
    sc = make_scenario(backend, shapes("chunked_prefill")[0], device=device, dtype=model_dtype,
                       seed=12)
    on, off = _on_and_off(sc, sliding_window=100, builder_window=100)
    assert_outputs_differ(on, off, 1e-3, "sliding_window=100")


@pytest.mark.parametrize("as_tensor", [pytest.param(False, id="list", marks=KERNEL_GRID),
                                       pytest.param(True, id="tensor")])
def test_alibi(backend, device, model_dtype, as_tensor):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=13)
    slopes = alibi_slopes_for(sc.num_heads)
    given = torch.tensor(slopes, dtype=torch.float32, device=device) if as_tensor else slopes
    on = sc.run(alibi_slopes=given)
    sc.check(on, alibi_slopes=slopes)
    sc.reset_cache()
    assert_outputs_differ(on, sc.run(), 1e-3, "alibi_slopes")


def test_alibi_with_gqa(backend, device, model_dtype):
    sc = make_scenario(backend, shapes("gqa_8to1")[0], device=device, dtype=model_dtype, seed=14)
    slopes = alibi_slopes_for(sc.num_heads)
    sc.check(sc.run(alibi_slopes=slopes), alibi_slopes=slopes)


@pytest.mark.parametrize("cap", grid([1.5, 30.0], kernel_grid=[30.0]))
def test_logits_soft_cap(backend, device, model_dtype, cap):
    # a large query magnitude makes the scores large enough that a cap of 30 matters too
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=15)
    sc.query.mul_(8.0 if cap > 10 else 1.0)
    on, off = _on_and_off(sc, logits_soft_cap=cap)
    assert_outputs_differ(on, off, 1e-3, f"logits_soft_cap={cap}")


@pytest.mark.parametrize("with_window", [pytest.param(False, id="full", marks=KERNEL_GRID),
                                         pytest.param(True, id="window")])  # sinks alone: test_sinks_shapes
def test_sinks(backend, device, model_dtype, with_window):
    # gpt-oss: one learnable logit per query head in every softmax's denominator, on full and
    # sliding-window layers; logits of -2..3 against scores of about 0 move every row
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=19)
    sinks = torch.linspace(-2.0, 3.0, sc.num_heads).tolist()
    window = dict(sliding_window=16, builder_window=16) if with_window else {}
    on, off = _on_and_off(sc, sinks=sinks, **window)
    if with_window:
        sc.reset_cache()
        off = sc.run(**window)
    assert_outputs_differ(on, off, 1e-3, "sinks")


def test_sinks_with_soft_cap_and_alibi(backend, device, model_dtype):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=20)
    opts = dict(sinks=[0.5] * sc.num_heads, logits_soft_cap=2.0, alibi_slopes=alibi_slopes_for(sc.num_heads))
    sc.check(sc.run(**opts), **opts)


@pytest.mark.parametrize("shape", grid(shapes("single_decode", "chunked_prefill", "block_size_5"),
                                       kernel_grid=shapes("chunked_prefill")))
def test_sinks_shapes(backend, device, model_dtype, shape):
    """Decode, chunks over a long cached prefix, odd pages (split launches and FP8 caches:
    test_lse_and_merge.py)."""
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype, seed=23)
    sinks = torch.linspace(3.0, -1.0, sc.num_heads).tolist()
    sc.check(sc.run(sinks=sinks), sinks=sinks)


def test_sinks_fp8_decodes(backend, device, model_dtype):
    sc = make_scenario(backend, shapes("many_decodes")[0], device=device, dtype=model_dtype,
                       kv_cache_dtype="fp8_e4m3", seed=24)
    sinks = [2.0, -2.0, 0.5, 1.0]
    on = sc.run(sinks=sinks)
    sc.check(on, sinks=sinks)
    sc.check_cache_writes()
    sc.reset_cache()
    assert_outputs_differ(on, sc.run(), 1e-3, "sinks over an FP8 cache")


@pytest.mark.parametrize("scale", grid([0.3, 0.01], kernel_grid=[0.01]))
def test_custom_scale(backend, device, model_dtype, scale):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=16)
    on, off = _on_and_off(sc, scale=scale)
    assert_outputs_differ(on, off, 1e-3, f"scale={scale}")


@GPU_ONLY_GRID  # our kernels' prefill parts take the scale in test_custom_scale (mixed)
def test_custom_scale_on_long_prefill(backend, device, model_dtype):
    """Prefill kernels must honour the scale too (FlashInfer's prefill once did not)."""
    sc = make_scenario(backend, shapes("long_prefill")[0], device=device, dtype=model_dtype,
                       seed=17)
    sc.check(sc.run(scale=0.5), scale=0.5)


@pytest.mark.parametrize("shape", grid(shapes("mixed", "chunked_prefill"), kernel_grid=shapes("chunked_prefill")))
def test_every_option_at_once(backend, device, model_dtype, shape):
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype, seed=18)
    opts = dict(sliding_window=24, alibi_slopes=alibi_slopes_for(sc.num_heads),
                logits_soft_cap=4.0, scale=0.2)
    sc.check(sc.run(builder_window=24, **opts), **opts)


FP8 = ["fp8", "fp8_e4m3", "fp8_e5m2"]


# each format and each form of the scales once for every adapter, every pair on the triton
# backend; "fp8" is "fp8_e4m3" by another name, so the interpreter runs the pair once
FP8_CELLS = {("fp8", False): (), ("fp8_e5m2", True): (), ("fp8_e4m3", True): KERNEL_GRID,
             ("fp8_e5m2", False): KERNEL_GRID, ("fp8", True): GPU_ONLY_GRID, ("fp8_e4m3", False): GPU_ONLY_GRID}


@pytest.mark.parametrize("kv_cache_dtype, scales_as_tensors", [
    pytest.param(dtype, as_tensor, id=f"{dtype}-{'tensor' if as_tensor else 'float'}",
                 marks=FP8_CELLS[dtype, as_tensor])
    for dtype in FP8 for as_tensor in (False, True)])
def test_fp8_cache(backend, device, model_dtype, kv_cache_dtype, scales_as_tensors):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype,
                       kv_cache_dtype=kv_cache_dtype, seed=19, magnitude=3.0)
    assert sc.k_scale != 1.0 and sc.v_scale != 1.0 and sc.k_scale != sc.v_scale
    out = sc.run(scales_as_tensors=scales_as_tensors)
    sc.check(out)
    sc.check_cache_writes()
    # the same data through an unquantised cache: FP8 must be visible, but small
    ref = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=19, magnitude=3.0)
    assert_outputs_differ(out, ref.run(), 1e-4, f"kv_cache_dtype={kv_cache_dtype}")


@pytest.mark.parametrize("kv_cache_dtype", grid(["fp8_e4m3", "fp8_e5m2"], kernel_grid=["fp8_e5m2"]))
@pytest.mark.parametrize("shape", shapes("single_decode", "chunked_prefill", "block_size_5"),
                         ids=str)
def test_fp8_cache_shapes(backend, device, model_dtype, shape, kv_cache_dtype):
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype,
                       kv_cache_dtype=kv_cache_dtype, seed=20)
    sc.check(sc.run(scales_as_tensors=True))
    sc.check_cache_writes()


def test_fp8_cache_with_bf16_model(backend, device):
    sc = make_scenario(backend, MIXED, device=device, dtype=torch.bfloat16,
                       kv_cache_dtype="fp8_e4m3", head_size=128, seed=21)
    sc.check(sc.run())
    sc.check_cache_writes()


def test_fp8_scale_is_applied(backend, device, model_dtype):
    """Same cache contents, scale doubled: K read back doubles, so the output must move."""
    sc = make_scenario(backend, shapes("many_decodes")[0], device=device, dtype=model_dtype,
                       kv_cache_dtype="fp8_e4m3", seed=22)
    first = sc.run()
    sc.check(first)
    sc.reset_cache()
    sc.v_scale *= 2.0
    sc.hist_v = [h * 2.0 for h in sc.hist_v]
    sc.value.mul_(2.0)  # stores value / (2 v_scale): the same bits as before
    second = sc.run(scales_as_tensors=True)
    sc.check(second)
    assert_outputs_differ(first, second, 1e-2, "v_scale")
