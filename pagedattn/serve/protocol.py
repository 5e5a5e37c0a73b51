"""The OpenAI API's request bodies (pydantic, checked on arrival) and its error shape.

As vLLM does, a field this server does not know is accepted and ignored (`ignored_fields` names
them; the server logs each name once), so clients written for OpenAI or vLLM keep working. A
known option the engine cannot honour is refused where it is declared, never answered as if
applied. Sampling options keep vLLM's names and map to `SamplingParams` (`serving.Serving`);
the fields of guided decoding (`response_format`, vLLM's `guided_*` and `structured_outputs`,
chat's forcing `tool_choice`) map to one `GuidedDecodingParams` (`guided.guided_decoding`).
`top_k`, `ignore_eos`, `add_generation_prompt`, `continue_final_message` and
`chat_template_kwargs` are vLLM's extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


MAX_LOGPROBS = 20
"""The most log-probabilities per position a request may ask (vLLM's default `max_logprobs`)."""


class APIError(Exception):
    """An error answered with `status` and OpenAI's body `{"error": {...}}` (plus `headers`)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class OpenAIModel(BaseModel):
    """A request object: unknown fields are kept (in `model_extra`) to be reported, not refused."""

    model_config = ConfigDict(extra="allow")


def ignored_fields(obj: Any, path: str = "") -> list[str]:
    """The dotted names of every unknown field of a parsed request, nested objects included
    (`messages.foo`: field foo of some message)."""
    if isinstance(obj, (list, tuple)):
        return sorted({name for item in obj for name in ignored_fields(item, path)})
    if not isinstance(obj, BaseModel):
        return []
    names = [f"{path}{k}" for k in (obj.model_extra or {})]
    for field in type(obj).model_fields:
        names += ignored_fields(getattr(obj, field), f"{path}{field}.")
    return sorted(set(names))


# ---------------------------------------------------------------------- sampling


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    """OpenAI's `response_format.json_schema`; `strict` or not, the schema is enforced."""

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` (its newer name for the guided_* fields): one kind, and
    `disable_any_whitespace` for JSON (xgrammar's fixed separators)."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None  # refused: xgrammar takes no whitespace pattern


class _SamplingRequest(OpenAIModel):
    model: str | None = None  # None: the served model
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1
    top_p: float | None = Field(None, gt=0, le=1)  # None: 1
    top_k: int | None = Field(None, ge=-1)  # None: every token
    n: int | None = Field(None, ge=1)  # None: 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(None, ge=-1, le=MAX_LOGPROBS)  # vLLM's; -1: the whole vocabulary
    response_format: ResponseFormat | None = None
    # vLLM's guided decoding fields (`guided.guided_decoding`)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # "xgrammar" (or "auto"): the only one
    guided_whitespace_pattern: str | None = None  # refused: xgrammar takes no whitespace pattern
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's account and storage options: accepted, no effect on a self-hosted server
    user: str | None = None
    service_tier: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None

    @property
    def num_choices(self) -> int:
        return self.n or 1


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default; None: what the context leaves; 0: echo alone
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value):
        if len(value) == 0 or (isinstance(value, list) and any(len(p) == 0 for p in value if isinstance(p, list))):
            raise ValueError("expected a non-empty prompt (text, token ids, or a list of them)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("expected no suffix (insertion is not supported)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# ---------------------------------------------------------------------- chat


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"expected content in a {self.role} message, got null")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateOptions(OpenAIModel):
    """What renders a conversation into a prompt (chat completions and /tokenize)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # vLLM's: a Jinja template for this request, over the server's
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_ending(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("expected at most one of add_generation_prompt and continue_final_message, got both")
        return self


class ChatCompletionRequest(_SamplingRequest, ChatTemplateOptions):
    max_tokens: int | None = Field(None, ge=1)  # None: what the context leaves after the prompt
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    def token_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise APIError(400, "expected one of max_tokens and max_completion_tokens, got both",
                               param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def parses_tool_calls(self) -> bool:
        """Tools were offered and the model may (OpenAI's default choice, "auto") or must
        ("required", a named function) call them."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """The function a named `tool_choice` forces, else None."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None


# ---------------------------------------------------------------------- vLLM's /tokenize and /detokenize


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateOptions):
    model: str | None = None
    add_special_tokens: bool = False  # the template writes them
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]
