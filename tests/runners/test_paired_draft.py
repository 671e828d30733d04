"""`model: auto` in a draft_model config: the draft paired with the target (specjax.models.resolve.PAIRED_DRAFTS)."""
from __future__ import annotations

import types

import pytest

from specjax.config import SpeculativeConfig
from specjax.drafters.build import SpeculativeConfigError
from specjax.models.resolve import paired_draft
from specjax.runners.speculative import with_paired_draft


def _llm(model, quantization=None):
    return types.SimpleNamespace(model_spec=model, quantization=quantization)


def test_pairs_by_alias():
    assert paired_draft("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert paired_draft("Qwen2.5-Coder-1.5B-Instruct") == "qwen2.5-coder-0.5b"
    assert paired_draft("smollm2-135m") == "assets/smollm2-135m-draft"
    assert paired_draft("/some/model.gguf") is None and paired_draft(None) is None


def test_auto_takes_the_pair_and_its_blocks_for_a_gguf_target():
    spec = SpeculativeConfig(method="draft_model", model="auto", num_speculative_tokens=3)
    got = with_paired_draft(_llm("qwen2.5-coder-1.5b", "gguf"), spec)
    assert (got.model, got.quantization, got.num_speculative_tokens) == ("qwen2.5-coder-0.5b", "gguf", 3)
    assert with_paired_draft(_llm("qwen2.5-coder-1.5b"), spec).quantization is None
    assert with_paired_draft(_llm("smollm2-135m", "gguf"), spec).model == "assets/smollm2-135m-draft"
    assert with_paired_draft(_llm("smollm2-135m", "gguf"), spec).quantization is None  # a float draft directory
    named = SpeculativeConfig(method="draft_model", model="qwen2.5-coder-0.5b", quantization="int4")
    assert with_paired_draft(_llm("qwen2.5-coder-1.5b", "gguf"), named) == named


def test_auto_without_a_pair_is_a_clear_error():
    spec = SpeculativeConfig(method="draft_model", model="auto")
    with pytest.raises(SpeculativeConfigError, match="has none.*name the draft model"):
        with_paired_draft(_llm("/tmp/x.gguf"), spec)
