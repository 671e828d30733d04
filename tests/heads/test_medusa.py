"""Medusa heads: head math, the drafter's tree and top-k mapping, exactness through the engine, training steps,
the FasterDecoding / vLLM / specjax formats, errors, and the lossy typical-acceptance opt-in.

Fast tests use a tiny random target (V = 64, H = 32) and tiny heads. Heads for the engine tests are first fitted
for a few hundred steps on the target's own greedy continuations of the test prompts (with the training code's
`train_step`), so that drafts are accepted often and deep: exactness is then checked on runs that really
accept multi-token paths, not on runs that reject everything.
The shipped SmolLM2 heads on Spec-Bench prompts (greedy speculative == plain) are in tests/test_spec_exactness.py.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import acceptance
from specjax.acceptance import TypicalMode, accept
from specjax.backoff import Adaptive
from specjax.buckets import Buckets
from specjax.drafters.base import DraftContext
from specjax.drafters.medusa import (DEFAULT_CHOICES, MedusaDrafter, chain_choices, choices_from_accuracy,
                                     expected_accepted, from_spec)
from specjax.heads.medusa import (MedusaConfig, MedusaError, apply, draft_params, head_hidden, init_heads,
                                  residual_blocks)
from specjax.heads.medusa_io import MedusaFormatError, detect_layout, load_medusa, save_medusa
from specjax.tree import TreeError, from_choices
from specjax.train import medusa as tm

from spec_helpers import (chi2_gof, chi2_pvalue, last_logits, make_sampling, outputs, run_plain, run_spec,
                          tiny_buckets, tiny_config, tiny_params)

V = 64
K = 3
BATCH = 4
MAX_NEW = 40
BUCKETS = tiny_buckets(BATCH, prompt_len=16, max_new=MAX_NEW + 8, extra=24)
PROMPTS = [
    [7, 3, 9, 12, 40],
    [1, 2, 3, 4, 5, 6, 1, 2],
    [33, 17, 50, 2, 61, 8, 8, 19, 44, 5, 21],
    [9, 9, 10, 11, 9, 9, 10, 11, 9, 9, 10, 11, 9, 9],
]
TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))


@pytest.fixture(scope="module")
def target():
    config = tiny_config(V)
    return config, tiny_params(config, seed=0)


@pytest.fixture(scope="module")
def plain_greedy(target):
    config, params = target
    outs, _ = outputs(run_plain(params, config, BUCKETS, PROMPTS, make_sampling(BATCH, max_new=MAX_NEW)), BATCH)
    assert all(len(o) == MAX_NEW for o in outs)
    return outs


def _hard_targets(seqs: list[list[int]], starts: list[int], num_heads: int):
    """Training positions of token sequences: feature row (n, t) for t >= start - 1; head k's target is token
    t + 1 + k. Returns (row, pos, hard [P, K]) with -1 past the end."""
    row, pos, hard = [], [], []
    for n, (s, st) in enumerate(zip(seqs, starts)):
        for t in range(st - 1, len(s) - 2):
            row.append(n)
            pos.append(t)
            hard.append([s[t + 1 + k] if t + 1 + k < len(s) else -1 for k in range(1, num_heads + 1)])
    return np.asarray(row), np.asarray(pos), np.asarray(hard, np.int32)


@pytest.fixture(scope="module")
def fitted(target, plain_greedy):
    """Heads fitted (with train_step) on the target's greedy continuations of PROMPTS, and the final metrics."""
    config, params = target
    seqs = [p + o for p, o in zip(PROMPTS, plain_greedy)]
    T = max(map(len, seqs))
    toks = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    hidden = np.asarray(tm.final_hidden(params, config, jnp.asarray(toks)))  # [B, T, H]
    row, pos, hard = _hard_targets(seqs, [len(p) for p in PROMPTS], K)
    x = jnp.asarray(hidden[row, pos])
    batch = {"hard": jnp.asarray(hard), "soft_idx": jnp.zeros(hard.shape + (1,), jnp.int32),
             "soft_p": jnp.zeros(hard.shape + (1,), jnp.float32)}
    hcfg = MedusaConfig(num_heads=K, hidden_size=config.hidden_size, vocab_size=V, num_layers=1)
    blocks = init_heads(hcfg)["blocks"]
    lm = jnp.asarray(params["lm_head"]).T  # [V, H]: the tiny target is untied
    steps = 300
    opt, _ = tm.make_optimizer(3e-2, steps, 10, 0.0, 1.0)
    state = opt.init(blocks)
    first = None
    for _ in range(steps):
        blocks, state, m = tm.train_step(blocks, state, lm, x, batch, optimizer=opt, hard_weight=1.0)
        first = first or float(m["loss"])
    return hcfg, {"blocks": blocks}, {"first_loss": first, "loss": float(m["loss"]), "top1": np.asarray(m["top1"])}


def test_training_lowers_the_loss_and_learns_every_head(fitted):
    _, _, m = fitted
    assert m["loss"] < 0.5 * m["first_loss"], m
    # memorising 4 short sequences: every head ends far above chance (1/64)
    assert np.all(m["top1"] > 0.5), m["top1"]


# ------------------------------------------------------------------------------------------------- head math


def test_residual_block_is_x_plus_silu_of_affine():
    rng = np.random.default_rng(0)
    w, b, x = rng.normal(size=(8, 8)), rng.normal(size=8), rng.normal(size=(3, 8))
    got = residual_blocks([{"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)}] * 2,
                          jnp.asarray(x, jnp.float32))
    ref = x
    for _ in range(2):
        y = ref @ w + b
        ref = ref + y / (1 + np.exp(-y))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


def test_zero_initialised_heads_repeat_the_target_prediction(target):
    config, params = target
    hcfg = MedusaConfig(num_heads=2, hidden_size=config.hidden_size, vocab_size=V)
    dp = draft_params(hcfg, init_heads(hcfg), {"embed": params["embed"], "lm_head": params["lm_head"]})
    x = jax.random.normal(jax.random.PRNGKey(1), (5, config.hidden_size))
    logits = apply(dp, x)
    want = x @ params["lm_head"]
    np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits[:, 1]), np.asarray(want), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------- tree + top-k


def test_tree_topology_and_ranks_from_choices():
    d = MedusaDrafter(MedusaConfig(3, 8, V), ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    # nodes ordered by depth then lexicographically: (0) (1) (0,0) (0,1) (1,0) (0,0,0)
    assert d.tree.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert d.tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert from_choices(d.choices)[1].tolist() == [-1, 0, 1, 0, 1, 0, 0]
    assert chain_choices(3) == ((0,), (0, 0), (0, 0, 0))
    assert MedusaDrafter(MedusaConfig(3, 8, V), chain_choices(3)).tree.is_chain


def test_propose_takes_rank_r_of_head_d_from_the_last_accepted_feature():
    H, Vd, B = 16, 40, 3
    rng = np.random.default_rng(3)
    hcfg = MedusaConfig(num_heads=3, hidden_size=H, vocab_size=V, draft_vocab_size=Vd)
    token_map = np.sort(rng.choice(V, Vd, replace=False)).astype(np.int32)
    heads = init_heads(hcfg, jax.random.PRNGKey(0), token_map=token_map, scale=0.5)
    lm = jnp.asarray(rng.normal(size=(V, H)), jnp.float32)
    dp = draft_params(hcfg, heads, {"embed": lm})
    d = MedusaDrafter(hcfg, TREE)
    feats = rng.normal(size=(B, d.tree.max_depth + 1, H)).astype(np.float32)
    count = np.asarray([1, 3, 2], np.int32)
    last_tok = np.asarray([5, 6, 7], np.int32)
    ctx = DraftContext(None, None, jnp.asarray(last_tok), None, None, None, (jnp.asarray(feats), jnp.asarray(count)))
    prop, _ = jax.jit(lambda c: d.propose(dp, (), c))(ctx)
    tokens = np.asarray(prop.tokens)
    tree, rank = from_choices(TREE)
    assert np.array_equal(tokens[:, 0], last_tok) and np.asarray(prop.valid).all()
    assert np.array_equal(np.asarray(prop.parents), np.broadcast_to(tree.parents_array, tokens.shape))
    lm_rows = np.asarray(lm)[token_map]
    for b in range(B):
        x = feats[b, count[b] - 1].astype(np.float64)  # the last accepted node's feature, nothing else
        for j in range(1, tree.num_nodes):
            blk = heads["blocks"][tree.depth[j] - 1][0]
            y = x @ np.asarray(blk["w"]) + np.asarray(blk["b"])
            order = np.argsort(-(lm_rows @ (x + y / (1 + np.exp(-y)))), kind="stable")
            assert tokens[b, j] == token_map[order[rank[j]]], (b, j)
        # siblings are distinct tokens (top-k of one head), as the deterministic acceptance rule needs
        for p in range(tree.num_nodes):
            kids = [tokens[b, j] for j in range(1, tree.num_nodes) if tree.parents[j] == p]
            assert len(kids) == len(set(kids))


def test_choices_from_accuracy_picks_the_best_prefix_closed_tree():
    acc = np.asarray([[0.6, 0.2, 0.08], [0.5, 0.1, 0.05], [0.4, 0.1, 0.0]])
    # path scores: (0) .6, (0,0) .3, (1) .2, (0,0,0) .12, (1,0) .1, (2) .08, (0,1) .06, ...
    ch = choices_from_accuracy(acc, 5)
    assert ch == ((0,), (0, 0), (1,), (0, 0, 0), (1, 0))
    assert expected_accepted(acc, ch) == pytest.approx(0.6 + 0.3 + 0.2 + 0.12 + 0.1)
    # more nodes never lower the expected gain, and a chain of 3 is worse than the 5-node tree
    assert expected_accepted(acc, choices_from_accuracy(acc, 8)) >= expected_accepted(acc, ch)
    assert expected_accepted(acc, chain_choices(3)) < expected_accepted(acc, ch)


# ------------------------------------------------------------------------------------------------- engine


def _medusa(target, fitted, choices, mode="deterministic"):
    config, params = target
    hcfg, heads, _ = fitted
    return MedusaDrafter(hcfg, choices, mode), draft_params(hcfg, heads, params)


@pytest.mark.parametrize("choices,adaptive,lookup", [(TREE, None, 0), (chain_choices(K), Adaptive(), 0),
                                                    (TREE, None, 3)],
                         ids=["tree", "chain-adaptive", "tree-with-lookup-branch"])
def test_greedy_equals_plain_through_the_engine(target, fitted, plain_greedy, choices, adaptive, lookup):
    config, params = target
    drafter, dp = _medusa(target, fitted, choices)
    if lookup:
        from specjax.drafters.with_lookup import WithLookup
        from specjax.drafters.ngram import NgramDrafter

        drafter = WithLookup(drafter, NgramDrafter(lookup, 1, 3))
    state = run_spec(params, config, dp, drafter, BUCKETS, PROMPTS, make_sampling(BATCH, max_new=MAX_NEW),
                     adaptive=adaptive)
    outs, _ = outputs(state.dec, BATCH)
    for i, (g, w) in enumerate(zip(outs, plain_greedy)):
        assert g == w, f"row {i}: medusa {g} != plain {w}"
    pos_acc = np.asarray(state.stats.pos_accepted).sum(0)
    # the fitted heads are accepted, down to the deepest level: the compaction and feature paths were exercised
    assert np.all(pos_acc > 0), pos_acc
    steps = int(np.asarray(state.stats.verify_steps).sum())
    assert steps < BATCH * MAX_NEW * 0.7, f"{steps} verify steps for {BATCH * MAX_NEW} tokens: heads barely accepted"


@pytest.mark.slow
def test_sampled_outputs_follow_the_target_distribution(target, fitted):
    """Two sampled tokens after a prompt, 2048 seeds in one batch: the pair distribution of Medusa speculation
    (first token from prefill, second from the verify step: an accepted draft or a correction) equals the
    target's exact one (chi-square)."""
    config, params = target
    n = 2048
    prompt = PROMPTS[0]
    temp = 1.0
    drafter, dp = _medusa(target, fitted, TREE)
    b = Buckets(n, 16, 16, 64)
    sampling = make_sampling(n, temperature=temp, seed=np.arange(n), max_new=2)
    state = run_spec(params, config, dp, drafter, b, [prompt] * n, sampling)
    outs, _ = outputs(state.dec, n)
    pairs = np.asarray(outs)
    assert pairs.shape == (n, 2)
    assert int(np.asarray(state.stats.accepted).sum()) > n // 20, "the drafts must be accepted sometimes"
    # exact pair probabilities p(a) p(b | a) from the target
    p1 = np.asarray(jax.nn.softmax(jnp.asarray(last_logits(params, config, prompt)) / temp), np.float64)
    probs = np.zeros((V, V))
    for a in np.unique(pairs[:, 0]):
        probs[a] = p1[a] * np.asarray(jax.nn.softmax(jnp.asarray(last_logits(params, config, prompt + [int(a)])) / temp))
    seen = np.unique(pairs[:, 0])
    mass = probs[seen].sum()
    counts = np.zeros((V, V))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    stat, dof = chi2_gof(counts[seen].ravel(), (probs[seen] / mass).ravel())
    # first token alone against p1 over the whole vocabulary
    stat1, dof1 = chi2_gof(np.bincount(pairs[:, 0], minlength=V), p1)
    assert chi2_pvalue(stat1, dof1) > 1e-3 and chi2_pvalue(stat, dof) > 1e-3, (stat1, dof1, stat, dof)


# ------------------------------------------------------------------------------------------------- typical (lossy)


def test_typical_acceptance_is_opt_in_and_labelled_lossy():
    hcfg = MedusaConfig(3, 8, V)
    lossless = from_spec(hcfg, 3, None)
    assert lossless.mode == "deterministic" and not lossless.lossy
    typical = from_spec(hcfg, 3, None, "typical", 0.05, 0.2)
    assert typical.lossy and isinstance(typical.mode, TypicalMode) and typical.mode.lossy
    assert (typical.mode.posterior_threshold, typical.mode.posterior_alpha) == (0.05, 0.2)
    with pytest.raises(MedusaError, match="lossless"):
        from_spec(hcfg, 3, None, "approximate")
    with pytest.raises(MedusaError, match="TypicalMode"):
        MedusaDrafter(hcfg, TREE, "iid")
    from specjax.config import SpeculativeConfig

    assert SpeculativeConfig(method="medusa", acceptance="typical").is_lossy
    assert not SpeculativeConfig(method="medusa").is_lossy


def test_accept_dispatches_and_typical_changes_the_distribution():
    """At the acceptance level on a small vocabulary: `accept` with "deterministic" emits the first token with
    exactly p_root; with TypicalMode the drafted token is over-represented (lossy), and chi-square sees it."""
    Vs, n = 6, 8000
    rng = np.random.default_rng(0)
    p_root = rng.dirichlet(np.ones(Vs) * 2.0)
    p_child = rng.dirichlet(np.ones(Vs) * 2.0, size=2)
    tokens = np.asarray([[0, int(np.argmin(p_root)), 1]] * n, np.int32)  # the draft is the least likely token
    parents = np.asarray([[-1, 0, 1]] * n, np.int32)
    valid = np.ones((n, 3), bool)
    p = jnp.asarray(np.broadcast_to(np.stack([p_root, p_child[0], p_child[1]]), (n, 3, Vs)), jnp.float32)
    u = jax.random.uniform(jax.random.PRNGKey(0), (n, 4))
    run = jax.jit(lambda mode: accept(tokens, parents, valid, p, None, u[:, :3], u[:, 3], mode), static_argnums=0)
    first = lambda r: np.where(np.asarray(r.num_accepted) > 0, tokens[:, 1], np.asarray(r.next_token))
    exact = run("deterministic")
    stat, dof = chi2_gof(np.bincount(first(exact), minlength=Vs), p_root)
    assert chi2_pvalue(stat, dof) > 1e-3
    typ = run(TypicalMode())
    ref = jax.jit(lambda: acceptance.typical_accept(tokens, parents, valid, p, u_final=u[:, 3]))()
    assert np.array_equal(np.asarray(typ.accepted), np.asarray(ref.accepted))
    stat, dof = chi2_gof(np.bincount(first(typ), minlength=Vs), p_root)
    assert chi2_pvalue(stat, dof) < 1e-6, "typical acceptance must change the distribution (it is lossy)"


def test_typical_mode_greedy_equals_plain_through_the_engine(target, fitted, plain_greedy):
    """Under greedy decoding typical acceptance accepts exactly the argmax; needs spec_engine to dispatch
    TypicalMode to acceptance.typical_accept (drafters.medusa.accept)."""
    config, params = target
    drafter, dp = _medusa(target, fitted, TREE, TypicalMode())
    state = run_spec(params, config, dp, drafter, BUCKETS, PROMPTS, make_sampling(BATCH, max_new=MAX_NEW))
    outs, _ = outputs(state.dec, BATCH)
    assert outs == plain_greedy
    assert int(np.asarray(state.stats.accepted).sum()) > 0


# ------------------------------------------------------------------------------------------------- formats


H_IO, V_IO = 16, 24


def _st_save(tensors: dict, path: str):
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path)


def _st_load(path: str) -> dict:
    from safetensors import safe_open

    with safe_open(path, framework="flax") as f:
        return {k: np.asarray(f.get_tensor(k), np.float32) for k in f.keys()}


def _rand(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


def _fd_dir(tmp_path, K=2, L=2, H=H_IO, Vv=V_IO, seed=0):
    """A FasterDecoding checkpoint written by hand with the published names."""
    rng = np.random.default_rng(seed)
    t = {}
    for h in range(K):
        for l in range(L):
            t[f"{h}.{l}.linear.weight"] = _rand(rng, H, H)
            t[f"{h}.{l}.linear.bias"] = _rand(rng, H)
        t[f"{h}.{L}.weight"] = _rand(rng, Vv, H)
    d = tmp_path / "fd"
    d.mkdir()
    _st_save(t, str(d / "medusa_lm_head.safetensors"))
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": K, "medusa_num_layers": L,
                                               "base_model_name_or_path": "some/base"}))
    return str(d), t


def test_fasterdecoding_layout_round_trip(tmp_path):
    path, t = _fd_dir(tmp_path)
    assert detect_layout(path) == "fasterdecoding"
    cfg, params, meta = load_medusa(path, H_IO, V_IO)
    assert (cfg.num_heads, cfg.num_layers, cfg.lm_head, cfg.bias) == (2, 2, "per_head", True)
    assert meta["base_model"] == "some/base" and meta["layout"] == "fasterdecoding"
    # PyTorch Linear [out, in] -> our x @ w with w [in, out]
    np.testing.assert_array_equal(np.asarray(params["blocks"][1][0]["w"]), t["1.0.linear.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["lm_head"][1]), t["1.2.weight"])
    out = tmp_path / "fd_out"
    save_medusa(str(out), cfg, params, layout="fasterdecoding", base_model="some/base", dtype="float32")
    back = _st_load(str(out / "medusa_lm_head.safetensors"))
    assert set(back) == set(t)
    for k in t:
        np.testing.assert_array_equal(back[k], t[k])
    c = json.loads((out / "config.json").read_text())
    assert (c["medusa_num_heads"], c["medusa_num_layers"], c["base_model_name_or_path"]) == (2, 2, "some/base")


def test_fasterdecoding_heads_compute_what_the_torch_layout_says(tmp_path):
    path, t = _fd_dir(tmp_path, K=2, L=1)
    cfg, params, _ = load_medusa(path)
    x = np.random.default_rng(1).normal(size=(H_IO,)).astype(np.float32)
    dp = draft_params(cfg, params, {})
    got = np.asarray(apply(dp, jnp.asarray(x)))
    for h in range(2):
        y = t[f"{h}.0.linear.weight"] @ x + t[f"{h}.0.linear.bias"]
        ref = t[f"{h}.1.weight"] @ (x + y / (1 + np.exp(-y)))
        np.testing.assert_allclose(got[h], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias,shared,truncated,prefix", [(False, False, False, ""), (True, True, False, ""),
                                                          (True, False, True, "medusa_heads.")])
def test_vllm_layout_round_trip(tmp_path, bias, shared, truncated, prefix):
    rng = np.random.default_rng(2)
    Kh, L = 3, 1
    Vd = 10 if truncated else V_IO
    t = {}
    for h in range(Kh):
        t[f"blocks.{h}.layers.0.weight"] = _rand(rng, H_IO, H_IO)
        if bias:
            t[f"blocks.{h}.layers.0.bias"] = _rand(rng, H_IO)
    for h in range(1 if shared else Kh):
        t[f"lm_heads.{h}.weight"] = _rand(rng, Vd, H_IO)
    if truncated:
        t["token_map"] = np.sort(rng.choice(V_IO, Vd, replace=False)).astype(np.int64)
    d = tmp_path / "vllm"
    d.mkdir()
    _st_save({prefix + k: v for k, v in t.items()}, str(d / "model.safetensors"))
    cfg_json = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H_IO, "vocab_size": V_IO,
                "num_heads": Kh, "num_hidden_layers": L, "truncated_vocab_size": Vd, "medusa_fc_bias": bias,
                "original_lm_head": shared}
    (d / "config.json").write_text(json.dumps(cfg_json))
    assert detect_layout(str(d)) == "vllm"
    cfg, params, _ = load_medusa(str(d), H_IO, V_IO)
    assert cfg.lm_head == ("shared" if shared else "per_head") and cfg.bias == bias
    assert cfg.out_vocab == Vd and (("token_map" in params) == truncated)
    np.testing.assert_array_equal(np.asarray(params["blocks"][2][0]["w"]), t["blocks.2.layers.0.weight"].T)
    out = tmp_path / "vllm_out"
    save_medusa(str(out), cfg, params, layout="vllm", dtype="float32")
    back = _st_load(str(out / "model.safetensors"))
    assert set(back) == set(t)
    for k in t:
        np.testing.assert_array_equal(back[k], t[k].astype(np.float32))
    c = json.loads((out / "config.json").read_text())
    for k in ("num_heads", "num_hidden_layers", "hidden_size", "vocab_size", "truncated_vocab_size",
              "medusa_fc_bias", "original_lm_head"):
        assert c[k] == cfg_json[k], k


@pytest.mark.parametrize("truncated", [False, True])
def test_vllm_shared_lm_head_of_the_wrong_rank_is_a_clear_error(tmp_path, truncated):
    # Found by the file fuzzer: a 1-D shared LM head next to a token_map reached `shape[-2]` (IndexError).
    rng = np.random.default_rng(5)
    Vd = 10 if truncated else V_IO
    t = {"blocks.0.layers.0.weight": _rand(rng, H_IO, H_IO), "lm_heads.0.weight": _rand(rng, Vd * H_IO)}
    if truncated:
        t["token_map"] = np.arange(Vd, dtype=np.int64)
    d = tmp_path / "vllm"
    d.mkdir()
    _st_save(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H_IO, "vocab_size": V_IO,
        "num_heads": 1, "num_hidden_layers": 1, "truncated_vocab_size": Vd, "original_lm_head": True}))
    with pytest.raises(MedusaFormatError) as e:
        load_medusa(str(d), H_IO, V_IO)
    assert f"lm_heads.0.weight must be [vocab, hidden={H_IO}]" in _one_line(e) and f"({Vd * H_IO},)" in str(e.value)


def test_specjax_layout_stores_no_lm_head_and_exports_to_vllm(tmp_path, target):
    config, params = target
    rng = np.random.default_rng(4)
    token_map = np.sort(rng.choice(V, 20, replace=False)).astype(np.int32)
    hcfg = MedusaConfig(num_heads=2, hidden_size=config.hidden_size, vocab_size=V, draft_vocab_size=20)
    heads = init_heads(hcfg, jax.random.PRNGKey(2), token_map=token_map, scale=0.3)
    files = save_medusa(str(tmp_path / "sj"), hcfg, heads, base_model="tiny", info={"tree_choices": [[0], [0, 0]]})
    names = set(_st_load(files[0]))
    assert names == {"blocks.0.layers.0.weight", "blocks.0.layers.0.bias", "blocks.1.layers.0.weight",
                     "blocks.1.layers.0.bias", "token_map"}
    cfg2, p2, meta = load_medusa(str(tmp_path / "sj"), config.hidden_size, V, dtype=jnp.float32)
    assert cfg2 == hcfg and meta["tree_choices"] == [[0], [0, 0]] and meta["layout"] == "specjax"
    x = jax.random.normal(jax.random.PRNGKey(5), (3, config.hidden_size))
    want = apply(draft_params(hcfg, heads, params), x)
    got = apply(draft_params(cfg2, p2, params), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0.03, atol=0.03)  # stored as bf16
    # vLLM needs an LM head: the target's rows are written once, as original_lm_head
    save_medusa(str(tmp_path / "v"), hcfg, heads, layout="vllm", target_params=params, dtype="float32")
    c = json.loads((tmp_path / "v" / "config.json").read_text())
    assert c["original_lm_head"] is True and c["truncated_vocab_size"] == 20
    cfg3, p3, _ = load_medusa(str(tmp_path / "v"), config.hidden_size, V)
    np.testing.assert_allclose(np.asarray(apply(draft_params(cfg3, p3, {}), x)), np.asarray(want), rtol=1e-4,
                               atol=1e-4)
    with pytest.raises(MedusaFormatError, match="layout='vllm'"):
        save_medusa(str(tmp_path / "fd"), hcfg, heads, layout="fasterdecoding", target_params=params)


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg and isinstance(err.value, ValueError)
    return msg


def test_hidden_and_vocab_mismatch_are_clear_errors(tmp_path):
    path, _ = _fd_dir(tmp_path)
    with pytest.raises(MedusaFormatError) as e:
        load_medusa(path, hidden_size=H_IO + 1)
    assert "hidden size" in _one_line(e) and "some/base" in str(e.value)
    with pytest.raises(MedusaFormatError) as e:
        load_medusa(path, vocab_size=V_IO * 2)
    assert "vocabulary" in _one_line(e)


def test_pickled_checkpoints_are_refused_with_a_conversion_hint(tmp_path):
    d = tmp_path / "pt"
    d.mkdir()
    (d / "medusa_lm_head.pt").write_bytes(b"not really a pickle")
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    with pytest.raises(MedusaFormatError) as e:
        load_medusa(str(d))
    msg = _one_line(e)
    assert "pickle" in msg and "save_file" in msg and "medusa_lm_head.safetensors" in msg
    with pytest.raises(MedusaFormatError, match="pickle"):
        load_medusa(str(d / "medusa_lm_head.pt"))


def test_malformed_checkpoints_name_the_problem(tmp_path):
    path, t = _fd_dir(tmp_path)
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    cfg["medusa_num_heads"] = 3
    open(os.path.join(path, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(MedusaFormatError, match="medusa_num_heads=3"):
        load_medusa(path)
    d = tmp_path / "v"
    d.mkdir()
    _st_save({"blocks.0.layers.0.weight": np.zeros((4, 4), np.float32)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"num_heads": 1, "num_hidden_layers": 1, "hidden_size": 4,
                                               "vocab_size": 8}))
    with pytest.raises(MedusaFormatError, match="lm_heads.0.weight"):
        load_medusa(str(d))
    with pytest.raises(MedusaFormatError, match="does not exist"):
        load_medusa(str(tmp_path / "nope"))


def test_drafter_settings_errors():
    hcfg = MedusaConfig(2, 8, V)
    with pytest.raises(MedusaError, match="only 2 positions"):
        MedusaDrafter(hcfg, chain_choices(3))
    with pytest.raises(TreeError, match="no parent"):
        MedusaDrafter(hcfg, ((0,), (1, 0)))
    with pytest.raises(MedusaError, match="only 4 tokens"):
        MedusaDrafter(MedusaConfig(2, 8, V, draft_vocab_size=4), ((0,), (4,)))
    # the default tree is cut to the heads' depth and to num_speculative_tokens
    assert max(map(len, from_spec(hcfg, 4, None).choices)) == 2
    assert max(map(len, from_spec(MedusaConfig(4, 8, V), 1, None).choices)) == 1
    assert set(from_spec(MedusaConfig(4, 8, V), 4, None).choices) == set(DEFAULT_CHOICES)


def test_training_targets_are_k_plus_one_tokens_ahead():
    """build_targets: feature row i (predicting response token i) gives head k the response token i + k, with
    soft targets from the target's top-k at that step; extract_features' row convention matches."""
    prompt_len, resp = 3, [10, 11, 12, 13, 14]
    tokens = np.zeros((1, 12), np.int32)
    tokens[0, :3] = [1, 2, 3]
    tokens[0, 3:8] = resp
    R, S = 6, 2
    topk_ids = np.zeros((1, R, S), np.int32)
    topk_ids[0, :, 0] = np.arange(R) + 30
    topk_ids[0, :, 1] = np.arange(R) + 40
    topk_logp = np.log(np.broadcast_to(np.asarray([0.75, 0.25], np.float32), (1, R, S))).astype(np.float16)
    arrays = {"tokens": tokens, "prompt_len": np.asarray([prompt_len]), "length": np.asarray([8]),
              "topk_ids": topk_ids, "topk_logp": topk_logp}
    t2d = np.arange(V, dtype=np.int32)
    t2d[41] = -1  # outside the draft vocabulary: its soft mass is dropped and the rest renormalised
    tg = tm.build_targets(arrays, np.asarray([0]), 2, t2d)
    assert tg["pos"].tolist() == [0, 1, 2, 3]
    assert tg["hard"].tolist() == [[11, 12], [12, 13], [13, 14], [14, -1]]
    assert tg["soft_idx"][0, 0].tolist() == [31, 0] and tg["soft_p"][0, 0].tolist() == [1.0, 0.0]
    np.testing.assert_allclose(tg["soft_p"][1, 0], [0.75, 0.25], rtol=1e-3)
    assert tg["soft_p"][3, 1].sum() == 0  # past the response


# ------------------------------------------------------------------------------------------------- real model


def _random_data(rng, N: int, L: int, R: int, prompt: tuple[int, int], min_resp: int, S: int = 4) -> dict:
    """A random distillation file's arrays: N rows of width L, prompts of prompt[0]..prompt[1]-1 tokens, at least
    min_resp of R response steps, top-S soft targets; nothing held out."""
    plen = rng.integers(*prompt, N).astype(np.int32)
    length = (plen + rng.integers(min_resp, R, N)).astype(np.int32)
    tokens = np.where(np.arange(L)[None] < length[:, None], rng.integers(3, V, (N, L)), 0).astype(np.int32)
    return {"tokens": tokens, "prompt_len": plen, "length": length,
            "topk_ids": rng.integers(0, V, (N, R, S)).astype(np.int32),
            "topk_logp": np.log(rng.dirichlet(np.ones(S), (N, R))).astype(np.float16),
            "temperature": np.zeros(N, np.float32), "prompt_index": np.arange(N, dtype=np.int32),
            "heldout": np.zeros(N, bool)}


def _tiny_run(tmp_path, target, steps: int, extra=()):
    """Write a tiny HF target and a small random distillation file; run `specjax.train.medusa.main`."""
    from spec_helpers import save_hf_llama
    from specjax.train.data import save_dataset

    config, params = target
    tdir = str(tmp_path / "target")
    if not os.path.exists(tdir):
        save_hf_llama(tdir, config, params)
    arrays = _random_data(np.random.default_rng(0), 12, 48, 32, (4, 12), 8)
    arrays["heldout"] = np.arange(12) % 4 == 1
    data = str(tmp_path / "data.npz")
    save_dataset(data, arrays, {"target": "tiny", "stop_token_ids": [2]})
    argv = ["--data", data, "--out", str(tmp_path / "run"), "--target", tdir, "--heads", "2", "--steps", str(steps),
            "--batch", "32", "--draft-vocab", "40", "--checkpoint-every", "5", "--eval-every", "5",
            "--eval-batch", "64", "--tree-nodes", "4", "--no-progress", *extra]
    return tm.main(argv)


def test_training_command_resumes_and_exports(tmp_path, target):
    """`python -m specjax.train.medusa` end to end on a tiny target: features, checkpoints, metrics, the exported
    heads, tree and curves; a run cut after its step-5 checkpoint resumes there and ends with the same heads."""
    import shutil

    first = _tiny_run(tmp_path, target, 10)
    run = tmp_path / "run"
    heads = run / "heads"
    want = _st_load(str(heads / "model.safetensors"))
    shutil.rmtree(run / "checkpoints" / "10")  # as if the run had stopped after step 5's checkpoint
    second = _tiny_run(tmp_path, target, 10)
    assert (first["resumed_from_step"], second["resumed_from_step"]) == (0, 5)
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs if r["kind"] == "train"] == list(range(1, 11))
    got = _st_load(str(heads / "model.safetensors"))
    assert set(got) == set(want) and "token_map" in got
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-2, atol=1e-3, err_msg=k)
    assert second["feature_seconds_this_run"] < first["feature_seconds_this_run"] + 5  # features were cached
    with pytest.raises(tm.MedusaTrainError, match="other settings"):
        _tiny_run(tmp_path, target, 10, ("--lr", "0.5"))
    assert (heads / "training_curve.png").stat().st_size > 1000
    cfg, params, meta = load_medusa(str(heads), target[0].hidden_size, V)
    assert cfg.num_heads == 2 and cfg.out_vocab == 40 and cfg.lm_head == "target"
    assert len(meta["tree_choices"]) == 4 and len(meta["heldout_top1"]) == 2
    assert len(first["heldout"]["rank_accuracy"]) == 2 and len(first["heldout"]["rank_accuracy"][0]) == tm.EVAL_RANKS
    drafter = from_spec(cfg, 2, None, default_choices=meta["tree_choices"])
    assert drafter.choices == tuple(map(tuple, meta["tree_choices"]))


def test_features_from_the_heads_cache_equal_a_feature_pass(tmp_path, target):
    """--features-cache (a cache of `specjax.train.eagle` / `specjax.train.data --features-out`) gives the rows
    `extract_features` computes; a cache made from other data is refused."""
    from specjax.train.data import save_dataset
    from specjax.train.features import compute_features, feature_cache_key, save_feature_cache

    config, params = target
    arrays = _random_data(np.random.default_rng(1), 6, 40, 24, (3, 10), 5)
    tokens, length = arrays["tokens"], arrays["length"]
    data = str(tmp_path / "data.npz")
    save_dataset(data, arrays, {"target": "tiny"})
    cache = str(tmp_path / "features.npz")
    save_feature_cache(cache, feature_cache_key(data, "tiny-target", (0,)),
                       compute_features(params, config, tokens, length, (0,), batch=2, bucket=16, progress=False))
    got = tm.features_from_cache(cache, data, "tiny-target", arrays)
    os.makedirs(tmp_path / "run")
    want = tm.extract_features(params, config, arrays, str(tmp_path / "run"), batch=2, bucket=16, progress=False)
    np.testing.assert_allclose(got.astype(np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert np.any(got != 0)
    with pytest.raises(tm.MedusaTrainError, match="other data or another target"):
        tm.features_from_cache(cache, data, "another-target", arrays)
    with pytest.raises(tm.MedusaTrainError, match="does not exist"):
        tm.features_from_cache(str(tmp_path / "none.npz"), data, "tiny-target", arrays)
