"""OpenAI's response bodies for one HTTP request: whole, or as server-sent events.

A request has `len(prompts) * n` choices; the choice of prompt p's completion j has index
`p * n + j`, as OpenAI and vLLM number them. Usage counts each prompt once and every completion.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedattn.engine.outputs import CompletionOutput, RequestOutput
from pagedattn.serve.async_engine import EngineDeadError
from pagedattn.serve.protocol import APIError
from pagedattn.serve.tool_parser import ToolCallStream, extract_tool_calls, tool_call_id


@dataclass
class _ChoiceStream:
    """Where one choice's stream stands."""

    sent: int = 0  # characters of the completion's text read so far
    tools: ToolCallStream | None = None
    called: bool = False  # a tool call was sent
    done: bool = False  # its last chunk was sent


class Reply:
    """`prompt_lens`: each prompt's length, in prompt order; `n`: completions per prompt.
    `tools`: parse tool calls out of chat answers (Hermes style); `parallel_tool_calls`: False
    keeps each answer's first call only."""

    def __init__(self, request_id: str, model: str, *, chat: bool, prompt_lens: list[int], n: int,
                 tools: bool = False, parallel_tool_calls: bool = True):
        self.id = request_id
        self.model = model
        self.chat = chat
        self.prompt_lens = prompt_lens
        self.n = n
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _usage(self, outs: list[RequestOutput | None]) -> dict:
        prompt = sum(self.prompt_lens)
        generated = sum(len(c.token_ids) for out in outs if out is not None for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    # ------------------------------------------------------------------ whole

    def whole(self, outs: list[RequestOutput]) -> dict:
        """The body of a finished request; `outs`: the last output of each prompt, in prompt order."""
        choices = []
        for p, out in enumerate(outs):
            for j, c in enumerate(out.outputs):
                index = p * self.n + j
                choices.append(self._message_choice(index, c) if self.chat else
                               {"index": index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason})
        return {**self._envelope(choices, chunk=False), "usage": self._usage(outs)}

    def _message_choice(self, index: int, c: CompletionOutput) -> dict:
        message = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if self.tools:
            content, calls = extract_tool_calls(c.text)
            if calls:
                calls = calls if self.parallel_tool_calls else calls[:1]
                message = {"role": "assistant", "content": content,
                           "tool_calls": [{"id": tool_call_id(), "type": "function", "function": f} for f in calls]}
                finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason}

    # ------------------------------------------------------------------ streamed

    async def events(self, outputs: AsyncIterator[RequestOutput], prompt_index: dict[str, int], stops: list[str],
                     usage: bool) -> AsyncIterator[str]:
        """Server-sent events of every choice's deltas, then "[DONE]". `prompt_index`: engine
        request id -> its prompt's position. A stop string ends a completion without its own
        text, so the last `len(longest stop) - 1` characters are held back until they can no
        longer start one. A chat stream opens each choice with its role."""
        hold = max(map(len, stops), default=1) - 1
        choices = [_ChoiceStream(tools=ToolCallStream() if self.tools else None)
                   for _ in range(len(self.prompt_lens) * self.n)]
        last: list[RequestOutput | None] = [None] * len(self.prompt_lens)
        if self.chat:
            for index in range(len(choices)):
                yield self._event([self._chunk_choice(index, {"role": "assistant", "content": ""}, None)])
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    p = prompt_index[out.request_id]
                    last[p] = out
                    if out.error is not None:
                        yield _event(APIError(400, out.error).body())
                        return
                    for j, c in enumerate(out.outputs):
                        index = p * self.n + j
                        chunk = self._delta(index, choices[index], c, hold)
                        if chunk is not None:
                            yield self._event([chunk])
            except EngineDeadError as e:
                yield _event(APIError(503, f"expected a running engine, got: {e}", type="server_error").body())
                return
        if usage:
            yield _event({**self._envelope([], chunk=True), "usage": self._usage(last)})
        yield "data: [DONE]\n\n"

    def _delta(self, index: int, state: _ChoiceStream, c: CompletionOutput, hold: int) -> dict | None:
        """The chunk of what choice `index` has that was not sent, or None."""
        if state.done:
            return None
        finished = c.finish_reason is not None
        end = len(c.text) if finished else max(state.sent, len(c.text) - hold)
        if state.tools is not None:
            content, calls = state.tools.feed(c.text[:end], final=finished)
        else:
            content, calls = c.text[state.sent:end], []
        state.sent = end
        if not self.parallel_tool_calls:
            calls = [call for call in calls if call["index"] == 0]
        state.called = state.called or bool(calls)
        if not (content or calls or finished):
            return None
        state.done = finished
        finish_reason = ("tool_calls" if state.called else c.finish_reason) if finished else None
        if not self.chat:
            return {"index": index, "text": content, "logprobs": None, "finish_reason": finish_reason}
        delta = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return self._chunk_choice(index, delta, finish_reason)

    def _chunk_choice(self, index: int, delta: dict, finish_reason: str | None) -> dict:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _event(self, choices: list[dict]) -> str:
        return _event(self._envelope(choices, chunk=True))


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
