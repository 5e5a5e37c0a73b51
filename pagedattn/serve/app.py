"""The OpenAI-compatible HTTP API over an `AsyncEngine` (FastAPI): `build_app(...)`.

Routes: POST /v1/completions, POST /v1/chat/completions (server-sent events with "stream"),
GET /v1/models, GET /health, GET /metrics. With an API key, /v1/* needs `Authorization: Bearer
<key>`. Every refusal is a 4xx with OpenAI's error body; limits are checked before a request
reaches the engine, so the engine only sees requests it can run to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedattn.engine.outputs import RequestOutput
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.intmath import cdiv
from pagedattn.serve.async_engine import AsyncEngine, EngineDeadError
from pagedattn.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1
"""How often a non-streaming request checks that its client is still there."""


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for; None: the model's context decides."""

    max_concurrent: int = 64  # requests in flight; more are answered 429
    max_prompt_len: int | None = None
    max_tokens: int | None = None


def build_app(engine: AsyncEngine, model_name: str, *, api_key: str | None = None,
              limits: ServeLimits = ServeLimits()) -> FastAPI:
    """The server's app; its lifespan starts and stops `engine`'s loop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="pagedattn", lifespan=lifespan)
    api = _API(engine, model_name, limits)
    metrics = engine.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        metrics.requests_refused.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:]) or 'body'}: {err['msg']}" for err in e.errors())
        return await _api_error(request, APIError(400, message, param=where))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.exception("unexpected error answering %s", request.url.path)
        return await _api_error(request, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "expected 'Authorization: Bearer <api key>' with the server's key",
                           type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return JSONResponse({"status": "error", "detail": engine.dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        card = {"id": model_name, "object": "model", "created": api.created, "owned_by": "pagedattn",
                "max_model_len": engine.engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            prompt_ids = api.encode(body.prompt)
        else:
            prompt_ids = api.check_token_ids(body.prompt)
        return await api.serve(request, body, prompt_ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        prompt_ids = api.apply_chat_template(body)
        return await api.serve(request, body, prompt_ids, body.token_limit(), chat=True)

    return app


class _API:
    """The request path shared by both completion routes: limits, the engine, the response."""

    def __init__(self, engine: AsyncEngine, model_name: str, limits: ServeLimits):
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.in_flight = 0
        self.created = int(time.time())

    # ------------------------------------------------------------------ prompts

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, f"expected token ids as the prompt, got text: {self.model_name} has no tokenizer",
                           param="prompt")
        return list(self.tokenizer.encode(text))

    def check_token_ids(self, ids: list[int]) -> list[int]:
        vocab = self.engine.engine.spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"expected token ids in [0, {vocab}), got {bad[:5]}", param="prompt")
        return ids

    def apply_chat_template(self, body: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"expected a model with a chat template, got {self.model_name} which has none "
                           "(use /v1/completions)", param="messages")
        # Many templates know no "developer" role: it is OpenAI's newer name of "system".
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # ------------------------------------------------------------------ limits

    def _sampling_params(self, body, prompt_len: int, max_tokens: int | None, chat: bool) -> SamplingParams:
        if body.model != self.model_name:
            raise APIError(404, f"expected model {self.model_name!r}, got {body.model!r}", param="model",
                           code="model_not_found")
        if body.stream and body.n > 1:
            raise APIError(400, f"expected n=1 with stream, got n={body.n}", param="n")
        max_prompt = min(self.limits.max_prompt_len or self.max_model_len, self.max_model_len - 1)
        if prompt_len > max_prompt:
            raise APIError(400, f"expected a prompt of at most {max_prompt} tokens, got {prompt_len}",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        room = self.max_model_len - prompt_len
        token_cap = min(self.limits.max_tokens or room, room)
        if max_tokens is None:
            max_tokens = token_cap
        elif max_tokens > (self.limits.max_tokens or max_tokens):
            raise APIError(400, f"expected max_tokens <= {self.limits.max_tokens}, got {max_tokens}",
                           param="max_tokens")
        elif max_tokens > room:
            raise APIError(400, f"expected prompt + max_tokens <= the context of {self.max_model_len} tokens, "
                           f"got {prompt_len} + {max_tokens}", param="max_tokens", code="context_length_exceeded")
        bm = self.engine.engine.block_manager
        blocks = cdiv(prompt_len + max_tokens, bm.block_size)
        if blocks > bm.num_blocks:
            raise APIError(400, f"expected a request that fits the KV cache of {bm.num_blocks} blocks of "
                           f"{bm.block_size} tokens, got {prompt_len} + {max_tokens} tokens ({blocks} blocks)",
                           param="max_tokens")
        try:
            return SamplingParams(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                  max_tokens=max_tokens, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # ------------------------------------------------------------------ serving

    async def serve(self, request: Request, body, prompt_ids: list[int], max_tokens: int | None, *, chat: bool):
        params = self._sampling_params(body, len(prompt_ids), max_tokens, chat)
        if self.engine.dead is not None:
            raise APIError(503, f"expected a running engine, got: {self.engine.dead}", type="server_error")
        if self.in_flight >= self.limits.max_concurrent:
            raise APIError(429, f"expected at most {self.limits.max_concurrent} requests in flight, got one more; "
                           "retry later", type="rate_limit_error", code="too_many_requests")
        self.in_flight += 1
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        reply = _Reply(request_id, self.model_name, chat, len(prompt_ids))
        outputs = self.engine.generate(prompt_ids, params, request_id)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            events = reply.events(outputs, params.stop, usage)
            return _EngineStream(events, on_close=self._release, media_type="text/event-stream")
        try:
            last = await _last_output(request, outputs)
        finally:
            self._release()
        if last.error is not None:
            raise APIError(400, last.error)
        return reply.whole(last)

    def _release(self) -> None:
        self.in_flight -= 1


async def _last_output(request: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output; the request is aborted when its client disconnects first."""

    async def last() -> RequestOutput:
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                result = out
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
            task.cancel()  # the generator's exit aborts the request
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    try:
        return task.result()
    except EngineDeadError as e:
        raise APIError(503, f"expected a running engine, got: {e}", type="server_error") from None
    except ValueError as e:
        raise APIError(400, str(e)) from None


class _EngineStream(StreamingResponse):
    """A streaming response that always closes its body and calls `on_close` once, even when the
    client left before the first byte (Starlette then never starts the body)."""

    def __init__(self, body: AsyncIterator[str], *, on_close, media_type: str):
        super().__init__(body, media_type=media_type)
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            self._on_close()


class _Reply:
    """OpenAI's response bodies for one request: whole, or as server-sent events."""

    def __init__(self, request_id: str, model: str, chat: bool, prompt_len: int):
        self.id = request_id
        self.model = model
        self.chat = chat
        self.prompt_len = prompt_len
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _usage(self, out: RequestOutput) -> dict:
        generated = sum(len(c.token_ids) for c in out.outputs)
        return {"prompt_tokens": self.prompt_len, "completion_tokens": generated,
                "total_tokens": self.prompt_len + generated}

    def whole(self, out: RequestOutput) -> dict:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                        "finish_reason": c.finish_reason, "logprobs": None} for i, c in enumerate(out.outputs)]
        else:
            choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
                       for i, c in enumerate(out.outputs)]
        return {**self._envelope(choices, chunk=False), "usage": self._usage(out)}

    def _chunk(self, text: str | None, finish_reason: str | None, first: bool) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return self._envelope([choice], chunk=True)

    async def events(self, outputs: AsyncIterator[RequestOutput], stops: list[str], usage: bool) -> AsyncIterator[str]:
        """Server-sent events of the text's deltas, then "[DONE]". A stop string ends a completion
        without its own text, so the last `len(longest stop) - 1` characters are held back until
        they can no longer start one."""
        hold = max(map(len, stops), default=1) - 1
        sent, first, last = 0, True, None
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    last = out
                    c = out.outputs[0]
                    if c.finish_reason == "error":
                        yield _event(APIError(400, out.error or "request failed").body())
                        return
                    end = len(c.text) if out.finished else max(sent, len(c.text) - hold)
                    if end > sent or first or out.finished:
                        yield _event(self._chunk(c.text[sent:end], c.finish_reason if out.finished else None, first))
                        sent, first = end, False
            except EngineDeadError as e:
                yield _event(APIError(503, f"expected a running engine, got: {e}", type="server_error").body())
                return
        if usage and last is not None:
            yield _event({**self._envelope([], chunk=True), "usage": self._usage(last)})
        yield "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
