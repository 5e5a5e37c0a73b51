"""Every user error is one line on stderr and exit status 2, found before any model loads."""

from __future__ import annotations

import pytest

from pagedattn.cli import main

from .conftest import run_cli


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model starts loading."""
    import pagedattn.models.loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loader, "load_model", refuse)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", "--backend", "bogus"], "Valid names: auto, torch"),
        (["generate", "--model", "/nope/model"], "--model"),
        (["generate", "--model", "missing.gguf"], "--model"),
        (["generate", "--device", "cuda:7"], "--device"),
        (["generate", "--device", "tpu"], "--device"),
        (["generate", "--top-p", "1.5"], "--top-p"),
        (["generate", "--top-k", "-3"], "--top-k"),
        (["generate", "--temperature", "-1"], "--temperature"),
        (["generate", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "-n", "0"], "expected -n to be"),
        (["generate", "--stop", ""], "--stop"),
        (["generate", "--dtype", "int8"], "--dtype"),
        (["generate", "--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
        (["generate", "--num-kv-blocks", "0"], "--num-kv-blocks"),
        (["generate", "--max-model-len", "-1"], "--max-model-len"),
        (["generate", "--seed", "x"], "--seed"),
        (["chat", "--top-p", "0"], "--top-p"),
        (["generate", "--gpu-memory-utilization", "1.5"], "expected 0 < --gpu-memory-utilization <= 1"),
        (["generate", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["generate", "--gpu-memory-utilization", "most"], "--gpu-memory-utilization"),
        (["generate", "--max-num-batched-tokens", "100"], "--max-num-batched-tokens to be an int >= 256"),
        (["chat", "--max-num-batched-tokens", "0", "--max-num-seqs", "1"], "--max-num-batched-tokens"),
        (["generate", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["generate", "--tensor-parallel-size", "0"], "expected --tensor-parallel-size to be an int >= 1"),
        (["serve", "-tp", "two"], "--tensor-parallel-size"),
        (["generate", "--tokenizer", "/nope/tokenizer"], "--tokenizer"),
        (["generate", "--chat-template", "no-such-file.jinja"], "expected --chat-template to be a template file"),
        (["generate", "--chat-template", "{% if %}"], "syntax error on line 1"),
        (["chat", "--chat-template", "{{ messages"], "--chat-template"),
        (["generate", "--chat-template", "{{ 1 }}", "--no-chat-template"], "--no-chat-template"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_user_error_is_one_line_and_status_2(argv, words, capsys, no_loading):
    assert status_of(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert words in err and "Traceback" not in err


def status_of(argv: list[str]) -> int:
    """`main(argv)`'s exit status, whether returned or raised by argparse."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_verbose_shows_the_traceback(no_loading):
    with pytest.raises(ValueError, match="--top-p"):
        main(["--verbose", "generate", "--top-p", "2"])
    with pytest.raises(ValueError, match="--top-p"):
        main(["generate", "--top-p", "2", "--verbose"])


def test_version_and_python_dash_m():
    import pagedattn

    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"pagedattn {pagedattn.__version__}"


def test_missing_extra_names_the_pip_install(monkeypatch, tiny_chat, capsys):
    import importlib.util

    import pagedattn.models.loader as loader
    from pagedattn import LLM
    from pagedattn.models.loader import MissingExtraError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    with pytest.raises(MissingExtraError, match=r"pip install 'pagedattn\[hf\]'"):
        LLM(tiny_chat, device="cpu")
    assert main(["generate", "hi", "--model", tiny_chat]) == 2
    err = capsys.readouterr().err
    assert "pip install 'pagedattn[hf]'" in err and len(err.strip().splitlines()) == 1
    assert loader.HF_EXTRA_MODULES[0] == "transformers"
