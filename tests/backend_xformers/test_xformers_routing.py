"""Which provider runs each part of a step, exercised on the CPU: with xFormers' device check
lifted, the backend builds every part's plan (operator, bias, inputs) as on a GPU, xFormers'
operator refuses the CPU tensors with its own reason, and our kernels give the oracle's answer.
The operator call itself needs a GPU (tests/backend --backend xformers --device cuda)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cases import Shape, alibi_slopes_for, make_scenario, shapes  # noqa: E402
from pagedattn.backends import xformers_fmha  # noqa: E402
from pagedattn.backends.xformers_backend import XFormersBackend  # noqa: E402

OPTIONS = {"plain": {}, "window": {"sliding_window": 7}, "alibi": {"alibi": True}}
# fresh prompts (their keys are the step's: cutlassF's block-diagonal biases) and decodes
FRESH = Shape("fresh_and_decodes", ((0, 9), (0, 20), (0, 1), (5, 1), (40, 1)), block_size=8)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("shape", [*shapes("mixed", "block_size_5"), FRESH], ids=str)
def test_every_part_is_planned_and_refused_on_cpu(shape, option, monkeypatch):
    pytest.importorskip("xformers.ops.fmha.attn_bias",
                        reason="xformers is not installed (pip install --no-deps xformers==0.0.35)")
    from xformers.ops import fmha

    ops = {role: tuple(getattr(fmha, name).FwOp for name in names) for role, names in xformers_fmha.ROLES.items()}
    monkeypatch.setattr(xformers_fmha, "choose", lambda device_type: xformers_fmha.Fmha(fmha, "xformers", ops))
    sc = make_scenario(XFormersBackend, shape, dtype=torch.float32, head_size=16)
    opts = dict(OPTIONS[option])
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = alibi_slopes_for(shape.num_heads)
    impl = sc.impl(**opts)
    md = sc.build()
    out = sc.forward(impl, md)
    sc.check(out, **opts)
    plans = [p for part in (md.prefill_metadata, md.decode_metadata) for p in part.xformers_plans.values()]
    assert len(plans) == 2, "expected one plan per part of the step"
    fresh = all(c == 0 for c, q in shape.lens if q > 1 or c == 0)
    for i, plan in enumerate(plans):  # prefill part, then decode part
        assert plan.op is None, plan
        over_step_rows = fresh and i == 0
        if option == "plain" or over_step_rows:
            assert "device=cpu" in plan.why_not, plan  # xFormers' operator's own refusal
        else:
            assert "over the paged cache" in plan.why_not, plan


@pytest.mark.parametrize("option", ["sinks", "lse", "two_sided_window"])
def test_what_xformers_lacks_runs_on_our_kernels(option, monkeypatch):
    """Attention sinks and windows of bidirectional attention are planned onto our kernels with
    the reason; a call that asks for the LSE goes there without a plan."""
    pytest.importorskip("xformers.ops.fmha.attn_bias",
                        reason="xformers is not installed (pip install --no-deps xformers==0.0.35)")
    from xformers.ops import fmha

    import pagedattn

    ops = {role: tuple(getattr(fmha, name).FwOp for name in names) for role, names in xformers_fmha.ROLES.items()}
    monkeypatch.setattr(xformers_fmha, "choose", lambda device_type: xformers_fmha.Fmha(fmha, "xformers", ops))
    shape = FRESH if option == "two_sided_window" else shapes("mixed")[0]
    sc = make_scenario(XFormersBackend, shape, dtype=torch.float32, head_size=16)
    opts = {"sinks": dict(sinks=[1.0, -1.0, 0.5, 2.0]), "lse": {},
            "two_sided_window": dict(sliding_window=(3, 2), attn_type=pagedattn.AttentionType.ENCODER_ONLY)}[option]
    impl = sc.impl(**opts)
    md = sc.build()
    if option == "two_sided_window":
        q, k, v = (x.reshape(x.shape[0], -1) for x in (sc.query, sc.key, sc.value))
        impl.forward(q, k, v, sc.kv_cache, md)
        (plan,) = md.xformers_plans.values()
        assert plan.op is None and "bidirectional" in plan.why_not, plan
        return
    if option == "lse":
        q, k, v = (x.reshape(x.shape[0], -1) for x in (sc.query, sc.key, sc.value))
        out, _ = impl.forward(q, k, v, sc.kv_cache, md, return_lse=True)
        sc.check(out)
        assert not any(m.xformers_plans for m in (md.prefill_metadata, md.decode_metadata)), "planned for xFormers"
        return
    out = sc.forward(impl, md)
    sc.check(out, **opts)
    plans = [p for part in (md.prefill_metadata, md.decode_metadata) for p in part.xformers_plans.values()]
    assert plans and all(p.op is None and "sinks" in p.why_not for p in plans), plans


# ----------------------------------------------------------------------------- on CUDA

# Block sizes xFormers' split-K operator takes (a multiple of its 64-key tile): decodes, a chunk
# over a cached prefix, and fresh prompts (cutlassF where its extension loads).
PAGED_64 = [Shape("decodes_block64", ((37, 1), (200, 1), (64, 1), (1, 1)), num_heads=8, num_kv_heads=2,
                  block_size=64),
            Shape("chunk_block128", ((130, 20), (0, 40), (300, 1)), num_heads=4, num_kv_heads=4, block_size=128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", PAGED_64, ids=str)
def test_operators_that_run_take_their_parts_on_cuda(shape, dtype, device):
    if device.type != "cuda":
        pytest.skip("xFormers' operators run on CUDA only; pass --device cuda")
    fmha = xformers_fmha.choose("cuda")
    print(f"xFormers fmha on this machine: {fmha.describe()}")
    sc = make_scenario(XFormersBackend, shape, dtype=dtype, device=device, head_size=128)
    impl = sc.impl()
    md = sc.build()
    out = sc.forward(impl, md)
    sc.check(out)
    plans = {part: p for part, m in (("prefill", md.prefill_metadata), ("decode", md.decode_metadata))
             if m is not None for p in m.xformers_plans.values()}
    if fmha.module is None:
        assert not plans, plans  # every part ran on our kernels (checked above)
        return
    # the decode part (paged cache, blocks a multiple of 64) goes to triton_splitKF where it runs
    if fmha.runs("paged"):
        assert plans["decode"].op is not None and plans["decode"].op.NAME == "triton_splitKF", plans
    else:
        assert plans["decode"].op is None, plans


def test_fresh_prompts_take_the_step_operator_on_cuda(device):
    """Fresh prompts over the step's K/V go to the first step operator that takes them (FA2 in
    MSLK on the H100), GQA and a sliding window included."""
    if device.type != "cuda":
        pytest.skip("xFormers' operators run on CUDA only; pass --device cuda")
    fmha = xformers_fmha.choose("cuda")
    if not fmha.runs("step"):
        pytest.skip(f"no step operator runs here: {fmha.describe()}")
    shape = Shape("fresh", ((0, 37), (0, 130), (0, 1)), num_heads=8, num_kv_heads=2, block_size=16)
    for opts in ({}, {"sliding_window": 16}, {"alibi_slopes": alibi_slopes_for(8)}):
        sc = make_scenario(XFormersBackend, shape, dtype=torch.bfloat16, device=device, head_size=128)
        impl = sc.impl(**opts)
        md = sc.build()
        sc.check(sc.forward(impl, md), **opts)
        plans = list(md.prefill_metadata.xformers_plans.values())
        assert len(plans) == 1 and plans[0].op is not None, (opts, plans)
        assert plans[0].op in fmha.ops["step"]
