"""`pagedattn chat`: an interactive conversation, each answer streamed, the whole conversation
sent again through the model's chat template at every turn (its prefix stays in the KV cache:
prefix caching makes a turn cost only its new tokens)."""

from __future__ import annotations

import argparse
import sys

from pagedattn.cli.model_args import (
    UsageError,
    add_model_arguments,
    add_sampling_arguments,
    engine_config,
    load_llm,
    sampling_params,
)
from pagedattn.cli.streaming import chat_prompt, stream

COMMANDS_HELP = "/reset starts a new conversation, /exit (or end of input) quits"


def add_parser(sub) -> None:
    """Register `chat` on `sub`, the `add_subparsers()` object of the `pagedattn` parser."""
    chat = sub.add_parser(
        "chat", help="talk with a model (lines from stdin, answers streamed)",
        description=f"Each line of stdin is a turn; {COMMANDS_HELP}.",
    )
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    add_sampling_arguments(chat, max_tokens=256)
    add_model_arguments(chat)
    chat.set_defaults(run=run)


def run(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    params = sampling_params(args)
    llm = load_llm(engine_config(args))
    if not llm.engine.spec.has_chat_template:
        raise UsageError(f"expected a model with a chat template for `chat`, got {args.model!r} without one")
    interactive = stdin.isatty()
    opening = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(opening)
    if interactive:
        print(f"[{COMMANDS_HELP}]", file=sys.stderr)
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:  # end of input
            break
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(opening)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        result = stream(llm.engine, chat_prompt(llm.tokenizer, messages), params, stdout)
        if result is None or result.error is not None:
            # The turn cannot run (the conversation outgrew the context): drop it, keep talking.
            messages.pop()
            print(f"pagedattn chat: error: {result.error if result else 'no answer'} (/reset to start over)",
                  file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": result.outputs[0].text})
    return 0
