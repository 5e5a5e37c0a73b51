"""Planning happens in `build` (and `State.begin_forward`), running in `forward`: a layer told its
query dtype is planned by the builder from its first step, and `forward` plans nothing."""

from __future__ import annotations

import pytest
import torch

from cases import make_scenario, shapes
from pagedattn.backends import flashinfer_plan
from pagedattn.backends.flashinfer_plan import Role

MIXED = shapes("mixed")[0]


@pytest.fixture
def no_planning_in_forward(monkeypatch):
    """Makes any `Plans.plan` call fail; returns a function that re-allows it."""
    original = flashinfer_plan.Plans.plan

    def refuse(self, *args, **kwargs):
        raise AssertionError("planned inside forward")

    def forbid():
        monkeypatch.setattr(flashinfer_plan.Plans, "plan", refuse)

    yield forbid
    monkeypatch.setattr(flashinfer_plan.Plans, "plan", original)


def test_first_step_is_planned_by_build(fi, cuda, no_planning_in_forward):
    sc = make_scenario(fi, MIXED, head_size=128, dtype=torch.bfloat16, device=cuda, seed=5)
    impl = sc.impl(sliding_window=23, logits_soft_cap=10.0)  # declares bf16 queries
    md = sc.build(layers=[impl])
    spec = impl.spec(torch.bfloat16)
    assert md.prefill_metadata.plans.get(Role.PREFILL, spec) is not None
    assert md.decode_metadata.plans.get(Role.DECODE, spec) is not None
    no_planning_in_forward()
    out = sc.forward(impl, md)
    sc.check(out, sliding_window=23, logits_soft_cap=10.0)


def test_undeclared_layer_plans_on_its_first_step_only(fi, cuda, no_planning_in_forward):
    sc = make_scenario(fi, MIXED, head_size=128, dtype=torch.bfloat16, device=cuda, seed=6)
    impl = fi.get_impl_cls()(sc.num_heads, sc.head_size, 0.3, sc.num_kv_heads)  # never told its dtype
    builder = sc.builder()  # the layer is not given to set_layers
    sc.check(sc.forward(impl, builder.build(sc.seqs)), scale=0.3)  # planned in forward, as the fallback
    sc.reset_cache()
    md = builder.build(sc.seqs)  # now the builder knows the layer's spec
    no_planning_in_forward()
    sc.check(sc.forward(impl, md), scale=0.3)


def test_declared_dtype_is_checked(fi):
    impl = fi.get_impl_cls()(8, 128, 0.1, 2)
    with pytest.raises(TypeError, match="query dtype"):
        impl.set_query_dtype(torch.float32)
