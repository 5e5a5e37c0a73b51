"""Each model family against transformers on the same tiny random weights, through the paged cache.

Prompts are longer than the sliding windows (8) and span many blocks (block size 4), so local
layers, GQA, rope scaling, biases, soft caps and tied heads all show in the logits.
"""

from __future__ import annotations

import pytest
import torch

from pagedattn.engine.kv_cache_groups import KVCacheGroups
from pagedattn.models import load_model

from .conftest import VOCAB, skip_unless_runs

ATOL = 1e-4
FAMILIES = ["llama", "llama3_rope", "mistral", "qwen2", "qwen2_sliding", "gemma2", "qwen3", "gemma3", "gpt_oss"]
N = 29  # prompt length: > the sliding window of 8, 8 blocks of 4 (the last one partial)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference_logits(ckpt, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.reference(input_ids=torch.tensor([tokens])).logits[0].float()  # [n, vocab]


@pytest.fixture
def loaded(request, tiny_checkpoint, backend_name, device):
    skip_unless_runs(request.param, backend_name)
    ckpt = tiny_checkpoint(request.param)
    return ckpt, load_model(ckpt.folder, dtype=torch.float32, device=device, attention_backend=backend_name)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours.cpu(), ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("loaded", FAMILIES, indirect=True)
def test_full_prefill_matches_transformers(loaded, paged_runner):
    ckpt, lm = loaded
    runner = paged_runner(lm)
    tokens = _prompt(N)
    ours = runner.step([(tokens, 0, N, runner.block_table(N))])
    _close(ours, _reference_logits(ckpt, tokens))


@pytest.mark.parametrize("loaded", FAMILIES, indirect=True)
def test_prefill_then_decode_reads_the_cache(loaded, paged_runner):
    ckpt, lm = loaded
    runner = paged_runner(lm)
    tokens = _prompt(N)
    ref = _reference_logits(ckpt, tokens)
    table = runner.block_table(N)
    runner.step([(tokens, 0, N - 3, table)])
    for seq_len in range(N - 2, N + 1):  # three decode steps, crossing into the last block
        ours = runner.step([(tokens, seq_len - 1, 1, table)])
        _close(ours[0], ref[seq_len - 1])


@pytest.mark.parametrize("loaded", ["mistral", "qwen2_sliding", "gemma2", "gemma3", "gpt_oss"], indirect=True)
def test_chunked_prefill_matches_transformers(loaded, paged_runner):
    ckpt, lm = loaded
    runner = paged_runner(lm)
    tokens = _prompt(N)
    table = runner.block_table(N)
    first = runner.step([(tokens, 0, 13, table)])
    rest = runner.step([(tokens, 13, N - 13, table)])  # a chunk over a cached prefix
    _close(torch.cat([first, rest]), _reference_logits(ckpt, tokens))


@pytest.mark.parametrize("loaded", ["llama", "gemma2"], indirect=True)
def test_mixed_batch_of_prefills_and_decodes(loaded, paged_runner):
    """Sequences share one flattened step: two prefills (one a chunk) and two decodes."""
    ckpt, lm = loaded
    runner = paged_runner(lm)
    prompts = [_prompt(n, seed) for n, seed in [(17, 1), (23, 2), (11, 3), (26, 4)]]
    tables = [runner.block_table(len(p)) for p in prompts]
    refs = [_reference_logits(ckpt, p) for p in prompts]
    # Step 1: prefill the two future decodes and the first chunk of the second prompt.
    runner.step([(prompts[1], 0, 9, tables[1]), (prompts[2], 0, 10, tables[2]), (prompts[3], 0, 25, tables[3])])
    # Step 2: a whole prefill, a chunk over a cached prefix, then two decodes.
    out = runner.step([
        (prompts[0], 0, 17, tables[0]),
        (prompts[1], 9, 14, tables[1]),
        (prompts[2], 10, 1, tables[2]),
        (prompts[3], 25, 1, tables[3]),
    ])
    first, chunk, dec2, dec3 = out.split([17, 14, 1, 1])
    _close(first, refs[0])
    _close(chunk, refs[1][9:])
    _close(dec2[0], refs[2][-1])
    _close(dec3[0], refs[3][-1])


@pytest.mark.parametrize(
    "loaded, windows, group_windows, tied",
    [
        ("llama", (None, None), (None,), False),
        ("mistral", (8, 8), (8,), False),
        ("qwen2", (None, None), (None,), True),
        ("qwen2_sliding", (None, 8), (None, 8), False),
        ("gemma2", (8, None), (None, 8), True),
        ("qwen3", (None, None), (None,), False),
        ("gemma3", (8, 8, None), (None, 8, 8), True),
        ("gpt_oss", (8, None), (None, 8), False),
    ],
    indirect=["loaded"],
)
def test_spec_describes_the_model(loaded, windows, group_windows, tied):
    _, lm = loaded
    spec = lm.spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.vocab_size) == (len(windows), 4, 2, VOCAB)
    assert spec.head_size == (32 if spec.architecture == "Qwen3ForCausalLM" else 16)
    assert spec.sliding_windows == windows
    assert KVCacheGroups.of(spec.sliding_windows).windows == group_windows  # the engine's KV cache groups
    assert spec.eos_token_ids == {257}
    assert spec.dtype == torch.float32
    assert spec.max_model_len == 128
    assert not spec.has_chat_template
    params = dict(lm.model.named_parameters())
    assert ("lm_head.weight" not in params) == tied


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_load(family, dtype, tiny_checkpoint, backend_name, device, paged_runner):
    ckpt = tiny_checkpoint(family)
    lm = load_model(ckpt.folder, dtype=dtype, device=device, attention_backend=backend_name)
    want = getattr(torch, dtype)
    assert lm.spec.dtype == want
    assert {p.dtype for p in lm.model.parameters()} == {want}
    runner = paged_runner(lm)
    assert runner.kv_caches[0].dtype == want
    tokens = _prompt(N)
    ours = runner.step([(tokens, 0, N, runner.block_table(N))])
    ref = _reference_logits(ckpt, tokens)
    assert ours.dtype == torch.float32
    # Rounding to 8 (bf16) or 11 (fp16) mantissa bits, not a different computation.
    torch.testing.assert_close(ours.cpu(), ref, atol=0.15 if dtype == "bfloat16" else 0.03, rtol=0.05)


def test_fp8_kv_cache_is_passed_to_attention(tiny_checkpoint, backend_name, device, paged_runner):
    ckpt = tiny_checkpoint("llama")
    lm = load_model(ckpt.folder, dtype=torch.float32, device=device, attention_backend=backend_name,
                    kv_cache_dtype="fp8_e5m2")
    runner = paged_runner(lm)
    runner.kv_caches = [torch.zeros_like(c, dtype=torch.float8_e5m2) for c in runner.kv_caches]
    tokens = _prompt(N)
    table = runner.block_table(N)
    runner.step([(tokens, 0, N - 1, table)])
    ours = runner.step([(tokens, N - 1, 1, table)])[0].cpu()
    ref = _reference_logits(ckpt, tokens)[-1]
    # The decode reads K/V rounded to 2 mantissa bits: close, but visibly not exact.
    assert 1e-3 < (ours - ref).abs().max() < 0.5


@pytest.mark.parametrize("loaded", ["qwen2_sliding", "gemma2"], indirect=True)
def test_compiles_without_graph_breaks(loaded, paged_runner):
    """torch.compile(fullgraph=True) traces the whole model (aot_eager: no C++ toolchain needed)."""
    ckpt, lm = loaded
    runner = paged_runner(lm)
    tokens = _prompt(N)
    table = runner.block_table(N)
    runner.step([(tokens, 0, N - 1, table)])
    runner.model = torch.compile(lm.model, fullgraph=True, backend="aot_eager")
    ours = runner.step([(tokens, N - 1, 1, table)])
    _close(ours[0], _reference_logits(ckpt, tokens)[-1])
