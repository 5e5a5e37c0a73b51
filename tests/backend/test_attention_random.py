"""Random batches against the oracle (hypothesis): lengths, block size, heads and options.

25 examples per backend; 8 (derandomised, like the 25) when the kernels run interpreted (the
CPU), where one example costs seconds, on each of the three backends that run our kernels.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import INTERPRETED, Shape, alibi_slopes_for, make_scenario

HEADS = [(2, 1), (4, 4), (6, 2), (8, 1), (4, 2)]


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 8, 16]))
    prefills = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(2, 24)), max_size=3))
    prompts = draw(st.lists(st.tuples(st.just(0), st.integers(1, 30)), max_size=2))
    decodes = draw(st.lists(st.tuples(st.integers(1, 70), st.just(1)), max_size=4))
    lens = tuple(prefills + prompts + decodes)
    if not lens:
        lens = ((draw(st.integers(1, 50)), 1),)
    hq, hkv = draw(st.sampled_from(HEADS))
    shape = Shape("random", lens, num_heads=hq, num_kv_heads=hkv, block_size=block_size,
                  slack_blocks=draw(st.integers(0, 1)))
    opts = {}
    if draw(st.booleans()):
        opts["sliding_window"] = draw(st.integers(1, 40))
    if draw(st.booleans()):
        opts["alibi_slopes"] = alibi_slopes_for(hq)
    if draw(st.booleans()):
        opts["logits_soft_cap"] = draw(st.sampled_from([2.0, 20.0]))
    if draw(st.booleans()):
        opts["scale"] = draw(st.sampled_from([0.05, 0.3]))
    return dict(shape=shape, opts=opts,
                head_size=draw(st.sampled_from([32, 64])),
                kv_cache_dtype=draw(st.sampled_from(["auto", "auto", "fp8_e4m3", "fp8_e5m2"])),
                window_in_builder=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=8 if INTERPRETED else 25, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=batches())
def test_random_batches(backend, device, model_dtype, case):
    opts = case["opts"]
    window = opts.get("sliding_window") if case["window_in_builder"] else None
    try:
        sc = make_scenario(backend, case["shape"], head_size=case["head_size"], device=device,
                           dtype=model_dtype, kv_cache_dtype=case["kv_cache_dtype"],
                           seed=case["seed"])
        out = sc.run(builder_window=window, **opts)
    except pytest.skip.Exception:
        return  # a non-reference backend refused this mix at construction; torch never does
    sc.check(out, **opts)
    if window is None:
        sc.check_cache_writes()
    else:
        sc.check_spare_blocks_untouched()
