"""A streamed answer is the text `--json` reports, stop strings included; long prefills show
their progress on a terminal."""

from __future__ import annotations

import io
import json

import pytest

from pagedattn import LLM, SamplingParams
from pagedattn.cli import main
from pagedattn.cli.streaming import held_back, stream


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def llm(tiny_chat):
    return LLM(tiny_chat, device="cpu", backend="torch")


def test_held_back_is_the_longest_suffix_that_starts_a_stop_string():
    assert held_back("The capital of France", ["France is"]) == len("France")
    assert held_back("The capital of Fr", ["France is", "Paris"]) == 2
    assert held_back("The capital of ", ["France is"]) == 0
    assert held_back("ab", ["b", "abc"]) == 2  # "ab" could begin "abc"
    assert held_back("xyz", []) == 0
    assert held_back("", ["stop"]) == 0


def _streamed(llm, prompt: str, params: SamplingParams) -> tuple[str, list[str]]:
    writes = []

    class Out(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    out = Out()
    result = stream(llm.engine, prompt, params, out)
    assert out.getvalue() == result.text + "\n"
    return result.text, writes


def test_streamed_text_equals_the_final_text_with_stop_strings(llm):
    greedy = {"temperature": 0, "max_tokens": 24}
    [full] = llm.generate("hello", SamplingParams(**greedy))
    text = full.outputs[0].text
    assert len(text) > 12, text
    # stop strings inside the answer (cut there), one whose first characters come up before the
    # whole of it does, and ones that only begin to match and never do (shown in the end)
    stops = [text[5:8], text[2:4] + text[5:9], text[10:12] + "\x00", text[-2:] + "\x01"]
    for stop in stops:
        params = SamplingParams(**greedy, stop=[stop])
        [final] = llm.generate("hello", params)
        streamed, writes = _streamed(llm, "hello", params)
        assert streamed == final.outputs[0].text, stop
        assert stop not in streamed
        shown = ""
        for w in writes[:-1]:  # no write ever showed what the final text does not have
            shown += w
            assert final.outputs[0].text.startswith(shown)


def test_generate_streams_what_json_reports(tiny_chat, capsys):
    base = ["generate", "hello", "--model", tiny_chat, "--max-tokens", "30", "--no-chat-template"]
    assert main([*base, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["outputs"][0]["text"]
    stop = text[6:9]
    assert main([*base, "--json", "--stop", stop]) == 0
    cut = json.loads(capsys.readouterr().out)["outputs"][0]
    assert main([*base, "--stop", stop]) == 0
    assert capsys.readouterr().out == cut["text"] + "\n"


def test_long_prefill_shows_progress_on_a_terminal(tiny_chat, monkeypatch):
    from pagedattn.engine.llm_engine import LLMEngine

    steps = []
    real_step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: steps.append(1) or real_step(self))
    prompt = "p" * 100  # 100 byte tokens
    base = ["generate", prompt, "--model", tiny_chat, "--max-tokens", "1", "--no-chat-template"]
    for flags, shown, num_steps in (([], False, 1), (["--max-num-seqs", "2", "--max-num-batched-tokens", "16"],
                                                       True, 7)):
        err = _Terminal()
        monkeypatch.setattr("sys.stderr", err)
        steps.clear()
        assert main([*base, *flags]) == 0
        assert len(steps) == num_steps  # --max-num-batched-tokens: 16 prompt tokens a step
        assert ("prefill: 0/100 tokens" in err.getvalue()) is shown, err.getvalue()
    # not on a terminal: no progress line
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert main([*base, "--max-num-seqs", "2", "--max-num-batched-tokens", "16"]) == 0
    assert "prefill" not in __import__("sys").stderr.getvalue()
