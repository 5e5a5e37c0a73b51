"""Prompts through a model's chat template, and one answer streamed to the terminal as it is made.

The streamed text is the text `--json` reports: while the answer's end could still be the start
of a stop string, that end is held back (a stop string ends the answer and is not part of it),
as an OpenAI server streams. A prompt that takes several engine steps to prefill shows its
progress on stderr when stderr is a terminal.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine loads transformers: import it only when a command runs
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.engine.outputs import RequestOutput
    from pagedattn.engine.sampling_params import SamplingParams


def chat_prompt(tokenizer, messages: list[dict[str, str]], chat_template: str | None = None) -> list[int]:
    """The token ids of `messages` ({"role", "content"} dicts) through `chat_template` (else the
    tokenizer's), ending with the assistant's turn to speak."""
    from pagedattn.llm import apply_chat_template

    return apply_chat_template(tokenizer, messages, chat_template=chat_template)[1]


@dataclass
class Streamed:
    """One streamed answer: the engine's last output for it (None when it never reported one),
    the text written, and whether `stop_requested` cut it short (the request was aborted)."""

    output: RequestOutput | None
    text: str
    interrupted: bool = False


def stream(
    engine: LLMEngine, prompt: str | list[int], params: SamplingParams, out=None, *,
    stop_requested: Callable[[], bool] | None = None,
) -> Streamed:
    """Generate one completion of `prompt`, writing its text to `out` (stdout) as it grows, then
    a newline. `stop_requested()` is asked between engine steps; True aborts the request there."""
    out = sys.stdout if out is None else out
    group = engine.add_request(prompt, params)
    progress = PrefillProgress.start(group, engine.runner.max_num_batched_tokens)
    printed, result, interrupted = "", None, False
    try:
        while engine.has_unfinished():
            if stop_requested is not None and stop_requested():
                engine.abort_request(group.request_id)
                interrupted = True
                break
            for output in engine.step():
                if output.request_id != group.request_id:
                    continue
                result = output
                if not output.outputs:
                    continue
                text = output.outputs[0].text
                shown = text if output.finished else text[: len(text) - held_back(text, params.stop)]
                if len(shown) > len(printed):
                    if progress is not None:  # the answer starts: the prefill line goes
                        progress.close()
                        progress = None
                    out.write(shown[len(printed):])
                    out.flush()
                    printed = shown
            if progress is not None:
                progress.update()
    finally:
        if progress is not None:
            progress.close()
    out.write("\n")
    out.flush()
    return Streamed(result, printed, interrupted)


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could begin a stop string (the longest such
    suffix): they are shown only once the next tokens rule the stop string out."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class PrefillProgress:
    """"prefill: 2048/6144 tokens" on stderr (a terminal) while a prompt that spans several steps
    is computed; the line goes away when the answer starts."""

    def __init__(self, group, bar):
        self.group = group
        self.bar = bar

    @classmethod
    def start(cls, group, step_tokens: int) -> PrefillProgress | None:
        """The progress of `group`'s prefill, or None when it fits one step of `step_tokens`,
        stderr is not a terminal, or tqdm is missing."""
        total = len(group.prompt_token_ids)
        if total <= step_tokens or group.is_finished or not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
            return None
        try:
            from tqdm import tqdm
        except ModuleNotFoundError:
            return None
        bar = tqdm(total=total, desc="prefill", unit=" tokens", leave=False, file=sys.stderr, dynamic_ncols=True,
                   bar_format="{desc}: {n}/{total}{unit} [{elapsed}<{remaining}, {rate_fmt}]")
        return cls(group, bar)

    def update(self) -> None:
        done = min(self.group.seqs[0].num_computed_tokens, self.bar.total)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class AnswerInterrupt:
    """Ctrl-C (SIGINT) while an answer streams asks for that answer to stop (`requested`), so
    the engine is never interrupted mid-step; a second Ctrl-C raises KeyboardInterrupt as usual.
    The previous handler is back after the `with` block. Outside the main thread (where
    signals cannot be caught) it does nothing."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> AnswerInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __call__(self) -> bool:
        return self.requested
