"""`pagedattn chat`: an interactive conversation, each answer streamed, the whole conversation
sent again through the model's chat template at every turn (its prefix stays in the KV cache:
prefix caching makes a turn cost only its new tokens).

On a terminal the prompt has readline's line editing and a history kept in the cache folder
(`$PAGEDATTN_CACHE/chat_history`, else under `$XDG_CACHE_HOME/pagedattn`; none where readline
is missing). Ctrl-C while an answer streams stops that answer (the conversation keeps what was
shown); Ctrl-C on an empty prompt, or Ctrl-D, ends the chat. Without a terminal, each line of
stdin is a turn.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from pagedattn.cli.model_args import (
    UsageError,
    add_chat_template_argument,
    add_model_arguments,
    add_sampling_arguments,
    chat_template,
    engine_config,
    load_llm,
    sampling_params,
    utf8,
)
from pagedattn.cli.streaming import AnswerInterrupt, chat_prompt, stream

COMMANDS_HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"
HISTORY_LENGTH = 1000


def add_parser(sub) -> None:
    """Register `chat` on `sub`, the `add_subparsers()` object of the `pagedattn` parser."""
    chat = sub.add_parser(
        "chat", help="talk with a model (lines from stdin, answers streamed)",
        description=f"Each line of stdin is a turn; {COMMANDS_HELP}.",
    )
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    add_chat_template_argument(chat)
    add_sampling_arguments(chat, max_tokens=256)
    add_model_arguments(chat, max_num_seqs=256)
    chat.set_defaults(run=run)


def run(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    params = sampling_params(args)
    config = engine_config(args)
    template = chat_template(args)
    if args.system is not None:
        utf8(args.system, "--system")
    llm = load_llm(config)
    if template is None and not llm.engine.spec.has_chat_template:
        raise UsageError(f"expected a model with a chat template for `chat` (or --chat-template), got "
                         f"{args.model or 'the default model'!r} without one")
    interactive = stdin.isatty()
    opening = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(opening)
    lines = _TerminalLines(stdin, stdout) if interactive else _PipedLines(stdin)
    if interactive:
        print(f"[{COMMANDS_HELP}]", file=sys.stderr)
    with lines:
        while True:
            try:
                text = lines.next()
            except UsageError as e:  # a line that is not UTF-8: say so, keep talking
                print(f"pagedattn chat: error: {e}", file=sys.stderr)
                continue
            if text is None or text in ("/exit", "/quit"):
                break
            if text == "/reset":
                messages = list(opening)
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": text})
            # On a terminal Ctrl-C stops the answer; from a pipe it stops the chat, as usual.
            with AnswerInterrupt() if interactive else contextlib.nullcontext() as interrupt:
                answer = stream(llm.engine, chat_prompt(llm.tokenizer, messages, template), params, stdout,
                                stop_requested=interrupt)
            result = answer.output
            if answer.interrupted:
                if answer.text:  # the conversation goes on from what was shown
                    messages.append({"role": "assistant", "content": answer.text})
                else:
                    messages.pop()
                continue
            if result is None or result.error is not None:
                # The turn cannot run (the conversation outgrew the context): drop it, keep talking.
                messages.pop()
                print(f"pagedattn chat: error: {result.error if result else 'no answer'} (/reset to start over)",
                      file=sys.stderr)
                continue
            messages.append({"role": "assistant", "content": result.outputs[0].text})
    return 0


class _PipedLines:
    """Turns from a pipe or file: one a line."""

    def __init__(self, stdin):
        self.stdin = stdin

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def next(self) -> str | None:
        """The next line's text, stripped; None at the end of input."""
        raw = getattr(self.stdin, "buffer", None)
        line = raw.readline() if raw is not None else self.stdin.readline()
        return utf8(line, "stdin").strip() if line else None


class _TerminalLines:
    """Turns typed at a prompt, with readline's editing and history where Python has readline."""

    def __init__(self, stdin, stdout):
        self.stdin = stdin
        self.stdout = stdout
        self.readline = None
        self.history = history_path()

    def __enter__(self):
        if self.stdin is not sys.__stdin__ or self.stdout is not sys.__stdout__:
            return self  # input() edits only the process's own terminal
        try:
            import readline
        except ImportError:  # Windows, or a Python built without it: plain input()
            return self
        self.readline = readline
        readline.set_history_length(HISTORY_LENGTH)
        if self.history is not None:
            try:
                readline.read_history_file(self.history)
            except OSError:  # none yet, or unreadable: start empty
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self.readline is None or self.history is None:
            return
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.history)
        except OSError:  # a read-only cache: no history, nothing worse
            pass

    def next(self) -> str | None:
        """The next line's text, stripped; None on Ctrl-D, or on Ctrl-C with nothing typed (Ctrl-C
        on a typed line drops the line and prompts again)."""
        while True:
            try:
                line = input("> ") if self.readline is not None else self._input()
            except EOFError:
                self.stdout.write("\n")
                return None
            except KeyboardInterrupt:
                self.stdout.write("\n")
                if self.readline is None or not self.readline.get_line_buffer():
                    return None
                continue
            return utf8(line, "the prompt").strip()

    def _input(self) -> str:
        self.stdout.write("> ")
        self.stdout.flush()
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line


def history_path() -> Path | None:
    """Where the chat's readline history is kept (None when no cache folder can be named)."""
    from pagedattn.models.cache import cache_dir

    try:
        return cache_dir() / "chat_history"
    except RuntimeError:  # no home folder to find the cache under
        return None
