"""Tool calls in a model's text, Hermes style (Hermes 2 Pro, Qwen2/2.5/3, SmolLM3 and others):

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`extract_tool_calls` reads a whole answer as vLLM's `hermes` parser does: no `<tool_call>`, the
text is the content; else each block (the last one may lack its closing tag) must be a JSON
object with "name" and "arguments", the content is the text before the first block (None if
empty), and text after it is dropped; one malformed block makes the whole text content.

`ToolCallStream` reads the same text as it grows (server-sent events): content before the first
block is streamed, holding back a tail that may be the start of `<tool_call>`; each block is
sent as one complete call once it closes (or at the end). A streamed malformed block is sent as
content (its text; the blocks before it were already sent as calls).
"""

from __future__ import annotations

import json
import logging
import re
import uuid

logger = logging.getLogger(__name__)

START = "<tool_call>"
END = "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END) + "|" + re.escape(START) + r"(.*)", re.DOTALL)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(block: str) -> dict:
    """One block's call as OpenAI's `function` object; ValueError/KeyError/TypeError when malformed."""
    obj = json.loads(block)
    return {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}


def extract_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole answer; each call is `{"name", "arguments"}` (arguments: JSON text)."""
    if START not in text:
        return text, []
    try:
        calls = [_call(closed or open_) for closed, open_ in _BLOCK.findall(text)]
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("a tool call could not be parsed (%s); answering the text as content", e)
        return text, []
    content = text[: text.find(START)]
    return content or None, calls


def _partial_start(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of START."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:n]):
            return n
    return 0


class ToolCallStream:
    """One choice's text, fed as it grows; see the module doc."""

    def __init__(self):
        self.pos = 0  # characters of the text consumed
        self.in_calls = False  # the first START was seen: only calls follow
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content to send, calls to send) for the text so far (a prefix that only grows);
        `final`: the text is complete."""
        content = ""
        if not self.in_calls:
            start = text.find(START, self.pos)
            if start < 0:
                end = len(text) if final else len(text) - _partial_start(text)
                content, self.pos = text[self.pos:end], max(self.pos, end)
                return content, []
            content, self.pos, self.in_calls = text[self.pos:start], start, True
        calls = []
        while True:
            start = text.find(START, self.pos)
            if start < 0:
                if final:
                    self.pos = len(text)  # text between or after calls is dropped, as in `extract_tool_calls`
                break
            body = start + len(START)
            end = text.find(END, body)
            if end < 0 and not final:
                break
            block, stop = (text[body:end], end + len(END)) if end >= 0 else (text[body:], len(text))
            try:
                call = _call(block)
            except (ValueError, KeyError, TypeError) as e:
                logger.warning("a streamed tool call could not be parsed (%s); sending it as content", e)
                content += text[start:stop]
            else:
                calls.append({"index": self.num_calls, "id": tool_call_id(), "type": "function", "function": call})
                self.num_calls += 1
            self.pos = stop
        return content, calls
