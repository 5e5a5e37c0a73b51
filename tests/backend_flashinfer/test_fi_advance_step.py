"""advance_step over several steps equals rebuilding: FlashInfer's pages (device and host) and
the attention output, with and without graph padding."""

from __future__ import annotations

import pytest
import torch

import pagedattn

BS = 4
LENS = (3, 6, 15, 8, 31, 1)  # several cross a block boundary within the steps


def _pages(md):
    kv = md.paged_kv
    n = int(kv.indptr[-1])
    return (kv.indptr.tolist(), kv.indices[:n].tolist(), kv.last_page_len.tolist(),
            kv.indptr_host.tolist(), kv.last_page_len_host.tolist())


@pytest.mark.parametrize("pad_to", [None, 8], ids=["no_padding", "graph_padding"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
def test_advance_step_equals_rebuild(fi, cuda, pad_to, heads):
    hq, hkv, d, dtype, steps = *heads, 64, torch.bfloat16, 5
    g = torch.Generator().manual_seed(2)
    tables, at = [], 0
    for n in LENS:
        need = -(-(n + 1 + steps) // BS) + 1
        tables.append(list(range(at, at + need))[::-1])
        at += need
    kv_cache = torch.randn(fi.get_kv_cache_shape(at, BS, hkv, d), generator=g).to(dtype).to(cuda)
    impl = fi.get_impl_cls()(hq, d, 0.125, hkv)
    builder = fi.get_builder_cls()(BS, cuda)
    seq_lens = [n + 1 for n in LENS]
    b = len(LENS)
    num_seqs = pad_to or b

    def build(lens):
        return builder.build([pagedattn.ScheduledSeq(n, 1, t) for n, t in zip(lens, tables)], cuda_graph_pad_to=pad_to)

    md = build(seq_lens)
    tokens = torch.zeros(num_seqs, dtype=torch.int64, device=cuda)
    positions = torch.tensor([n - 1 for n in seq_lens] + [0] * (num_seqs - b), device=cuda)
    for step in range(steps):
        rebuilt = build(seq_lens)
        assert _pages(md) == _pages(rebuilt), f"step {step}: pages differ from a rebuild"
        q = torch.randn(num_seqs, hq, d, generator=g).to(dtype).to(cuda)
        k = torch.randn(num_seqs, hkv, d, generator=g).to(dtype).to(cuda)
        v = torch.randn(num_seqs, hkv, d, generator=g).to(dtype).to(cuda)
        ref_cache = kv_cache.clone()
        out = impl.forward(q, k, v, kv_cache, md)
        ref = impl.forward(q, k, v, ref_cache, rebuilt)
        torch.testing.assert_close(out[:b], ref[:b], atol=1e-3, rtol=1e-3, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(kv_cache, ref_cache), f"step {step}: different cache writes"
        sampled = torch.randint(0, 100, (b, 1), generator=g).to(cuda)
        md.advance_step(tokens, positions, sampled, BS, num_seqs, b)
        seq_lens = [n + 1 for n in seq_lens]
