"""Prompts through a model's chat template, and one answer streamed to the terminal as it is made."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine loads transformers: import it only when a command runs
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.engine.outputs import RequestOutput
    from pagedattn.engine.sampling_params import SamplingParams


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of `messages` ({"role", "content"} dicts) through the tokenizer's chat
    template, ending with the assistant's turn to speak."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams, out=None) -> RequestOutput:
    """Generate one completion of `prompt`, writing its text to `out` (stdout) as it grows;
    the final RequestOutput (its `error` set when the request could not run)."""
    out = sys.stdout if out is None else out
    group = engine.add_request(prompt, params)
    printed = 0
    result = None
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id != group.request_id:
                continue
            result = output
            if output.outputs:
                text = output.outputs[0].text
                out.write(text[printed:])
                out.flush()
                printed = len(text)
    out.write("\n")
    out.flush()
    return result
