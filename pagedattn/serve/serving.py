"""The request path of the completion routes: checks, the engine, the response.

Every limit is checked before a request reaches the engine, so the engine only sees requests it
can run to the end. Requests beyond the running batch wait in the engine's queue; only when
`ServeLimits.max_waiting` requests already wait is one answered 429 (with `Retry-After`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedattn.engine.grammar import GrammarError
from pagedattn.engine.outputs import RequestOutput
from pagedattn.engine.sampling_params import GuidedDecodingParams, SamplingParams
from pagedattn.serve import MAX_WAITING
from pagedattn.serve.async_engine import AsyncEngine, EngineDeadError, EngineRequest
from pagedattn.serve.guided import guided_decoding
from pagedattn.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, ignored_fields
from pagedattn.serve.responses import Reply, ReplyShape

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1
"""How often a non-streaming request checks that its client is still there."""

RETRY_AFTER_S = 1
"""What a 429 asks the client to wait (its `Retry-After` header, which OpenAI's clients honour)."""



@dataclass(frozen=True)
class ServeLimits:
    """What the server takes; None: the model's context decides."""

    max_waiting: int = MAX_WAITING  # requests waiting for the running batch; more are answered 429
    max_prompt_len: int | None = None
    max_tokens: int | None = None


class Serving:
    def __init__(self, engine: AsyncEngine, model_name: str, limits: ServeLimits):
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.spec.vocab_size
        self.grammars = engine.engine.grammars  # thread-safe, apart from the engine's state
        self._blocks = engine.engine.block_manager  # read-only here: the pool's size and a request's least blocks
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ requests

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"expected model {self.model_name!r}, got {name!r}", param="model",
                           code="model_not_found")

    def warn_ignored(self, body) -> None:
        """Log the unknown fields of `body`, each name once per server (as vLLM warns)."""
        names = [n for n in ignored_fields(body) if n not in self._warned]
        if names:
            self._warned.update(names)
            logger.warning("The following fields were present in the request but ignored: %s "
                           "(each name is logged once)", ", ".join(names))

    def encode(self, text: str, *, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, f"expected token ids, got text: {self.model_name} has no tokenizer", param=param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], *, param: str = "tokens") -> str:
        if self.tokenizer is None:
            raise APIError(400, f"expected a model with a tokenizer, got {self.model_name} which has none", param=param)
        return self.tokenizer.decode(ids)

    def check_token_ids(self, ids: list[int], *, param: str = "prompt") -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"expected token ids in [0, {self.vocab_size}), got {bad[:5]}", param=param)
        return ids

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    # ------------------------------------------------------------------ limits

    def _max_tokens(self, prompt_len: int, max_tokens: int | None, chat: bool) -> int:
        """The request's max_tokens for a prompt of `prompt_len` tokens (None: what the context leaves)."""
        max_prompt = min(self.limits.max_prompt_len or self.max_model_len, self.max_model_len - 1)
        if prompt_len > max_prompt:
            raise APIError(400, f"expected a prompt of at most {max_prompt} tokens, got {prompt_len}",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = min(self.limits.max_tokens or room, room)
        elif max_tokens > (self.limits.max_tokens or max_tokens):
            raise APIError(400, f"expected max_tokens <= {self.limits.max_tokens}, got {max_tokens}",
                           param="max_tokens")
        elif max_tokens > room:
            raise APIError(400, f"expected prompt + max_tokens <= the context of {self.max_model_len} tokens, "
                           f"got {prompt_len} + {max_tokens}", param="max_tokens", code="context_length_exceeded")
        blocks = self._blocks.min_blocks(prompt_len + max_tokens)  # every KV cache group's
        if blocks > self._blocks.num_blocks:
            raise APIError(400, f"expected a request that fits the KV cache of {self._blocks.num_blocks} blocks of "
                           f"{self._blocks.block_size} tokens, got {prompt_len} + {max_tokens} tokens ({blocks} blocks)",
                           param="max_tokens")
        return max_tokens

    def _sampling_params(self, body, max_tokens: int, guided: GuidedDecodingParams | None) -> SamplingParams:
        """The engine's options for `body` (a prompt of it that may generate `max_tokens`)."""
        logprobs, prompt_logprobs = _logprobs(body)
        try:
            params = SamplingParams(
                n=body.num_choices, best_of=getattr(body, "best_of", None),
                temperature=_or(body.temperature, 1.0), top_p=_or(body.top_p, 1.0), top_k=_or(body.top_k, -1),
                max_tokens=max_tokens, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos,
                presence_penalty=_or(body.presence_penalty, 0.0), frequency_penalty=_or(body.frequency_penalty, 0.0),
                repetition_penalty=_or(body.repetition_penalty, 1.0), min_p=_or(body.min_p, 0.0),
                min_tokens=body.min_tokens, stop_token_ids=body.stop_token_ids, logit_bias=body.logit_bias,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, guided_decoding=guided,
            )
        except ValueError as e:
            raise APIError(400, str(e), param=_named_param(str(e))) from None
        error = params.vocab_error(self.vocab_size)
        if error is not None:
            raise APIError(400, error, param=_named_param(error))
        return params

    # ------------------------------------------------------------------ serving

    async def complete(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                       prompts: list[list[int]], max_tokens: int | None, *, echo: list[str] | None = None):
        """Answer `body` (its model already checked) for `prompts` (token ids, one per prompt);
        `echo`: each prompt's text, when the answer starts with it."""
        chat = isinstance(body, ChatCompletionRequest)
        self.warn_ignored(body)
        guided = await self._guided_decoding(body)
        n = body.num_choices
        best_of = getattr(body, "best_of", None)
        if body.stream and best_of is not None and best_of > n:
            raise APIError(400, f"expected best_of <= n with stream, got best_of={best_of}, n={n}", param="best_of")
        generate = max_tokens != 0
        if not generate and echo is None:
            raise APIError(400, "expected max_tokens >= 1, or 0 with echo (the prompt alone), got 0",
                           param="max_tokens")
        # max_tokens=0 with echo: the prompt's log-probabilities need a step; its token is not answered
        params = [self._sampling_params(body, self._max_tokens(len(p), max_tokens if generate else 1, chat), guided)
                  for p in prompts]
        if self.engine.dead is not None:
            raise APIError(503, f"expected a running engine, got: {self.engine.dead}", type="server_error")
        waiting = self.engine.num_waiting
        if waiting + len(prompts) > self.limits.max_waiting:
            raise APIError(429, f"expected at most {self.limits.max_waiting} requests waiting, got {waiting} and "
                           f"{len(prompts)} more; retry later", type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        requests = [EngineRequest(f"{request_id}-{p}", ids, sp) for p, (ids, sp) in enumerate(zip(prompts, params))]
        tools = chat and body.parses_tool_calls
        shape = ReplyShape(
            chat=chat, n=n, prompts=prompts, tools=tools, forced_tool=tools and body.forced_tool is not None,
            parallel_tool_calls=not tools or body.parallel_tool_calls is not False,
            logprobs=params[0].logprobs, echo=echo, generate=generate,
            prompt_logprobs=body.prompt_logprobs is not None,
        )
        reply = Reply(request_id, self.model_name, shape, self._decode_token)
        outputs = self.engine.generate(requests)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            index = {r.request_id: p for p, r in enumerate(requests)}
            return _EngineStream(reply.events(outputs, index, params[0].stop, usage), media_type="text/event-stream")
        last = await _last_outputs(request, outputs)
        outs = [last[r.request_id] for r in requests]
        for out in outs:
            if out.error is not None:
                raise APIError(400, out.error)
        return reply.whole(outs)

    async def _guided_decoding(self, body) -> GuidedDecodingParams | None:
        """The request's guided decoding, compiled once here (off the event loop; the engine's
        compiler caches it) so that a spec xgrammar refuses is a 400 naming its field."""
        found = guided_decoding(body)
        if found is None:
            return None
        spec, param = found
        try:
            await asyncio.to_thread(self.grammars.compile, spec)
        except GrammarError as e:
            raise APIError(400, str(e), param=param) from None
        return spec


def _or(value, default):
    return default if value is None else value


def _logprobs(body) -> tuple[int | None, int | None]:
    """The engine's `logprobs` and `prompt_logprobs` for `body`, as vLLM maps them: chat's
    `top_logprobs` (0 with `logprobs` alone); completions' `logprobs`, also for the prompt with `echo`."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, f"expected logprobs true with top_logprobs, got top_logprobs={body.top_logprobs} "
                           "alone", param="logprobs")
        return (_or(body.top_logprobs, 0) if body.logprobs else None), body.prompt_logprobs
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo and body.logprobs is not None:
        prompt_logprobs = body.logprobs
    return body.logprobs, prompt_logprobs


def _named_param(message: str) -> str | None:
    """The option an engine message ("expected -2 <= presence_penalty <= 2, ...") is about."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                 "stop_token_ids", "logit_bias", "prompt_logprobs", "logprobs", "best_of", "top_k", "top_p",
                 "temperature", "seed", "stop", "n"):
        if f" {name} " in f" {message.replace(',', ' ').replace('=', ' ')} ":
            return name
    return None


async def _last_outputs(request: Request, outputs: AsyncIterator[RequestOutput]) -> dict[str, RequestOutput]:
    """The final output of each engine request; they are aborted when the client disconnects first."""

    async def last() -> dict[str, RequestOutput]:
        result = {}
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                result[out.request_id] = out
        return result

    task = asyncio.ensure_future(last())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                raise APIError(499, "client closed the request", code="client_closed_request")
    finally:
        if not task.done():
            task.cancel()  # the generator's exit aborts the requests
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    try:
        return task.result()
    except EngineDeadError as e:
        raise APIError(503, f"expected a running engine, got: {e}", type="server_error") from None
    except ValueError as e:
        raise APIError(400, str(e)) from None


class _EngineStream(StreamingResponse):
    """A streaming response that always closes its body, even when the client left before the
    first byte (Starlette then never starts the body): closing it aborts the requests."""

    def __init__(self, body: AsyncIterator[str], *, media_type: str):
        super().__init__(body, media_type=media_type)
        self._body = body

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
