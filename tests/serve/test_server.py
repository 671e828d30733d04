"""`specjax serve` over HTTP: a server on 127.0.0.1 at a free port, driven with the real `openai` client (and raw
httpx for malformed bodies). A tiny random model keeps it fast; `LLM.generate` / `LLM.chat` on the same model
is the reference. The real-model tests are in test_real_model.py (slow)."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from serve_helpers import RunningServer, metric, tiny_llm
from specjax.config import SamplingParams
from specjax.runners.serving import EngineOptions, ServingEngine
from specjax.serve import build_server
from specjax.serve.app import create_app

OPTIONS = EngineOptions(max_batch=3, max_prompt_tokens=32, max_tokens=16, max_queue=8, step_chunk=2)
NAME = "tiny"


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


@pytest.fixture(scope="module")
def served(llm):
    app, engine = build_server(llm, None, OPTIONS, model_name=NAME)
    server = RunningServer(app, engine)
    yield server, engine
    server.stop()
    engine.shutdown()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(llm, prompt, n=8, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, **kw))[0]


def test_completions_and_chat_equal_llm_generate(llm, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    for prompt in ("hello there", "abcabc"):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
        ref = greedy(llm, prompt)
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.model_extra["timing"]["time_to_first_token"] <= r.model_extra["timing"]["e2e_latency"]
        assert "spec_decode" not in r.model_extra  # plain decoding
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    ref = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0]
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(ref.token_ids)
    # token-id prompts and a one-prompt list work too
    r = client.completions.create(model=NAME, prompt=[llm.tokenizer.encode("abcabc")], max_tokens=8, temperature=0)
    assert r.choices[0].text == greedy(llm, "abcabc").text


def test_streaming_pieces_join_to_the_text_and_usage_comes_last(llm, client):
    ref = greedy(llm, "hello there", 16, ignore_eos=True)
    stream = client.completions.create(model=NAME, prompt="hello there", max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "stream me"}]
    ref = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0]
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_stop_strings_cut_the_text_and_are_never_streamed(llm, client):
    full = greedy(llm, "hello there", 16, ignore_eos=True).text
    stop = full[5:7]
    ref = greedy(llm, "hello there", 16, ignore_eos=True, stop=[stop])
    r = client.completions.create(model=NAME, prompt="hello there", max_tokens=16, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    pieces = [c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="hello there", max_tokens=16, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True})]
    assert "".join(pieces) == ref.text and all(stop not in p for p in pieces)


def test_seeds_reproduce_samples(llm, client):
    kw = dict(model=NAME, prompt="abc", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    ref = llm.generate("abc", SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0].text
    assert a == b == ref and c != a


@pytest.mark.parametrize("body, status, words", [
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 4', 400, "not valid JSON"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokenz": 4}', 400, "unknown field 'max_tokenz'"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"model": "tiny"}', 400, "missing field 'prompt'"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 100000}', 400, "max_tokens=100000"),
    (b'{"model": "tiny", "prompt": "hi", "n": 2}', 400, "n=2"),
    (b'{"model": "tiny", "prompt": "hi", "logprobs": 2}', 400, "logprobs"),
    (b'{"model": "tiny", "prompt": ["a", "b"]}', 400, "one prompt per request"),
    (b'{"model": "other", "prompt": "hi"}', 404, "'other' is not served here"),
    (b'[1, 2]', 400, "JSON object"),
])
def test_malformed_requests_get_400_naming_the_field(served, body, status, words):
    r = httpx.post(served[0].url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status


def test_chat_errors_and_prompt_past_the_limit(client):
    with pytest.raises(openai.BadRequestError, match="unknown field 'tools'"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[])
    with pytest.raises(openai.BadRequestError, match="more than this server's limit of 32"):
        client.completions.create(model=NAME, prompt="x" * 40, max_tokens=4)


def test_engine_state_maps_to_429_503_and_health(llm):
    """A full queue answers 429 with the limit in the message; a draining engine 503 and /health 503."""
    engine = ServingEngine(llm, None, EngineOptions(**dict(vars(OPTIONS), max_queue=0)))  # never started
    server = RunningServer(create_app(engine, NAME), engine)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and "--max-queue 0" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 503  # not running
        engine.drain()
        r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    finally:
        server.stop()
        engine.shutdown()


def test_api_key_guards_every_route_but_health(llm, served):
    engine = served[1]
    app = create_app(engine, NAME, api_key="s3cret")
    server = RunningServer(app, engine)
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(server.url + path).status_code == 401
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens
    finally:
        server.server.should_exit = True  # the engine belongs to the module's server: not drained here
        server.thread.join(30)


def test_metrics_add_up_the_responses(client, served):
    """/metrics counters grow by exactly what the responses report (usage and finish reasons)."""
    url = served[0].url
    before = httpx.get(url + "/metrics").text
    rs = [client.completions.create(model=NAME, prompt=p, max_tokens=n, temperature=0)
          for p, n in (("a", 3), ("bb", 9), ("ccc", 16))]
    after = httpx.get(url + "/metrics").text
    grew = lambda name, **lab: metric(after, name, **lab) - metric(before, name, **lab)  # noqa: E731
    assert grew("specjax:generation_tokens_total") == sum(r.usage.completion_tokens for r in rs)
    assert grew("specjax:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in rs)
    reasons = [r.choices[0].finish_reason for r in rs]
    for reason in set(reasons):
        assert grew("specjax:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert grew("specjax:e2e_request_latency_seconds_count") == 3
    assert metric(after, "specjax:num_requests_running") == 0
    assert metric(after, "specjax:jit_compiles") == metric(before, "specjax:jit_compiles")
    assert metric(after, "process_resident_memory_bytes") > 0


def _slow_steps(engine, monkeypatch, seconds=0.05):
    real = engine.progs.advance
    monkeypatch.setattr(engine.progs, "advance", lambda *a: (time.sleep(seconds), real(*a))[1])


def test_client_disconnect_cancels_and_frees_the_row(served, monkeypatch):
    server, engine = served
    _slow_steps(engine, monkeypatch)
    before = httpx.get(server.url + "/metrics").text
    body = {"model": NAME, "prompt": "abc", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        next(r.iter_lines())  # the first event arrived: the request runs
        assert engine.num_running == 1
    deadline = time.time() + 20
    while engine.num_running and time.time() < deadline:
        time.sleep(0.02)
    assert engine.num_running == 0
    after = httpx.get(server.url + "/metrics").text
    assert metric(after, "specjax:request_failure_total", reason="cancelled") \
        == metric(before, "specjax:request_failure_total", reason="cancelled") + 1
    # a non-streamed request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=dict(body, stream=False), timeout=0.2)
    deadline = time.time() + 20
    while engine.num_running and time.time() < deadline:
        time.sleep(0.02)
    assert engine.num_running == 0


def test_a_failed_generation_gets_500_and_the_rest_are_served(llm, served, client, monkeypatch):
    engine = served[1]
    real = engine.progs.prefill

    def flaky(tokens, lens, active, sampling):
        if int(tokens[0, 0]) == llm.tokenizer.encode("!")[0]:
            raise FloatingPointError("injected")
        return real(tokens, lens, active, sampling)

    monkeypatch.setattr(engine.progs, "prefill", flaky)
    with pytest.raises(openai.InternalServerError, match="injected"):
        client.completions.create(model=NAME, prompt="!boom", max_tokens=4)
    r = httpx.post(served[0].url + "/v1/completions", json={"model": NAME, "prompt": "!x", "stream": True})
    assert '"type":"server_error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    assert client.completions.create(model=NAME, prompt="fine", max_tokens=4, temperature=0).choices[0].text \
        == greedy(llm, "fine", 4).text


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(llm, monkeypatch):
    """What SIGTERM does (uvicorn calls the server's handle_exit): the stream in flight runs to its end, new
    requests are refused, and the server thread exits."""
    app, engine = build_server(llm, None, OPTIONS, model_name=NAME)
    server = RunningServer(app, engine, shutdown_timeout=20)
    _slow_steps(engine, monkeypatch, 0.03)
    body = {"model": NAME, "prompt": "abc", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    lines = []

    def consume():
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            lines.extend(x for x in r.iter_lines() if x)

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.time() + 20
    while not engine.num_running and time.time() < deadline:
        time.sleep(0.01)
    server.server.handle_exit(signal.SIGTERM, None)
    try:  # refused: 503 while the listener is still open, or no connection once it closed
        r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    except httpx.ConnectError:
        pass
    reader.join(30)
    server.thread.join(30)
    assert not server.thread.is_alive()
    assert lines[-1] == "data: [DONE]" and any('"finish_reason":"length"' in x for x in lines)
    assert engine.shutdown() is True
