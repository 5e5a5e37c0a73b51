"""Tool calls: the Hermes parser on whole and growing text, the chat template's tools and tool
messages, and calls parsed back through the server (the model's text forced to a call, since a
random tiny model does not write one)."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedattn.serve.tool_parser import ToolCallStream, extract_tool_calls

from .conftest import MODEL_NAME

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
ARGS = {"city": "Paris", "unit": "°C"}
TWO_CALLS = 'Checking both.' + CALL + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def _streamed(text: str, step: int = 1) -> tuple[str, list[dict]]:
    """Feed `text` growing by `step` characters, as the server does; (content, calls) sent."""
    stream, content, calls = ToolCallStream(), "", []
    for end in range(step, len(text) + step, step):
        c, new = stream.feed(text[:end], final=end >= len(text))
        content, calls = content + c, calls + new
    return content, calls


@pytest.mark.parametrize("text, content, names", [
    ("no call here <tool", "no call here <tool", []),
    (CALL, None, ["get_weather"]),
    ("Let me look." + CALL, "Let me look.", ["get_weather"]),
    (TWO_CALLS, "Checking both.", ["get_weather", "get_time"]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', None, ["f"]),  # unclosed last block, as vLLM
])
def test_extract_and_stream_agree(text, content, names):
    got_content, calls = extract_tool_calls(text)
    assert got_content == content and [c["name"] for c in calls] == names
    for step in (1, 3, len(text)):
        streamed_content, streamed = _streamed(text, step)
        assert streamed_content == (content or "")
        assert [c["function"] for c in streamed] == calls
        assert [c["index"] for c in streamed] == list(range(len(names)))
        assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in streamed)
    if names and names[0] == "get_weather":
        assert json.loads(calls[0]["arguments"]) == ARGS


def test_malformed_call_is_content():
    bad = 'Hi <tool_call>{"name": "f", "arguments": </tool_call>'
    assert extract_tool_calls(bad) == (bad, [])  # vLLM: the whole text is content
    assert extract_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name
    content, calls = _streamed(bad)
    assert content == bad and calls == []


def test_stream_holds_a_partial_start_tag():
    stream = ToolCallStream()
    assert stream.feed("Hello <tool", final=False) == ("Hello ", [])
    assert stream.feed("Hello <toolbox>", final=False) == ("<toolbox>", [])
    stream = ToolCallStream()
    assert stream.feed("x <", final=True) == ("x <", [])


# ---------------------------------------------------------------------- through the server

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

TOOLS_TEMPLATE = (
    "{% if tools %}[tools] {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}>{% endfor %}{% endif %}"
    "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


@pytest.fixture
def tools_template(server):
    tokenizer = server.engine.tokenizer
    saved, tokenizer.chat_template = tokenizer.chat_template, TOOLS_TEMPLATE
    yield
    tokenizer.chat_template = saved


def test_tools_and_tool_messages_reach_the_template(server, tools_template):
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": messages, "tools": [WEATHER_TOOL]})
    assert r.status_code == 200, r.text
    text = server.engine.tokenizer.decode(r.json()["tokens"])
    assert text == ('[tools] get_weather \n[user] weather in Paris?\n[assistant] <call get_weather {"city": "Paris"}>\n'
                    "[tool] sunny (for call_1)\nA:")
    out = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL],
                                                  max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == r.json()["count"]


@pytest.fixture
def forced(server, monkeypatch):
    """Every completion's text becomes `forced.text`, revealed as tokens come (the whole of it once
    the completion finishes)."""

    class Forced:
        text = ""

    step = server.engine.step

    def forced_step():
        outs = step()
        for out in outs:
            for c in out.outputs:
                per_token = -(-len(Forced.text) // 16)
                c.text = Forced.text if c.finish_reason else Forced.text[: per_token * len(c.token_ids)]
        return outs

    monkeypatch.setattr(server.engine, "step", forced_step)
    return Forced


def test_tool_calls_parsed_back(server, forced):
    forced.text = "Let me check." + CALL
    client = server.client()
    request = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
                   max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**request)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments) == ARGS

    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Let me check." and reasons[-1] == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == ARGS

    # tool_choice "none", or no tools: the text is the answer
    out = client.chat.completions.create(**request | dict(tool_choice="none"))
    assert out.choices[0].message.content == forced.text and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "length"


def test_parallel_tool_calls_false_keeps_the_first(server, forced):
    forced.text = TWO_CALLS
    request = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "both?"}], tools=[WEATHER_TOOL],
                   max_tokens=16, extra_body={"ignore_eos": True})
    client = server.client()
    both = client.chat.completions.create(**request).choices[0].message.tool_calls
    assert [c.function.name for c in both] == ["get_weather", "get_time"]
    first = client.chat.completions.create(**request, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [c.function.name for c in first] == ["get_weather"]
    streamed = [c for chunk in client.chat.completions.create(**request, parallel_tool_calls=False, stream=True)
                for c in chunk.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in streamed] == ["get_weather"]
