"""The committed SmolLM2 corpus (data/smollm2-135m): enough distinct prompts, a held-out split, no benchmark
text, and shards that match their manifests."""
from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT, SPEC_BENCH
from specjax.train.magpie import normalise
from specjax.train.shards import iter_examples, is_heldout, open_corpus

DATA = os.path.join(ROOT, "data", "smollm2-135m")
PROMPTS = os.path.join(DATA, "prompts.jsonl")

pytestmark = pytest.mark.skipif(not os.path.isfile(PROMPTS), reason="no committed corpus")


def _prompts():
    with open(PROMPTS) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_prompts_are_many_distinct_and_split_by_id():
    ps = _prompts()
    assert len(ps) >= 20000
    assert len({normalise(p["text"]) for p in ps}) == len(ps)
    assert len({p["id"] for p in ps}) == len(ps)
    assert all(p["heldout"] == is_heldout(p["id"]) for p in ps)
    held = sum(p["heldout"] for p in ps)
    assert 0.03 * len(ps) < held < 0.08 * len(ps)
    cats = {p["category"].removeprefix("template-") for p in ps}
    assert {"chat", "writing", "coding", "math", "reasoning", "extraction", "translation"} <= cats


def test_no_spec_bench_question_is_a_prompt():
    if not os.path.isfile(SPEC_BENCH):
        pytest.skip("Spec-Bench questions not present")
    with open(SPEC_BENCH) as f:
        bench = {normalise(t) for line in f if line.strip() for t in json.loads(line)["turns"]}
    ours = {normalise(p["text"]) for p in _prompts()}
    assert not bench & ours
    long_bench = [q for q in bench if len(q) > 60]
    for o in (o for o in ours if len(o) > 60):
        assert not any(q in o for q in long_bench)


@pytest.mark.parametrize("phase", ["instructions", "responses", "long"])
def test_shards_match_their_manifest(phase):
    root = os.path.join(DATA, phase)
    if not os.path.isdir(root):
        pytest.skip(f"phase {phase} not generated yet")
    (c,) = open_corpus(root)  # every listed shard exists and has its recorded SHA-256
    n = sum(1 for _ in iter_examples([c], split="all", shuffle=False))  # and its arrays agree with its entry
    assert n == c.totals()["sequences"] > 0


@pytest.mark.slow
def test_the_shipped_target_still_matches_the_corpus_fingerprint():
    """A change to the config class or the loader must not orphan the committed corpus: resuming generation or
    training on it checks this fingerprint and refuses a mismatch."""
    from specjax.models.loading import load_model
    from specjax.train.shards import read_manifest, target_fingerprint

    m = load_model("smollm2-135m", "float32", with_tokenizer=False)
    assert target_fingerprint(m.config, m.params) == read_manifest(os.path.join(DATA, "responses"))["target"]
