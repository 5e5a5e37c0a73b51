"""OpenAI's response bodies for one HTTP request: whole, or as server-sent events.

A request has `len(prompts) * n` choices; the choice of prompt p's completion j has index
`p * n + j`, as OpenAI and vLLM number them. Usage counts each prompt once and every completion.
With `echo` a completion's text (and log-probabilities) start with its prompt's; a stream sends
them in the choice's first chunk, once the prompt is computed.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedattn.engine.outputs import CompletionOutput, RequestOutput
from pagedattn.serve.async_engine import EngineDeadError
from pagedattn.serve.logprobs import CompletionLogprobs, chat_logprobs, prompt_logprobs_json
from pagedattn.serve.protocol import APIError
from pagedattn.serve.tool_parser import ToolCallStream, extract_tool_calls, tool_call_id


@dataclass(frozen=True)
class ReplyShape:
    """What one request's answer holds, beyond the engine's outputs."""

    chat: bool
    n: int  # completions per prompt
    prompts: list[list[int]]  # each prompt's token ids, in prompt order
    tools: bool = False  # parse tool calls out of chat answers (Hermes style)
    forced_tool: bool = False  # a named tool_choice: its answer finishes as "stop" (OpenAI's, vLLM's), not "tool_calls"
    parallel_tool_calls: bool = True  # False: each answer's first call only
    logprobs: int | None = None  # completions' `logprobs`, chat's `top_logprobs` (0: logprobs=true alone)
    echo: list[str] | None = None  # completions' echo: each prompt's text
    generate: bool = True  # False: echo with max_tokens=0 (the engine's one token is not answered)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs, in whole answers


@dataclass
class _ChoiceStream:
    """Where one choice's stream stands."""

    sent: int = 0  # characters of the completion's text read so far
    tokens: int = 0  # tokens whose log-probabilities were sent
    tools: ToolCallStream | None = None
    logprobs: CompletionLogprobs | None = None
    echoed: bool = False
    called: bool = False  # a tool call was sent
    done: bool = False  # its last chunk was sent


class Reply:
    """`decode`: a token id's text (completions' log-probabilities of a prompt's first token)."""

    def __init__(self, request_id: str, model: str, shape: ReplyShape, decode: Callable[[int], str]):
        self.id = request_id
        self.model = model
        self.shape = shape
        self.decode = decode
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.shape.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _usage(self, outs: list[RequestOutput | None]) -> dict:
        prompt = sum(map(len, self.shape.prompts))
        generated = sum(len(c.token_ids) for out in outs if out is not None for c in out.outputs)
        generated = generated if self.shape.generate else 0
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    def _answered(self, c: CompletionOutput) -> tuple[str, list[int], list]:
        """(text, token ids, their log-probabilities) of `c` that the answer holds."""
        if not self.shape.generate:
            return "", [], []
        return c.text, c.token_ids, c.logprobs or []

    # ------------------------------------------------------------------ whole

    def whole(self, outs: list[RequestOutput]) -> dict:
        """The body of a finished request; `outs`: the last output of each prompt, in prompt order."""
        choices = []
        for p, out in enumerate(outs):
            for j, c in enumerate(out.outputs):
                index = p * self.shape.n + j
                choices.append(self._message_choice(index, c) if self.shape.chat else self._text_choice(index, p, out, c))
        body = {**self._envelope(choices, chunk=False), "usage": self._usage(outs)}
        if self.shape.chat and self.shape.prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_json(outs[0].prompt_logprobs)
        return body

    def _text_choice(self, index: int, p: int, out: RequestOutput, c: CompletionOutput) -> dict:
        text, token_ids, positions = self._answered(c)
        if self.shape.echo is not None:
            text = self.shape.echo[p] + text
            token_ids, positions = out.prompt_token_ids + token_ids, (out.prompt_logprobs or []) + positions
        logprobs = None
        if self.shape.logprobs is not None:
            logprobs = CompletionLogprobs(self.shape.logprobs, self.decode).add(token_ids, positions)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if self.shape.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return choice

    def _message_choice(self, index: int, c: CompletionOutput) -> dict:
        message = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if self.shape.tools:
            content, calls = extract_tool_calls(c.text)
            if calls:
                calls = calls if self.shape.parallel_tool_calls else calls[:1]
                message = {"role": "assistant", "content": content,
                           "tool_calls": [{"id": tool_call_id(), "type": "function", "function": f} for f in calls]}
                finish_reason = finish_reason if self.shape.forced_tool else "tool_calls"
        logprobs = None
        if self.shape.logprobs is not None:
            logprobs = {"content": chat_logprobs(c.token_ids, c.logprobs or [], self.shape.logprobs)}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": c.stop_reason}

    # ------------------------------------------------------------------ streamed

    async def events(self, outputs: AsyncIterator[RequestOutput], prompt_index: dict[str, int], stops: list[str],
                     usage: bool) -> AsyncIterator[str]:
        """Server-sent events of every choice's deltas, then "[DONE]". `prompt_index`: engine
        request id -> its prompt's position. A stop string ends a completion without its own
        text, so the last `len(longest stop) - 1` characters are held back until they can no
        longer start one. A chat stream opens each choice with its role."""
        shape = self.shape
        hold = max(map(len, stops), default=1) - 1
        choices = [
            _ChoiceStream(tools=ToolCallStream() if shape.tools else None,
                          logprobs=None if shape.chat or shape.logprobs is None else
                          CompletionLogprobs(shape.logprobs, self.decode))
            for _ in range(len(shape.prompts) * shape.n)
        ]
        last: list[RequestOutput | None] = [None] * len(shape.prompts)
        if shape.chat:
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
                        index = p * shape.n + j
                        chunk = self._delta(index, p, choices[index], out, c, hold)
                        if chunk is not None:
                            yield self._event([chunk])
            except EngineDeadError as e:
                yield _event(APIError(503, f"expected a running engine, got: {e}", type="server_error").body())
                return
        if usage:
            yield _event({**self._envelope([], chunk=True), "usage": self._usage(last)})
        yield "data: [DONE]\n\n"

    def _delta(self, index: int, p: int, state: _ChoiceStream, out: RequestOutput, c: CompletionOutput,
               hold: int) -> dict | None:
        """The chunk of what choice `index` (of prompt `p`) has that was not sent, or None."""
        if state.done:
            return None
        shape = self.shape
        finished = c.finish_reason is not None
        text, token_ids, positions = self._answered(c)
        end = len(text) if finished else max(state.sent, len(text) - hold)
        if state.tools is not None:
            content, calls = state.tools.feed(text[:end], final=finished)
        else:
            content, calls = text[state.sent:end], []
        state.sent = end
        if not shape.parallel_tool_calls:
            calls = [call for call in calls if call["index"] == 0]
        state.called = state.called or bool(calls)
        prefix_ids, prefix_positions = [], []
        if shape.echo is not None and not state.echoed and (c.token_ids or finished):  # the prompt is computed
            state.echoed = True
            content = shape.echo[p] + content
            prefix_ids, prefix_positions = out.prompt_token_ids, out.prompt_logprobs or []
        if not (content or calls or finished):
            return None
        state.done = finished
        new_ids, new_positions = token_ids[state.tokens:], positions[state.tokens:]
        state.tokens = len(token_ids)
        finish_reason = None
        if finished:
            finish_reason = "tool_calls" if state.called and not shape.forced_tool else c.finish_reason
        stop_reason = c.stop_reason if finished else None
        if not shape.chat:
            logprobs = None
            if state.logprobs is not None:
                logprobs = state.logprobs.add(prefix_ids + new_ids, prefix_positions + new_positions)
            return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        delta = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        logprobs = None
        if shape.logprobs is not None:
            logprobs = {"content": chat_logprobs(new_ids, new_positions, shape.logprobs)}
        return self._chunk_choice(index, delta, finish_reason, logprobs, stop_reason)

    def _chunk_choice(self, index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None,
                      stop_reason: int | str | None = None) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def _event(self, choices: list[dict]) -> str:
        return _event(self._envelope(choices, chunk=True))


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
