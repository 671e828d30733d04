"""`specjax serve` on the real model (SmolLM2-135M-Instruct, `LLM()`), driven with the `openai` client: greedy
completions and chats equal `LLM.generate` / `LLM.chat` (plain decoding) with speculation off, n-gram and
EAGLE-3 (the shipped head, as configs/methods/eagle3.yaml shapes it), streaming joins to the same text, stop
strings, seeds; and the `specjax serve` command itself starts, serves and exits with 0 on SIGTERM.

A few short prompts, 32 tokens each; every server compiles its programs once (slow: marked)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from serve_helpers import RunningServer, metric
from specjax.config import SamplingParams
from specjax.runners.serving import EngineOptions
from specjax.serve import build_server

pytestmark = pytest.mark.slow

OPTIONS = EngineOptions(max_batch=4, max_prompt_tokens=128, max_tokens=32, max_queue=16, step_chunk=4)
NAME = "smollm2"
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
CHAT = [{"role": "user", "content": "Name three rivers in Europe, one per line."}]
METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 4, "top_k": 1, "depth": 4, "total_tokens": 4},
}


@pytest.fixture(scope="module")
def llm():
    from specjax.api import LLM

    return LLM()


@pytest.fixture(scope="module")
def references(llm):
    """(greedy texts of PROMPTS, greedy text of CHAT, seeded sampled texts of PROMPTS): one batch each, so the
    sampled one reuses the greedy one's programs (temperature is traced)."""
    greedy = SamplingParams(max_tokens=32, temperature=0)
    sampled = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11)
    return ([o.text for o in llm.generate(PROMPTS, greedy)], llm.chat(CHAT, greedy)[0].text,
            [o.text for o in llm.generate(PROMPTS, sampled)])


@pytest.fixture(scope="module", params=list(METHODS))
def served(request, llm):
    app, engine = build_server(llm, METHODS[request.param], OPTIONS, model_name=NAME)
    server = RunningServer(app, engine)
    yield request.param, server, engine
    server.stop()
    engine.shutdown()


def test_greedy_output_equals_llm_generate(served, references):
    method, server, engine = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    texts, chat_text, _ = references
    compiles = engine.compiles
    for prompt, ref in zip(PROMPTS, texts):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=0)
        assert r.choices[0].text == ref, method
        m = r.model_extra.get("spec_decode")
        if method == "plain":
            assert m is None
        else:
            assert m["accepted"] == sum(m["per_position_accepted"]) <= m["drafted"]
            assert m["mean_accepted_length"] == pytest.approx(
                1 + m["accepted"] / m["verify_steps"] if m["verify_steps"] else 1.0)
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == chat_text
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=32, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == chat_text
    assert engine.compiles == compiles  # nothing compiled after the warm-up


def test_stop_strings_and_seeds(served, llm, references):
    method, server, engine = served
    if method != "plain":
        pytest.skip("checked once, on plain decoding")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    text = references[0][0]
    stop = text.split()[2]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=32, temperature=0.8, top_p=0.95)
    a, b = (client.completions.create(seed=11, **kw).choices[0].text for _ in range(2))
    assert a == b == references[2][0]


def test_metrics_match_the_responses_with_speculation(served):
    method, server, engine = served
    if method != "ngram":
        pytest.skip("checked once, with n-gram speculation")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    before = httpx.get(server.url + "/metrics").text
    rs = [client.completions.create(model=NAME, prompt=p, max_tokens=32, temperature=0) for p in PROMPTS]
    after = httpx.get(server.url + "/metrics").text
    grew = lambda name, **lab: metric(after, name, **lab) - metric(before, name, **lab)  # noqa: E731
    spec = [r.model_extra["spec_decode"] for r in rs]
    assert grew("specjax:spec_decode_num_draft_tokens_total") == sum(m["drafted"] for m in spec)
    assert grew("specjax:spec_decode_num_accepted_tokens_total") == sum(m["accepted"] for m in spec)
    assert grew("specjax:spec_decode_num_drafts_total") == sum(m["verify_steps"] for m in spec)
    for pos in range(4):
        assert grew("specjax:spec_decode_num_accepted_tokens_per_pos_total", position=pos) \
            == sum(m["per_position_accepted"][pos] for m in spec)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_serve_command_serves_and_exits_cleanly_on_sigterm(tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "specjax.cli.main", "serve", "--port", str(port), "--max-batch", "2",
                             "--max-prompt-tokens", "64", "--max-tokens", "16", "--api-key", "k",
                             "--speculative-config", '{"method": "ngram"}', "--shutdown-timeout", "20"],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
        r = client.completions.create(model="smollm2-135m", prompt=PROMPTS[0], max_tokens=16, temperature=0)
        assert r.usage.completion_tokens > 0 and r.model_extra["spec_decode"]["verify_steps"] >= 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert "stopped" in (tmp_path / "serve.log").read_text()
