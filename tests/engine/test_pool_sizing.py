"""The KV pool sized from memory when `num_kv_blocks` is not given: on CUDA by profiling the
largest step (the path every engine built without `num_kv_blocks` takes there), on the CPU from
`cpu_kv_cache_gib`; refused with the numbers when one full-length request cannot fit."""

from __future__ import annotations

import pytest
import torch

from pagedattn.engine.sampling_params import SamplingParams

from .conftest import engine_factory, random_prompts


@pytest.fixture
def make_sized_engine(loaded, device, backend_name):
    return engine_factory(loaded, device, backend_name, num_kv_blocks=None)


def test_pool_sized_from_memory_holds_a_full_request(make_sized_engine):
    engine = make_sized_engine()
    runner = engine.runner
    assert runner.num_blocks >= runner.max_blocks_per_seq
    [out] = engine.generate(random_prompts((9,)), [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    assert out.error is None and len(out.outputs[0].token_ids) == 4


def test_profiled_step_runs_before_the_caches_exist(make_sized_engine, monkeypatch):
    """The CUDA profile (the largest step, on empty caches) runs on any device with the CUDA
    memory queries faked: it must not need the pool it is sizing."""
    engine = make_sized_engine()
    runner = engine.runner
    if runner.device.type != "cuda":
        gib = 1 << 30
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: {
            "allocated_bytes.all.peak": 3 * gib, "allocated_bytes.all.current": gib})
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (60 * gib, 80 * gib))
    del runner.kv_caches  # as when the runner is being built
    free = runner.pool_sizer.profile_free_bytes(0.9)
    if runner.device.type != "cuda":
        assert free == pytest.approx(80 * 0.9 * (1 << 30) - 20 * (1 << 30) - 2 * (1 << 30))


def test_pool_too_small_for_one_request_is_refused(make_sized_engine):
    with pytest.raises(ValueError, match="expected the KV pool to hold one request of max_model_len"):
        make_sized_engine(cpu_kv_cache_gib=1e-6, gpu_memory_utilization=0.0001)
