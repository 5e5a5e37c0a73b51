"""A conversation (OpenAI's messages, and tools) into prompt token ids through the model's chat
template, with the message shapes Hugging Face templates expect (as vLLM passes them):

- "developer" is sent as "system" (OpenAI's newer name; many templates know only "system");
- content parts are joined into one string; an assistant's null content is "";
- an assistant's `tool_calls` keep OpenAI's shape, with `function.arguments` parsed from JSON
  text into an object (templates write `arguments | tojson`); a tool message keeps
  `tool_call_id` (and `name`);
- `tools` (OpenAI's `{"type": "function", "function": {...}}` objects) go to the template's
  `tools`, as transformers' `apply_chat_template(tools=...)` documents.
"""

from __future__ import annotations

import json

from pagedattn.serve.protocol import APIError, ChatMessage, ChatTemplateOptions


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for m in messages:
        msg: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                          "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template gets what the client sent


def render_chat(tokenizer, body: ChatTemplateOptions, model_name: str, *, add_special_tokens: bool = False,
                chat_template: str | None = None) -> list[int]:
    """The prompt's token ids: the template's text, tokenized without adding special tokens (the
    template writes them) unless `add_special_tokens`. The template is the request's
    `chat_template`, else `chat_template` (the server's `--chat-template`), else the tokenizer's.
    A 400 when there is none or the template refuses the messages."""
    template = body.chat_template or chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"expected a model with a chat template, got {model_name} which has none "
                       "(use /v1/completions, or start the server with --chat-template)", param="messages")
    kwargs = dict(body.chat_template_kwargs or {})
    if template is not None:
        kwargs["chat_template"] = template
    if body.tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    try:
        text = tokenizer.apply_chat_template(
            template_messages(body.messages), add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, tokenize=False, **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - a template's own check (raise_exception) or a jinja error: the caller's
        raise APIError(400, f"expected messages the chat template accepts, got: {type(e).__name__}: {e}",
                       param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
