"""Every route of `pagedattn serve` through the official `openai` client on loopback: greedy text
equal to `LLM.generate`'s, streaming equal to the whole answer, refusals as 4xx in OpenAI's shape."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from pagedattn.engine.sampling_params import SamplingParams

from .conftest import MODEL_NAME, run_server

PROMPTS = ["Hello there", "The quick brown fox", "paged attention"]


def greedy(reference, prompt, max_tokens: int) -> str:
    [out] = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))
    return out.outputs[0].text


def test_models_health_metrics(server):
    [card] = server.client().models.list().data
    assert card.id == MODEL_NAME and card.max_model_len == 128
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    server.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("pagedattn_num_requests_waiting", "pagedattn_num_requests_running", "pagedattn_kv_cache_usage_ratio",
                 "pagedattn_generation_tokens_per_second", "pagedattn_generation_tokens_total"):
        assert f"\n{name}" in text, name
    assert 'pagedattn_requests_finished_total{reason="length"}' in text


def test_completion_is_llm_generate(server, reference):
    client = server.client()
    for prompt in PROMPTS:
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == greedy(reference, prompt, 12)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 12
    ids = reference.tokenizer.encode(PROMPTS[0])
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    assert out.choices[0].text == greedy(reference, PROMPTS[0], 5)
    server.assert_no_leak()


def test_streaming_equals_whole(server, reference):
    client = server.client()
    for prompt in PROMPTS:
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == greedy(reference, prompt, 16)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 16


def test_stop_string_is_never_streamed(server, reference):
    client = server.client()
    full = greedy(reference, PROMPTS[1], 20)
    stop = full[6:8]  # two characters the answer reaches
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[stop], stream=True))
    assert whole.choices[0].text == streamed == full[: full.index(stop)]
    assert whole.choices[0].finish_reason == "stop"


def test_chat_uses_the_template(server, reference):
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = "[system] be brief\n[user] hi\nA:"
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == greedy(reference, prompt, 10)
    assert out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    # Without max_tokens the answer may fill the context, up to the server's --max-tokens (64).
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == min(64, 128 - out.usage.prompt_tokens)


def test_neutral_defaults_are_accepted(server):
    out = server.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, presence_penalty=0,
                                             frequency_penalty=0.0, logprobs=None, echo=False, user="u1")
    assert out.usage.completion_tokens == 2
    out = server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                  max_completion_tokens=2, logprobs=False, presence_penalty=0)
    assert out.usage.completion_tokens == 2


def test_sampling_n_and_seed(server):
    client = server.client()
    kwargs = dict(model=MODEL_NAME, prompt="abc", max_tokens=8, temperature=1.0, seed=7, n=2)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len(first.choices) == 2


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        (dict(model="other"), 404, "model"),
        (dict(max_tokens=0), 400, "max_tokens"),
        (dict(max_tokens=65), 400, "max_tokens"),  # over the server's --max-tokens
        (dict(prompt="x" * 128), 400, "prompt"),  # the context is 128 tokens
        (dict(prompt="x" * 100, max_tokens=40), 400, "max_tokens"),  # prompt + max_tokens over the context
        (dict(prompt=[5, 999]), 400, "prompt"),  # token id out of the vocabulary
        (dict(temperature=-1), 400, "temperature"),
        (dict(top_p=0), 400, "top_p"),
        (dict(best_of=3, stream=True), 400, "best_of"),  # best_of > n cannot stream (vLLM)
    ],
)
def test_invalid_requests_are_4xx(server, kwargs, status, param):
    request = dict(model=MODEL_NAME, prompt="hi", max_tokens=4) | kwargs
    with pytest.raises(openai.APIStatusError) as e:
        server.client().completions.create(**request)
    assert e.value.status_code == status
    error = e.value.response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_bodies_are_400(server):
    for body in (b"not json", b"{}", b'{"model": "tiny-llama", "messages": []}', b'{"model": 3, "prompt": "x"}'):
        for route in ("completions", "chat/completions"):
            r = httpx.post(f"{server.url}/v1/{route}", content=body, headers={"content-type": "application/json"})
            assert r.status_code in (400, 422) and "message" in r.json()["error"], (route, body, r.text)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_chat_without_template_is_refused(loaded, device, server):
    template = server.engine.tokenizer.chat_template
    server.engine.tokenizer.chat_template = None
    try:
        with pytest.raises(openai.BadRequestError, match="chat template"):
            server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}])
    finally:
        server.engine.tokenizer.chat_template = template


def test_api_key(loaded, device):
    with run_server(loaded, device, api_key="sekret") as s:
        for client in (s.client(), s.client(api_key="wrong")):
            with pytest.raises(openai.AuthenticationError) as e:
                client.models.list()
            assert e.value.status_code == 401 and e.value.response.json()["error"]["code"] == "invalid_api_key"
        assert s.client(api_key="sekret").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices
        assert httpx.get(f"{s.url}/health").status_code == 200  # probes need no key


def _metric(server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_disconnect_aborts_and_frees_blocks(server, monkeypatch):
    """A client that leaves mid-stream, or before a whole answer, frees its blocks."""
    step = server.engine.step

    def slow_step():  # 60 tokens take over a second: both clients surely leave before the end
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(server.engine, "step", slow_step)
    aborted = 'pagedattn_requests_finished_total{reason="abort"}'
    before = _metric(server, aborted)
    client = server.client()
    stream = client.completions.create(model=MODEL_NAME, prompt="long answer", max_tokens=60, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=0.05,
                   json=dict(model=MODEL_NAME, prompt="x" * 60, max_tokens=60, ignore_eos=True))
    time.sleep(0.3)  # the non-streaming handler notices within DISCONNECT_POLL_S
    server.assert_no_leak()
    assert _metric(server, aborted) == before + 2


def test_full_queue_is_429_with_retry_after(loaded, device, reference):
    """Requests beyond the running batch wait; past --max-waiting one is answered 429."""
    with run_server(loaded, device, max_waiting=1, engine_kwargs=dict(max_num_seqs=1)) as s:
        step = s.engine.step

        def slow_step():  # 60 tokens take over a second: the first request runs while the others arrive
            time.sleep(0.02)
            return step()

        s.engine.step = slow_step
        client = s.client()
        running = client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=60, stream=True,
                                            extra_body={"ignore_eos": True})
        next(iter(running))
        waiting = client.completions.create(model=MODEL_NAME, prompt="b", max_tokens=2, stream=True, temperature=0)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL_NAME, prompt="c", max_tokens=2)
        assert e.value.response.headers["retry-after"] == "1"
        error = e.value.response.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "at most 1 requests waiting" in error["message"]
        running.close()
        assert "".join(c.choices[0].text for c in waiting) == greedy(reference, "b", 2)
        s.assert_no_leak()


def test_failed_step_is_503_and_server_stays_up(loaded, device):
    with run_server(loaded, device) as s:
        def broken():
            raise RuntimeError("device lost")

        s.engine.step = broken  # the loop calls it in its worker thread
        with pytest.raises(openai.InternalServerError) as e:
            s.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and "device lost" in e.value.response.json()["error"]["message"]
        health = httpx.get(f"{s.url}/health")
        assert health.status_code == 503 and "device lost" in health.json()["detail"]
        with pytest.raises(openai.InternalServerError):
            s.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert httpx.get(f"{s.url}/metrics").status_code == 200


def test_a_stopped_server_lets_its_engine_go(loaded, device):
    """FastAPI caches route functions process-wide, so an app outlives its server: once the
    server stops, nothing of it may keep the engine (a model and its KV pool) alive.
    `pagedattn bench engine` serves one model shape after another in one process."""
    import gc
    import weakref

    with run_server(loaded, device) as s:
        s.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        engine = weakref.ref(s.engine)
    del s
    gc.collect()
    assert engine() is None, "the stopped server still holds its engine"
