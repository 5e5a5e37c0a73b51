"""Text that is not UTF-8 (the command line, stdin, a template file) is one line and exit status 2,
found before the model loads; a chat line that is not UTF-8 is refused and the chat goes on."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from pagedattn.cli import main
from pagedattn.cli.model_args import UsageError, utf8

from .conftest import REPO
from .test_errors import no_loading, status_of  # noqa: F401  (a fixture)


class _BytesPipe:
    """stdin as a pipe of bytes (what `sys.stdin.buffer` reads)."""

    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)

    def isatty(self) -> bool:
        return False


def test_utf8_names_the_first_bad_byte():
    assert utf8("café", "x") == "café"
    assert utf8("café".encode(), "x") == "café"
    with pytest.raises(UsageError, match=r"expected UTF-8 text in stdin, got the byte 0xe9 at byte 3"):
        utf8(b"caf\xe9 au lait", "stdin")
    # the command line and stdin come as str with each bad byte a lone surrogate (surrogateescape)
    with pytest.raises(UsageError, match=r"in PROMPT 1, got the byte 0xff at byte 5"):
        utf8("é\u00e9z" + "\udcff", "PROMPT 1")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", "caf\udce9"], "expected UTF-8 text in PROMPT 1, got the byte 0xe9 at byte 3"),
        (["generate", "ok", "\udcff"], "PROMPT 2"),
        (["generate", "--stop", "\udcff"], "--stop 1"),
        (["generate", "--system", "\udcff"], "--system"),
        (["generate", "--chat-template", "{{ '\udcff' }}"], "--chat-template"),
        (["chat", "--system", "\udcff"], "--system"),
    ],
)
def test_command_line_that_is_not_utf8(argv, words, capsys, no_loading):  # noqa: F811
    assert status_of(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err, err


def test_stdin_and_template_file_that_are_not_utf8(monkeypatch, capsys, tmp_path, no_loading):  # noqa: F811
    for argv in (["generate"], ["generate", "-"]):
        monkeypatch.setattr("sys.stdin", _BytesPipe(b"caf\xe9 au lait\n"))
        assert status_of(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pagedattn generate: error: expected UTF-8 text in stdin, got the byte 0xe9 at byte 3"] * 2
    template = tmp_path / "latin1.jinja"
    template.write_bytes("{{ 'café' }}".encode("latin-1"))
    assert status_of(["generate", "hi", "--chat-template", str(template)]) == 2
    assert f"expected UTF-8 text in --chat-template {template}" in capsys.readouterr().err


def test_bytes_from_a_real_pipe(tiny_chat):
    """The whole way, through the process's own stdin, before the model loads (no tokenizer error)."""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "pagedattn", "generate", "--model", tiny_chat], input=b"caf\xe9\n",
                          capture_output=True, env=env, timeout=120)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err == "pagedattn generate: error: expected UTF-8 text in stdin, got the byte 0xe9 at byte 3\n"


def test_chat_skips_a_line_that_is_not_utf8(tiny_chat, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", _BytesPipe(b"hello\n\xff\xfe\nagain\n"))
    assert main(["chat", "--model", tiny_chat, "--max-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2  # two answers
    assert "pagedattn chat: error: expected UTF-8 text in stdin, got the byte 0xff at byte 0" in captured.err
