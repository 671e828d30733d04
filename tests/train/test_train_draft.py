"""Draft-model training and the draft format, on a tiny random target (no real-model training here)."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from conftest import ROOT, SPEC_BENCH
from specjax.kv_cache import init_cache
from specjax.models.llama import LlamaConfig, forward, init_params, lm_head
from specjax.models import draft_io
from specjax.train import draft_model as D
from specjax.train.data import load_dataset, save_dataset
from specjax.train.prompts import build_prompts, is_heldout

TINY = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
                   tie_word_embeddings=True)
ASSET = os.path.join(ROOT, "specjax", "assets", "smollm2-135m-draft")


@pytest.fixture(scope="module")
def target():
    return init_params(TINY, jax.random.key(0), scale=0.5)


def _layers(params):
    return {"layers": params["layers"], "final_norm": params["final_norm"]}


def _toy_arrays(n=12, prompt=5, resp=10, k=4, seed=0, V=TINY.vocab_size):
    """A fake distillation file: a deterministic 'target' that continues t -> (3t + 1) mod V."""
    rng = np.random.default_rng(seed)
    L = prompt + resp
    tokens = np.zeros((n, L), np.int32)
    topk_ids = np.zeros((n, resp, k), np.int32)
    topk_logp = np.full((n, resp, k), np.log(0.02), np.float16)
    for i in range(n):
        tokens[i, :prompt] = rng.integers(3, V, prompt)
        for t in range(prompt, L):
            tokens[i, t] = (3 * tokens[i, t - 1] + 1) % V
        for j in range(resp):
            nxt = tokens[i, prompt + j]
            topk_ids[i, j] = [nxt] + [(nxt + d) % V for d in range(1, k)]
            topk_logp[i, j, 0] = np.log(0.94)
    return {"tokens": tokens, "prompt_len": np.full(n, prompt, np.int32), "length": np.full(n, L, np.int32),
            "topk_ids": topk_ids, "topk_logp": topk_logp, "temperature": np.zeros(n, np.float32),
            "prompt_index": np.arange(n, dtype=np.int32), "heldout": np.arange(n) % 4 == 1}


# ------------------------------------------------------------------------------------------ format
def test_save_load_round_trip_exact_names(tmp_path, target):
    cfg = D.draft_config(TINY, 2)
    layers = D.init_from_target(target, (0, 2))
    d2t = np.asarray([0, 1, 2, 7, 11, 40, 95], np.int32)
    D.save_draft(str(tmp_path), cfg, layers, d2t, {"target": "tiny", "steps": 3}, dtype="bfloat16")

    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
        meta = f.metadata()
    suffixes = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight"]
    assert names == {f"model.layers.{i}.{s}" for i in range(2) for s in suffixes} | {"model.norm.weight", "d2t"}
    assert json.loads(meta["steps"]) == 3
    with safe_open(str(tmp_path / "model.safetensors"), framework="flax") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == jnp.bfloat16
        assert tuple(f.get_tensor("model.layers.1.mlp.down_proj.weight").shape) == (32, 48)  # [out, in]
        assert f.get_tensor("d2t").dtype == jnp.int32
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["num_hidden_layers"] == 2
    assert raw["tie_word_embeddings"] is False and raw["vocab_size"] == 96
    assert raw["specjax_draft"] == {"target": "tiny", "shares_target_embeddings": True, "draft_vocab_size": 7}

    cfg2, params, d2t2 = D.load_draft(str(tmp_path), target)
    assert cfg2 == cfg
    np.testing.assert_array_equal(np.asarray(d2t2), d2t)
    assert params["embed"] is target["embed"]
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(target["embed"])[d2t].T)
    for got, want in zip(params["layers"], layers["layers"]):
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(params["layers"][1]["wq"]), np.asarray(target["layers"][2]["wq"]),
                               rtol=1e-2, atol=1e-2)


def test_draft_logits_sit_at_d2t_target_ids(tmp_path, target):
    """Draft logit j equals the full-vocabulary logit (target embedding as head) of token d2t[j]."""
    cfg = D.draft_config(TINY, 2)
    d2t = np.asarray([2, 5, 9, 30, 64, 80], np.int32)
    D.save_draft(str(tmp_path), cfg, D.init_from_target(target, (0, 1)), d2t, {"target": "tiny"})
    cfg, params, d2t = D.load_draft(str(tmp_path), target)
    toks = jnp.asarray([[3, 17, 44, 90]], jnp.int32)
    cache = init_cache(cfg.num_layers, 1, 8, cfg.num_kv_heads, cfg.head_dim)
    out = forward(params, cfg, toks, jnp.arange(4, dtype=jnp.int32)[None], cache)
    assert out.logits.shape == (1, 4, 6)
    full = lm_head({"embed": target["embed"]}, out.hidden)  # [1, 4, V] tied head over the whole vocabulary
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(full)[..., np.asarray(d2t)], rtol=1e-5, atol=1e-5)


def test_load_draft_refuses_bad_directories(tmp_path, target):
    cfg = D.draft_config(TINY, 1)
    with pytest.raises(D.DraftError, match="no config.json"):
        D.load_draft(str(tmp_path), target)
    D.save_draft(str(tmp_path), cfg, D.init_from_target(target, (0,)), np.arange(5), {"target": "tiny"})
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["specjax_draft"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(D.DraftError, match="specjax_draft"):
        D.load_draft(str(tmp_path), target)
    with pytest.raises(D.DraftError, match="outside the target vocabulary"):
        D.save_draft(str(tmp_path), cfg, D.init_from_target(target, (0,)), np.asarray([0, 96]), {"target": "t"})
    with pytest.raises(D.DraftError, match="twice"):
        D.save_draft(str(tmp_path), cfg, D.init_from_target(target, (0,)), np.asarray([3, 3]), {"target": "t"})
    other = init_params(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                                    num_kv_heads=2, head_dim=8), jax.random.key(1))
    D.save_draft(str(tmp_path), cfg, D.init_from_target(target, (0,)), np.arange(5), {"target": "tiny"})
    with pytest.raises(D.DraftError, match="target embedding is"):
        D.load_draft(str(tmp_path), other)


def test_select_draft_vocab_ranks_by_target_output_and_keeps_specials():
    a = _toy_arrays()
    d2t = D.select_draft_vocab(a, 20, TINY.vocab_size, always=(0, 1, 2))
    assert d2t.size == 20 and np.all(np.diff(d2t) > 0) and {0, 1, 2} <= set(d2t.tolist())
    counts = np.bincount(np.concatenate([a["tokens"][n, 5:] for n in range(12)]), minlength=TINY.vocab_size)
    top = np.argsort(-counts, kind="stable")[:10]
    assert set(top.tolist()) <= set(d2t.tolist())
    # More room than the data names: the rest are the lowest unused ids.
    b = {"tokens": np.asarray([[5, 40, 30, 40, 20]], np.int32), "prompt_len": np.asarray([1], np.int32),
         "length": np.asarray([5], np.int32), "topk_ids": np.asarray([[[40, 30]] * 4], np.int32),
         "topk_logp": np.zeros((1, 4, 2), np.float16)}
    assert D.select_draft_vocab(b, 8, TINY.vocab_size, always=(0, 1, 2)).tolist() == [0, 1, 2, 3, 4, 20, 30, 40]
    assert D.select_draft_vocab(b, 5, TINY.vocab_size, always=(0, 1, 2)).tolist() == [0, 1, 2, 30, 40]


def test_build_targets_maps_topk_to_draft_indices():
    a = _toy_arrays(n=3)
    a["length"][2] = 9  # a shorter response: 4 steps
    d2t = D.select_draft_vocab(a, 40, TINY.vocab_size)
    t = D.build_targets(a, d2t, TINY.vocab_size)
    assert t["mask"][1].all() and t["mask"][2].tolist() == [True] * 4 + [False] * 6
    assert t["pos"][1].tolist() == list(range(4, 14))  # prompt_len 5: position 4 predicts response step 0
    n, i = 1, 3
    assert t["greedy_id"][n, i] == a["tokens"][n, 5 + i]
    g = t["greedy_idx"][n, i]
    assert g < 0 or d2t[g] == a["tokens"][n, 5 + i]
    assert np.all(t["greedy_idx"][2, 4:] == -1) and np.all(t["soft_p"][2, 4:] == 0)
    inside = t["soft_p"][n, i] > 0
    np.testing.assert_array_equal(d2t[t["soft_idx"][n, i][inside]], a["topk_ids"][n, i][inside])
    np.testing.assert_allclose(t["soft_p"][n, i].sum(), 1.0, rtol=1e-5)


def test_make_batches_buckets_and_is_deterministic():
    length = np.asarray([10, 70, 12, 130, 64, 65, 20])
    b1 = D.make_batches(length, 2, 64, seed=0, epoch=3)
    assert [(i.tolist(), s) for i, s in b1] == [(i.tolist(), s) for i, s in D.make_batches(length, 2, 64, 0, 3)]
    for idx, size in b1:
        assert len(idx) == 2 and np.all(length[idx] <= size) and np.all(length[idx] > size - 64)
    assert {int(r) for idx, _ in b1 for r in idx} == set(range(7))


def test_chain_acceptance_counts_leading_matches():
    match = np.asarray([[1, 1, 0, 1, 1, 1]], bool)
    mask = np.ones_like(match)
    r = D.chain_acceptance(match, mask, depth=2)
    # Draft 0 matches at 5 of 6 starts; draft 1 (after a match) at starts 0,3,4 of {0,1,3,4} with t+1 inside.
    assert r["alpha"][0] == pytest.approx(5 / 6)
    assert r["alpha"][1] == pytest.approx(3 / 4)
    assert r["tau"][1] == pytest.approx(1 + 5 / 6)
    assert r["tau"][2] == pytest.approx(1 + (4 + 3) / 5)


# ------------------------------------------------------------------------------------------ training
@pytest.mark.slow
def test_train_steps_reduce_loss(target):
    a = _toy_arrays()
    d2t = D.select_draft_vocab(a, 48, TINY.vocab_size)
    t = D.build_targets(a, d2t, TINY.vocab_size)
    cfg = D.draft_config(TINY, 1)
    frozen = {"embed": target["embed"], "head": target["embed"][jnp.asarray(d2t)].T}
    params = D.init_from_target(target, (0,))
    opt, _ = D.make_optimizer(3e-2, 30, 2, 0.0, 1.0)
    state = opt.init(params)
    batch = D.device_batch(t, np.arange(12), 15)
    first = float(D.loss_and_metrics(params, frozen, cfg, batch, 0.5)[0])
    for _ in range(15):
        params, state, m = D.train_step(params, state, frozen, batch, config=cfg, optimizer=opt, hard_weight=0.5)
    last = float(D.loss_and_metrics(params, frozen, cfg, batch, 0.5)[0])
    assert last < 0.7 * first


def _write_tiny_target(path, params):
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": TINY.vocab_size, "hidden_size": TINY.hidden_size,
           "intermediate_size": TINY.intermediate_size, "num_hidden_layers": TINY.num_layers,
           "num_attention_heads": TINY.num_heads, "num_key_value_heads": TINY.num_kv_heads,
           "head_dim": TINY.head_dim, "rms_norm_eps": TINY.rms_norm_eps, "rope_theta": TINY.rope_theta,
           "max_position_embeddings": 128, "tie_word_embeddings": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    t = {"model.embed_tokens.weight": np.asarray(params["embed"]), "model.norm.weight": np.asarray(params["final_norm"])}
    for i, lp in enumerate(params["layers"]):
        for k, suffix in draft_io.LAYER_NAMES.items():
            w = np.asarray(lp[k])
            t[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(w.T if k in draft_io.MATRICES else w)
    save_file(t, os.path.join(path, "model.safetensors"))


@pytest.mark.slow
def test_resume_continues_from_last_checkpoint(tmp_path, target):
    tdir, data, out = str(tmp_path / "target"), str(tmp_path / "d.npz"), str(tmp_path / "run")
    _write_tiny_target(tdir, target)
    save_dataset(data, _toy_arrays(), {"stop_token_ids": [2]})
    argv = ["--data", data, "--out", out, "--target", tdir, "--steps", "4", "--batch", "4", "--lr", "1e-2",
            "--warmup", "1", "--draft-vocab", "40", "--init-layers", "0,2", "--checkpoint-every", "2",
            "--eval-every", "2", "--eval-batch", "2", "--no-progress"]
    s1 = D.main(argv)
    assert s1["heldout"]["step"] == 4
    _, p1, _ = D.load_draft(os.path.join(out, "draft"), target)
    # Lose the final checkpoint: the rerun must restart at step 2 and redo exactly steps 3 and 4.
    shutil.rmtree(os.path.join(out, "checkpoints", "4"))
    D.main(argv)
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [0, 2, 4]
    _, p2, _ = D.load_draft(os.path.join(out, "draft"), target)
    np.testing.assert_allclose(np.asarray(p2["layers"][0]["wq"]), np.asarray(p1["layers"][0]["wq"]), atol=1e-6)
    assert os.path.isfile(os.path.join(out, "draft", "training_curve.png"))
    with pytest.raises(D.DraftError, match="other settings"):
        D.main(argv[:-1] + ["--lr", "5e-3", "--no-progress"])


# ------------------------------------------------------------------------------------------ data
class _FakeTokenizer:
    """Prompts as text: one id per character; ids decode to numbers."""

    def __init__(self, stop_token_ids=(2,)):
        self.stop_token_ids = tuple(stop_token_ids)

    def apply_chat_template(self, messages):
        return messages[0]["content"]

    def encode(self, text):
        return [3 + ord(c) % 60 for c in text]

    def decode(self, ids, **kw):
        return " ".join(str(int(t)) for t in ids)


def _llm(target, stop_token_ids=(2,)):
    """The tiny target as an `LLM` (the serving engine runs it) with the character tokenizer."""
    from spec_helpers import tiny_llm

    llm = tiny_llm(TINY, target)
    llm.tokenizer = _FakeTokenizer(stop_token_ids)
    return llm


def test_dataset_answers_equal_a_greedy_recompute_and_stop(target):
    import specjax.train.data as data
    from specjax.train.prompts import Prompt

    R = 5
    prompts = [Prompt(0, "x", "abcd"), Prompt(1, "x", "kdbefa")]
    S = 6 + R

    @jax.jit
    def next_token(seq, n):  # no cache: full causal recompute over a fixed [1, S] buffer, read at n - 1
        cache = init_cache(TINY.num_layers, 1, S, TINY.num_kv_heads, TINY.head_dim)
        out = forward(target, TINY, seq, jnp.arange(S, dtype=jnp.int32)[None], cache)
        return jnp.argmax(out.logits[0, n - 1])

    def greedy(seq, n):
        seq = list(seq)
        for _ in range(n):
            seq.append(int(next_token(jnp.asarray([seq + [0] * (S - len(seq))], jnp.int32), len(seq))))
        return seq

    enc = _FakeTokenizer().encode
    want = [greedy(enc(p.text), R)[len(enc(p.text)):] for p in prompts]
    stop = want[0][2]  # row 0 must stop after emitting this token (kept); row 1 too if it emits it
    got = data.generate_dataset(_llm(target, (stop,)), prompts, max_new=R, batch=2, top_k=3, sample_every=0,
                                progress=False)
    for n in range(2):
        cut = want[n].index(stop) + 1 if stop in want[n] else R
        pl, ln = got["prompt_len"][n], got["length"][n]
        assert got["tokens"][n, :pl].tolist() == enc(prompts[n].text)
        assert got["tokens"][n, pl:ln].tolist() == want[n][:cut]
        assert np.all(got["topk_ids"][n, :cut, 0] == want[n][:cut])  # the greedy token is the top-1
        assert not got["topk_ids"][n, cut:].any()
    assert got["length"][0] - got["prompt_len"][0] == 3
    assert np.all(np.diff(got["topk_logp"].astype(np.float32), axis=-1) <= 1e-3)  # top-k sorted by log-prob


class _Interrupted(RuntimeError):
    pass


def test_generate_dataset_resumes_from_partial_file(tmp_path, target, monkeypatch):
    import specjax.train.data as data
    from specjax.train.prompts import Prompt

    prompts = [Prompt(i, "x", "abcdefgh"[: 2 + i]) for i in range(5)]
    kw = dict(max_new=4, batch=2, top_k=3, sample_every=2, temperature=0.8, seed=1, progress=False)
    full = data.generate_dataset(_llm(target), prompts, **kw)
    partial = str(tmp_path / "p.npz")
    real, calls, armed = data.teacher_forced, [], [True]

    def dies_on_second_block(*a, **k):  # the scoring forward of a finished block
        calls.append(1)
        if len(calls) == 2 and armed:
            raise _Interrupted
        return real(*a, **k)

    monkeypatch.setattr(data, "teacher_forced", dies_on_second_block)
    with pytest.raises(_Interrupted):
        data.generate_dataset(_llm(target), prompts, partial=partial, **kw)
    assert os.path.isfile(partial)
    calls.clear()
    armed.clear()
    resumed = data.generate_dataset(_llm(target), prompts, partial=partial, **kw)
    assert len(calls) == 2  # 3 blocks in all, the first one finished was kept
    assert not os.path.exists(partial)
    for k in full:
        np.testing.assert_array_equal(full[k], resumed[k])
    np.testing.assert_allclose(full["temperature"], [0.0, 0.8, 0.0, 0.8, 0.0])


def test_generate_dataset_with_extra_answers_and_features_resumes(tmp_path, target, monkeypatch):
    import specjax.train.data as data
    from specjax.train.prompts import Prompt

    prompts = [Prompt(i, "x", "abcdefgh"[: 2 + i]) for i in range(6)]  # prompt 5 is held out
    kw = dict(max_new=4, batch=4, top_k=3, sample_every=0, temperature=0.8, extra_samples=2, feature_layers=(1,),
              seed=1, progress=False)
    full = data.generate_dataset(_llm(target), prompts, **kw)
    N, L = full["tokens"].shape
    assert N == 6 + 2 * 5 and full["features_final"].shape == (N, L, TINY.hidden_size)
    assert full["features_layers"].shape == (N, L, TINY.hidden_size)
    for n in range(N):  # features exactly where there are tokens
        assert not np.any(full["features_final"][n, full["length"][n]:])
        assert np.all(np.any(full["features_final"][n, :full["length"][n]] != 0, axis=-1))
    # Answers 1 and 2 of a prompt are sampled with their own seeds: not all copies of answer 0.
    resp = lambda n: tuple(full["tokens"][n, full["prompt_len"][n]:full["length"][n]])
    assert len({resp(n) for n in range(N) if full["prompt_index"][n] == 0}) > 1
    partial = str(tmp_path / "p.npz")
    real, calls = data.teacher_forced, []

    def dies_on_third_block(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise _Interrupted
        return real(*a, **k)

    monkeypatch.setattr(data, "teacher_forced", dies_on_third_block)
    with pytest.raises(_Interrupted):
        data.generate_dataset(_llm(target), prompts, partial=partial, **kw)
    monkeypatch.setattr(data, "teacher_forced", real)
    resumed = data.generate_dataset(_llm(target), prompts, partial=partial, **kw)
    for k in full:
        np.testing.assert_array_equal(full[k], resumed[k])
    assert not any(p.name.startswith("p.npz") for p in tmp_path.iterdir())


def test_plan_requests_extra_answers_for_training_prompts_only():
    from specjax.train.data import DataError, plan_requests
    from specjax.train.prompts import Prompt, is_heldout

    prompts = [Prompt(i, "x", f"p{i}") for i in range(12)]
    plan = plan_requests(prompts, sample_every=4, temperature=0.7, extra_samples=3, extra_temperatures=(1.0, 0.5))
    train = [p for p in prompts if not is_heldout(p.index)]
    assert len(plan) == len(prompts) + 3 * len(train)
    assert [p.index for p, _, a in plan if a == 0] == list(range(12))  # the first answers keep their old order
    for p, t, a in plan:
        if is_heldout(p.index):
            assert (t, a) == (0.0, 0)  # held out: one greedy answer
        elif a:
            assert t == (1.0, 0.5)[(a - 1) % 2]
    with pytest.raises(DataError, match="must all be > 0"):
        plan_requests(prompts, 4, 0.7, extra_samples=1, extra_temperatures=(0.0,))
    with pytest.raises(DataError, match=">= 0"):
        plan_requests(prompts, 4, 0.7, extra_samples=-1)


def test_dataset_features_equal_the_heads_feature_pass(target):
    """Features saved with the data are the ones `specjax.train.eagle` computes with its own prefill."""
    import specjax.train.data as data
    from specjax.train.features import compute_features
    from specjax.train.prompts import Prompt

    prompts = [Prompt(0, "x", "abcd"), Prompt(1, "x", "kdbefa"), Prompt(3, "x", "zz")]
    got = data.generate_dataset(_llm(target, (999,)), prompts, max_new=5, batch=2, top_k=3, sample_every=2,
                                temperature=0.9, feature_layers=(0, 2), progress=False)
    H = TINY.hidden_size
    N, L = got["tokens"].shape
    assert got["features_final"].shape == (N, L, H) and got["features_layers"].shape == (N, L, 2 * H)
    np.testing.assert_allclose(got["temperature"], [0.0, 0.9, 0.9])  # prompts 1 and 3 sampled
    ref = compute_features(target, TINY, got["tokens"], got["length"], (0, 2), batch=2, bucket=16, progress=False)
    for k in ("final", "layers"):
        np.testing.assert_allclose(got[f"features_{k}"].astype(np.float32), ref[k].astype(np.float32), rtol=1e-2,
                                   atol=1e-2)
    for n in range(N):  # features exactly where there are tokens
        assert not got["features_final"][n, got["length"][n]:].any()
        assert np.all(np.any(got["features_final"][n, :got["length"][n]] != 0, axis=-1))


def test_dataset_round_trip_without_pickles(tmp_path):
    a = _toy_arrays()
    save_dataset(str(tmp_path / "x.npz"), a, {"k": 1})
    b, meta = load_dataset(str(tmp_path / "x.npz"))
    assert meta == {"k": 1}
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    np.savez(str(tmp_path / "bad.npz"), tokens=a["tokens"])
    from specjax.train.data import DataError

    with pytest.raises(DataError, match="missing"):
        load_dataset(str(tmp_path / "bad.npz"))


# ------------------------------------------------------------------------------------------ prompts
def _norm(s: str) -> str:
    return " ".join(s.lower().split())


def test_prompts_are_deterministic_diverse_and_not_spec_bench():
    ps = build_prompts()
    assert [p.text for p in ps] == [p.text for p in build_prompts()]
    assert len(ps) >= 250 and len({p.text for p in ps}) == len(ps)
    assert len({p.category for p in ps}) >= 10
    assert 0 < sum(is_heldout(p.index) for p in ps) < len(ps) // 5
    if not os.path.isfile(SPEC_BENCH):
        pytest.skip("Spec-Bench questions not present")
    with open(SPEC_BENCH) as f:
        firsts = {_norm(json.loads(line)["turns"][0]) for line in f if line.strip()}
    ours = [_norm(p.text) for p in ps]
    assert not firsts & set(ours)
    # No prompt embeds a benchmark question (nor the other way round) for anything longer than a few words.
    for q in firsts:
        for o in ours:
            if len(q) > 40 and len(o) > 40:
                assert q not in o and o not in q


# ------------------------------------------------------------------------------------------ shipped asset
@pytest.mark.slow
def test_shipped_draft_is_small_and_loads_against_real_target():
    if not os.path.isdir(ASSET):
        pytest.skip("no shipped draft asset")
    size = sum(os.path.getsize(os.path.join(ASSET, f)) for f in os.listdir(ASSET))
    assert size < 20 * 2 ** 20
    from specjax.models.loading import load_model

    tgt = load_model("smollm2-135m", with_tokenizer=False)
    cfg, params, d2t = D.load_draft(ASSET, tgt.params)
    raw = json.loads(open(os.path.join(ASSET, "config.json")).read())
    assert raw["specjax_draft"]["target"] == "smollm2-135m"
    assert cfg.hidden_size == tgt.config.hidden_size and cfg.vocab_size == tgt.config.vocab_size
    assert cfg.rope_theta == tgt.config.rope_theta and cfg.rms_norm_eps == tgt.config.rms_norm_eps
    assert {0, 1, 2} <= set(np.asarray(d2t).tolist())
    assert params["lm_head"].shape == (cfg.hidden_size, d2t.shape[0])
    # im_start, "user" ... : the draft should continue the chat header the way the target does.
    toks = jnp.asarray([[1, 4093, 198]], jnp.int32)
    cache = init_cache(cfg.num_layers, 1, 8, cfg.num_kv_heads, cfg.head_dim)
    out = forward(params, cfg, toks, jnp.arange(3, dtype=jnp.int32)[None], cache)
    assert np.all(np.isfinite(np.asarray(out.logits)))
