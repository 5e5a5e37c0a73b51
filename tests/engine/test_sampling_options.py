"""Sampling options and log-probabilities end to end on the tiny random Llama, against
transformers' logits: logprobs and prompt_logprobs, min_tokens, stop_token_ids, logit_bias,
penalties, min_p; seeds under any batch and scheduling; bad options failing alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedattn.engine.sampling_params import SamplingParams

from .conftest import hf_generate, random_prompts

TOL = 1e-4


def _hf_logprobs(tiny, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax [len(ids), V]: row p predicts token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(tiny.reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_position(entry, token: int, row: torch.Tensor, k: int, tokenizer) -> None:
    """One position's {token id: Logprob} against transformers' log-probabilities `row` [V]: its
    token first with its rank, then the k most likely (k - 1 when the token is among them)."""
    ids = list(entry)
    assert ids[0] == token and len(ids) in (k, k + 1) and len(set(ids)) == len(ids)
    kth = row.topk(k).values[-1].item() if k else float("inf")
    assert all(row[t].item() >= kth - TOL for t in ids[1:])
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(row[t].item(), abs=TOL)
        assert lp.decoded_token == tokenizer.decode([t])
    rank = entry[token].rank
    assert (row > row[token] + TOL).sum().item() + 1 <= rank <= (row >= row[token] - TOL).sum().item()
    ranks = [entry[t].rank for t in ids[1:]]
    assert ranks == sorted(ranks) and set(ranks) <= set(range(1, k + 1))


def _check_output(tiny, tokenizer, prompt, out, params) -> None:
    completion = out.outputs[0]
    ref = _hf_logprobs(tiny, prompt + completion.token_ids)
    if params.logprobs is None:
        assert completion.logprobs is None
    else:
        assert len(completion.logprobs) == len(completion.token_ids)
        for i, (t, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            _check_position(entry, t, ref[len(prompt) - 1 + i], params.logprobs, tokenizer)
        total = sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            _check_position(out.prompt_logprobs[i], prompt[i], ref[i - 1], params.prompt_logprobs, tokenizer)


CONFIGS = {
    "default": {},
    "chunked_7": dict(max_num_batched_tokens=7, max_num_seqs=3),  # prompts span several steps
    "recompute": dict(num_kv_blocks=6, block_size=8, max_num_batched_tokens=16, max_num_seqs=3,
                      preemption_mode="recompute"),
    "async": dict(async_scheduling=True),
    "multi_step_3": dict(num_scheduler_steps=3),
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_logprobs_equal_transformers(make_engine, tiny, config):
    prompts = random_prompts((11, 20, 5, 17), seed=12)
    params = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True, logprobs=0, prompt_logprobs=0),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),  # asks for nothing
              SamplingParams(temperature=1.0, top_k=5, seed=4, max_tokens=8, ignore_eos=True, logprobs=5)]
    engine = make_engine(**CONFIGS[config])
    outs = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        _check_output(tiny, engine.tokenizer, prompt, out, p)
    if config == "recompute":  # recomputed prompts record their logprobs once
        assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_prompt_logprobs_do_not_read_the_prefix_cache(make_engine, tiny):
    engine = make_engine()
    prompt = random_prompts((37,), seed=13)[0]
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    asking = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    engine.generate([prompt], [plain])  # caches the prompt's two full blocks
    groups = [engine.add_request(prompt, asking), engine.add_request(prompt, plain)]
    assert engine.block_manager.prefix_hits(groups[0].seqs[0]) == []
    assert len(engine.block_manager.prefix_hits(groups[1].seqs[0])) == 2
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    _check_output(tiny, engine.tokenizer, prompt, finished[groups[0].request_id], asking)


def test_logprobs_with_n_and_best_of(make_engine, tiny):
    prompt = random_prompts((9,), seed=14)[0]
    params = SamplingParams(n=2, best_of=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    engine = make_engine()
    [out] = engine.generate([prompt], [params])
    assert len(out.outputs) == 2
    for completion in out.outputs:
        _check_output(tiny, engine.tokenizer, prompt, dataclasses.replace(out, outputs=[completion]), params)


def test_min_tokens_suppresses_eos(make_engine, loaded_eos, tiny, tiny_eos):
    engine = make_engine(loaded_eos)
    prompt = list(range(40, 50))  # its greedy first token is the EOS
    [eos_first] = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=10)])
    assert eos_first.outputs[0].token_ids == [tiny_eos.eos_token_id]
    for min_tokens in (1, 4):
        [out] = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=10, min_tokens=min_tokens)])
        ref = hf_generate(tiny.reference, prompt, 10, tiny_eos.eos_token_id, min_new_tokens=min_tokens)
        tokens = out.outputs[0].token_ids
        assert tokens == ref and tiny_eos.eos_token_id not in tokens[:min_tokens] and len(tokens) > min_tokens


def test_stop_token_ids(make_engine):
    engine = make_engine()
    prompt = random_prompts((10,), seed=15)[0]
    [full] = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])
    tokens = full.outputs[0].token_ids
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop, never = tokens[k], next(t for t in range(256) if t not in tokens)
    [cut] = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                      stop_token_ids=[never, stop])])
    c = cut.outputs[0]
    assert c.token_ids == tokens[: k + 1]  # the stop token is kept
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == engine.tokenizer.decode(tokens[:k], skip_special_tokens=True)  # its text is not
    # min_tokens past it: the stop token is masked until then
    [late] = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                       stop_token_ids=[stop], min_tokens=k + 1)])
    assert len(late.outputs[0].token_ids) > k + 1 and stop not in late.outputs[0].token_ids[: k + 1]
    # stop strings and EOS report their own stop_reason
    text = full.outputs[0].text
    [by_string] = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                            stop=[text[4:6]])])
    assert by_string.outputs[0].stop_reason == text[4:6]


def test_logit_bias_forces_and_bans(make_engine):
    engine = make_engine()
    prompts = random_prompts((8, 13), seed=16)
    forced = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={77: 100}),
              SamplingParams(temperature=1.0, seed=1, max_tokens=5, ignore_eos=True, logit_bias={"78": 100})]
    outs = engine.generate(prompts, forced)
    assert outs[0].outputs[0].token_ids == [77] * 5 and outs[1].outputs[0].token_ids == [78] * 5
    [plain] = engine.generate(prompts[:1], [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    first = plain.outputs[0].token_ids[0]
    [banned] = engine.generate(prompts[:1], [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                            logit_bias={first: -100})])
    assert banned.outputs[0].token_ids[0] != first


def _reference_greedy(tiny, prompt, n, *, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Greedy decoding over transformers' logits with the options applied by hand."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = tiny.reference(torch.tensor([ids])).logits[0, -1].double()
        for t, b in (bias or {}).items():
            logits[t] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).double()
        seen = (counts > 0) | torch.isin(torch.arange(logits.numel()), torch.tensor(prompt))
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
        logits = logits - frequency * counts - presence * (counts > 0).double()
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


PENALTIES = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "negative_presence": dict(presence_penalty=-1.0, frequency_penalty=-0.5),
    "repetition": dict(repetition_penalty=1.8),
    "repetition_below_1": dict(repetition_penalty=0.6),
    "all_and_bias": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3,
                         logit_bias={5: 3.0, 6: -2.0}),
}


@pytest.mark.parametrize("name", list(PENALTIES), ids=list(PENALTIES))
def test_penalties_equal_a_hand_computed_greedy_loop(make_engine, tiny, name):
    options = PENALTIES[name]
    prompts = random_prompts((6, 15), seed=20)  # greedy repeats a token from its third on
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, **options)
    engine = make_engine()
    outs = engine.generate(prompts, [params, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)])
    kwargs = dict(presence=params.presence_penalty, frequency=params.frequency_penalty,
                  repetition=params.repetition_penalty, bias=params.logit_bias)
    assert outs[0].outputs[0].token_ids == _reference_greedy(tiny, prompts[0], 14, **kwargs)
    assert outs[1].outputs[0].token_ids == hf_generate(tiny.reference, prompts[1], 14)  # its neighbour is untouched
    assert outs[0].outputs[0].token_ids != hf_generate(tiny.reference, prompts[0], 14)  # the options did act


def _tokens_and_logprobs(outputs):
    return [[(c.token_ids, c.finish_reason,
              [{t: round(lp.logprob, 3) for t, lp in e.items()} for e in c.logprobs or []]) for c in o.outputs]
            for o in outputs]


def test_seeded_options_are_reproducible_whatever_the_batch(make_engine, loaded_eos):
    prompts = random_prompts((7, 20, 33, 12), seed=18)
    params = [SamplingParams(temperature=0.9, min_p=0.05, presence_penalty=0.5, seed=1, max_tokens=12, n=2,
                             logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=1.0, repetition_penalty=1.2, seed=2,
                             max_tokens=12, min_tokens=6, logit_bias={3: 2.0}),
              SamplingParams(temperature=0.7, top_k=20, min_p=0.2, seed=3, max_tokens=10, stop_token_ids=[1, 2]),
              SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=12, logprobs=1, min_tokens=3)]
    make = lambda **kw: make_engine(loaded_eos, **kw)  # noqa: E731  (an EOS the model emits)
    first = _tokens_and_logprobs(make().generate(prompts, params))
    tight = make(num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=3)  # preemptions, chunks
    assert _tokens_and_logprobs(tight.generate(prompts[::-1], params[::-1]))[::-1] == first
    assert _tokens_and_logprobs(make().generate(prompts[1:2], params[1:2])) == first[1:2]
    assert _tokens_and_logprobs(make(num_scheduler_steps=4).generate(prompts, params)) == first
    engine = make(async_scheduling=True)
    launch, carried = engine.runner.launch, []
    engine.runner.launch = lambda out, after=None: (carried.append(after is not None), launch(out, after))[1]
    assert _tokens_and_logprobs(engine.generate(prompts, params)) == first
    assert sum(carried) > 5  # the pending-token path ran


def test_beam_search_with_prompt_logprobs_and_a_sampled_neighbour(make_engine, tiny):
    prompts = random_prompts((9, 14), seed=19)
    beam = SamplingParams(use_beam_search=True, n=2, temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    engine = make_engine()
    [alone] = engine.generate(prompts[:1], [beam])
    _check_output(tiny, engine.tokenizer, prompts[0], dataclasses.replace(alone, outputs=alone.outputs[:1]), beam)
    # a step holding beams and sampled rows: each reads its own logits rows
    mixed = engine.generate(prompts, [beam, SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True)])
    assert [c.token_ids for c in mixed[0].outputs] == [c.token_ids for c in alone.outputs]
    assert [c.token_ids for c in mixed[1].outputs] == [hf_generate(tiny.reference, prompts[1], 5)] * 2


def test_bad_options_fail_alone(make_engine):
    engine = make_engine()
    good = random_prompts((6, 9, 7, 8), seed=20)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={10_000: 1.0}),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop_token_ids=[3, 260]),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=261, prompt_logprobs=-1)]
    outs = engine.generate(good, params)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "length", "error", "error"]
    assert "expected logit_bias token ids in [0, 260), got [10000]" in outs[0].error
    assert "stop_token_ids" in outs[2].error and "logprobs <= the vocabulary size (260)" in outs[3].error
    [whole] = engine.generate(good[:1], [SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)])
    assert len(whole.outputs[0].logprobs[0]) == 260 and len(whole.prompt_logprobs[1]) == 260


def test_min_tokens_is_clamped_with_max_tokens_to_the_context(make_engine):
    prompt = random_prompts((90,), seed=21)[0]  # 6 tokens of context left
    [out] = make_engine().generate([prompt], [SamplingParams(temperature=0, max_tokens=20, min_tokens=10)])
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(presence_penalty=2.5), "-2 <= presence_penalty <= 2"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty > 0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(min_p=1.5), "0 <= min_p <= 1"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_tokens=-1), "min_tokens to be an int >= 0"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens <= max_tokens"),
        (dict(min_tokens=1.5), "min_tokens"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids to hold token ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids to be a list"),
        (dict(logit_bias={1: float("inf")}), "finite"),
        (dict(logit_bias={"x": 1.0}), "logit_bias keys"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys"),
        (dict(logit_bias=[1, 2]), "logit_bias to be a dict"),
        (dict(logprobs=-2), "logprobs to be None, -1"),
        (dict(prompt_logprobs=True), "prompt_logprobs"),
        (dict(use_beam_search=True, presence_penalty=1.0), "presence_penalty=0.0 with use_beam_search"),
        (dict(use_beam_search=True, logprobs=1, min_tokens=2), "min_tokens=0, logprobs=None with use_beam_search"),
        (dict(use_beam_search=True, logit_bias={1: 1.0}), "logit_bias"),
        (dict(use_beam_search=True, stop_token_ids=[3]), "stop_token_ids"),
    ],
)
def test_sampling_option_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
