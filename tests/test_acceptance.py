"""Tests for specjax.acceptance: Monte Carlo losslessness (chi-square), greedy exactness, planted bugs, helpers.

The Monte Carlo tests use a small "language": a target and a drafter whose next-token distributions depend on
the whole prefix (tables indexed by the prefix, depth 0..D). Each trial drafts a tree from the drafter, runs
accept_tree, and records the first three emitted tokens. Losslessness means y1 ~ p(.|root), y2 | y1 ~ p(.|y1)
and y3 | y1 y2 ~ p(.|y1 y2), each among the trials that emitted that token (a token emitted in this step is
either an accepted draft, the correction, or the bonus, so all three paths are covered). The SAME test helpers
must reject the planted bugs, so they are shown to have power.
"""
from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import gammaincc

from specjax import acceptance as A
from specjax.acceptance import (AcceptanceError, accept_tree, accepted_path, sample_from, tree_depth,
                                typical_accept)

V = 12
TRIALS = 40_000
PASS_P = 1e-3      # a correct sampler must give p-values above this (fixed seeds: the outcome is deterministic)
FAIL_P = 1e-8      # a planted bug must give a p-value below this


@functools.lru_cache(maxsize=None)
def jit_accept(mode: str):
    """One compiled accept_tree per mode (eager calls would compile every op separately: slow on CPU)."""
    return jax.jit(functools.partial(accept_tree, mode=mode))


jit_typical = jax.jit(typical_accept)
jit_sample = jax.jit(sample_from)


# ----------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------


def chi2_gof(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square of observed counts against probabilities; low-expectation cells are pooled.

    Returns (statistic, degrees of freedom); a count on a zero-probability cell gives an infinite statistic.
    """
    probs = np.asarray(probs, np.float64)
    probs = probs / probs.sum()
    n = counts.sum()
    if np.any(counts[probs == 0] > 0):
        return math.inf, 1
    nz = np.flatnonzero(probs > 0)
    E = n * probs[nz]
    O = counts[nz].astype(np.float64)
    order = np.argsort(E)
    groups_O, groups_E, acc_O, acc_E = [], [], 0.0, 0.0
    for i in order:                      # pool the smallest cells until each pooled cell expects >= min_expected
        acc_O += O[i]
        acc_E += E[i]
        if acc_E >= min_expected:
            groups_O.append(acc_O)
            groups_E.append(acc_E)
            acc_O = acc_E = 0.0
    if acc_E > 0:
        if groups_E:
            groups_O[-1] += acc_O
            groups_E[-1] += acc_E
        else:
            groups_O.append(acc_O)
            groups_E.append(acc_E)
    go, ge = np.array(groups_O), np.array(groups_E)
    return float(np.sum((go - ge) ** 2 / ge)), max(len(go) - 1, 1)


def p_value(stat: float, df: int) -> float:
    if math.isinf(stat):
        return 0.0
    return float(gammaincc(jnp.float32(df / 2), jnp.float32(stat / 2)))


def emission_test(ys: list[np.ndarray], p_tabs: list[np.ndarray]) -> dict:
    """Chi-square per emitted position: y1 against p_tabs[0][0]; y_{l+1} | y_1..y_l against p_tabs[l][prefix],
    summed over prefixes with at least 50 trials. ys[l] is -1 where the step emitted fewer than l + 1 tokens.
    Returns {"stat": [...], "df": [...], "p": [...], "n": [...]} per position."""
    out = {"stat": [], "df": [], "p": [], "n": []}
    ctx = np.zeros(len(ys[0]), np.int64)
    for level, y in enumerate(ys):
        emitted = y >= 0
        stat, df, n = 0.0, 0, 0
        for c in np.unique(ctx[emitted]):
            sel = emitted & (ctx == c)
            if sel.sum() < 50:
                continue
            st, d = chi2_gof(np.bincount(y[sel], minlength=V), p_tabs[level][c])
            stat, df, n = stat + st, df + d, n + int(sel.sum())
        assert n > 1000, f"too few trials emitted token {level + 1} for the test"
        out["stat"].append(stat)
        out["df"].append(df)
        out["p"].append(p_value(stat, df))
        out["n"].append(n)
        ctx = ctx * V + np.maximum(y, 0)
    return out


# ----------------------------------------------------------------------------------------------------------------
# A prefix-dependent target / drafter and the Monte Carlo driver
# ----------------------------------------------------------------------------------------------------------------


def full_tree(branching: tuple[int, ...]):
    """Complete tree in BFS order: parents list, depth list, children lists."""
    parents, depth, level = [-1], [0], [0]
    for k in branching:
        nxt = []
        for node in level:
            for _ in range(k):
                parents.append(node)
                depth.append(depth[node] + 1)
                nxt.append(len(parents) - 1)
        level = nxt
    kids = [[c for c in range(len(parents)) if parents[c] == i] for i in range(len(parents))]
    return parents, depth, kids


def _zero_and_normalise(t: np.ndarray, rng, zero_frac: float) -> np.ndarray:
    t = np.where(rng.random(t.shape) < zero_frac, 0.0, t)
    t[np.arange(len(t)), rng.integers(0, V, len(t))] += 0.05          # never an all-zero row
    return (t / t.sum(-1, keepdims=True)).astype(np.float32)


def make_pq(seed: int, D: int, k: int, alpha: float = 0.4, mix: float = 0.6, zero_frac: float = 0.25):
    """Target and draft tables, lists of [V**d, V] for d = 0..D (row = distribution after that prefix).

    Rows are peaky Dirichlet draws; q mixes p with an independent draw (so drafts are often but not always
    right), then p and q are zeroed independently, so q has zeros where p has mass and vice versa. Every q row
    keeps at least k nonzero entries (drawing k siblings without replacement needs them).
    """
    rng = np.random.default_rng(seed)
    p_tabs, q_tabs = [], []
    for d in range(D + 1):
        base = rng.dirichlet(np.full(V, alpha), size=V ** d)
        other = rng.dirichlet(np.full(V, alpha), size=V ** d)
        p = _zero_and_normalise(base, rng, zero_frac)
        q = _zero_and_normalise(mix * base + (1 - mix) * other, rng, zero_frac)
        for r in np.flatnonzero((q > 0).sum(-1) < k):
            q[r, rng.choice(V, k, replace=False)] += 0.02
        p_tabs.append(p)
        q_tabs.append(q / q.sum(-1, keepdims=True))
    return p_tabs, q_tabs


def _draw(rows: np.ndarray, k: int, draft: str, rng) -> np.ndarray:
    """k sibling tokens per row of rows [n, V] -> [n, k] (numpy, independent of the code under test)."""
    n = len(rows)
    if draft == "iid":                                   # inverse CDF, k independent draws
        c = np.cumsum(rows, -1)
        u = rng.random((n, k, 1)) * c[:, None, -1:]
        t = (c[:, None, :] <= u).sum(-1)
        return np.minimum(t, V - 1)
    if draft == "wor":                                   # Gumbel top-k == sequential draws without replacement
        with np.errstate(divide="ignore"):
            g = np.log(rows) + rng.gumbel(size=rows.shape)
        return np.argsort(-g, -1, kind="stable")[:, :k]
    return np.argsort(-rows, -1, kind="stable")[:, :k]   # "top": deterministic candidates


def simulate(branching, mode, draft, p_tabs, q_draw, q_pass=None, n=TRIALS, seed=0):
    """Run n verify steps; return ([y1, y2, y3], num_accepted): emitted tokens, -1 where not emitted.

    draft: "iid" (siblings sampled independently from q_draw), "wor" (without replacement, Gumbel top-k),
    "top" (the k most likely tokens of q_draw: a deterministic candidate set). q_pass is the q given to
    accept_tree (default q_draw; a different one plants the "q is not what was sampled" bug).
    Drafting is numpy; accept_tree gets a fresh jit per call, so monkeypatched internals are traced in.
    """
    q_pass = q_draw if q_pass is None else q_pass
    rng = np.random.default_rng(seed)
    parents, depth, kids = full_tree(branching)
    N, D = len(parents), len(branching)
    tokens = np.zeros((n, N), np.int32)
    ctx = np.zeros((n, N), np.int64)
    for i in range(N):
        if kids[i]:
            t = _draw(q_draw[depth[i]][ctx[:, i]], len(kids[i]), draft, rng)
            for c, tc in zip(kids[i], t.T):
                tokens[:, c] = tc
                ctx[:, c] = ctx[:, i] * V + tc
    P = np.stack([p_tabs[depth[i]][ctx[:, i]] for i in range(N)], 1)
    Q = np.stack([q_pass[depth[i]][ctx[:, i]] for i in range(N)], 1)
    u = rng.random((n, N), dtype=np.float32)
    uf = rng.random(n, dtype=np.float32)
    par = np.broadcast_to(np.asarray(parents, np.int32), (n, N))

    def run(tokens, P, Q, u, uf):
        res = accept_tree(tokens, par, jnp.ones((n, N), bool), P, None if mode == "deterministic" else Q, u, uf,
                          mode=mode)
        return res, accepted_path(res.accepted, jnp.asarray(depth), D)

    res, path = jax.jit(run)(tokens, P, Q, u, uf)
    tp = np.take_along_axis(tokens, np.asarray(path), axis=1)
    m, nxt = np.asarray(res.num_accepted), np.asarray(res.next_token)
    ys = []
    for level in range(min(D + 1, 3)):          # token level+1: accepted draft at depth level+1, or the final one
        draft_tok = tp[:, level] if level < D else np.full(n, -1)
        ys.append(np.where(m > level, draft_tok, np.where(m == level, nxt, -1)))
    return ys, m


def check(name, branching, mode, draft, p_tabs, q_draw, q_pass=None, seed=0, n=TRIALS):
    t0 = time.perf_counter()
    ys, m = simulate(branching, mode, draft, p_tabs, q_draw, q_pass, n=n, seed=seed)
    r = emission_test(ys, p_tabs)
    r["mean_accepted"] = float(m.mean())
    cols = " | ".join(f"y{i + 1}: chi2={r['stat'][i]:.1f} df={r['df'][i]} p={r['p'][i]:.3g} n={r['n'][i]}"
                      for i in range(len(ys)))
    print(f"\n[{name}] trials={n} mode={mode} draft={draft} tree={branching} {cols} "
          f"| mean accepted={r['mean_accepted']:.3f} | {time.perf_counter() - t0:.2f}s")
    return r


# ----------------------------------------------------------------------------------------------------------------
# Losslessness: one test per mode
# ----------------------------------------------------------------------------------------------------------------

LOSSLESS_CASES = [
    # name, branching, mode, draft
    ("chain-iid", (1, 1, 1), "iid", "iid"),
    ("tree-deterministic", (3, 2), "deterministic", "top"),
    ("tree-iid", (3, 2), "iid", "iid"),
    ("tree-wor", (3, 2), "wor", "wor"),
]


@pytest.mark.parametrize("name,branching,mode,draft", LOSSLESS_CASES, ids=[c[0] for c in LOSSLESS_CASES])
def test_lossless_emission_matches_target(name, branching, mode, draft):
    p_tabs, q_tabs = make_pq(seed=1, D=len(branching), k=max(branching))
    # The test is only meaningful if q really differs from p and has zeros where p has mass (and vice versa).
    assert np.any((q_tabs[0][0] == 0) & (p_tabs[0][0] > 0)) and np.any((p_tabs[0][0] == 0) & (q_tabs[0][0] > 0))
    r = check(name, branching, mode, draft, p_tabs, q_tabs)
    assert min(r["p"]) > PASS_P, r
    assert 0.2 < r["mean_accepted"], "drafts are almost never accepted: the test would not exercise the tree"


def test_wor_accepts_more_than_iid():
    """Sequoia's point: without replacement the tree accepts at least as many tokens (on the same tables)."""
    p_tabs, q_tabs = make_pq(seed=1, D=2, k=3)
    _, m_iid = simulate((3, 2), "iid", "iid", p_tabs, q_tabs, n=20_000, seed=5)
    _, m_wor = simulate((3, 2), "wor", "wor", p_tabs, q_tabs, n=20_000, seed=5)
    assert m_wor.mean() > m_iid.mean() + 0.02, (m_wor.mean(), m_iid.mean())


# ----------------------------------------------------------------------------------------------------------------
# Planted bugs: the same helpers must reject them
# ----------------------------------------------------------------------------------------------------------------


def test_planted_bug_residual_not_updated_is_detected(monkeypatch):
    monkeypatch.setattr(A, "residual", lambda P, Q: P)
    p_tabs, q_tabs = make_pq(seed=1, D=2, k=3)
    r = check("BUG residual=P (iid)", (3, 2), "iid", "iid", p_tabs, q_tabs)
    assert min(r["p"]) < FAIL_P, r


def test_planted_bug_wor_q_not_updated_is_detected(monkeypatch):
    monkeypatch.setattr(A, "remove_token", lambda Q, x: Q)
    p_tabs, q_tabs = make_pq(seed=1, D=2, k=3)
    r = check("BUG wor Q not updated", (3, 2), "wor", "wor", p_tabs, q_tabs)
    assert min(r["p"]) < FAIL_P, r


def _top_p(t: np.ndarray, top_p: float) -> np.ndarray:
    """Nucleus filter per row: keep the smallest set of most likely tokens whose mass reaches top_p."""
    order = np.argsort(-t, axis=-1)
    sorted_t = np.take_along_axis(t, order, -1)
    keep_sorted = (np.cumsum(sorted_t, -1) - sorted_t) < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    out = np.where(keep, t, 0.0)
    return (out / out.sum(-1, keepdims=True)).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def test_planted_bug_top_p_applied_to_p_only_is_detected():
    """Top-p applied to the target's p but not to the drafter's q. The drafter samples through the engine's
    sampler (with top-p), while the q handed to the acceptance is the unprocessed softmax of the draft logits:
    the emission then misses the processed target. Processing q the same way as what was sampled fixes it.
    (With identical draft and target logits this bug is invisible: every draft is accepted and the drafts are
    already distributed as p; so the draft logits differ from the target's here.)"""
    rng = np.random.default_rng(7)
    D, top_p = 2, 0.8
    logits_p = [rng.normal(0, 1.5, (V ** d, V)) for d in range(D + 1)]
    logits_q = [lp + rng.normal(0, 1.0, lp.shape) for lp in logits_p]
    p_proc = [_top_p(_softmax(lp), top_p) for lp in logits_p]
    q_raw = [_softmax(lq) for lq in logits_q]
    q_proc = [_top_p(t, top_p) for t in q_raw]
    bad = check("BUG top-p on p only", (1, 1), "iid", "iid", p_proc, q_proc, q_pass=q_raw)
    assert min(bad["p"]) < FAIL_P, bad
    good = check("top-p on p and q", (1, 1), "iid", "iid", p_proc, q_proc)
    assert min(good["p"]) > PASS_P, good
    # What matters is that q is what the drafter sampled from: an unprocessed drafter passing its raw q is
    # lossless too (acceptance only needs the honest q).
    honest = check("raw q sampled and passed", (1, 1), "iid", "iid", p_proc, q_raw)
    assert min(honest["p"]) > PASS_P, honest


# ----------------------------------------------------------------------------------------------------------------
# Greedy: one-hot p gives exactly the matching path in every mode
# ----------------------------------------------------------------------------------------------------------------


def random_tree_batch(rng, B, N, Vg):
    """Random topological trees with distinct sibling tokens: parents [B, N], tokens [B, N]."""
    parents = np.full((B, N), -1, np.int32)
    tokens = np.zeros((B, N), np.int32)
    for b in range(B):
        used = {0: set()}
        for j in range(1, N):
            cands = [i for i in range(j) if len(used[i]) < Vg]
            par = int(rng.choice(cands))
            tok = int(rng.choice(sorted(set(range(Vg)) - used[par])))
            used[par].add(tok)
            used[j] = set()
            parents[b, j], tokens[b, j] = par, tok
    return parents, tokens


def greedy_reference(parents, tokens, argmax, valid):
    """Follow the unique child whose token equals the argmax at the current node."""
    B, N = parents.shape
    acc = np.zeros((B, N), bool)
    last = np.zeros(B, np.int32)
    for b in range(B):
        cur = 0
        for j in range(1, N):
            if valid[b, j] and parents[b, j] == cur and tokens[b, j] == argmax[b, cur]:
                acc[b, j], cur = True, j
        last[b] = cur
    return acc, last


@pytest.mark.parametrize("mode", A.MODES)
@pytest.mark.parametrize("greedy_drafter", [False, True])
def test_greedy_one_hot_p_gives_matching_path(mode, greedy_drafter):
    rng = np.random.default_rng(11)
    B, N, Vg = 300, 14, 3
    parents, tokens = random_tree_batch(rng, B, N, Vg)
    argmax = rng.integers(0, Vg, (B, N))
    valid = rng.random((B, N)) > 0.1
    valid[:, 0] = True
    p = np.eye(Vg, dtype=np.float32)[argmax]
    if greedy_drafter:
        q = np.eye(Vg, dtype=np.float32)[rng.integers(0, Vg, (B, N))]
    else:
        q = rng.dirichlet(np.ones(Vg), (B, N)).astype(np.float32)
    u = rng.random((B, N)).astype(np.float32)
    u[:, ::3] = 0.0
    u[:, 1::3] = np.float32(1 - 2 ** -24)          # the largest float32 below 1
    uf = rng.random(B).astype(np.float32)
    res = jit_accept(mode)(tokens, parents, valid, p, q, u, uf)
    acc_ref, last_ref = greedy_reference(parents, tokens, argmax, valid)
    np.testing.assert_array_equal(np.asarray(res.accepted), acc_ref)
    np.testing.assert_array_equal(np.asarray(res.last_node), last_ref)
    np.testing.assert_array_equal(np.asarray(res.num_accepted), acc_ref.sum(1))
    np.testing.assert_array_equal(np.asarray(res.next_token), argmax[np.arange(B), last_ref])
    assert 0 < acc_ref.sum(1).mean() and acc_ref.sum(1).max() >= 3     # the batch really has long paths
    # The verify step's all-greedy fast path must give exactly the general walk's result.
    fast = jax.jit(A.greedy_accept_tree)(tokens, parents, valid, argmax.astype(np.int32))
    for name in res._fields:
        np.testing.assert_array_equal(np.asarray(getattr(fast, name)), np.asarray(getattr(res, name)), err_msg=name)


def test_batch_with_different_accept_counts_and_accepted_path():
    """Greedy chain of 3 drafts; request b matches the argmax for exactly b drafts."""
    B, N, Vg = 4, 4, 5
    argmax = np.array([[2, 3, 4, 1]] * B)                        # node i's argmax is the token of node i + 1
    tokens = np.array([[0, 2, 3, 4]] * B, np.int32)               # all correct ...
    for b in range(B):
        tokens[b, 1 + b:] = 0                                      # ... up to depth b
    parents = np.array([[-1, 0, 1, 2]] * B, np.int32)
    p = np.eye(Vg, dtype=np.float32)[argmax]
    u = np.full((B, N), 0.5, np.float32)
    res = jit_accept("deterministic")(tokens, parents, np.ones((B, N), bool), p, None, u,
                                      np.full(B, 0.5, np.float32))
    np.testing.assert_array_equal(np.asarray(res.num_accepted), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(res.last_node), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(res.next_token), [2, 3, 4, 1])
    path = accepted_path(res.accepted, tree_depth(parents), 3)
    np.testing.assert_array_equal(np.asarray(path), [[0, 0, 0], [1, 0, 0], [1, 2, 0], [1, 2, 3]])


def test_accepted_path_on_a_branching_tree():
    #        0
    #      1   2          depth 1
    #    3  4    5        depth 2
    #        6            depth 3
    parents = np.array([-1, 0, 0, 1, 1, 2, 4], np.int32)
    depth = tree_depth(parents)
    np.testing.assert_array_equal(np.asarray(depth), [0, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(np.asarray(tree_depth(np.stack([parents] * 2))), [[0, 1, 1, 2, 2, 2, 3]] * 2)
    accepted = np.zeros((3, 7), bool)
    accepted[0, [1, 4, 6]] = True
    accepted[1, [2, 5]] = True
    path = accepted_path(accepted, depth, 4)
    np.testing.assert_array_equal(np.asarray(path), [[1, 4, 6, 0], [2, 5, 0, 0], [0, 0, 0, 0]])
    path_b = accepted_path(accepted, np.broadcast_to(np.asarray(depth), (3, 7)), 2)
    np.testing.assert_array_equal(np.asarray(path_b), [[1, 4], [2, 5], [0, 0]])


# ----------------------------------------------------------------------------------------------------------------
# Padding, degenerate inputs, sample_from
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", A.MODES)
def test_invalid_nodes_change_nothing(mode):
    """Inserting padding nodes (that would be accepted if valid) anywhere gives the same result."""
    rng = np.random.default_rng(3)
    B, N, Vs, extra = 64, 9, 6, 4
    parents, tokens = random_tree_batch(rng, B, N, Vs)
    p = rng.dirichlet(np.full(Vs, 0.5), (B, N)).astype(np.float32)
    q = rng.dirichlet(np.full(Vs, 0.5), (B, N)).astype(np.float32)
    u = rng.random((B, N)).astype(np.float32)
    uf = rng.random(B).astype(np.float32)
    M = N + extra
    P2, T2, p2, q2, u2 = (np.zeros((B, M), np.int32), np.zeros((B, M), np.int32), np.zeros((B, M, Vs), np.float32),
                          np.zeros((B, M, Vs), np.float32), np.zeros((B, M), np.float32))
    valid2 = np.ones((B, M), bool)
    new_index = np.zeros((B, N), np.int64)
    for b in range(B):
        pad = set(rng.choice(np.arange(1, M), extra, replace=False).tolist())
        keep = [i for i in range(M) if i not in pad]
        new_index[b] = keep
        for old, new in enumerate(keep):
            P2[b, new] = -1 if old == 0 else new_index[b, parents[b, old]]
            T2[b, new], p2[b, new], q2[b, new], u2[b, new] = tokens[b, old], p[b, old], q[b, old], u[b, old]
        for i in pad:
            P2[b, i] = rng.integers(0, i)
            T2[b, i] = 0
            p2[b, i] = 0.0
            p2[b, i, 0] = 1.0
            q2[b, i] = 1.0 / Vs
            u2[b, i] = 0.0                                        # would pass any test if it were tested
            valid2[b, i] = False
    ref = jit_accept(mode)(tokens, parents, np.ones((B, N), bool), p, q, u, uf)
    got = jit_accept(mode)(T2, P2, valid2, p2, q2, u2, uf)
    acc_ref = np.asarray(ref.accepted)
    acc_got = np.asarray(got.accepted)
    assert not np.any(acc_got & ~valid2)
    np.testing.assert_array_equal(np.take_along_axis(acc_got, new_index, 1), acc_ref)
    np.testing.assert_array_equal(np.asarray(got.num_accepted), np.asarray(ref.num_accepted))
    np.testing.assert_array_equal(np.asarray(got.last_node), new_index[np.arange(B), np.asarray(ref.last_node)])
    np.testing.assert_array_equal(np.asarray(got.next_token), np.asarray(ref.next_token))
    assert np.asarray(ref.num_accepted).max() >= 2


def test_degenerate_residuals_do_not_produce_nan():
    Vd = 5
    # P <= Q everywhere (sub-normalised p), rejection forced: the residual is empty, fall back to P.
    q = np.array([0.0, 0.5, 0.5, 0.0, 0.0], np.float32)
    p = q * 0.999
    r = np.asarray(A.residual(jnp.asarray(p), jnp.asarray(q)))
    assert np.all(np.isfinite(r)) and np.allclose(r, p)
    # Q with all its mass on the removed token: removal is empty, Q is kept.
    onehot = np.eye(Vd, dtype=np.float32)[2]
    r = np.asarray(A.remove_token(jnp.asarray(onehot), jnp.asarray(onehot)))
    assert np.all(np.isfinite(r)) and np.array_equal(r, onehot)
    # Whole walk: the first draft is rejected only because p is sub-normalised (p = 0.999 q, u = 0.9999), so
    # every mode meets an empty residual (and wor an empty Q); the final token falls back to P's support.
    tokens = np.array([[0, 1, 2]], np.int32)
    parents = np.array([[-1, 0, 1]], np.int32)
    e1 = np.eye(Vd, dtype=np.float32)[1]
    P = np.stack([0.999 * e1, onehot, onehot])[None]
    Q = np.stack([e1, onehot, onehot])[None]
    u = np.array([[0.0, 0.9999, 0.0]], np.float32)
    for mode in A.MODES:
        res = jit_accept(mode)(tokens, parents, np.ones((1, 3), bool), P, Q, u, np.array([0.7], np.float32))
        assert int(res.num_accepted[0]) == 0 and int(res.next_token[0]) == 1, mode
    # All-zero rows (garbage padding of a whole request) still give a valid index.
    z = np.zeros((1, 3, Vd), np.float32)
    for mode in A.MODES:
        res = jit_accept(mode)(tokens, parents, np.ones((1, 3), bool), z, z, u, np.array([0.3], np.float32))
        assert 0 <= int(res.next_token[0]) < Vd and int(res.num_accepted[0]) == 0


def test_sample_from_never_returns_zero_probability_tokens():
    probs = jnp.array([[0.0, 0.0, 0.3, 0.0, 0.7, 0.0, 0.0],
                       [0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0],      # unnormalised
                       [0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9]])
    us = np.array([0.0, 1e-9, 0.3, 0.299999, 0.5, 1 - 2 ** -24], np.float32)
    t = np.asarray(jit_sample(jnp.broadcast_to(probs, (len(us), 3, 7)), jnp.asarray(np.repeat(us[:, None], 3, 1))))
    assert np.all(np.asarray(probs)[np.arange(3)[None, :], t] > 0), t
    # Forcing the target above the total (what cumsum rounding can do) must land on the last nonzero token.
    assert int(sample_from(probs[0], jnp.float32(1.5))) == 4
    assert int(sample_from(jnp.zeros(4), jnp.float32(0.5))) == 0
    # Distribution check on an unnormalised vector with zeros.
    w = np.array([0.0, 3.0, 0.0, 1.0, 2.0, 0.0, 4.0], np.float32)
    u = jax.random.uniform(jax.random.PRNGKey(0), (20_000,))
    s = np.asarray(jit_sample(jnp.broadcast_to(jnp.asarray(w), (20_000, 7)), u))
    stat, df = chi2_gof(np.bincount(s, minlength=7), w)
    assert p_value(stat, df) > PASS_P, (stat, df)


def test_bad_arguments_raise_clear_errors():
    B, N, Vb = 2, 3, 4
    t = np.zeros((B, N), np.int32)
    par = np.array([[-1, 0, 0]] * B, np.int32)
    ok = np.ones((B, N), bool)
    p = np.full((B, N, Vb), 0.25, np.float32)
    u = np.zeros((B, N), np.float32)
    uf = np.zeros(B, np.float32)
    with pytest.raises(AcceptanceError, match="mode"):
        accept_tree(t, par, ok, p, p, u, uf, mode="greedy")
    with pytest.raises(AcceptanceError, match="needs q"):
        accept_tree(t, par, ok, p, None, u, uf, mode="iid")
    with pytest.raises(AcceptanceError, match="p must be"):
        accept_tree(t, par, ok, p[0], p[0], u, uf, mode="iid")
    with pytest.raises(AcceptanceError, match="parents"):
        accept_tree(t, par[:, :2], ok, p, p, u, uf, mode="wor")
    with pytest.raises(AcceptanceError, match="q must"):
        accept_tree(t, par, ok, p, p[:, :, :2], u, uf, mode="wor")
    with pytest.raises(AcceptanceError, match="u_final"):
        accept_tree(t, par, ok, p, None, u, uf[:1], mode="deterministic")
    assert issubclass(AcceptanceError, ValueError)


def test_vmap_and_jit_compose():
    """accept_tree is traceable under an outer vmap (e.g. over groups) and jit."""
    rng = np.random.default_rng(0)
    G, B, N, Vs = 3, 2, 5, 6
    p = rng.dirichlet(np.ones(Vs), (G, B, N)).astype(np.float32)
    parents = np.broadcast_to(np.array([-1, 0, 0, 1, 1], np.int32), (G, B, N))
    tokens = rng.integers(0, Vs, (G, B, N)).astype(np.int32)
    u = rng.random((G, B, N)).astype(np.float32)
    uf = rng.random((G, B)).astype(np.float32)
    f = jax.jit(jax.vmap(lambda t, pa, pp, uu, ff: accept_tree(t, pa, jnp.ones(t.shape, bool), pp, pp, uu, ff,
                                                             mode="iid")))
    res = f(tokens, parents, p, u, uf)
    direct = jit_accept("iid")(tokens[1], parents[1], np.ones((B, N), bool), p[1], p[1], u[1], uf[1])
    np.testing.assert_array_equal(np.asarray(res.accepted[1]), np.asarray(direct.accepted))
    np.testing.assert_array_equal(np.asarray(res.next_token[1]), np.asarray(direct.next_token))


# ----------------------------------------------------------------------------------------------------------------
# Typical acceptance (lossy, opt-in)
# ----------------------------------------------------------------------------------------------------------------


def test_typical_accept_is_labelled_lossy():
    assert "LOSSY" in typical_accept.__doc__
    assert "typical" in typical_accept.__name__


def _typical_example():
    #          0
    #      1(t2)   2(t1)         depth 1: p0 = [0.1, 0.4, 0.45, 0.05] -> both pass (thr = 0.09)
    #      3(t0)   4(t3)         depth 2: both pass with p = 0.5
    #              5(t1)         depth 3 under node 4, p[4](1) = 0.02 -> fails
    #      6(t3)                 depth 2 under node 1: p[1](3) = 0.01 -> fails
    Vt = 4
    tokens = np.array([0, 2, 1, 0, 3, 1, 3], np.int32)
    parents = np.array([-1, 0, 0, 1, 2, 4, 1], np.int32)
    p = np.array([[0.1, 0.4, 0.45, 0.05],
                  [0.5, 0.2, 0.29, 0.01],
                  [0.25, 0.0, 0.25, 0.5],
                  [0.0, 0.0, 1.0, 0.0],
                  [0.0, 0.0, 0.0, 1.0],
                  [0.49, 0.02, 0.0, 0.49],
                  [0.25, 0.25, 0.25, 0.25]], np.float32)
    assert p.shape[1] == Vt
    return tokens, parents, p


def test_typical_accept_hand_example_ties_by_log_p():
    tokens, parents, p = _typical_example()
    res = jit_typical(tokens[None], parents[None], np.ones((1, 7), bool), p[None],
                         u_final=np.array([0.5], np.float32))
    # Nodes 3 and 4 both sit at depth 2; path 0-1-3 has log .45 + log .5 > log .4 + log .5 of path 0-2-4.
    np.testing.assert_array_equal(np.asarray(res.accepted[0]), [0, 1, 0, 1, 0, 0, 0])
    assert int(res.num_accepted[0]) == 2 and int(res.last_node[0]) == 3 and int(res.next_token[0]) == 2


def test_typical_accept_prefers_longer_path_and_respects_valid():
    tokens, parents, p = _typical_example()
    p = p.copy()
    p[4] = [0.0, 0.5, 0.0, 0.5]                 # node 5 (token 1) now passes: path 0-2-4-5 is the longest
    valid = np.ones((2, 7), bool)
    valid[1, 5] = False                         # ... unless node 5 is padding
    res = jit_typical(np.stack([tokens] * 2), np.stack([parents] * 2), valid, np.stack([p] * 2),
                         u_final=np.array([0.5, 0.5], np.float32))
    np.testing.assert_array_equal(np.asarray(res.accepted), [[0, 0, 1, 0, 1, 1, 0], [0, 1, 0, 1, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(res.num_accepted), [3, 2])
    np.testing.assert_array_equal(np.asarray(res.last_node), [5, 3])
    assert int(res.next_token[1]) == 2 and p[5][int(res.next_token[0])] > 0


def test_typical_threshold_uses_entropy():
    """A flat target lowers the bar to alpha * exp(-H): with V = 4 uniform, H ~ log 4, bar ~ 0.075 < 0.09."""
    tokens = np.array([[0, 1]], np.int32)
    parents = np.array([[-1, 0]], np.int32)
    flat = np.full((1, 2, 4), 0.25, np.float32)
    res = jit_typical(tokens, parents, np.ones((1, 2), bool), flat, u_final=np.zeros(1, np.float32))
    assert int(res.num_accepted[0]) == 1
    res = jit_typical(tokens, parents, np.ones((1, 2), bool), flat, posterior_alpha=1.1,
                         u_final=np.zeros(1, np.float32))
    assert int(res.num_accepted[0]) == 1                     # min(eps, ...) caps the bar at 0.09 < 0.25
    res = jit_typical(tokens, parents, np.ones((1, 2), bool), flat, posterior_threshold=0.3,
                         posterior_alpha=1.1, u_final=np.zeros(1, np.float32))
    assert int(res.num_accepted[0]) == 0                     # bar min(0.3, 1.1 * 0.25) = 0.275 > 0.25


# ----------------------------------------------------------------------------------------------------------------
# Structure: only selects, one-hot products and scans (portable to every backend, no data-dependent shapes)
# ----------------------------------------------------------------------------------------------------------------

FORBIDDEN = {"gather", "scatter", "scatter-add", "sort", "cond", "while", "dynamic_slice", "dynamic_update_slice"}


def _primitives(closed_jaxpr) -> set[str]:
    from jax.extend.core import jaxprs_in_params

    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.add(eqn.primitive.name)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("fn", ["deterministic", "iid", "wor", "typical", "path", "greedy"])
def test_no_gather_scatter_sort_or_cond(fn):
    B, N, Vs = 2, 5, 7
    t = jnp.zeros((B, N), jnp.int32)
    par = jnp.array([[-1, 0, 0, 1, 1]] * B, jnp.int32)
    ok = jnp.ones((B, N), bool)
    p = jnp.full((B, N, Vs), 1.0 / Vs)
    u = jnp.zeros((B, N))
    uf = jnp.zeros(B)
    if fn in A.MODES:
        jx = jax.make_jaxpr(lambda *a: accept_tree(*a, mode=fn))(t, par, ok, p, p, u, uf)
    elif fn == "typical":
        jx = jax.make_jaxpr(lambda *a: typical_accept(*a, u_final=uf))(t, par, ok, p)
    elif fn == "greedy":
        jx = jax.make_jaxpr(A.greedy_accept_tree)(t, par, ok, t)
    else:
        jx = jax.make_jaxpr(lambda a, pa: accepted_path(a, tree_depth(pa), 3))(ok, par)
    prims = _primitives(jx)
    assert "scan" in prims or fn == "path"
    assert not prims & FORBIDDEN, prims & FORBIDDEN
