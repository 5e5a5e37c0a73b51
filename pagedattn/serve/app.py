"""The OpenAI-compatible HTTP API over an `AsyncEngine` (FastAPI): `build_app(...)`.

Routes: POST /v1/completions, POST /v1/chat/completions (server-sent events with "stream"),
GET /v1/models, GET /v1/models/{id}; vLLM's POST /tokenize and POST /detokenize; GET /health,
GET /metrics, GET /version. With an API key, /v1/* needs `Authorization: Bearer <key>` (the
others are probes and tools, as in vLLM). Every error, an unknown route or method included, is
answered with OpenAI's error body.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

import pagedattn
from pagedattn.serve.async_engine import AsyncEngine
from pagedattn.serve.chat_template import render_chat
from pagedattn.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedattn.serve.serving import ServeLimits, Serving

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, model_name: str, *, api_key: str | None = None,
              limits: ServeLimits = ServeLimits(), chat_template: str | None = None) -> FastAPI:
    """The server's app; its lifespan starts and stops `engine`'s loop. `chat_template` (Jinja
    text) replaces the tokenizer's template for conversations that name none of their own."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="pagedattn", version=pagedattn.__version__, lifespan=lifespan)
    serving = Serving(engine, model_name, limits)
    metrics = engine.metrics
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        metrics.requests_refused.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, e: RequestValidationError):
        return await _api_error(request, _validation_error(e.errors(), in_body=True))

    @app.exception_handler(ValidationError)
    async def _invalid(request: Request, e: ValidationError):
        return await _api_error(request, _validation_error(e.errors(), in_body=False))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            message = f"Invalid URL ({where}): expected a route of this server (see /docs)"
        elif e.status_code == 405:
            message = f"expected {e.headers.get('Allow', 'another method') if e.headers else 'another method'} " \
                      f"for {request.url.path}, got {request.method}"
        else:
            message = str(e.detail)
        return await _api_error(request, APIError(e.status_code, message, headers=e.headers))

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

    # ------------------------------------------------------------------ probes

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return JSONResponse({"status": "error", "detail": engine.dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/version")
    async def version():
        return {"version": pagedattn.__version__}

    # ------------------------------------------------------------------ models

    def card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "pagedattn",
                "root": model_name, "parent": None, "max_model_len": serving.max_model_len}

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(check_key)])
    async def model(model_id: str):
        serving.check_model(model_id)
        return card()

    # ------------------------------------------------------------------ generation

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        serving.check_model(body.model)
        given = body.prompts()
        prompts = [serving.encode(p) if isinstance(p, str) else serving.check_token_ids(p) for p in given]
        echo = [p if isinstance(p, str) else serving.decode(p, param="prompt") for p in given] if body.echo else None
        return await serving.complete(request, body, prompts, body.max_tokens, echo=echo)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        serving.check_model(body.model)
        prompt = render_chat(serving.tokenizer, body, model_name, chat_template=chat_template)
        return await serving.complete(request, body, [prompt], body.token_limit())

    # ------------------------------------------------------------------ vLLM's tokenizer routes

    @app.post("/tokenize")
    async def tokenize(request: Request):
        raw = await _json_body(request)
        chat = isinstance(raw, dict) and "messages" in raw
        body = (TokenizeChatRequest if chat else TokenizeCompletionRequest).model_validate(raw)
        serving.check_model(body.model)
        serving.warn_ignored(body)
        if chat:
            ids = render_chat(serving.tokenizer, body, model_name, add_special_tokens=body.add_special_tokens,
                              chat_template=chat_template)
        else:
            ids = serving.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = serving.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        serving.warn_ignored(body)
        return {"prompt": serving.decode(serving.check_token_ids(body.tokens, param="tokens"))}

    return app


async def _json_body(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise APIError(400, f"expected a JSON body, got: {e}") from None


def _validation_error(errors: list[dict], *, in_body: bool) -> APIError:
    """A 400 naming every invalid field; `param` is the first one's top-level field."""

    def where(err: dict) -> list[str]:
        loc = [str(x) for x in err.get("loc", ())]
        return loc[1:] if in_body and loc[:1] == ["body"] else loc

    message = "; ".join(f"{'.'.join(where(err)) or 'body'}: {err['msg']}" for err in errors) or "invalid request"
    first = where(errors[0]) if errors and errors[0].get("type") != "json_invalid" else []
    return APIError(400, message, param=first[0] if first else None)
