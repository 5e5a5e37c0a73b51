"""CUDA graphs through the backend's AttentionState: capture a decode step at a batch size,
replay it with other lengths and block tables, and compare with eager execution.

The protocol (API.md section 5) is graph_harness.DecodeGraph's.
"""

from __future__ import annotations

import random

import pytest
import torch

import pagedattn
from cases import refusal_guard
from graph_harness import DecodeGraph

pytestmark = pytest.mark.cuda_only

HQ, HKV, D, BLOCK = 8, 2, 128, 16
MAX_BATCH, MAX_BLOCKS = 32, 24


def _real_step(backend, device, batch: int, pool: int, rng: random.Random):
    """A decode-only batch of `batch` sequences of random lengths over shuffled blocks."""
    ids = list(range(pool))
    rng.shuffle(ids)
    seqs = []
    for _ in range(batch):
        seq_len = rng.randint(2, MAX_BLOCKS * BLOCK)
        n = -(-seq_len // BLOCK)
        seqs.append(pagedattn.ScheduledSeq(seq_len, 1, [ids.pop() for _ in range(n)]))
    builder = backend.get_builder_cls()(BLOCK, device)
    return builder.build(seqs, cuda_graph_pad_to=batch)


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_replay_with_new_lengths_equals_eager(backend, device, batch, kv_cache_dtype):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need --device cuda")
    rng = random.Random(batch)
    dtype = torch.bfloat16
    pool = MAX_BATCH * MAX_BLOCKS + 8
    with refusal_guard(backend, f"kv_cache_dtype={kv_cache_dtype}, head_size={D}"):
        impl = backend.get_impl_cls()(HQ, D, D**-0.5, HKV, kv_cache_dtype=kv_cache_dtype,
                                      logits_soft_cap=30.0)
    cache_dtype = pagedattn.kv_cache_dtype(kv_cache_dtype, dtype)
    kv_cache = (torch.randn(backend.get_kv_cache_shape(pool, BLOCK, HKV, D), device=device)
                * 0.5).to(cache_dtype)
    k_scale = torch.tensor(0.7, device=device)
    v_scale = torch.tensor(1.3, device=device)

    state = backend.get_state_cls()(MAX_BATCH, MAX_BLOCKS, BLOCK, device)
    with state.graph_capture(MAX_BATCH):
        graph = DecodeGraph(state, impl, kv_cache, batch, num_heads=HQ, num_kv_heads=HKV,
                            head_size=D, dtype=dtype, k_scale=k_scale, v_scale=v_scale)

    for _ in range(3):
        real = _real_step(backend, device, batch, pool, rng)
        q = torch.randn(batch, HQ * D, device=device, dtype=dtype)
        k = torch.randn(batch, HKV * D, device=device, dtype=dtype)
        v = torch.randn(batch, HKV * D, device=device, dtype=dtype)
        eager_cache = kv_cache.clone()
        expected = impl.forward(q, k, v, eager_cache, real, k_scale, v_scale)
        out = graph.replay(real, q, k, v)
        torch.cuda.synchronize()
        assert not out.isnan().any(), "the replay left rows unwritten"
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        assert torch.equal(kv_cache.view(torch.uint8), eager_cache.view(torch.uint8)), (
            "the replay wrote other slots")
