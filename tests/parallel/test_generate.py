"""A tiny random Llama at 2 ranks (gloo, the workers spawned by the engine) gives the greedy
tokens it gives at 1 rank and that transformers gives, with its KV heads replicated (1 KV
head), one a rank (2) and two a rank (4), through async scheduling (the input tokens broadcast
on the device), chunked prefill and prefix caching, multi-step decoding (each step's draws
broadcast), forks (copy-on-write block copies), preemption, and prompt log-probabilities (the
output head on every rank); and a tiny Gemma 2 (tied head, soft caps) at 2 ranks as at 1. Each engine's worker is gone once it is collected, or shut down."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from pagedattn.engine.config import EngineConfig
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.engine.sampling_params import SamplingParams

from .conftest import alive

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((5, 16, 17, 33, 40, 9))]
PROMPTS += [PROMPTS[3][:20] + [7, 8, 9], PROMPTS[4][:32] + [1, 2]]  # shared prefixes: one and two blocks
MAX_TOKENS = 16

CONFIGS = {  # num_kv_heads -> the engine options its run exercises
    1: dict(async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=4),
    2: dict(num_scheduler_steps=4),
    4: dict(num_kv_blocks=12, max_num_seqs=8),  # 8 prompts of up to 3 blocks in 12 blocks: preemption
}


def _engine(tiny, size: int, **options) -> LLMEngine:
    config = EngineConfig(model=tiny.folder, device="cpu", dtype="float32", tensor_parallel_size=size,
                          **{"num_kv_blocks": 64, **options})
    return LLMEngine(config, check_integrity=True)


def _run(engine: LLMEngine) -> dict:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = engine.generate(PROMPTS, [greedy] * len(PROMPTS))
    forks = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2, prompt_logprobs=2)
    fork = engine.generate([PROMPTS[3]], [forks])[0]
    return {"tokens": [o.outputs[0].token_ids for o in outs], "forks": [c.token_ids for c in fork.outputs],
            "prompt_logprobs": [{t: lp.logprob for t, lp in d.items()} for d in fork.prompt_logprobs[1:]]}


@pytest.mark.parametrize("num_kv_heads", list(CONFIGS), ids=[f"{k}kv" for k in CONFIGS])
def test_two_ranks_equal_one_and_transformers(tiny_kv, num_kv_heads):
    tiny = tiny_kv(num_kv_heads)
    one = _run(_engine(tiny, 1, **CONFIGS[num_kv_heads]))
    engine = _engine(tiny, 2, **CONFIGS[num_kv_heads])
    pids = engine.worker_pids
    assert list(pids) == [1] and alive(pids[1])
    two = _run(engine)
    assert two["tokens"] == one["tokens"]
    assert two["forks"] == one["forks"] == [one["tokens"][3][:8]] * 2
    for a, b in zip(two["prompt_logprobs"], one["prompt_logprobs"]):
        assert a.keys() == b.keys()
        torch.testing.assert_close(list(a.values()), list(b.values()), atol=1e-4, rtol=0)
    for prompt, tokens in zip(PROMPTS, two["tokens"]):
        ids = torch.tensor([prompt])
        ref = tiny.reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=MAX_TOKENS, pad_token_id=0, eos_token_id=None)
        assert tokens == ref[0, len(prompt):].tolist()
    if num_kv_heads == 4:  # shut down: the worker is gone when it returns, and the engine takes no step after
        engine.shutdown()
        assert not alive(pids[1])
        with pytest.raises(RuntimeError, match="shut down"):
            engine.step()
        return
    del engine  # collected: the worker goes too
    gc.collect()
    deadline = time.monotonic() + 15
    while alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids[1])


def test_gemma2_two_ranks_equal_one(tmp_path):
    """Gemma 2's own paths at 2 ranks: the tied head over the vocabulary shards, the final soft
    cap on the gathered logits, a sliding-window layer (transformers' equality: tests/models)."""
    from .conftest import save_tiny_gemma2

    save_tiny_gemma2(tmp_path)
    tokens = []
    for size in (1, 2):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64,
                                        tensor_parallel_size=size))
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens.append([o.outputs[0].token_ids for o in engine.generate(PROMPTS, [greedy] * len(PROMPTS))])
        engine.shutdown()
    assert tokens[1] == tokens[0]


def test_fp8_kv_cache_two_ranks_equal_one(tiny_kv):
    # Each rank holds some of a layer's KV heads; the FP8 scales calibrated at the first prefill
    # are the max over the ranks, so every rank quantizes as one rank does and the tokens agree.
    tiny = tiny_kv(2)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for size in (1, 2):
        engine = _engine(tiny, size, kv_cache_dtype="fp8_e4m3")
        tokens = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, [greedy] * len(PROMPTS))]
        layers = [m for m in engine.runner.model.modules() if hasattr(m, "calibrating")]
        runs.append((tokens, [(float(m.k_scale), float(m.v_scale)) for m in layers]))
        engine.shutdown()
    (one, one_scales), (two, two_scales) = runs
    # equal up to float32 rounding: a later layer's input sums the ranks' partial outputs
    assert [s for pair in two_scales for s in pair] == pytest.approx([s for pair in one_scales for s in pair], rel=1e-5)
    assert two == one
