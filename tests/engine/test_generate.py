"""End to end on a tiny random Llama: the engine's tokens equal transformers' `generate`,
whatever the scheduling (prefix caching, chunked prefill, preemption, batch composition)."""

from __future__ import annotations

import pytest

from pagedattn.engine.sampling_params import SamplingParams

from .conftest import hf_generate, random_prompts

# Lengths around block boundaries (block_size 16), plus prompts sharing prefixes.
LENGTHS = (5, 16, 17, 33, 40, 9)


def _prompts() -> list[list[int]]:
    prompts = random_prompts(LENGTHS, seed=1)
    prompts.append(prompts[3][:20] + [7, 8, 9])  # shares one block with prompt 3
    prompts.append(prompts[4][:32] + [1, 2])  # shares two blocks with prompt 4
    return prompts


@pytest.fixture(scope="module")
def greedy_refs(tiny):
    return [hf_generate(tiny.reference, p, 24) for p in _prompts()]


def _greedy(engine, prompts, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, [params] * len(prompts))]


def _count_moves(engine) -> dict[str, int]:
    """Count the steps that swap out / swap in / copy blocks."""
    counts = {"swap_out": 0, "swap_in": 0, "copies": 0}
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        for key in counts:
            counts[key] += bool(getattr(out, key))
        return out

    engine.scheduler.schedule = counting
    return counts


CONFIGS = {
    "default": {},
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunked_16": dict(max_num_batched_tokens=16, max_num_seqs=4),
    "no_chunking": dict(enable_chunked_prefill=False),
    "block_size_1": dict(block_size=1, num_kv_blocks=800),
    "block_size_5_chunked": dict(block_size=5, num_kv_blocks=200, max_num_batched_tokens=12, max_num_seqs=3),
    "max_num_seqs_1": dict(max_num_seqs=1),
    "multi_step_4": dict(num_scheduler_steps=4),
    "async": dict(async_scheduling=True),
    "async_chunked_16": dict(async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=4),
    "async_block_size_1": dict(async_scheduling=True, block_size=1, num_kv_blocks=800),
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_greedy_equals_transformers(make_engine, greedy_refs, config):
    engine = make_engine(**CONFIGS[config])
    prompts = _prompts()
    assert _greedy(engine, prompts) == greedy_refs
    # Again in reverse order: now every prompt's full blocks are cached (when enabled).
    assert _greedy(engine, prompts[::-1])[::-1] == greedy_refs
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_is_hit(make_engine, greedy_refs):
    engine = make_engine()
    prompts = _prompts()
    _greedy(engine, prompts)
    computed = []
    launch = engine.runner.launch
    engine.runner.launch = lambda out, after=None: (computed.append(out.num_batched_tokens), launch(out, after))[1]
    assert _greedy(engine, prompts) == greedy_refs
    # Cached blocks are skipped: far fewer prompt tokens than the prompts hold are computed.
    assert sum(computed) < sum(len(p) for p in prompts) + len(prompts) * 24


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(make_engine, greedy_refs, mode, async_scheduling):
    # 12 blocks of 16 tokens cannot hold 8 sequences of up to 64 tokens at once.
    engine = make_engine(num_kv_blocks=12, preemption_mode=mode, async_scheduling=async_scheduling)
    moves = _count_moves(engine)
    prompts = _prompts()
    outputs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts))
    assert [o.outputs[0].token_ids for o in outputs] == greedy_refs
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    if mode == "swap":
        assert moves["swap_out"] > 0 and moves["swap_in"] > 0
    else:
        assert moves["swap_out"] == 0


def test_multi_step_with_tiny_pool(make_engine, greedy_refs):
    engine = make_engine(num_scheduler_steps=3, block_size=8, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4)
    assert _greedy(engine, _prompts()) == greedy_refs


def test_batch_composition_does_not_change_tokens(make_engine, greedy_refs):
    prompts = _prompts()
    engine = make_engine(max_num_batched_tokens=24, max_num_seqs=3)
    for subset in ([2], [0, 5], [7, 1, 4], [6, 3]):
        assert _greedy(engine, [prompts[i] for i in subset]) == [greedy_refs[i] for i in subset]


def test_n2_greedy_gives_identical_sequences(make_engine, greedy_refs):
    engine = make_engine(block_size=4, num_kv_blocks=100)
    moves = _count_moves(engine)
    prompts = _prompts()[:3]  # 5 and 17 tokens end mid-block: the forks copy the last block
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    for out, ref in zip(engine.generate(prompts, [params] * 3), greedy_refs):
        assert [c.token_ids for c in out.outputs] == [ref, ref]
    assert moves["copies"] > 0


BEAMS = [(2, 2, None), (3, 2, None), (4, 4, "eos")]


@pytest.mark.parametrize("width,n,eos", BEAMS, ids=[f"W{w}_n{n}_{e}" for w, n, e in BEAMS])
def test_beam_search_equals_transformers(request, make_engine, tiny, width, n, eos):
    checkpoint = request.getfixturevalue("tiny_eos") if eos else tiny
    model = request.getfixturevalue("loaded_eos") if eos else None
    engine = make_engine(model, block_size=4, num_kv_blocks=400)
    prompts = _prompts()[:4] + [list(range(40, 50))]
    params = SamplingParams(n=n, best_of=width, use_beam_search=True, max_tokens=12, temperature=0)
    outputs = engine.generate(prompts, [params] * len(prompts))
    eos_id = checkpoint.eos_token_id if eos else None
    finished_by_eos = 0
    for prompt, out in zip(prompts, outputs):
        ref = hf_generate(tiny.reference, prompt, 12, eos_id, num_beams=width, num_return_sequences=n)
        assert [c.token_ids for c in out.outputs] == ref
        finished_by_eos += sum(c.finish_reason == "stop" for c in out.outputs)
    if eos:
        assert finished_by_eos > 0


def test_sliding_window_frees_blocks_and_matches_transformers(tmp_path, device, backend_name, make_engine):
    """Mistral with one window for every layer: blocks behind the window are freed, so a pool
    far smaller than the sequences still serves them, with transformers' tokens."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from pagedattn.models.loader import load_model

    from .conftest import TINY, _save

    torch.manual_seed(0)
    ref = MistralForCausalLM(MistralConfig(**TINY, sliding_window=8)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" not in name:
                p.mul_(10.0)  # peaked distributions, as in conftest
    _save(ref, tmp_path)
    ref.generation_config.eos_token_id = None
    loaded = load_model(str(tmp_path), dtype=torch.float32, device=device, attention_backend=backend_name)
    engine = make_engine(loaded, block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=2)
    assert engine.runner.kv_groups.windows == (8,)  # one group: every layer frees by the window
    prompts = random_prompts((30, 41), seed=11)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = engine.generate(prompts, [params] * 2)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_generate(ref, prompt, 20)
    assert sum(o.metrics.num_preemptions for o in outputs) == 0  # 2 x 61 tokens in 48 slots
