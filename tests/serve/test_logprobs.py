"""Sampling options and log-probabilities through the server: every option gives `LLM.generate`'s
answer with the same `SamplingParams`, and log-probabilities come back in OpenAI's shapes
(completions' tokens/token_logprobs/top_logprobs/text_offset, with echo the prompt's too; chat's
content entries), streamed ones adding up to the whole."""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedattn.engine.sampling_params import SamplingParams

from .conftest import MODEL_NAME

PROMPT = "The quick brown fox"
CHAT_PROMPT = "[user] hi\nA:"  # what the tiny template makes of one user message "hi"


def _reference(reference, prompt, **params):
    [out] = reference.generate([prompt], SamplingParams(**{"temperature": 0} | params))
    return out


def _completion_logprobs(ids, positions, num, decode, offset=0):
    """OpenAI's completions object of the engine's `positions` (the expected answer)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for t, position in zip(ids, positions):
        if position is None:
            text, lp, best = decode(t), None, None
        else:
            text, lp = position[t].decoded_token, position[t].logprob
            ranked = sorted(position.items(), key=lambda item: item[1].rank)[:num]
            best = {x.decoded_token: x.logprob for _, x in ranked}
            best.setdefault(text, lp)
        tokens.append(text)
        token_logprobs.append(lp)
        top.append(best)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _close(got, want):
    """Equal, floats to 1e-4 (the server's JSON round trip and a different batch)."""
    if isinstance(want, float):
        return isinstance(got, float) and abs(got - want) < 1e-4
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_close(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_close, got, want))
    return got == want


@pytest.mark.parametrize("options", [
    dict(presence_penalty=1.5), dict(frequency_penalty=-1.0), dict(repetition_penalty=1.8), dict(min_tokens=20),
    dict(stop_token_ids=[32]), dict(logit_bias={"101": 100}), dict(temperature=1.0, min_p=0.3, seed=5),
])
def test_sampling_options_are_llm_generate(server, reference, options):
    params = dict(max_tokens=20) | options
    want = _reference(reference, PROMPT, **params).outputs[0]
    request = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    request |= {k: v for k, v in options.items() if k in ("presence_penalty", "frequency_penalty", "seed",
                                                               "temperature", "logit_bias")}
    extra = {k: v for k, v in options.items() if k in ("repetition_penalty", "min_tokens", "stop_token_ids", "min_p")}
    out = server.client().completions.create(**request, extra_body=extra)
    assert out.choices[0].text == want.text and out.usage.completion_tokens == len(want.token_ids)
    if "stop_token_ids" in options and want.finish_reason == "stop":
        assert out.choices[0].stop_reason == 32


def test_completion_logprobs(server, reference):
    want = _reference(reference, PROMPT, max_tokens=8, logprobs=3)
    decode = lambda t: reference.tokenizer.decode([t])  # noqa: E731
    expected = _completion_logprobs(want.outputs[0].token_ids, want.outputs[0].logprobs, 3, decode)
    client = server.client()
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    assert _close(out.choices[0].logprobs.model_dump(), expected)
    assert "".join(expected["tokens"]) == out.choices[0].text

    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                           stream=True):
        for key, values in (chunk.choices[0].logprobs.model_dump() if chunk.choices[0].logprobs else {}).items():
            streamed[key] += values
    assert _close(streamed, expected)


def test_echo(server, reference):
    want = _reference(reference, PROMPT, max_tokens=4, logprobs=2, prompt_logprobs=2)
    decode = lambda t: reference.tokenizer.decode([t])  # noqa: E731
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    expected = _completion_logprobs(ids, want.prompt_logprobs + want.outputs[0].logprobs, 2, decode)
    client = server.client()
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    assert out.choices[0].text == PROMPT + want.outputs[0].text
    assert _close(out.choices[0].logprobs.model_dump(), expected) and expected["token_logprobs"][0] is None

    text, streamed = "", []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                           echo=True, stream=True):
        text += chunk.choices[0].text
        streamed += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    assert text == out.choices[0].text and _close(streamed, expected["token_logprobs"])

    # max_tokens=0: the prompt alone (how lm-eval-harness scores text), prompts as token ids too
    prompt_ids = reference.tokenizer.encode(PROMPT)
    n = len(want.prompt_token_ids)
    for prompt, text in (([prompt_ids, prompt_ids], reference.tokenizer.decode(prompt_ids)), ([PROMPT], PROMPT)):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        assert len(out.choices) == len(prompt) and out.usage.completion_tokens == 0
        for choice in out.choices:
            assert choice.text == text and choice.logprobs.tokens == expected["tokens"][:n]
            assert _close(choice.logprobs.token_logprobs, expected["token_logprobs"][:n])
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert chunks[-1].usage.completion_tokens == 0
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, echo=True, temperature=0)
    assert out.choices[0].text == PROMPT + want.outputs[0].text[:len(out.choices[0].text) - len(PROMPT)]
    assert out.choices[0].logprobs is None
    server.assert_no_leak()


def test_chat_logprobs(server, reference):
    want = _reference(reference, reference.tokenizer.encode(CHAT_PROMPT, add_special_tokens=False), max_tokens=6,
                      logprobs=2).outputs[0]
    client = server.client()
    request = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
                   logprobs=True, top_logprobs=2)
    out = client.chat.completions.create(**request)
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == want.text
    for entry, t, position in zip(content, want.token_ids, want.logprobs, strict=True):
        assert entry.token == position[t].decoded_token and abs(entry.logprob - position[t].logprob) < 1e-4
        assert entry.bytes == list(entry.token.encode())
        best = sorted(position.items(), key=lambda item: item[1].rank)[:2]
        assert [x.token for x in entry.top_logprobs] == [lp.decoded_token for _, lp in best]
    streamed = [e for chunk in client.chat.completions.create(**request, stream=True)
                if chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    out = client.chat.completions.create(**request | dict(top_logprobs=None))
    assert all(e.top_logprobs == [] for e in out.choices[0].logprobs.content)


def test_prompt_logprobs_extension(server, reference):
    want = _reference(reference, PROMPT, max_tokens=2, prompt_logprobs=1)
    body = httpx.post(f"{server.url}/v1/completions", json=dict(prompt=PROMPT, max_tokens=2, prompt_logprobs=1)).json()
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for entry, position in zip(got[1:], want.prompt_logprobs[1:]):
        assert set(entry) == {str(t) for t in position}
        assert all(abs(entry[str(t)]["logprob"] - lp.logprob) < 1e-4 and entry[str(t)]["rank"] == lp.rank
                   for t, lp in position.items())


@pytest.mark.parametrize("kwargs, param", [
    (dict(extra_body={"logit_bias": {"100000": 5}}), "logit_bias"),
    (dict(extra_body={"stop_token_ids": [100000]}), "stop_token_ids"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=0), "max_tokens"),  # 0 only with echo
    (dict(extra_body={"min_tokens": 10}, max_tokens=5), "min_tokens"),
])
def test_invalid_sampling_options(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(**dict(model=MODEL_NAME, prompt="hi", max_tokens=4) | kwargs)
    assert e.value.response.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                                top_logprobs=2)
    assert e.value.response.json()["error"]["param"] == "logprobs"
