"""CUDA-graph decode: capture at batch sizes 1/8/32, replay with other lengths and tables, and
compare with eager execution (and the step's cache writes); also multi-step replay."""

from __future__ import annotations

import pytest
import torch

import pagedattn
from graph_harness import DecodeGraph

BLOCK_SIZE = 16
MAX_BLOCKS = 12  # 192 tokens per sequence
MAX_BATCH = 32


def _random_seqs(g, n, num_blocks, lookahead=0):
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs, at = [], 0
    for _ in range(n):
        seq_len = int(torch.randint(2, MAX_BLOCKS * BLOCK_SIZE - lookahead, (1,), generator=g))
        need = -(-(seq_len + lookahead) // BLOCK_SIZE)
        seqs.append(pagedattn.ScheduledSeq(seq_len, 1, perm[at:at + need]))
        at += need
    return seqs


def _setup(fi, cuda, g, hq, hkv, d, dtype):
    """(num_blocks, a random cache, impl, graph state, builder) of one graph test."""
    num_blocks = MAX_BATCH * MAX_BLOCKS + 8
    kv_cache = torch.randn(fi.get_kv_cache_shape(num_blocks, BLOCK_SIZE, hkv, d), generator=g).to(dtype).to(cuda)
    impl = fi.get_impl_cls()(hq, d, 0.1, hkv)
    state = fi.get_state_cls()(MAX_BATCH, MAX_BLOCKS, BLOCK_SIZE, cuda)
    return num_blocks, kv_cache, impl, state, fi.get_builder_cls()(BLOCK_SIZE, cuda)


def _step_qkv(g, real, hq, hkv, d, dtype, cuda):
    """A decode step's q [real, hq, d] and k, v [real, hkv, d]."""
    return tuple(torch.randn(real, h, d, generator=g).to(dtype).to(cuda) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4_tensor_cores", "mha_cuda_cores"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_graph_replay_with_new_lengths_equals_eager(fi, cuda, heads, dtype):
    hq, hkv, d = *heads, 128
    g = torch.Generator().manual_seed(0)
    num_blocks, kv_cache, impl, state, builder = _setup(fi, cuda, g, hq, hkv, d, dtype)
    with state.graph_capture(MAX_BATCH):
        graphs = {b: DecodeGraph(state, impl, kv_cache, b, num_heads=hq, num_kv_heads=hkv,
                                 head_size=d, dtype=dtype) for b in (32, 8, 1)}
    for b, graph in graphs.items():
        for real in sorted({b, max(1, b - 3)}):
            for _ in range(2):  # replays with different lengths and tables
                seqs = _random_seqs(g, real, num_blocks)
                q, k, v = _step_qkv(g, real, hq, hkv, d, dtype, cuda)
                eager_cache = kv_cache.clone()
                eager = impl.forward(q, k, v, eager_cache, builder.build(seqs))
                out = graph.replay(builder.build(seqs, cuda_graph_pad_to=b), q, k, v)
                torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2,
                                           msg=lambda m: f"batch {b} ({real} real): {m}")
                assert torch.equal(kv_cache, eager_cache), f"batch {b}: the graph wrote other cache entries"


def test_graph_replay_after_advance_step(fi, cuda):
    """Multi-step decoding: advance the real metadata on the device, re-plan, replay."""
    hq, hkv, d, dtype, b, real = 8, 2, 128, torch.bfloat16, 8, 6
    g = torch.Generator().manual_seed(1)
    num_blocks, kv_cache, impl, state, builder = _setup(fi, cuda, g, hq, hkv, d, dtype)
    with state.graph_capture(MAX_BATCH):
        graph = DecodeGraph(state, impl, kv_cache, b, num_heads=hq, num_kv_heads=hkv,
                            head_size=d, dtype=dtype)
    seqs = _random_seqs(g, real, num_blocks, lookahead=4)
    md = builder.build(seqs, cuda_graph_pad_to=b)
    tokens = torch.zeros(b, dtype=torch.int64, device=cuda)
    positions = torch.tensor([s.seq_len - 1 for s in seqs] + [0] * (b - real), device=cuda)
    for step in range(4):
        q, k, v = _step_qkv(g, real, hq, hkv, d, dtype, cuda)
        eager_cache = kv_cache.clone()
        eager = impl.forward(q, k, v, eager_cache, builder.build(seqs))
        out = graph.replay(md, q, k, v)
        torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(kv_cache, eager_cache), f"step {step}: different cache writes"
        md.advance_step(tokens, positions, torch.zeros(real, 1, dtype=torch.int64, device=cuda),
                        BLOCK_SIZE, b, real)
        seqs = [pagedattn.ScheduledSeq(s.seq_len + 1, 1, s.block_table) for s in seqs]
