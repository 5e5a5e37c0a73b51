"""`LLM.generate` and `LLM.chat` as vLLM users call them: prompt forms, chat templates, progress
bars, and vLLM's keywords that pagedattn cannot honour refused by name."""

from __future__ import annotations

import io

import pytest
from tiny_models import CHAT_TEMPLATE

from pagedattn import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _texts(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_forms_give_the_same_answers(llm):
    ids = llm.tokenizer.encode("hello")
    want = _texts(llm.generate("hello", GREEDY, use_tqdm=False))
    assert _texts(llm.generate(["hello"], GREEDY)) == want
    assert _texts(llm.generate({"prompt": "hello"}, GREEDY)) == want
    assert _texts(llm.generate([{"prompt": "hello"}, {"prompt_token_ids": ids}, ids], GREEDY)) == want * 3
    assert _texts(llm.generate(ids, GREEDY)) == want  # a flat list of ids is one prompt
    [out] = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert out.prompt is None and out.prompt_token_ids == ids
    [bad] = llm.generate({"prompt": "a", "prompt_token_ids": ids}, GREEDY)
    assert bad.error is not None and "one key" in bad.error


def test_chat_is_generate_on_the_template_applied_prompt(llm):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert text == "[system] be brief\n[user] hello\nA:"
    [want] = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)}, GREEDY)
    [got] = llm.chat(conversation, GREEDY)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt == text and got.prompt_token_ids == want.prompt_token_ids
    # several conversations, one sampling params each; OpenAI's text parts are joined
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    outs = llm.chat([conversation, parts], [GREEDY, GREEDY])
    assert [o.prompt for o in outs] == [text, "[user] hel\nlo\nA:"]
    assert outs[0].outputs[0].token_ids == want.outputs[0].token_ids


def test_chat_template_options(llm):
    conversation = [{"role": "user", "content": "hello"}]
    [out] = llm.chat(conversation, GREEDY, chat_template="{{ messages[0]['content'] }}{{ suffix }}",
                     chat_template_kwargs={"suffix": "?"})
    assert out.prompt == "hello?"
    [out] = llm.chat(conversation, GREEDY, add_generation_prompt=False)
    assert out.prompt == "[user] hello\n"
    tools = [{"type": "function", "function": {"name": "now", "description": "the time", "parameters": {}}}]
    [out] = llm.chat(conversation, GREEDY, tools=tools,
                     chat_template="{% for t in tools %}{{ t.function.name }};{% endfor %}" + CHAT_TEMPLATE)
    assert out.prompt.startswith("now;[user] hello")
    with pytest.raises(ValueError, match="add_generation_prompt=False with continue_final_message"):
        llm.chat(conversation, continue_final_message=True)


@pytest.mark.parametrize(
    "messages, words",
    [
        ([], "got an empty list"),
        ("hello", "got str"),
        ([[{"role": "user", "content": "a"}], []], "conversation 1"),
        ([{"content": "no role"}], "'role' string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "'image_url'"),
        ([{"role": "user", "content": 5}], "content to be a string"),
    ],
)
def test_chat_refuses_what_is_not_a_conversation(llm, messages, words):
    with pytest.raises(ValueError, match=words):
        llm.chat(messages)


def test_chat_needs_a_template(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="expected a chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    [out] = llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template="{{ messages[0]['content'] }}")
    assert out.prompt == "hi"


def test_vllm_keywords_we_cannot_honour_are_refused(llm):
    with pytest.raises(ValueError, match="lora_request=None"):
        llm.generate("hi", lora_request=object())
    with pytest.raises(ValueError, match="priority=None"):
        llm.generate(["hi"], priority=[1])
    with pytest.raises(ValueError, match="lora_request=None"):
        llm.chat([{"role": "user", "content": "hi"}], lora_request=object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'guided_decoding'"):
        llm.generate("hi", guided_decoding=None)
    with pytest.raises(ValueError, match="use_tqdm to be a bool or a tqdm class"):
        llm.generate("hi", use_tqdm="yes")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_where_it_helps(llm, monkeypatch):
    two = ["hello", "world"]
    for err, prompts, shown in ((_Terminal(), two, True), (_Terminal(), ["hello"], False), (io.StringIO(), two, False)):
        monkeypatch.setattr("sys.stderr", err)
        llm.generate(prompts, GREEDY)  # use_tqdm=True, the default
        assert ("Processed prompts: 100%" in err.getvalue()) is shown, err.getvalue()
    err = _Terminal()
    monkeypatch.setattr("sys.stderr", err)
    llm.generate(two, GREEDY, use_tqdm=False)
    llm.chat([[{"role": "user", "content": "a"}]] * 2, GREEDY, use_tqdm=False)
    assert err.getvalue() == ""

    made = []

    def my_tqdm(**kwargs):  # vLLM lets use_tqdm be a tqdm class: used as given, even off a terminal
        from tqdm import tqdm

        made.append(kwargs)
        return tqdm(file=io.StringIO(), **kwargs)

    monkeypatch.setattr("sys.stderr", io.StringIO())
    llm.generate("hello", GREEDY, use_tqdm=my_tqdm)
    assert made and made[0]["total"] == 1
