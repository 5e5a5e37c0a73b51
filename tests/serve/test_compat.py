"""What clients written for OpenAI or vLLM send and expect: unknown fields ignored (logged once),
prompt lists and n > 1 (streamed too) with OpenAI's choice indices, OpenAI's error body on every
error, vLLM's /tokenize, /detokenize and /version, latency histograms and the throughput log."""

from __future__ import annotations

import logging
import time

import httpx

from pagedattn.engine.sampling_params import SamplingParams

from .conftest import MODEL_NAME, run_server

PROMPTS = ["Hello there", "The quick brown fox", "paged attention"]


def _greedy(reference, prompts, max_tokens: int) -> list[str]:
    outs = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.outputs[0].text for o in outs]


def test_unknown_fields_are_ignored_and_logged_once(server, caplog):
    client = server.client()
    extra = {"frobnicate": 1, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    with caplog.at_level(logging.WARNING, logger="pagedattn.serve"):
        for _ in range(2):
            out = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body=extra)
            assert out.usage.completion_tokens == 2
    ignored = [r.getMessage() for r in caplog.records if "present in the request but ignored" in r.getMessage()]
    assert len(ignored) == 1 and "frobnicate" in ignored[0] and "stream_options.continuous_usage_stats" in ignored[0]
    # OpenAI's options with no effect here, and a text response format, are accepted silently
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedattn.serve"):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, store=False,
            metadata={"k": "v"}, service_tier="auto", parallel_tool_calls=True, response_format={"type": "text"},
            user="u1",
        )
    assert out.usage.completion_tokens == 2 and not caplog.records


def test_prompt_lists_and_n(server, reference):
    client = server.client()
    ids = reference.tokenizer.encode(PROMPTS[1])
    want = _greedy(reference, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], 6)
    out = client.completions.create(model=MODEL_NAME, prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=6, temperature=0)
    assert [(c.index, c.text) for c in out.choices] == [(0, want[0]), (1, want[2])]
    out = client.completions.create(model=MODEL_NAME, prompt=[ids, reference.tokenizer.encode(PROMPTS[0])],
                                    max_tokens=6, temperature=0, n=2)
    assert [(c.index, c.text) for c in out.choices] == [(0, want[1]), (1, want[1]), (2, want[0]), (3, want[0])]
    prompt_lens = len(ids) + len(reference.tokenizer.encode(PROMPTS[0]))
    assert out.usage.prompt_tokens == prompt_lens and out.usage.completion_tokens == 4 * 6
    server.assert_no_leak()


def test_n_and_prompt_lists_stream(server):
    client = server.client()
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=8, temperature=0.9, seed=3, n=2)
    whole = client.completions.create(**kwargs)
    texts, reasons = {}, {}
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices} and set(reasons) == {0, 1, 2, 3}
    assert chunk.usage.completion_tokens == whole.usage.completion_tokens == 4 * 8

    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0.9,
                seed=3, n=3)
    whole = client.chat.completions.create(**chat)
    texts = {}
    for chunk in client.chat.completions.create(**chat, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                assert c.delta.role == "assistant" and c.index not in texts
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {c.index: c.message.content for c in whole.choices}
    server.assert_no_leak()


def test_model_is_optional_and_checked(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL_NAME
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    for route, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": [
            {"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{server.url}/v1/{route}", json={"model": "gpt-4o", **body})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_every_error_has_openais_body(server):
    cases = [
        (httpx.get(f"{server.url}/v1/nope"), 404),
        (httpx.post(f"{server.url}/nope", json={}), 404),
        (httpx.get(f"{server.url}/v1/completions"), 405),
        (httpx.delete(f"{server.url}/v1/models"), 405),
        (httpx.post(f"{server.url}/v1/completions", content=b"{", headers={"content-type": "application/json"}), 400),
        (httpx.get(f"{server.url}/v1/models/other"), 404),
    ]
    for r, status in cases:
        assert r.status_code == status, (r.request.url, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
    assert cases[2][0].headers["allow"] == "POST"
    assert "Invalid URL (GET /v1/nope)" in cases[0][0].json()["error"]["message"]


def test_models_version_tokenize_detokenize(server, reference):
    import pagedattn

    card = server.client().models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    assert httpx.get(f"{server.url}/version").json() == {"version": pagedattn.__version__}

    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there", "return_token_strs": True})
    body = r.json()
    ids = reference.tokenizer.encode("Hello there")
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] == 128
    assert body["token_strs"] == reference.tokenizer.convert_ids_to_tokens(ids)
    body = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "hi"}]}).json()
    assert reference.tokenizer.decode(body["tokens"]) == "[user] hi\nA:" and body["token_strs"] is None
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello there"}
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 100_000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_latency_histograms_and_throughput_log(loaded, device, caplog):
    with caplog.at_level(logging.INFO, logger="pagedattn.serve"):
        with run_server(loaded, device, log_interval_s=0.2) as s:
            client = s.client()
            for _ in range(3):
                client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=8, temperature=0)
            metrics = httpx.get(f"{s.url}/metrics").text
            time.sleep(0.5)  # a line for the busy interval, then one saying the server is idle
    assert "pagedattn_time_to_first_token_seconds_count 3.0" in metrics
    assert "pagedattn_inter_token_latency_seconds_count 21.0" in metrics  # 7 gaps between 8 tokens, 3 times
    assert "pagedattn_prompt_tokens_total 15.0" in metrics
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Avg prompt throughput")]
    assert lines and "Running: 0 reqs, Waiting: 0 reqs" in lines[-1]
    assert any("Avg generation throughput: 0.0 tokens/s" not in line for line in lines)
    assert lines[-1].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s")
    assert len(lines) <= 4  # idle intervals after the first are not logged


PLAIN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def test_chat_template_of_the_server_and_of_a_request(loaded, device, server):
    # `serve --chat-template` replaces the tokenizer's template; a request's vLLM `chat_template`
    # field replaces both; /tokenize renders through the same template
    messages = [{"role": "user", "content": "hi there"}]
    with run_server(loaded, device, chat_template=PLAIN_TEMPLATE) as custom:
        ids = httpx.post(f"{custom.url}/tokenize", json={"messages": messages}).json()["tokens"]
        tok = custom.engine.tokenizer
        assert ids == tok.encode("[user] hi there\n[assistant] ", add_special_tokens=False)
        other = "{{ messages[0]['content'] }}!"
        body = {"messages": messages, "chat_template": other}
        assert httpx.post(f"{custom.url}/tokenize", json=body).json()["tokens"] == tok.encode(
            "hi there!", add_special_tokens=False)
    default = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert default != ids  # the model's own template differs
