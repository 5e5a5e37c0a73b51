"""`pagedattn chat` on a terminal: Ctrl-C stops only the answer; Ctrl-C or Ctrl-D at an empty
prompt ends the chat; readline edits lines and keeps a history in the cache folder."""

from __future__ import annotations

import fcntl
import io
import os
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

import pagedattn.cli.chat as chat
from pagedattn.cli import main

from .conftest import REPO


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(tiny_chat, monkeypatch, capsys, tmp_path):
    from pagedattn.engine.llm_engine import LLMEngine

    monkeypatch.setenv("PAGEDATTN_CACHE", str(tmp_path))
    seen, engines = [], []
    real_prompt, real_step = chat.chat_prompt, LLMEngine.step

    def spy(tokenizer, messages, template=None):
        seen.append([dict(m) for m in messages])
        return real_prompt(tokenizer, messages, template)

    def step(self):
        engines.append(self)
        if len(engines) == 3:  # the first answer's third step: Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self)

    monkeypatch.setattr(chat, "chat_prompt", spy)
    monkeypatch.setattr(LLMEngine, "step", step)
    monkeypatch.setattr("sys.stdin", _Terminal("first\nsecond\n"))
    assert main(["chat", "--model", tiny_chat, "--max-tokens", "20"]) == 0
    out = capsys.readouterr().out
    first, second = out.split("> ")[1:3]
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    partial = seen[1][1]["content"]
    assert first == partial + "\n" and 0 < len(partial)  # what was shown stays in the conversation
    assert len(second) > len(first)  # the next answer runs to its end
    assert not engines[0].has_unfinished()  # the stopped request was aborted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back


def test_ctrl_c_at_the_prompt_ends_the_chat(tiny_chat, monkeypatch):
    class Interrupted(_Terminal):
        def readline(self, *args):
            raise KeyboardInterrupt

    monkeypatch.setattr("sys.stdin", Interrupted())
    assert main(["chat", "--model", tiny_chat]) == 0


def _own_terminal():
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the pty is the chat's terminal: Ctrl-C sends SIGINT


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")
def test_readline_history_and_keys_on_a_real_terminal(tiny_chat, tmp_path):
    import pty

    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDATTN_CACHE": str(tmp_path), "TERM": "dumb"}
    proc = subprocess.Popen([sys.executable, "-m", "pagedattn", "chat", "--model", tiny_chat, "--max-tokens", "3"],
                            stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=_own_terminal)
    os.close(slave)
    received = bytearray()

    def until_prompt(timeout: float = 60) -> bytes:
        end = time.monotonic() + timeout
        while not received.endswith(b"> ") and time.monotonic() < end:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    received.extend(os.read(master, 4096))
                except OSError:
                    break
        text = bytes(received)
        received.clear()
        assert text.endswith(b"> "), text
        return text

    def press(keys: bytes) -> None:
        # A signal that lands between readline's echo (or prompt) and its wait for the next key
        # is seen only at the next key: a person is never that quick, a test must wait.
        time.sleep(0.5)
        os.write(master, keys)

    try:
        until_prompt()
        press(b"hello\r")
        assert b"hello" in until_prompt()
        press(b"typed")
        press(b"\x03")  # Ctrl-C on a typed line: a fresh prompt
        until_prompt()
        press(b"\x10\r")  # Ctrl-P: the last line again, from readline's history
        assert b"hello" in until_prompt()
        press(b"\x03")  # Ctrl-C at an empty prompt: the end
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert (tmp_path / "chat_history").read_text().split() == ["hello"]  # a repeat is kept once
