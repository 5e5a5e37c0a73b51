"""Guided decoding (xgrammar): each guided completion's text matches its JSON schema, regex,
choice or grammar, whatever the batch, scheduling and preemptions around it; unguided neighbours
are untouched; a spec that does not compile fails its request alone.

The tiny random model wanders through whitespace when JSON allows any (it never closes the
object), so the JSON requests here ask for xgrammar's fixed separators (`disable_any_whitespace`).
"""

from __future__ import annotations

import json
import re
import sys

import pytest

pytest.importorskip("xgrammar")

from pagedattn.engine.sampling_params import GuidedDecodingParams, SamplingParams  # noqa: E402

from .conftest import engine_factory, random_prompts  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "maxItems": 2},
    },
    "required": ["id", "ok", "color", "tags"],
    "additionalProperties": False,
}
JSON = GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True)
EOS = 257  # the tiny checkpoint's
CLOSE = 92  # "}" in its byte tokenizer


def check_schema(text: str) -> None:
    """`text` is one JSON object valid under SCHEMA (checked by hand: jsonschema is not a dependency)."""
    obj = json.loads(text)
    assert set(obj) == {"id", "ok", "color", "tags"}, obj
    assert type(obj["id"]) is int and 0 <= obj["id"] <= 999, obj
    assert type(obj["ok"]) is bool and obj["color"] in ("red", "green", "blue"), obj
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 2, obj
    assert all(isinstance(t, str) and re.fullmatch("[a-z]{1,5}", t) for t in obj["tags"]), obj


def _results(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def test_json_schema_batch_with_unguided_neighbours(make_engine):
    """20 guided prompts (greedy and seeded) and unguided ones in one batch: every guided text
    validates and ends on EOS; the unguided outputs equal those of a batch without guided rows."""
    guided_prompts = random_prompts([4 + i % 9 for i in range(20)], seed=30)
    guided = [SamplingParams(temperature=0, max_tokens=80, guided_decoding=JSON) if i % 2 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=80, guided_decoding=JSON) for i in range(20)]
    plain_prompts = random_prompts((5, 17, 9, 30, 12, 8), seed=31)
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2),
             SamplingParams(temperature=1.0, top_k=8, seed=8, max_tokens=30, ignore_eos=True, presence_penalty=0.5),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={5: 3.0}),
             SamplingParams(temperature=0.7, seed=9, max_tokens=18, ignore_eos=True, min_tokens=4)]
    order = [i % 4 != 3 for i in range(26)]  # interleaved: guided and unguided rows alternate in the steps
    guided_it, plain_it = iter(zip(guided_prompts, guided)), iter(zip(plain_prompts, plain))
    prompts, params = zip(*[next(guided_it if g else plain_it) for g in order])
    engine = make_engine(num_kv_blocks=200)
    outs = engine.generate(prompts, params)
    texts = set()
    for out, is_guided in zip(outs, order):
        if is_guided:
            [c] = out.outputs
            check_schema(c.text)
            assert c.finish_reason == "stop" and c.stop_reason is None and c.token_ids[-1] == EOS, c
            texts.add(c.text)
    assert len(texts) > 10  # different prompts and seeds: different objects
    alone = make_engine(num_kv_blocks=200).generate(plain_prompts, plain)
    assert _results([o for o, g in zip(outs, order) if not g]) == _results(alone)
    assert [c.logprobs for o, g in zip(outs, order) if not g for c in o.outputs] == \
           [c.logprobs for o in alone for c in o.outputs]


def test_choice_regex_and_grammar(make_engine):
    choices = ["red wine", "white", "rosé", 'say "cheese"']
    prompts = random_prompts((6, 11, 8, 14, 9), seed=32)
    params = [
        SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=20,
                       guided_decoding=GuidedDecodingParams(choice=choices)),
        SamplingParams(temperature=0.9, seed=4, n=2, best_of=3, max_tokens=20,
                       guided_decoding=GuidedDecodingParams(choice=choices)),
        SamplingParams(temperature=0.9, seed=5, max_tokens=30,
                       guided_decoding=GuidedDecodingParams(regex=r"[0-9]{3}-[A-Z]{2}(-[a-z]+)?")),
        SamplingParams(temperature=0, max_tokens=30, guided_decoding=GuidedDecodingParams(
            grammar='root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?')),
        SamplingParams(temperature=0, max_tokens=10,
                       guided_decoding=GuidedDecodingParams(grammar='start: "yes" | "no"')),
    ]
    outs = make_engine().generate(prompts, params)
    for c in outs[0].outputs + outs[1].outputs:  # each completion has its own grammar state
        assert c.text in choices and c.finish_reason == "stop", c
    assert len(outs[0].outputs) == 4 and len(outs[1].outputs) == 2
    assert len({c.text for c in outs[0].outputs}) > 1
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}(-[a-z]+)?", outs[2].outputs[0].text), outs[2].outputs[0]
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", outs[3].outputs[0].text), outs[3].outputs[0]
    assert outs[4].outputs[0].text in ("yes", "no")  # Lark's syntax (no "::=")


def test_json_object_and_a_structural_tag(make_engine):
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<call>", "end": "</call>",
                                                "content": {"type": "json_schema", "json_schema": SCHEMA,
                                                            "max_whitespace_cnt": 1}}}
    prompts = random_prompts((7, 10, 12), seed=33)
    json_object = GuidedDecodingParams(json_object=True)  # any whitespace: the model wanders, a bias ends it
    params = [SamplingParams(temperature=0, max_tokens=60, guided_decoding=json_object),
              SamplingParams(temperature=0, max_tokens=80, guided_decoding=GuidedDecodingParams(structural_tag=tag)),
              SamplingParams(temperature=0, max_tokens=60, guided_decoding=json_object, logit_bias={CLOSE: 30.0})]
    first, second, third = (o.outputs[0] for o in make_engine().generate(prompts, params))
    assert first.text.startswith("{")
    assert third.text == "{}" and third.finish_reason == "stop"  # the bias cannot bring back what the mask took
    assert second.text.startswith("<call>") and second.text.endswith("</call>"), second
    assert json.loads(second.text[len("<call>"):-len("</call>")])["color"] in ("red", "green", "blue")


def test_a_spec_that_does_not_compile_fails_alone(make_engine):
    prompts = random_prompts((6, 9, 7, 8), seed=34)
    params = [SamplingParams(temperature=0, max_tokens=60, guided_decoding=JSON),
              SamplingParams(temperature=0, max_tokens=8,
                             guided_decoding=GuidedDecodingParams(json={"type": "nonsense"})),
              SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(regex="([a-z]")),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    engine = make_engine()
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "error", "error", "length"]
    check_schema(outs[0].outputs[0].text)
    assert outs[1].error.startswith("xgrammar cannot compile the guided decoding json: ")
    assert "nonsense" in outs[1].error
    assert "regex" in outs[2].error and "[" not in outs[2].error.split(": ")[0]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_grammar_end_stops_the_completion(make_engine):
    """EOS is the only token left once the grammar is done: it ends the completion, with
    ignore_eos too; under min_tokens (EOS masked) the completion ends there all the same."""
    prompts = random_prompts((8, 8, 8), seed=35)
    choice = GuidedDecodingParams(choice=["ok"])
    params = [SamplingParams(temperature=0, max_tokens=10, guided_decoding=choice),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, guided_decoding=choice),
              SamplingParams(temperature=0.5, seed=1, max_tokens=10, min_tokens=6, guided_decoding=choice)]
    outs = make_engine().generate(prompts, params)
    for out in outs:
        [c] = out.outputs
        assert c.text == "ok" and c.finish_reason == "stop" and c.stop_reason is None, c
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 2]  # "o", "k", EOS; no EOS under min_tokens


CONFIGS = {
    "async": dict(async_scheduling=True),
    "multi_step_4": dict(num_scheduler_steps=4),
    "recompute": dict(num_kv_blocks=9, max_num_seqs=4, preemption_mode="recompute"),
    "swap": dict(num_kv_blocks=9, max_num_seqs=4, preemption_mode="swap"),
    "chunked_5": dict(max_num_batched_tokens=5, max_num_seqs=5),
}


MIXED_PROMPTS = random_prompts((9, 14, 6, 20, 11), seed=36)
MIXED = [SamplingParams(temperature=0.8, seed=2, n=2, max_tokens=70, guided_decoding=JSON),
         SamplingParams(temperature=0, max_tokens=75, ignore_eos=True),  # outlasts the guided ones
         SamplingParams(temperature=0, max_tokens=70, guided_decoding=JSON),
         SamplingParams(temperature=1.0, seed=3, max_tokens=75, ignore_eos=True),
         SamplingParams(temperature=0.9, seed=4, max_tokens=20, guided_decoding=GuidedDecodingParams(
             regex="[a-z]+( [a-z]+)*"))]


@pytest.fixture(scope="module")
def plain_mixed(loaded, device, backend_name):
    """The mixed workload's results on the plain engine (synchronous, one step at a time, a roomy pool)."""
    return _results(engine_factory(loaded, device, backend_name)().generate(MIXED_PROMPTS, MIXED))


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_scheduling_does_not_change_outputs(make_engine, plain_mixed, config):
    """Async scheduling, multi-step decoding, preemption (recompute and swap: the grammar state
    follows the completion's tokens) and chunked prefills give the tokens of the plain engine."""
    engine = make_engine(**CONFIGS[config])
    launch, carried, steps = engine.runner.launch, [], []
    engine.runner.launch = lambda out, after=None: (carried.append(after is not None), steps.append(out.num_steps),
                                                    launch(out, after))[-1]
    outs = engine.generate(MIXED_PROMPTS, MIXED)
    assert _results(outs) == plain_mixed
    for c in outs[0].outputs + outs[2].outputs:
        check_schema(c.text)
    if config == "async":
        assert sum(carried) > 0  # once the guided requests ended, decodes were launched ahead
    if config == "multi_step_4":
        assert max(steps) == 4
    if config in ("recompute", "swap"):
        assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_guided_params_validation():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar, structural_tag"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="got json, regex"):
        GuidedDecodingParams(json={}, regex="a")
    with pytest.raises(ValueError, match="JSON text, got text that is not JSON"):
        GuidedDecodingParams(json="{nope")
    with pytest.raises(ValueError, match="non-empty list of non-empty strings"):
        GuidedDecodingParams(choice=["a", ""])
    with pytest.raises(ValueError, match="backend None or 'xgrammar'"):
        GuidedDecodingParams(regex="a", backend="outlines")
    with pytest.raises(ValueError, match="guided_decoding to be a GuidedDecodingParams"):
        SamplingParams(guided_decoding={"json": {}})
    with pytest.raises(ValueError, match="guided_decoding=None with use_beam_search"):
        SamplingParams(use_beam_search=True, n=2, temperature=0, guided_decoding=GuidedDecodingParams(choice=["a"]))
    assert GuidedDecodingParams(json='{"type": "object"}').kind == "json"


def test_without_xgrammar_only_guided_requests_fail(make_engine, monkeypatch):
    """Unguided steps never reach xgrammar; without it a guided request fails alone, saying what to install."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # a None entry blocks the import
    prompts = random_prompts((6, 9), seed=37)
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, guided_decoding=GuidedDecodingParams(choice=["a"]))]
    outs = make_engine().generate(prompts, params)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error"]
    assert "needs xgrammar" in outs[1].error and "pip install 'pagedattn[guided]'" in outs[1].error
