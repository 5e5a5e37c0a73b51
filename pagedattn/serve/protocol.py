"""The OpenAI API's request bodies (pydantic, checked on arrival) and its error shape.

Fields the engine cannot honour (logprobs, penalties, logit bias, tools, ...) are not declared,
and unknown fields are refused: a request is never answered as if an option had been applied.
`top_k` and `ignore_eos` are extensions, as in vLLM.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered with `status` and OpenAI's body `{"error": {...}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None  # an end-user id for the caller's own logs; no effect here


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: what the context leaves after the prompt
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens

    def token_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise APIError(400, "expected one of max_tokens and max_completion_tokens, got both",
                               param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
