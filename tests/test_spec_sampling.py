"""End-to-end losslessness of speculative sampling on a tiny model (fast).

Thousands of sampled continuations of 3 tokens from a tiny random target (vocabulary of 12, so the joint space of
the first tokens is small), decoded plainly and speculatively (a different tiny draft model; the n-gram drafter),
are compared by chi-square with the EXACT target distribution, computed by enumerating every prefix with the
target's forward and processing the logits in NumPy (temperature, top-k, top-p written independently of
specjax.sampling). Two joints are tested: (y1, y2) and (y1, y2, y3); y1 comes from the prefill, y2 and y3 from
the first verify steps (accepted drafts, corrections after a rejection at depth 1 or 2, bonus tokens).

The same test must reject planted bugs: (a) the residual after a rejection not updated (`acceptance.residual`
returns P), for the draft model (iid acceptance) and the n-gram drafter (deterministic acceptance); (b) the
draft samples with top-p but reports a q computed without it. A draft that ignores top-p for both sampling and
q is NOT a bug (acceptance is lossless for any q that is what was sampled), and the test must pass it.
Planted variants run under a fresh drafter subclass, so no compiled program is shared with the honest runs.
Deterministic trees with siblings (a static Medusa tree, an EAGLE-2 dynamic tree, the latter with a lookup chain
merged in) go through the same tests; their
planted bug is the same residual one, which there lets a rejected sibling come back as the correction token.
The draft model's cheap variants go through them too, each with its own planted bug: a trimmed draft vocabulary
(q must be zero off the kept tokens: the bug reports some mass there), p_min (q must be restricted to the tokens
at or above p_min: the bug reports the unrestricted q) and the draft model merged with lookup (a looked-up
token's q is a point mass: the bug reports a smoothed one).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import acceptance, engine
from specjax.backoff import Adaptive
from specjax.buckets import Buckets
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.kv_cache import init_cache
from specjax.models.llama import forward
from specjax.sampling import process_logits

from spec_helpers import (chi2_gof, chi2_pvalue, last_logits, make_sampling, outputs, run_plain, run_spec,
                          tiny_config, tiny_params)

V = 12
NEW = 3  # tokens sampled per sequence
ROWS = 4096  # sequences per jitted call (each row its own seed)
CALLS = 4  # -> 16384 sequences per run
BUCKETS = Buckets(ROWS, 16, 16, 48)
PROMPT_LEN = 15
GAMMA = 2
PASS_P = 1e-3  # an exact sampler must give p above this (fixed seeds: deterministic outcome)
FAIL_P = 1e-6  # a planted bug must give p below this
MIN_EXPECTED = 10  # chi-square cells are pooled up to this expected count (sparse cells inflate the statistic)

SETTINGS = {
    "t1": dict(temperature=1.0),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_k": dict(temperature=0.8, top_k=4, top_p=0.95),
}


@pytest.fixture(scope="module")
def target():
    config = tiny_config(V)
    return config, tiny_params(config, seed=3)


@pytest.fixture(scope="module")
def draft(target):
    """Another random model (own layers, one fewer) that shares the target's embedding and LM head, so its
    preferences overlap the target's without being equal: acceptance is neither rare nor certain."""
    tcfg, tparams = target
    config = tiny_config(V, num_layers=1)
    params = tiny_params(config, seed=4)
    params["embed"], params["lm_head"] = tparams["embed"], tparams["lm_head"]
    return config, params


# ------------------------------------------------------------------------------------------------ exact target


def process_np(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Reference logits processing in float64 with sorts: temperature, keep the top_k largest, renormalise,
    keep the smallest most-likely set whose mass reaches top_p, renormalise. logits [..., V]."""
    x = np.asarray(logits, np.float64) / temperature
    if top_k > 0:
        kth = np.sort(x, axis=-1)[..., -top_k][..., None]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        keep_sorted = before < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


@pytest.fixture(scope="module")
def prompt(target):
    """[5, 2, 9] continued greedily by the target: the n-gram drafter then proposes continuations the target
    itself likes (higher acceptance than arbitrary repeats), and misses for tokens absent from the prompt
    (rows verifying a root-only tree next to rows with proposals)."""
    config, params = target
    seq = [5, 2, 9]
    while len(seq) < PROMPT_LEN:
        seq.append(int(np.argmax(last_logits(params, config, seq))))
    return seq


@pytest.fixture(scope="module")
def exact_logits(target, prompt):
    """Target logits after the prompt, after prompt + y1, after prompt + y1 + y2, for every (y1, y2):
    ([V], [V, V], [V, V, V]) float64, from one forward over all V * V continuations."""
    config, params = target
    P = len(prompt)
    y1, y2 = np.meshgrid(np.arange(V), np.arange(V), indexing="ij")
    seqs = np.concatenate([np.tile(prompt, (V * V, 1)), y1.reshape(-1, 1), y2.reshape(-1, 1)], axis=1)
    B, T = seqs.shape
    cache = init_cache(config.num_layers, B, T, config.num_kv_heads, config.head_dim)
    pos = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    logits = np.asarray(forward(params, config, jnp.asarray(seqs, jnp.int32), pos, cache).logits, np.float64)
    return logits[0, P - 1], logits[::V, P], logits[:, P + 1].reshape(V, V, V)


def _library_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    rows = logits.reshape(-1, V)
    n = rows.shape[0]
    return np.asarray(process_logits(jnp.asarray(rows, jnp.float32), jnp.full((n,), temperature, jnp.float32),
                                     jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p, jnp.float32)))


def exact_joint(logits, setting: dict) -> np.ndarray:
    """Exact P(y1, y2, y3) [V, V, V] of the processed target for one sampling setting."""
    kw = dict(temperature=setting.get("temperature", 1.0), top_k=setting.get("top_k", 0),
              top_p=setting.get("top_p", 1.0))
    probs = [process_np(lg, **kw) for lg in logits]
    for ref, lg in zip(probs, logits):
        # the kept token sets must agree with specjax's processing, else the setting sits on a cut-off boundary
        assert np.array_equal(_library_process(lg, **kw) > 0, ref.reshape(-1, V) > 0), "cut-off too close to call"
    p1, p2, p3 = probs
    return p1[:, None, None] * p2[:, :, None] * p3


# ------------------------------------------------------------------------------------------------ sampling runs


def sample_sequences(target, prompt, setting: dict, drafter=None, dparams=None, base_seed: int = 0,
                     adaptive=None, backed_off: bool = False) -> np.ndarray:
    """ROWS * CALLS sampled continuations [n, NEW] (plain decoding when drafter is None; speculation without
    back-off unless `adaptive` is given)."""
    config, params = target
    out = []
    for c in range(CALLS):
        seeds = base_seed + c * ROWS + np.arange(ROWS)
        sampling = make_sampling(ROWS, seed=seeds, max_new=NEW, **setting)
        prompts = [prompt] * ROWS
        if drafter is None:
            dec = run_plain(params, config, BUCKETS, prompts, sampling)
        else:
            dec = run_spec(params, config, dparams, drafter, BUCKETS, prompts, sampling, adaptive=adaptive,
                           backed_off=backed_off).dec
        toks, finish = outputs(dec)
        assert np.all(np.asarray(dec.num_new) == NEW) and np.all(finish == engine.FINISH_LENGTH)
        out.append(np.asarray(toks, np.int64))
    return np.concatenate(out)


def joint_test(samples: np.ndarray, joint: np.ndarray) -> dict:
    """Chi-square of the (y1, y2) and (y1, y2, y3) joints against the exact target; p = the smaller p-value
    times 2 (Bonferroni)."""
    c2 = np.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V)
    c3 = np.bincount((samples[:, 0] * V + samples[:, 1]) * V + samples[:, 2], minlength=V ** 3)
    s2, d2 = chi2_gof(c2, joint.sum(-1), MIN_EXPECTED)
    s3, d3 = chi2_gof(c3, joint, MIN_EXPECTED)
    p2, p3 = chi2_pvalue(s2, d2), chi2_pvalue(s3, d3)
    return dict(stat2=s2, dof2=d2, p2=p2, stat3=s3, dof3=d3, p3=p3, p=min(1.0, 2 * min(p2, p3)))


def fresh(drafter, **overrides):
    """A copy of `drafter` under a new subclass: a jit cache miss, so a planted patch is traced in (and the
    patched program is never reused by another test)."""
    cls = type(f"Fresh{type(drafter).__name__}", (type(drafter),), dict(overrides))
    return cls(**{f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)})


def drafter_for(name: str, draft, target=None):
    """(drafter, dparams): chains ("draft_model", "ngram") and deterministic trees with siblings ("medusa": a
    static 5-node tree from two random heads; "eagle": an EAGLE-2 dynamic tree of 6 nodes from a perturbed
    EAGLE-1 head; "eagle_lookup": that tree with an n-gram chain of GAMMA merged in where the context matches)."""
    if name == "draft_model":
        dcfg, dparams = draft
        return DraftModelDrafter(dcfg, GAMMA, V), {"params": dparams}
    if name == "ngram":
        return NgramDrafter(GAMMA, 1, 2), {}
    if name in ("draft_trim", "draft_pmin", "draft_lookup"):
        from specjax.drafters.draft_model import trim_vocab
        from specjax.drafters.with_lookup import DraftWithLookup

        dcfg, dparams = draft
        drafter = DraftModelDrafter(dcfg, GAMMA, V)
        if name == "draft_trim":
            params, d2t = trim_vocab(dparams, None, TRIM_KEEP)
            return drafter, {"params": params, "d2t": d2t}
        if name == "draft_pmin":
            return drafter, {"params": dparams, "p_min": jnp.float32(P_MIN)}
        return DraftWithLookup.around(drafter, NgramDrafter(GAMMA, 1, 2)), {"params": dparams}
    config, params = target
    if name == "medusa":
        from specjax.drafters.medusa import MedusaDrafter
        from specjax.heads.medusa import MedusaConfig, draft_params, init_heads

        mc = MedusaConfig(num_heads=2, hidden_size=config.hidden_size, vocab_size=V)
        heads = init_heads(mc, jax.random.PRNGKey(7), scale=0.3)
        return (MedusaDrafter(mc, ((0,), (1,), (0, 0), (1, 0), (0, 1))), draft_params(mc, heads, params))
    if name == "eagle":
        from specjax.drafters.eagle import EagleDrafter
        from specjax.heads.eagle import head_config, init_from_target

        hc = head_config(config, "eagle")
        head = init_from_target(hc, params, -1)
        leaves, treedef = jax.tree_util.tree_flatten(head)
        keys = jax.random.split(jax.random.PRNGKey(8), len(leaves))
        head = jax.tree_util.tree_unflatten(treedef, [a + 0.1 * jax.random.normal(k, a.shape, a.dtype)
                                                      for a, k in zip(leaves, keys)])
        eagle = EagleDrafter(hc, top_k=3, depth=2, total_tokens=6)
        return eagle, {"head": head, "embed": params["embed"], "lm_head": params["lm_head"]}
    if name == "eagle_lookup":
        from specjax.drafters.with_lookup import WithLookup

        eagle, dparams = drafter_for("eagle", draft, target)
        return WithLookup(eagle, NgramDrafter(GAMMA, 1, 2)), dparams
    raise AssertionError(name)


TREES = ["medusa", "eagle", "eagle_lookup"]
CHEAP = ["draft_trim", "draft_pmin", "draft_lookup"]
TRIM_KEEP = [0, 2, 3, 5, 7, 8, 9, 11]  # 8 of the 12 ids
P_MIN = 0.2


def report(label: str, res: dict, extra: str = "") -> str:
    line = (f"{label}: (y1,y2) chi2 {res['stat2']:.1f} dof {res['dof2']} p {res['p2']:.3g}; (y1,y2,y3) chi2 "
            f"{res['stat3']:.1f} dof {res['dof3']} p {res['p3']:.3g}{extra}")
    print(line)
    return line


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_plain_sampling_matches_the_exact_distribution(target, prompt, exact_logits, setting):
    res = joint_test(sample_sequences(target, prompt, SETTINGS[setting]), exact_joint(exact_logits, SETTINGS[setting]))
    line = report(f"plain {setting}", res)
    assert res["p"] > PASS_P, line


@pytest.mark.parametrize("method,setting", [(m, s) for m in ("draft_model", "ngram") for s in SETTINGS]
                         + [(m, s) for m in TREES + CHEAP for s in ("t1", "top_k")])
def test_speculative_sampling_matches_the_exact_distribution(target, draft, prompt, exact_logits, method, setting):
    drafter, dparams = drafter_for(method, draft, target)
    samples = sample_sequences(target, prompt, SETTINGS[setting], drafter, dparams, base_seed=10 ** 6)
    res = joint_test(samples, exact_joint(exact_logits, SETTINGS[setting]))
    line = report(f"{method} {setting}", res)
    assert res["p"] > PASS_P, line


def test_speculative_sampling_with_back_off_matches_the_exact_distribution(target, draft, prompt, exact_logits):
    """With the adaptive back-off forced to alternate (plain step, then a probe) from a backed-off start, y2
    comes from a plain step inside the speculative loop (the draft only observes it) and y3 from a verify step."""
    drafter, dparams = drafter_for("draft_model", draft)
    back_off = Adaptive(min_gain=5.0, probe_every=1, max_gap_factor=1)
    samples = sample_sequences(target, prompt, SETTINGS["t1"], drafter, dparams, base_seed=5 * 10 ** 6,
                               adaptive=back_off, backed_off=True)
    res = joint_test(samples, exact_joint(exact_logits, SETTINGS["t1"]))
    line = report("draft_model t1 with back-off", res)
    assert res["p"] > PASS_P, line
    config, params = target
    st = run_spec(params, config, dparams, drafter, BUCKETS, [prompt] * ROWS,
                  make_sampling(ROWS, seed=np.arange(ROWS), max_new=NEW, **SETTINGS["t1"]), adaptive=back_off,
                  backed_off=True).stats
    assert np.all(np.asarray(st.plain_steps) == 1) and np.all(np.asarray(st.verify_steps) >= 1)


def acceptance_rate(target, prompt, drafter, dparams, setting: dict, per_step: bool = False) -> float:
    """Accepted / drafted tokens, or accepted tokens per verify step (`per_step`)."""
    config, params = target
    sampling = make_sampling(ROWS, seed=np.arange(ROWS), max_new=NEW, **setting)
    st = run_spec(params, config, dparams, drafter, BUCKETS, [prompt] * ROWS, sampling).stats
    den = st.verify_steps if per_step else st.drafted
    return float(np.asarray(st.accepted).sum() / max(1, np.asarray(den).sum()))


@pytest.mark.parametrize("method", ["draft_model", "ngram"] + TREES + CHEAP)
def test_acceptance_is_neither_rare_nor_certain(target, draft, prompt, method):
    """The statistical tests only have power if drafts are often accepted and often rejected (thousands of
    each over a run of 16k sequences)."""
    drafter, dparams = drafter_for(method, draft, target)
    if method in TREES:
        # Most siblings are rejected by construction (at most one child per node is accepted), so a tree's
        # per-node rate is low; what matters is that steps accept something often and not always everything.
        gain = acceptance_rate(target, prompt, drafter, dparams, SETTINGS["t1"], per_step=True)
        print(f"{method}: {gain:.3f} accepted tokens per verify step at temperature 1")
        assert 0.1 < gain < 0.9 * drafter.tree.max_depth, gain
        return
    rate = acceptance_rate(target, prompt, drafter, dparams, SETTINGS["t1"])
    print(f"{method}: acceptance rate {rate:.3f} at temperature 1")
    assert 0.1 < rate < 0.9, rate


@pytest.mark.parametrize("method", ["draft_model", "ngram", "eagle", "eagle_lookup"])
def test_planted_bug_residual_not_updated_is_caught(target, draft, prompt, exact_logits, method, monkeypatch):
    """For a tree, the bug lets a rejected sibling be sampled again as the correction."""
    drafter, dparams = drafter_for(method, draft, target)
    monkeypatch.setattr(acceptance, "residual", lambda P, Q: P)
    samples = sample_sequences(target, prompt, SETTINGS["t1"], fresh(drafter), dparams, base_seed=2 * 10 ** 6)
    res = joint_test(samples, exact_joint(exact_logits, SETTINGS["t1"]))
    line = report(f"planted residual bug, {method}", res)
    assert res["p"] < FAIL_P, line


def _q_without_top_p(self, dparams, logits, sampling, allow_cond):
    """Planted bug: the draft samples from the top-p-processed distribution, but reports q without top-p."""
    sampled = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p, allow_cond=allow_cond)
    reported = process_logits(logits, sampling.temperature, sampling.top_k, jnp.ones_like(sampling.top_p),
                               allow_cond=allow_cond)
    assert dparams.get("d2t") is None
    return reported, sampled


def test_planted_bug_q_without_top_p_is_caught(target, draft, prompt, exact_logits):
    drafter, dparams = drafter_for("draft_model", draft)
    samples = sample_sequences(target, prompt, SETTINGS["top_p"], fresh(drafter, _q=_q_without_top_p), dparams,
                               base_seed=3 * 10 ** 6)
    res = joint_test(samples, exact_joint(exact_logits, SETTINGS["top_p"]))
    line = report("planted q-without-top-p bug", res)
    assert res["p"] < FAIL_P, line


def test_draft_that_ignores_top_p_everywhere_stays_lossless(target, draft, prompt, exact_logits, monkeypatch):
    """The draft samples AND reports q without top-p (the target keeps it): q is what was sampled, so the
    acceptance rule still yields the target's top-p distribution. Guards against a test that fails for any
    change in the draft."""
    import specjax.drafters.draft_model as dm

    drafter, dparams = drafter_for("draft_model", draft)
    real = dm.process_logits
    monkeypatch.setattr(dm, "process_logits", lambda lg, t, k, p, **kw: real(lg, t, k, jnp.ones_like(p), **kw))
    samples = sample_sequences(target, prompt, SETTINGS["top_p"], fresh(drafter), dparams, base_seed=4 * 10 ** 6)
    res = joint_test(samples, exact_joint(exact_logits, SETTINGS["top_p"]))
    line = report("draft without top-p (sampled and reported)", res)
    assert res["p"] > PASS_P, line


def _q_with_mass_off_the_kept_tokens(self, dparams, logits, sampling, allow_cond):
    """Planted bug (trimmed vocabulary): the draft samples over the kept tokens but reports a q that leaves some
    mass on the dropped ones (as if its full-vocabulary q had not been restricted)."""
    full, probs = DraftModelDrafter._q(self, dparams, logits, sampling, allow_cond)
    off = (full == 0).astype(full.dtype)
    return 0.7 * full + 0.3 * off / jnp.maximum(off.sum(-1, keepdims=True), 1.0), probs


def _draw_without_restricting_q(self, dparams, logits, sampling, u, p_min, allow_cond):
    """Planted bug (p_min): the chain still stops at an unlikely token, but q is not restricted to the tokens at
    or above p_min (the kept token was drawn from the restricted distribution)."""
    return DraftModelDrafter._draw(self, dparams, logits, sampling, u, jnp.float32(0.0), allow_cond)


def _smoothed_lookup_q(tokens, V, dtype):
    """Planted bug (draft + lookup): a looked-up token reported as drawn from a smoothed point mass."""
    from specjax.drafters.with_lookup import DraftWithLookup

    return 0.6 * DraftWithLookup._lookup_q(tokens, V, dtype) + 0.4 / V


@pytest.mark.parametrize("method", CHEAP)
def test_planted_bug_in_a_cheap_draft_variant_is_caught(target, draft, prompt, exact_logits, method):
    drafter, dparams = drafter_for(method, draft, target)
    if method == "draft_trim":
        bad = fresh(drafter, _q=_q_with_mass_off_the_kept_tokens)
    elif method == "draft_pmin":
        bad = fresh(drafter, _draw=_draw_without_restricting_q)
    else:
        bad = fresh(drafter, _lookup_q=staticmethod(_smoothed_lookup_q))
    samples = sample_sequences(target, prompt, SETTINGS["t1"], bad, dparams, base_seed=6 * 10 ** 6)
    res = joint_test(samples, exact_joint(exact_logits, SETTINGS["t1"]))
    line = report(f"planted bug, {method}", res)
    assert res["p"] < FAIL_P, line
