"""The continuous-batching distillation generator: exact greedy answers, recorded features equal to a separate
forward, crash-safe resume, a deterministic corpus, and the Magpie instruction filters."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from helpers import save_hf_model, tiny_config, tiny_params
from specjax.train import generate as G
from specjax.train import magpie
from specjax.train.shards import ShardError, iter_examples, open_corpus, read_manifest

CFG = tiny_config(num_layers=3, vocab_size=259, architecture="LlamaForCausalLM")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(tmp_path_factory.mktemp("gen-model"), CFG, tiny_params(CFG, seed=4))


@pytest.fixture(scope="module")
def loaded(model_dir):
    from specjax.api import LLM

    return LLM(model_dir, "float32", max_num_seqs=None)


def _requests(tok, n=11, temps=None):
    texts = [f"question {i}: " + "abc" * (i % 4) for i in range(n)]
    temps = temps or [0.0 if i % 3 else 0.9 for i in range(n)]
    return [G.Request(i, 100 + i, G.chat_tokens(tok, [{"role": "user", "content": t}]), temps[i], 6 + 3 * (i % 4))
            for i, t in enumerate(texts)], texts


def test_greedy_answers_equal_plain_decoding_and_features_equal_a_forward(loaded, model_dir):
    from specjax.api import LLM
    from specjax.config import SamplingParams
    from specjax.train.features import target_features

    cfg, params, tok = loaded.config, loaded.params, loaded.tokenizer
    reqs, texts = _requests(tok)
    got = {}
    shape = G.GenShape(batch=4, prompt_len=48, max_new=16, steps=3)  # fewer slots than requests: refills
    G.generate(loaded, reqs, shape, seed=0, phase="t", on_done=lambda s: got.setdefault(s.request, s),
               features=("final", 1))
    assert sorted(got) == list(range(len(reqs)))
    llm = LLM(model_dir, max_num_seqs=2)  # the default path: fixed batches, not the engine
    for r in reqs:
        s = got[r.id]
        if r.temperature == 0:
            want = llm.generate([texts[r.id]], SamplingParams(max_new_tokens=r.max_new, temperature=0.0),
                                chat=True)[0].token_ids
            assert s.response.tolist() == list(want), r.id
        seq = np.concatenate([s.prompt, s.response])[None]
        final, lay = jax.device_get(target_features(params, cfg, seq, (1,)))
        ref = np.concatenate([final, lay], -1)[0]
        f = np.asarray(s.features, np.float32)
        assert f.shape == ref.shape
        # Every position matches a fresh forward of the sequence alone (bfloat16 storage).
        np.testing.assert_allclose(f, ref, rtol=2e-2, atol=2e-2)
        assert np.all(np.any(f != 0, axis=-1))


def test_sampled_answers_do_not_depend_on_the_batch(loaded):
    tok = loaded.tokenizer
    reqs, _ = _requests(tok, n=6, temps=[1.0] * 6)
    runs = []
    for shape in (G.GenShape(2, 48, 16, 2), G.GenShape(8, 48, 16, 5)):
        got = {}
        G.generate(loaded, reqs, shape, seed=5, phase="t",
                   on_done=lambda s: got.setdefault(s.request, s.response.tolist()))
        runs.append(got)
    assert runs[0] == runs[1]
    other = {}
    G.generate(loaded, reqs, G.GenShape(2, 48, 16, 2), seed=6, phase="t",
               on_done=lambda s: other.setdefault(s.request, s.response.tolist()))
    assert other != runs[0]  # the seed matters


def test_a_request_that_does_not_fit_is_refused(loaded):
    tok = loaded.tokenizer
    reqs, _ = _requests(tok, n=2)
    with pytest.raises(ShardError, match="request 0: prompt of .* does not fit"):
        G.generate(loaded, reqs, G.GenShape(2, 8, 16, 2), seed=0, phase="t", on_done=lambda s: None)


def _main(out, model_dir, *extra):
    return G.main(["--out", str(out), "--target", model_dir, "--candidates", "60", "--instruction-tokens", "20",
                   "--max-new", "24", "--prompt-len", "96", "--batch", "8", "--steps", "4",
                   "--block", "16", "--no-progress", *extra])


def _shard_hashes(root):
    return [(s["block"], s["sha256"]) for s in read_manifest(root)["shards"]]


def test_crash_then_rerun_equals_an_uninterrupted_run(tmp_path, model_dir, monkeypatch):
    whole = _main(tmp_path / "whole", model_dir)
    assert whole["phases"]["instructions"]["prompts"] > 0
    assert whole["compute_limit"]["limit_tokens_per_s"] > 0
    from specjax.train import shards

    real_add, calls = shards.CorpusWriter.add, []

    def flaky(self, block, *a, **k):
        calls.append(block)
        if os.path.basename(self.root) == "responses" and len(calls) > 5:
            raise KeyboardInterrupt  # the process dies here: nothing after this block is written
        return real_add(self, block, *a, **k)

    monkeypatch.setattr(shards.CorpusWriter, "add", flaky)
    with pytest.raises(KeyboardInterrupt):
        _main(tmp_path / "cut", model_dir)
    monkeypatch.setattr(shards.CorpusWriter, "add", real_add)
    partial = read_manifest(str(tmp_path / "cut" / "responses"))["shards"]
    assert 0 < len(partial) < len(read_manifest(str(tmp_path / "whole" / "responses"))["shards"])
    _main(tmp_path / "cut", model_dir)
    for phase in ("instructions", "responses"):
        assert _shard_hashes(str(tmp_path / "cut" / phase)) == _shard_hashes(str(tmp_path / "whole" / phase))
    (c,) = open_corpus(str(tmp_path / "cut" / "responses"))
    reqs = [e.prompt_id for e in iter_examples([c], split="all", shuffle=False)]
    assert c.totals()["sequences"] == len(reqs)
    prompts = [json.loads(line) for line in open(tmp_path / "cut" / "prompts.jsonl")]
    assert len({p["text"] for p in prompts}) == len(prompts)  # deduplicated
    # Held-out prompts are answered once, greedily; some training prompts twice.
    held = {p["id"] for p in prompts if p["heldout"]}
    for e in iter_examples([c], split="heldout", shuffle=False):
        assert e.prompt_id in held and e.temperature == 0.0


def test_magpie_prefix_and_filters(loaded):
    tok = loaded.tokenizer
    pre = magpie.user_prefix(tok)
    assert pre == "<|im_start|>user\n"
    assert magpie.clean("the the the the the the the the") is None
    assert magpie.clean("ok") is None
    assert magpie.clean("Напиши короткое стихотворение о весне пожалуйста") is None
    assert magpie.clean("12345 67890 !!! ??? ... 111") is None
    assert magpie.clean("  Write a short poem about the sea at night.  ") == "Write a short poem about the sea at night."
    items = [(0, "a", "Hello there, friend!"), (1, "a", "hello   THERE friend"), (2, "b", "Something else entirely.")]
    assert [i for i, _, _ in magpie.dedupe(items)] == [0, 2]
    cands = magpie.plan_candidates(30, seed=1)
    assert cands == magpie.plan_candidates(30, seed=1) and len({c.category for c in cands}) == len(magpie.OPENERS)


@pytest.mark.slow
def test_long_phase_builds_passage_and_multi_turn_prompts(tmp_path, model_dir, loaded):
    from specjax.train.shards import is_heldout

    _main(tmp_path / "c", model_dir)
    tok = loaded.tokenizer
    prompts = G.read_prompt_file(str(tmp_path / "c"))
    with pytest.raises(ShardError, match="blocks .* are not generated yet"):
        G.long_requests(tok, str(tmp_path / "c"), prompts, source_blocks=99, prompt_len=512, max_new=8)
    reqs = G.long_requests(tok, str(tmp_path / "c"), prompts, source_blocks=2, prompt_len=512, max_new=8,
                           min_passage=4)
    assert len(reqs) >= 8
    texts = [tok.decode(r.tokens.tolist(), skip_special_tokens=False) for r in reqs]
    assert any("Passage:" in t for t in texts) and any(t.count("<|im_start|>user") == 2 for t in texts)
    assert len({r.prompt_id for r in reqs}) == len(reqs) and all(r.prompt_id >= 2_000_000 for r in reqs)
    again = G.long_requests(tok, str(tmp_path / "c"), prompts, source_blocks=2, prompt_len=512, max_new=8,
                            min_passage=4)
    assert [(r.prompt_id, r.tokens.tolist()) for r in again] == [(r.prompt_id, r.tokens.tolist()) for r in reqs]
    got = []
    G.generate(loaded, reqs[:6], G.GenShape(4, 512, 8, 4), seed=0, phase="long", on_done=got.append)
    assert len(got) == 6
    assert {is_heldout(r.prompt_id) for r in reqs} <= {True, False}
