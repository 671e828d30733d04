"""Memory preflight (`specjax.memory`): the estimate's KV arithmetic, the refusal with its numbers before any
cache is allocated (Python API and batch job), the override for a container's share, and the upper bounds on
draft sizes that would otherwise compile for minutes."""
from __future__ import annotations

import json
import time

import pytest

from specjax import memory
from specjax.buckets import make_buckets
from specjax.config import ConfigError, SamplingParams, SpeculativeConfig
from specjax.models.llama import LlamaConfig

from spec_helpers import tiny_config, tiny_llm, tiny_params

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64, vocabulary 49152.
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def test_kv_estimate_is_the_cache_arithmetic():
    b = make_buckets(4, 100, 200)
    est = memory.estimate(SMOLLM2, b, 4)
    assert est.kv_cache == 2 * 30 * 4 * 3 * b.capacity * 64 * 4
    assert est.draft_cache == 0 and est.activations > 0
    with_draft = memory.estimate(SMOLLM2, b, 4, tree_nodes=5, draft_config=SMOLLM2)
    assert with_draft.draft_cache == est.kv_cache and with_draft.activations > est.activations


def test_an_absurd_batch_is_refused_with_its_numbers():
    """Batch 4096 x 8000 new tokens on SmolLM2 wants about 1.5 TB of KV cache."""
    b = make_buckets(4096, 64, 8000)
    with pytest.raises(memory.ResourceError) as e:
        memory.preflight(SMOLLM2, b, 4, available=24 * 2 ** 30)
    msg = str(e.value)
    assert "KV cache 1" in msg and "TiB" not in msg and "batch 4096" in msg and "24.00 GiB is available" in msg
    assert "lower max_tokens" in msg
    assert memory.preflight(SMOLLM2, make_buckets(1, 64, 64), 4, available=24 * 2 ** 30).total < 2 ** 30


def test_limit_override_and_parse():
    assert memory.parse_bytes("512M") == 512 * 2 ** 20 and memory.parse_bytes("1.5G") == int(1.5 * 2 ** 30)
    assert memory.parse_bytes("2GiB") == 2 * 2 ** 30 and memory.parse_bytes("1000") == 1000
    with pytest.raises(memory.ResourceError, match="is not a size"):
        memory.parse_bytes("lots")
    assert memory.available_bytes() is None or memory.available_bytes() > 0


@pytest.fixture(scope="module")
def llm():
    config = tiny_config(64)
    return tiny_llm(config, tiny_params(config, seed=0))


def test_generate_refuses_before_allocating(llm, monkeypatch):
    monkeypatch.setenv("SPECJAX_MEMORY_LIMIT", "1M")
    t = time.perf_counter()
    with pytest.raises(memory.ResourceError, match=r"this generation needs about .* but only 1.0 MiB is available"):
        llm.generate([[1, 2, 3]] * 64, SamplingParams(max_tokens=900))
    assert time.perf_counter() - t < 5  # refused up front, not after compiling
    monkeypatch.setenv("SPECJAX_MEMORY_LIMIT", "1G")
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


def test_batch_job_refuses_before_decoding(llm, monkeypatch, tmp_path):
    from specjax.runners.batch import run_job

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": [1, 2, 3], "sampling": {"max_tokens": 900}}) + "\n"
                           for i in range(8)))
    monkeypatch.setenv("SPECJAX_MEMORY_LIMIT", "1M")
    with pytest.raises(memory.ResourceError, match="this batch job needs about"):
        run_job(llm, str(src), str(tmp_path / "out.jsonl"), batch_size=8, progress=False)


@pytest.mark.parametrize("kw, name", [(dict(method="eagle", depth=1000), "depth"),
                                      (dict(method="eagle", total_tokens=2000), "total_tokens"),
                                      (dict(method="ngram", num_speculative_tokens=10 ** 9), "num_speculative_tokens"),
                                      (dict(method="suffix", suffix_max_depth=10 ** 6), "suffix_max_depth")])
def test_draft_sizes_that_never_pay_are_refused(kw, name):
    with pytest.raises(ConfigError, match=f"invalid {name}=.*never pay back"):
        SpeculativeConfig(**kw)
