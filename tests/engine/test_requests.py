"""Per-request behaviour: sampling, seeds, stops, EOS, bad input, and the public LLM API."""

from __future__ import annotations

import pytest

from pagedattn.engine.sampling_params import SamplingParams

from .conftest import hf_generate, random_prompts


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_seeded_sampling_is_reproducible(make_engine):
    prompts = random_prompts((7, 20, 33), seed=2)
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=s, max_tokens=12, n=2, ignore_eos=True)
              for s in (1, 2, 3)]
    first = _tokens(make_engine().generate(prompts, params))
    # Another engine, another batch composition, a preemption-prone pool: same tokens.
    engine = make_engine(num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=3)
    assert _tokens(engine.generate(prompts[::-1], params[::-1]))[::-1] == first
    assert _tokens(make_engine().generate(prompts[:1], params[:1])) == first[:1]
    # Multi-step decoding samples on the device from the same per-request streams.
    assert _tokens(make_engine(num_scheduler_steps=4).generate(prompts, params)) == first
    for completions in first:
        assert completions[0] != completions[1]  # the two samples draw from different streams
    other = _tokens(make_engine().generate(prompts, [SamplingParams(temperature=0.9, seed=99, max_tokens=12)] * 3))
    assert [c[0] for c in other] != [c[0] for c in first]


def test_best_of_returns_the_most_likely(make_engine):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
    [out] = make_engine().generate(random_prompts((9,)), [params])
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_cumulative_logprob_of_greedy_matches_transformers(make_engine, tiny):
    import torch

    prompt = random_prompts((11,), seed=3)[0]
    [out] = make_engine().generate([prompt], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = tiny.reference(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    expected = sum(logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens))
    assert out.outputs[0].cumulative_logprob == pytest.approx(expected, abs=1e-3)


def test_eos_stops_like_transformers(make_engine, loaded_eos, tiny, tiny_eos):
    engine = make_engine(loaded_eos)
    prompts = [list(range(40, 50))] + random_prompts((8, 21), seed=4)
    outputs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=10)] * 3)
    for prompt, out in zip(prompts, outputs):
        ref = hf_generate(tiny.reference, prompt, 10, tiny_eos.eos_token_id)
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == ("stop" if ref[-1] == tiny_eos.eos_token_id else "length")
    assert outputs[0].outputs[0].finish_reason == "stop"


def test_stop_string_truncates_text(make_engine):
    engine = make_engine()
    prompt = random_prompts((10,), seed=5)[0]
    [full] = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])
    text = full.outputs[0].text
    assert len(text) > 6
    stop = text[3:5]
    [cut] = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])])
    first = text.find(stop)
    assert cut.outputs[0].text == text[:first]
    assert cut.outputs[0].finish_reason == "stop"
    assert full.outputs[0].token_ids[: len(cut.outputs[0].token_ids)] == cut.outputs[0].token_ids


def test_bad_requests_fail_alone(make_engine):
    engine = make_engine(num_kv_blocks=8)  # 128 tokens of KV cache; the model's context is 96
    good = random_prompts((12, 30), seed=6)
    too_long = random_prompts((97,), seed=7)[0]
    prompts = [good[0], too_long, [], [1, 2, 10_000], good[1]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = engine.generate(prompts, [params] * len(prompts))
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "error", "error", "length"]
    assert "longer than the model's context" in outputs[1].error
    assert all(o.finished for o in outputs)
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 8


def test_non_integer_token_ids_fail_alone(make_engine):
    import numpy as np

    engine = make_engine()
    good = random_prompts((6,), seed=10)[0]
    prompts = [[1.5, 2], good, [True, 3], [np.float32(2.0), 4], [2.0, 3], [np.int64(5), 6]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = engine.generate(prompts, [params] * len(prompts))
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert reasons == ["error", "length", "error", "error", "error", "length"]
    assert "expected token ids to be ints, got 1.5 (float) at index 0" in outputs[0].error
    assert "got True (bool)" in outputs[2].error
    assert "(float32)" in outputs[3].error and "(float)" in outputs[4].error
    assert outputs[5].prompt_token_ids == [5, 6] and type(outputs[5].prompt_token_ids[0]) is int


def test_vllm_prompt_dicts(make_engine):
    """vLLM's TokensPrompt / TextPrompt forms equal the bare prompt; malformed ones fail alone."""
    engine = make_engine()
    ids = random_prompts((7,), seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [ids, {"prompt_token_ids": ids}, {"prompt_token_ids": ids, "prompt": "x"},
               {"prompt": ids}, {"prompt_token_ids": "abc"}]
    outputs = engine.generate(prompts, [params] * len(prompts))
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length", "error", "error", "error"]
    assert outputs[1].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert outputs[1].prompt_token_ids == ids
    assert "expected one key, 'prompt' or 'prompt_token_ids'" in outputs[2].error
    assert "expected 'prompt' to be a string, got list" in outputs[3].error
    assert "got a string" in outputs[4].error


def test_request_larger_than_the_pool_fails_alone(make_engine):
    engine = make_engine(num_kv_blocks=2, block_size=16)  # 32 tokens of KV cache
    prompts = random_prompts((40, 10), seed=8)
    outputs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 2)
    assert outputs[0].outputs[0].finish_reason == "error" and "KV-cache blocks" in outputs[0].error
    # The second fits until it outgrows the pool alone: the pool ends its context, so it stops
    # with "length" and keeps what it generated: 10 prompt + 22 generated tokens fill the 32
    # slots, and the last of them samples a 23rd.
    assert outputs[1].outputs[0].finish_reason == "length" and outputs[1].error is None
    assert len(outputs[1].outputs[0].token_ids) == 23
    assert not engine.has_unfinished()


def test_context_length_ends_generation(make_engine):
    prompt = random_prompts((90,), seed=9)[0]
    [out] = make_engine().generate([prompt], [SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)])
    assert out.outputs[0].finish_reason == "length"
    assert len(prompt) + len(out.outputs[0].token_ids) == 96


def test_llm_api(tiny):
    from pagedattn import LLM, RequestOutput

    llm = LLM(tiny.folder, device="cpu", num_kv_blocks=32, max_num_seqs=4)
    outputs = llm.generate(["hello", "a longer prompt here", [5, 6, 7]], SamplingParams(temperature=0, max_tokens=5))
    assert [o.prompt for o in outputs] == ["hello", "a longer prompt here", None]
    assert all(isinstance(o, RequestOutput) and o.finished for o in outputs)
    assert outputs[2].prompt_token_ids == [5, 6, 7]
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode("hello")
    for o in outputs:
        c = o.outputs[0]
        assert len(c.token_ids) <= 5 and c.finish_reason in ("stop", "length")
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert o.metrics.first_token_time >= o.metrics.arrival_time
    [single] = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5))
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    [flat] = llm.generate([1.5, 2], SamplingParams(temperature=0, max_tokens=5))  # one prompt, refused
    assert flat.outputs[0].finish_reason == "error" and "expected token ids to be ints" in flat.error
    with pytest.raises(ValueError, match="expected 3 sampling params"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1), "temperature >= 0"),
        (dict(top_p=0), "0 < top_p <= 1"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n to be an int >= 1"),
        (dict(n=3, best_of=2), "best_of to be an int >= 3"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(use_beam_search=True, top_k=5), "use_beam_search"),
        (dict(seed="x"), "seed"),
        (dict(temperature=float("nan")), "temperature >= 0 \\(a finite number\\), got nan"),
        (dict(temperature=float("inf")), "temperature >= 0 \\(a finite number\\), got inf"),
        (dict(top_p=float("nan")), "0 < top_p <= 1, got nan"),
        (dict(top_p=float("inf")), "0 < top_p <= 1, got inf"),
        (dict(temperature=True), "temperature"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
        (dict(dtype="float64"), "dtype"),
        (dict(swap_space_gib=-1), "swap_space_gib"),
        (dict(num_scheduler_steps=0), "num_scheduler_steps"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(device="tpu"), "device"),
    ],
)
def test_llm_config_validation(kwargs, match):
    from pagedattn import LLM

    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent", **kwargs)
