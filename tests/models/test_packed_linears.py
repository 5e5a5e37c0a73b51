"""The engine's CPU linears (oneDNN-prepacked, `pack_linears_for_cpu`) compute what nn.Linear does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedattn.models import load_model
from pagedattn.models.layers import PackedLinear, pack_linears_for_cpu

from .test_model_families import FAMILIES, N, _close, _prompt, _reference_logits

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch build")


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_model_matches_transformers(family, tiny_checkpoint, backend_name, device, paged_runner):
    if device.type != "cpu":
        pytest.skip("the engine packs linears on the CPU only")
    ckpt = tiny_checkpoint(family)
    lm = load_model(ckpt.folder, dtype=torch.float32, device=device, attention_backend=backend_name)
    linears = sum(isinstance(m, nn.Linear) for m in lm.model.modules())
    embedding = lm.model.model.embed_tokens.weight
    head = getattr(lm.model, "lm_head", None)  # Gemma 2 computes logits from the embedding itself
    tied = head is not None and head.weight is embedding
    assert pack_linears_for_cpu(lm.model) == linears
    assert not any(isinstance(m, nn.Linear) for m in lm.model.modules())
    for name, m in lm.model.named_modules():
        if isinstance(m, PackedLinear):  # packed, but a tied head keeps sharing the embedding (no copy)
            assert m.weight.data_ptr() == embedding.data_ptr() if tied and name == "lm_head" else m.weight.is_mkldnn
    runner = paged_runner(lm)
    tokens = _prompt(N)
    table = runner.block_table(N)
    ours = runner.step([(tokens, 0, N - 1, table)])
    ref = _reference_logits(ckpt, tokens)
    _close(ours, ref[: N - 1])
    _close(runner.step([(tokens, N - 1, 1, table)])[0], ref[N - 1])


def test_packed_linear_with_bias_and_batch_shapes():
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=True)
    packed = PackedLinear(linear, tied=False)
    for shape in ((1, 48), (7, 48), (3, 5, 48)):
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
