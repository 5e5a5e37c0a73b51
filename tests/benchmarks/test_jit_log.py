"""CompileLog installs Triton's JIT hooks for its block only and records what they report."""

import pytest

from pagedattn.benchmarks.jit_log import CompileLog


def test_hooks_are_restored_and_events_recorded():
    knobs = pytest.importorskip("triton").knobs
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    with CompileLog() as log:
        assert log.available
        key, fn = ("k",), type("Fn", (), {"name": "_paged_attention_kernel"})()
        assert knobs.runtime.jit_cache_hook(key=key, fn=fn, repr="", compile={}) is False
        knobs.runtime.jit_post_compile_hook(key=key, fn=fn, repr="", compile={})
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
    assert [e[0] for e in log.events] == ["_paged_attention_kernel"]
    assert log.summary()["kernels"] == {"_paged_attention_kernel": 1} and log.summary()["count"] == 1
