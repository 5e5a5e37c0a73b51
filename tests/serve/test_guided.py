"""Guided decoding through the server, with OpenAI's client: `response_format` (json_schema,
json_object), vLLM's `guided_*` and `structured_outputs`, and forced tool calls; refusals name
their field.

The tiny random model wanders through whitespace when JSON allows any, so the schema requests ask
for compact JSON (`structured_outputs.disable_any_whitespace`, vLLM's).
"""

from __future__ import annotations

import json
import re

import openai
import pytest

pytest.importorskip("xgrammar")

from .conftest import MODEL_NAME, run_server  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["id", "ok", "color"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def server(loaded, device):
    """A server without a max_tokens limit: a Hermes tool call is ~90 byte tokens of the context's 128."""
    with run_server(loaded, device) as s:
        yield s


def check_item(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"id", "ok", "color"}, obj
    assert type(obj["id"]) is int and 0 <= obj["id"] <= 999 and type(obj["ok"]) is bool, obj
    assert obj["color"] in ("red", "green", "blue"), obj


def _chat(client, content: str, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}], **kwargs)


def test_json_schema_on_both_routes(server):
    client = server.client()
    prompts = [f"Item {i}: describe it as JSON." for i in range(20)]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=60, temperature=0.8, seed=3,
                                    extra_body={"response_format": RESPONSE_FORMAT} | COMPACT)
    assert len(out.choices) == 20
    for choice in out.choices:
        check_item(choice.text)
        assert choice.finish_reason == "stop"
    assert len({c.text for c in out.choices}) > 2  # one seed, twenty prompts
    request = dict(max_tokens=60, temperature=0, response_format=RESPONSE_FORMAT, extra_body=COMPACT)
    answers = [_chat(client, p, **request).choices[0].message.content for p in prompts[:3]]
    for answer in answers:
        check_item(answer)
    chunks = _chat(client, prompts[0], stream=True, **request)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert streamed == answers[0]
    server.assert_no_leak()


def test_json_object_choice_regex_and_grammar(server):
    client = server.client()
    out = _chat(client, "Any JSON object, please.", max_tokens=40, temperature=0,
                response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    choices = ["positive", "negative", "neutral"]
    out = _chat(client, "Sentiment of: great!", max_tokens=10, temperature=1.0, seed=5, n=4,
                extra_body={"guided_choice": choices})
    assert len(out.choices) == 4 and all(c.message.content in choices for c in out.choices)
    out = client.completions.create(model=MODEL_NAME, prompt="A date:", max_tokens=20, temperature=0,
                                    extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out.choices[0].text)
    out = client.completions.create(model=MODEL_NAME, prompt="Say it:", max_tokens=20, temperature=0,
                                    extra_body={"guided_grammar": 'root ::= ("yes" | "no") "!"'})
    assert out.choices[0].text in ("yes!", "no!")
    out = client.completions.create(model=MODEL_NAME, prompt="Say it:", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["ab", "cd"]}})
    assert out.choices[0].text in ("ab", "cd")
    server.assert_no_leak()


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def test_forced_tool_calls(server):
    client = server.client()
    request = dict(temperature=0, tools=[WEATHER, TIME], extra_body=COMPACT)
    forced = {"type": "function", "function": {"name": "weather"}}
    named = _chat(client, "Weather?", tool_choice=forced, **request)
    choice = named.choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "weather" and choice.message.content is None
    args = json.loads(call.function.arguments)
    assert re.fullmatch("[A-Z][a-z]{1,5}", args["city"]) and 1 <= args["days"] <= 7
    assert choice.finish_reason == "stop"  # OpenAI's and vLLM's for a named function
    calls, reasons = {}, []
    for chunk in _chat(client, "Weather?", tool_choice=forced, stream=True, **request):
        for c in chunk.choices[0].delta.tool_calls or []:
            calls[c.index] = (c.function.name, json.loads(c.function.arguments))
        reasons.append(chunk.choices[0].finish_reason)
    assert calls == {0: ("weather", args)} and reasons[-1] == "stop"

    required = _chat(client, "Time or weather?", tool_choice="required", n=3, seed=2, **request | dict(temperature=1.0))
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.function.name in ("weather", "time")
            assert set(json.loads(call.function.arguments)) in ({"city", "days"}, {"zone"})
    single = _chat(client, "Time?", tool_choice="required", parallel_tool_calls=False, **request)
    assert len(single.choices[0].message.tool_calls) == 1
    server.assert_no_leak()


@pytest.mark.parametrize("kwargs, param, message", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format", "xgrammar cannot compile the guided decoding json"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "'schema'"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex",
     "expected one kind of guided decoding, got response_format and guided_regex"),
    (dict(extra_body={"guided_regex": "(a"}), "guided_regex", "xgrammar cannot compile the guided decoding regex"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "non-empty list"),
    (dict(extra_body={"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}),
     "guided_whitespace_pattern", "whitespace pattern"),
    (dict(extra_body={"guided_regex": "a", "guided_decoding_backend": "outlines"}), "guided_decoding_backend",
     "'xgrammar' (the only one)"),
    (dict(tool_choice="required"), "tool_choice", "expected tools with tool_choice 'required'"),
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=[WEATHER]), "tool_choice",
     "got 'nope'"),
])
def test_refusals_name_their_field(server, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server.client(), "x", max_tokens=2, **kwargs)
    error = e.value.response.json()["error"]
    assert error["param"] == param and message in error["message"], error
