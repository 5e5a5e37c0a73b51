"""A request's guided decoding (vLLM's structured outputs), from its OpenAI and vLLM fields.

`guided_decoding(body)` gathers one `GuidedDecodingParams` from, at most one kind among them:
- `response_format`: `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (the schema, strict or not); "text" guides nothing;
- vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (EBNF, or Lark's
  syntax), and `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`,
  `structural_tag`, and `disable_any_whitespace`, which applies to whichever kind is given);
- chat's `tool_choice` "required" or a named function (with `tools`): the answer is Hermes
  `<tool_call>` blocks, each `{"name": <a tool's name>, "arguments": <its parameters' schema>}`,
  one for a named function, one or more for "required" (one with `parallel_tool_calls: false`),
  as xgrammar's structural tag; the tool parser then reads them as `tool_calls`.
Two kinds, vLLM's `guided_whitespace_pattern` (xgrammar takes none) and a backend other than
xgrammar are 400s naming the field. Whether the spec compiles is checked by the caller
(`Serving.complete`, through the engine's compiler) before the request is queued.
"""

from __future__ import annotations

import json

from pagedattn.engine.sampling_params import GuidedDecodingParams
from pagedattn.serve.protocol import APIError, ChatCompletionRequest, Tool
from pagedattn.serve.tool_parser import END, START

_COMPACT_WHITESPACE = 1  # disable_any_whitespace in a tool call's arguments: at most one blank between tokens


def guided_decoding(body) -> tuple[GuidedDecodingParams, str] | None:
    """(the request's guided decoding, the field it came from) or None; `APIError` 400s."""
    kinds: dict[str, tuple[str, object]] = {}  # GuidedDecodingParams field -> (request field, value)

    def add(kind: str, param: str, value) -> None:
        if value is None or value is False:
            return
        if kinds:
            (other, _), = kinds.values()
            raise APIError(400, f"expected one kind of guided decoding, got {other} and {param}", param=param)
        kinds[kind] = (param, value)

    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        add("json_object", "response_format", True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "expected response_format.json_schema with a 'schema' for type 'json_schema', got none",
                           param="response_format")
        add("json", "response_format", fmt.json_schema.json_schema)
    for kind in ("json", "regex", "choice", "grammar"):
        add(kind, f"guided_{kind}", getattr(body, f"guided_{kind}"))
    outputs = body.structured_outputs
    if outputs is not None:
        for kind in ("json", "regex", "choice", "grammar", "json_object", "structural_tag"):
            add(kind, "structured_outputs", getattr(outputs, "json_schema" if kind == "json" else kind))
    if isinstance(body, ChatCompletionRequest):
        add("structural_tag", "tool_choice", _tool_calls(body, outputs is not None and outputs.disable_any_whitespace))
    if body.guided_whitespace_pattern is not None or (outputs is not None and outputs.whitespace_pattern is not None):
        param = "guided_whitespace_pattern" if body.guided_whitespace_pattern is not None else "structured_outputs"
        raise APIError(400, "expected no whitespace pattern: xgrammar, the guided decoding backend, takes none "
                       "(structured_outputs.disable_any_whitespace asks for compact JSON)", param=param)
    if body.guided_decoding_backend not in (None, "xgrammar", "auto"):
        raise APIError(400, f"expected guided_decoding_backend 'xgrammar' (the only one), got "
                       f"{body.guided_decoding_backend!r}", param="guided_decoding_backend")
    if not kinds:
        return None
    (kind, (param, value)), = kinds.items()
    try:
        spec = GuidedDecodingParams(**{kind: value},
                                    disable_any_whitespace=outputs is not None and outputs.disable_any_whitespace)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None
    return spec, param


def _tool_calls(body: ChatCompletionRequest, compact: bool) -> dict | None:
    """The structural tag of the calls a "required" or named `tool_choice` forces, else None."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    if not body.tools:
        raise APIError(400, f"expected tools with tool_choice {_shown(choice)}, got none", param="tool_choice")
    if body.forced_tool is not None:
        named = [t for t in body.tools if t.function.name == body.forced_tool]
        if not named:
            names = [t.function.name for t in body.tools]
            raise APIError(400, f"expected tool_choice to name one of the tools {names}, got {body.forced_tool!r}",
                           param="tool_choice")
        return {"type": "structural_tag", "format": _call_tag(named[0], compact)}
    return {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": [_call_tag(t, compact) for t in body.tools], "separator": "\n",
        "at_least_one": True, "stop_after_first": body.parallel_tool_calls is False}}


def _call_tag(tool: Tool, compact: bool) -> dict:
    """One Hermes call of `tool`: `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`."""
    parameters = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    content = {"type": "json_schema", "json_schema": parameters}
    if compact:
        content["max_whitespace_cnt"] = _COMPACT_WHITESPACE
    name = json.dumps(tool.function.name, ensure_ascii=False)
    return {"type": "tag", "begin": f'{START}\n{{"name": {name}, "arguments": ', "content": content,
            "end": f"}}\n{END}"}


def _shown(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
