"""`impl.forward` checks a layer's cache layout once per cache (tensor and query dtype), then only
each step's block ids: a later bad step is still refused, another cache or query dtype is checked
again, and the layer holds no reference that keeps a dropped pool alive."""

import gc
import weakref

import pytest
import torch

import pagedattn


def _layer(backend_name="torch"):
    Backend = pagedattn.get_backend(backend_name)
    impl = Backend.get_impl_cls()(4, 16, 0.25, 2)
    builder = Backend.get_builder_cls()(4, "cpu")
    cache = torch.zeros(Backend.get_kv_cache_shape(8, 4, 2, 16))
    return Backend, impl, builder, cache


def _step(builder, table):
    return builder.build([pagedattn.ScheduledSeq(seq_len=6, query_len=6, block_table=table)])


def test_bad_steps_and_caches_are_still_refused_after_a_good_one():
    Backend, impl, builder, cache = _layer()
    q, kv = torch.randn(6, 64), torch.randn(6, 32)
    impl.forward(q, kv, kv, cache, _step(builder, [1, 2]))
    with pytest.raises(IndexError, match="block ids in \\[0, 8\\)"):
        impl.forward(q, kv, kv, cache, _step(builder, [1, 8]))
    with pytest.raises(TypeError, match="kv_cache dtype"):
        impl.forward(q.half(), kv.half(), kv.half(), cache, _step(builder, [1, 2]))
    wrong = torch.zeros(Backend.get_kv_cache_shape(8, 4, 2, 8))  # another cache: checked again
    with pytest.raises(ValueError, match="kv_cache shape"):
        impl.forward(q, kv, kv, wrong, _step(builder, [1, 2]))


def test_a_dropped_pool_is_freed():
    _, impl, builder, cache = _layer()
    q, kv = torch.randn(6, 64), torch.randn(6, 32)
    impl.forward(q, kv, kv, cache, _step(builder, [1, 2]))
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None
