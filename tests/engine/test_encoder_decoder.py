"""End to end on a tiny random BART: the engine's greedy tokens equal transformers' `generate`,
whatever the scheduling (prefix caching, chunked prefill, preemption by recompute or swap,
batch composition), and bad encoder-decoder input fails per request.

Encoder prompts run through the encoder once, on a request's prefill step, which writes the
cross K/V into the cross pool; every later step reads them. Equal tokens over preemptions and
batch shapes mean cross blocks are owned, freed, recomputed and swapped right.
"""

from __future__ import annotations

import pytest
import torch
from schedule_counter import count_schedule
from tiny_models import TINY_BART_CONFIG, tiny_bart

from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.sequence import Sequence

from .conftest import engine_factory, random_prompts

START = TINY_BART_CONFIG["decoder_start_token_id"]
MAX_LEN = TINY_BART_CONFIG["max_position_embeddings"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_bart")
    return str(folder), tiny_bart(folder)


@pytest.fixture(scope="module")
def bart_loaded(bart, device, backend_name):
    from pagedattn.models.loader import load_model

    return load_model(bart[0], dtype=torch.float32, device=device, attention_backend=backend_name)


@pytest.fixture
def make_bart_engine(bart_loaded, device, backend_name):
    return engine_factory(bart_loaded, device, backend_name, block_size=4)


def _prompts() -> list:
    """Encoder prompts of several lengths; some with a decoder prompt of their own, two sharing
    a decoder prompt over different encoder prompts, one repeated (prefix-cache hits)."""
    enc = random_prompts((5, 17, 33, 9, 40, 12), seed=4)
    dec = [START, *random_prompts((9,), seed=5)[0]]  # 10 tokens: two full blocks of 4
    return [
        enc[0],
        {"encoder_prompt": enc[1], "decoder_prompt": dec},
        enc[2],
        {"encoder_prompt": enc[3], "decoder_prompt": dec},
        {"encoder_prompt": enc[4]},
        {"encoder_prompt": enc[5], "decoder_prompt": dec[1:5]},  # the start token is prepended
        {"encoder_prompt": enc[1], "decoder_prompt": dec},
    ]


def _hf_generate(reference, prompt, max_tokens: int) -> list[int]:
    """transformers' greedy continuation, every generation rule that we do not have turned off."""
    if not isinstance(prompt, dict):
        prompt = {"encoder_prompt": prompt}
    decoder = list(prompt.get("decoder_prompt") or [START])
    if decoder[0] != START:
        decoder.insert(0, START)
    ids = torch.tensor([prompt["encoder_prompt"]])
    out = reference.generate(
        ids, attention_mask=torch.ones_like(ids), decoder_input_ids=torch.tensor([decoder]), do_sample=False,
        max_new_tokens=max_tokens, num_beams=1, no_repeat_ngram_size=0, forced_bos_token_id=None,
        forced_eos_token_id=None, min_length=0, repetition_penalty=1.0, eos_token_id=None, pad_token_id=258,
    )
    return out[0, len(decoder) :].tolist()


@pytest.fixture(scope="module")
def greedy_refs(bart):
    return [_hf_generate(bart[1], p, MAX_TOKENS) for p in _prompts()]


def _greedy(engine, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = engine.generate(prompts, [params] * len(prompts))
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


CONFIGS = {
    "default": {},
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "no_chunking": dict(enable_chunked_prefill=False),
    "small_step_budget": dict(max_num_batched_tokens=56, max_num_seqs=3),
    "block_size_16": dict(block_size=16, num_kv_blocks=16),
    "max_num_seqs_1": dict(max_num_seqs=1),
    "multi_step_4": dict(num_scheduler_steps=4),
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_greedy_matches_transformers(make_bart_engine, greedy_refs, config):
    engine = make_bart_engine(**CONFIGS[config])
    counts = count_schedule(engine)
    assert _greedy(engine, _prompts()) == greedy_refs
    encoder_lens = [len(p["encoder_prompt"] if isinstance(p, dict) else p) for p in _prompts()]
    assert counts["encoder_tokens"] == sum(encoder_lens)  # once per request
    assert engine.block_manager.num_free_cross_blocks == engine.runner.num_cross_blocks  # all freed


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(make_bart_engine, bart, mode):
    """Short encoder prompts, long outputs, a pool of 10 blocks of 4: decoders outgrow it."""
    prompts = random_prompts((3, 6, 4, 5), seed=9)
    refs = [_hf_generate(bart[1], p, 24) for p in prompts]
    engine = make_bart_engine(num_kv_blocks=10, preemption_mode=mode, swap_space_gib=0.01)
    counts = count_schedule(engine)
    assert _greedy(engine, prompts, max_tokens=24) == refs
    assert counts["preempted"] > 0
    if mode == "swap":  # swapped cross K/V come back: each encoder runs once
        assert counts["cross_swap_out"] > 0 and counts["cross_swap_in"] > 0
        assert counts["encoder_tokens"] == sum(map(len, prompts))
    else:  # a recomputed request runs its encoder again
        assert counts["encoder_tokens"] > sum(map(len, prompts))
    assert engine.block_manager.num_free_cross_blocks == engine.runner.num_cross_blocks


def test_requests_alone_match_the_batch(make_bart_engine, greedy_refs):
    engine = make_bart_engine()
    for prompt, ref in zip(_prompts(), greedy_refs):
        assert _greedy(engine, [prompt]) == [ref]


def test_prefix_cache_keys_on_the_encoder_prompt(make_bart_engine, greedy_refs):
    """Decoder K/V depend on the encoder output: blocks are shared between requests with the
    same encoder and decoder prompts only, and a hit still leaves a prefill to run the encoder."""
    engine = make_bart_engine()
    prompts = _prompts()
    _greedy(engine, [prompts[1]])
    same = Sequence(-1, [START, *prompts[1]["decoder_prompt"][1:]], 4, tuple(prompts[1]["encoder_prompt"]))
    other = Sequence(-2, list(same.token_ids), 4, tuple(prompts[3]["encoder_prompt"]))
    assert len(engine.block_manager.prefix_hits(same)) == 2  # 10 tokens: 2 blocks, 2 tokens left
    assert engine.block_manager.prefix_hits(other) == []
    counts = count_schedule(engine)
    assert _greedy(engine, [prompts[6], prompts[3]]) == [greedy_refs[6], greedy_refs[3]]
    assert counts["encoder_tokens"] == len(prompts[6]["encoder_prompt"]) + len(prompts[3]["encoder_prompt"])


def test_sampling_several_completions_shares_cross_blocks(make_bart_engine):
    engine = make_bart_engine(num_kv_blocks=24)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    prompts = random_prompts((20, 30), seed=6)
    first = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, [params] * 2)]
    again = make_bart_engine(num_kv_blocks=64)
    assert [[c.token_ids for c in o.outputs] for o in again.generate(prompts, [params] * 2)] == first
    assert engine.block_manager.num_free_cross_blocks == engine.runner.num_cross_blocks


def test_bad_encoder_decoder_input_fails_alone(make_bart_engine, greedy_refs, make_engine):
    ok = _prompts()[0]
    bad = [
        random_prompts((MAX_LEN + 1,), seed=8)[0],  # longer than max_position_embeddings
        {"decoder_prompt": [START, 5]},  # no encoder prompt
        {"encoder_prompt": None},
        {"encoder_prompt": []},
        {"encoder_prompt": [1, 2], "prompt": [3]},
        {"encoder_prompt": [1, 999]},  # outside the vocabulary
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = make_bart_engine().generate([ok, *bad, ok], [params] * (len(bad) + 2))
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", *["error"] * len(bad), "length"]
    assert outputs[0].outputs[0].token_ids == outputs[-1].outputs[0].token_ids == greedy_refs[0]
    errors = [o.error for o in outputs[1:-1]]
    assert f"encoder prompt of {MAX_LEN + 1} tokens is longer than the model's maximum of {MAX_LEN}" in errors[0]
    assert "expected an encoder prompt for this encoder-decoder model, got none" in errors[1]
    assert "got none" in errors[2]
    assert "expected a non-empty encoder prompt" in errors[3]
    assert "expected prompt keys" in errors[4] and "'prompt'" in errors[4]
    assert "expected encoder token ids in [0, 260), got [999]" in errors[5]
    # Over the step budget: an encoder-decoder prompt is never chunked.
    [out] = make_bart_engine(max_num_batched_tokens=16, max_num_seqs=4).generate([random_prompts((20,))[0]], [params])
    assert out.outputs[0].finish_reason == "error" and "max_num_batched_tokens (16)" in out.error
    # More encoder tokens than the cross pool holds (40 tokens: 10 blocks of 4, the pool has 8).
    outputs = make_bart_engine(num_kv_blocks=8).generate([random_prompts((40,))[0], ok], [params] * 2)
    assert outputs[0].outputs[0].finish_reason == "error" and "40 encoder tokens" in outputs[0].error
    assert outputs[1].outputs[0].token_ids == greedy_refs[0]
    # A decoder-only model given an encoder-decoder prompt.
    outputs = make_engine().generate([{"encoder_prompt": [1, 2, 3]}, [1, 2, 3]], [params] * 2)
    assert outputs[0].outputs[0].finish_reason == "error" and "decoder-only model" in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == MAX_TOKENS


def test_llm_and_cli_take_encoder_prompts(bart, device, capsys):
    import pagedattn
    from pagedattn.cli import main

    folder, reference = bart
    llm = pagedattn.LLM(folder, device=str(device), num_kv_blocks=32, block_size=4)
    params = pagedattn.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [text] = llm.generate("hello there", params)
    [pair] = llm.generate({"encoder_prompt": "hello there", "decoder_prompt": "ab"}, params)
    encoder_ids = list(llm.tokenizer.encode("hello there"))
    assert text.encoder_prompt == "hello there" and text.encoder_prompt_token_ids == encoder_ids
    assert text.prompt_token_ids == [START] and pair.prompt_token_ids == [START, *llm.tokenizer.encode("ab")]
    assert text.outputs[0].token_ids == _hf_generate(reference, encoder_ids, 6)
    assert pair.outputs[0].token_ids == _hf_generate(
        reference, {"encoder_prompt": encoder_ids, "decoder_prompt": pair.prompt_token_ids}, 6
    )
    assert main(["generate", "--model", folder, "--device", str(device), "--max-tokens", "4", "hello there"]) == 0
    assert "4 tokens" in capsys.readouterr().err
