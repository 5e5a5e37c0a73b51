"""md.advance_step (multi-step decoding) must equal rebuilding the metadata each step."""

import pytest
import torch

import pagedattn
from cases import KERNEL_GRID, Shape, make_scenario
from oracle import assert_attention_close, dense_attention, tolerance_for

STEPS = 3
# block_size 4: several sequences cross a block boundary during the three steps
DECODES = Shape("advance", ((3, 1), (6, 1), (15, 1), (8, 1), (31, 1)), block_size=4)


def _fresh(sc, seq_lens, pad_to):
    seqs = [pagedattn.ScheduledSeq(n, 1, t) for n, t in zip(seq_lens, sc.block_tables)]
    return sc.build(seqs=seqs, pad_to=pad_to)


# every backend's metadata advances with TritonMetadata.advance_step: padding rows once, on triton
@pytest.mark.parametrize("pad_to", [pytest.param(None, id="no_padding"),
                                    pytest.param(8, id="graph_padding", marks=KERNEL_GRID)])
def test_advance_step_equals_rebuild(backend, device, model_dtype, pad_to):
    sc = make_scenario(backend, DECODES, device=device, dtype=model_dtype, seed=60, lookahead=STEPS)
    b = len(DECODES.lens)
    num_seqs = pad_to or b
    impl = sc.impl()
    hq, hkv, d = sc.num_heads, sc.num_kv_heads, sc.head_size
    g = torch.Generator().manual_seed(61)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    seq_lens = [c + 1 for c, _ in DECODES.lens]
    # dense K/V the oracle reads: history plus every step's new token
    dense_k = [h.clone() for h in sc.hist_k]
    dense_v = [h.clone() for h in sc.hist_v]

    md = _fresh(sc, seq_lens, pad_to)
    advance = getattr(md, "advance_step", None)
    if advance is None:
        assert backend is not pagedattn.get_backend("torch")
        pytest.skip(f"{backend.get_name()} metadata has no advance_step")
    input_tokens = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    input_tokens[:b] = torch.arange(b, device=device) + 100
    input_positions = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    input_positions[:b] = torch.tensor([n - 1 for n in seq_lens], device=device)

    for step in range(STEPS + 1):
        # run this step with the (advanced) metadata and with a rebuilt one; same answer
        q, k, v = (rand(num_seqs, h, d).to(sc.dtype) for h in (hq, hkv, hkv))
        rebuilt = _fresh(sc, seq_lens, pad_to)
        ref_cache = sc.kv_cache.clone()
        out = sc.forward(impl, md, query=q, key=k, value=v)
        out_rebuilt = sc.forward(impl, rebuilt, query=q, key=k, value=v, kv_cache=ref_cache)
        tol = tolerance_for(sc.dtype).atol / 10
        torch.testing.assert_close(out[:b], out_rebuilt[:b], atol=tol, rtol=tol,
                                   msg=lambda m: f"step {step}: {m}")
        assert torch.equal(sc.kv_cache, ref_cache), f"step {step}: different cache writes"
        for i in range(b):
            dense_k[i] = torch.cat([dense_k[i], k[i:i + 1].cpu().double()])
            dense_v[i] = torch.cat([dense_v[i], v[i:i + 1].cpu().double()])
        ref = torch.cat([dense_attention(q[i:i + 1].cpu(), dense_k[i], dense_v[i],
                                         scale=sc.default_scale) for i in range(b)])
        assert_attention_close(out[:b], ref, tolerance_for(sc.dtype),
                               what=f"advance_step, step {step}")
        if step == STEPS:
            break

        sampled = torch.randint(0, 1000, (b, 1), generator=g).to(device)
        md.advance_step(input_tokens, input_positions, sampled, sc.block_size, num_seqs, b)
        seq_lens = [n + 1 for n in seq_lens]
        rebuilt = _fresh(sc, seq_lens, pad_to)

        assert input_tokens[:b].tolist() == sampled.flatten().tolist()
        assert input_positions[:b].tolist() == [n - 1 for n in seq_lens]
        slots = md.slot_mapping.cpu().tolist()
        assert slots == rebuilt.slot_mapping.cpu().tolist(), f"step {step}: slot_mapping"
        assert slots[b:] == [-1] * (num_seqs - b), "graph padding rows must keep slot -1"
        assert md.slot_mapping.dtype == torch.int64
        assert (md.seq_lens_tensor.cpu().tolist()[:b] == seq_lens
                == rebuilt.seq_lens_tensor.cpu().tolist()[:b]), f"step {step}: seq_lens_tensor"
        assert md.seq_lens_tensor.dtype == torch.int32
