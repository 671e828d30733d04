"""The tuner (specjax.tools.tune): cost-model arithmetic, tree-size candidates, and one end-to-end tree tune.

* predict / predict_tree with hand-made costs and acceptance give the hand-computed tokens/s and pick the
  setting a hand computation picks (and a different one when the acceptance changes).
* leviathan_expected_tokens equals the geometric sum 1 + alpha + ... + alpha^gamma and tends to gamma + 1.
* Medusa sizes are prefixes of the best-first tree: of the right length and prefix-closed; oversize requests are
  capped to the whole tree, and a prefix that is not a tree is skipped. EAGLE sizes the expansion cannot fill are
  skipped with a message.
* Plain decoding (setting 0) is a candidate: chosen where nothing is predicted to pay, and on a tie.
* tune() on a tiny random target with a tiny EAGLE head, and with n-gram (validate=True, 2 tiny prompts), picks
  the setting with the best predicted tokens/s among plain and the valid candidates, measures every one (and the
  best speculative one with back-off on) and returns the documented, JSON-serialisable keys.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from specjax.tools import tune
from specjax.config import SamplingParams, SpeculativeConfig
from specjax.drafters.medusa import DEFAULT_CHOICES, choices_from_accuracy
from specjax.tree import from_choices

from spec_helpers import tiny_config, tiny_llm, tiny_params

V = 64
LAYERS = 3
PROMPTS = [[7, 3, 9, 12, 40, 7, 3, 9], [33, 17, 50, 2, 61, 8, 8, 19, 44]]


def _closed(choices) -> bool:
    have = {tuple(c) for c in choices}
    return all(tuple(c[:-1]) in have for c in choices if len(c) > 1)


# ============================================================================================ arithmetic
def test_predict_chain_matches_hand_computation():
    costs = tune.Costs(0.010, {1: 0.012, 2: 0.014, 4: 0.019})
    pos = np.array([8.0, 6.0, 3.0, 1.0])  # accepted counts at depth 1..4 over 10 verify steps
    pred = tune.predict(costs, pos, 10, [1, 2, 4])
    # gamma 1: E = 1.8, step 0.012; gamma 2: E = 2.4, step 0.014; gamma 4: E = 2.8, step 0.019
    want = {1: 1.8 / 0.012, 2: 2.4 / 0.014, 4: 2.8 / 0.019}
    for g, tps in want.items():
        assert pred[g]["tokens_per_s"] == pytest.approx(tps)
        assert pred[g]["speedup"] == pytest.approx(tps * 0.010)
    assert tune.choose(pred) == 2
    # 5 plain steps (nothing proposed) at one token and one plain forward each: (5 + 24) / (0.05 + 0.14)
    assert tune.predict(costs, pos, 10, [2], plain_steps=5)[2]["tokens_per_s"] == pytest.approx(29 / 0.19)
    # Deep acceptance makes the longest chain pay off.
    assert tune.choose(tune.predict(costs, np.array([10.0, 10, 10, 10]), 10, [1, 2, 4])) == 4


def test_plain_decoding_is_a_candidate_and_wins_where_nothing_pays():
    costs = tune.Costs(0.010, {1: 0.016, 2: 0.020})
    pos = np.array([3.0, 1.0])  # 10 verify steps: E = 1.3 at gamma 1 (81 tok/s), 1.4 at gamma 2 (70 tok/s)
    pred = tune.with_plain(costs, tune.predict(costs, pos, 10, [1, 2]))
    assert pred[tune.OFF] == {"expected_tokens": 1.0, "step_s": 0.010, "tokens_per_s": pytest.approx(100.0),
                              "speedup": 1.0}
    assert tune.choose(pred) == tune.OFF
    # Where a setting pays, it beats plain: gamma 1 at E = 1.9 gives 119 tok/s.
    pred = tune.with_plain(costs, tune.predict(costs, np.array([9.0, 1.0]), 10, [1, 2]))
    assert tune.choose(pred) == 1
    # A tie goes to plain decoding (cheaper: no drafter to run).
    tie = tune.with_plain(tune.Costs(0.010, {1: 0.015}), tune.predict(tune.Costs(0.010, {1: 0.015}),
                                                                        np.array([5.0]), 10, [1]))
    assert tie[1]["tokens_per_s"] == pytest.approx(100.0) and tune.choose(tie) == tune.OFF


def test_predict_tree_matches_hand_computation_and_picks_the_best_size():
    costs = tune.Costs(0.010, {4: 0.014, 8: 0.019})
    acc = {4: tune.Acceptance(accepted=30, drafted=80, verify_steps=20),
           8: tune.Acceptance(accepted=44, drafted=160, verify_steps=20)}
    pred = tune.predict_tree(costs, acc)
    assert pred[4]["expected_tokens"] == pytest.approx(2.5)
    assert pred[4]["tokens_per_s"] == pytest.approx(2.5 / 0.014)
    assert pred[8]["tokens_per_s"] == pytest.approx(3.2 / 0.019)
    assert pred[8]["speedup"] == pytest.approx(3.2 / 0.019 * 0.010)
    assert tune.choose(pred) == 4
    acc[8] = tune.Acceptance(accepted=60, drafted=160, verify_steps=20)  # E = 4: 210 tok/s beats 179
    assert tune.choose(tune.predict_tree(costs, acc)) == 8


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.95])
@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_leviathan_closed_form_is_the_geometric_sum(alpha, gamma):
    assert tune.leviathan_expected_tokens(alpha, gamma) == pytest.approx(sum(alpha ** k for k in range(gamma + 1)))


def test_leviathan_limit_alpha_to_one():
    for gamma in (1, 4, 8):
        assert tune.leviathan_expected_tokens(1.0, gamma) == gamma + 1
        assert tune.leviathan_expected_tokens(1 - 1e-7, gamma) == pytest.approx(gamma + 1, rel=1e-5)
        assert tune.leviathan_expected_tokens(0.999, gamma) < gamma + 1


# ============================================================================================ tree sizes
def test_medusa_sizes_are_prefix_closed_prefixes_of_the_default_tree():
    found, skipped = tune.medusa_tree_choices(DEFAULT_CHOICES, [1, 4, 8, 12, 20, 32])
    n = len(DEFAULT_CHOICES)
    assert sorted(found) == [1, 4, 8, 12, n]  # 20 and 32 capped to the whole tree
    assert len(skipped) == 1 and "20, 32" in skipped[0] and str(n) in skipped[0]
    for s, choices in found.items():
        assert choices == DEFAULT_CHOICES[:s] and len(choices) == s
        assert _closed(choices)
        assert from_choices(choices)[0].num_nodes == s + 1


def test_best_first_trees_have_prefix_closed_prefixes():
    acc = np.sort(np.random.default_rng(0).uniform(0.05, 0.9, (4, 6)), axis=1)[:, ::-1]
    base = choices_from_accuracy(acc, 30)
    found, skipped = tune.medusa_tree_choices(base, range(1, 31))
    assert not skipped and sorted(found) == list(range(1, 31))
    assert all(_closed(c) for c in found.values())


def test_medusa_prefix_that_is_not_a_tree_is_skipped():
    base = ((0,), (0, 0), (1, 0), (1,))  # (1, 0) comes before its parent (1,)
    found, skipped = tune.medusa_tree_choices(base, [2, 3, 4])
    assert sorted(found) == [2, 4]
    assert len(skipped) == 1 and "tree size 3" in skipped[0]


def test_invalid_eagle_sizes_are_skipped_with_a_message():
    # top_k 3, depth 3: at most 3 + 2 * 9 = 21 candidates; size 2 is a depth-2 tree
    found, skipped = tune.eagle_tree_sizes(3, 3, [2, 8, 21, 22, 40])
    assert found == {2: (2, 2), 8: (3, 8), 21: (3, 21)}
    assert len(skipped) == 2
    assert "tree size 22" in skipped[0] and "21 candidates" in skipped[0] and "top_k" in skipped[0]
    assert "tree size 40" in skipped[1]
    # a top-1 "tree" is a chain: no size beyond its depth
    assert tune.eagle_tree_sizes(1, 4, [2, 4, 5])[0] == {2: (2, 2), 4: (4, 4)}


def test_sizes_a_lookup_branch_would_fill_are_skipped():
    spec = SpeculativeConfig(method="eagle3", model="unused", top_k=3, depth=3, total_tokens=12, lookup_tokens=4)
    settings, skipped = tune.tree_configs(None, spec, [2, 4, 5, 12, 40])
    assert sorted(settings) == [5, 12]
    for s, sc in settings.items():
        assert sc.total_tokens == s and sc.lookup_tokens == 4 and not sc.adaptive
    assert any("2, 4 skipped: lookup_tokens 4" in m for m in skipped)
    assert any("tree size 40 skipped" in m for m in skipped)
    # per-position acceptance must cover the lookup branch, which is deeper than the head's 3 levels
    assert tune._tree_depth(settings[12]) == 4
    assert tune._tree_depth(dataclasses.replace(settings[12], lookup_tokens=2)) == 3


def test_chain_method_has_no_tree_sizes():
    llm = tiny_llm(tiny_config(V), tiny_params(tiny_config(V), seed=0))
    with pytest.raises(tune.TuneError, match="chain"):
        tune.tree_configs(llm, SpeculativeConfig(method="ngram"), [4])


# ============================================================================================ tiny models
@pytest.fixture(scope="module")
def target():
    config = tiny_config(V, num_layers=LAYERS)
    return config, tiny_params(config, seed=0)


def test_medusa_tree_configs_use_the_heads_default_tree(target, tmp_path):
    from specjax.heads.medusa import MedusaConfig, init_heads
    from specjax.heads.medusa_io import save_medusa

    config, params = target
    hcfg = MedusaConfig(num_heads=3, hidden_size=config.hidden_size, vocab_size=V)
    save_medusa(str(tmp_path), hcfg, init_heads(hcfg, jax.random.PRNGKey(1), scale=0.3), dtype="float32")
    spec = SpeculativeConfig(method="medusa", model=str(tmp_path), num_speculative_tokens=3,
                             tree_choices=((0,), (0, 0)))
    settings, skipped = tune.tree_configs(tiny_llm(config, params), spec, [2, 6, 40])
    base = tuple(c for c in DEFAULT_CHOICES if len(c) <= 3)  # the default cut to the 3 heads
    assert sorted(settings) == [2, 6, len(base)]
    for s, sc in settings.items():
        assert sc.tree_choices == base[:s] and not sc.adaptive
    assert "configured tree_choices" in skipped[0] and "40" in skipped[1]


@pytest.mark.slow  # ~50 s on 2 loaded cores: compiling the speculative loop at each size dominates
def test_tune_tree_end_to_end_on_a_tiny_eagle_head(target, tmp_path):
    from specjax.heads.eagle import head_config, init_from_target
    from specjax.heads.eagle_io import save_head

    config, params = target
    hcfg = head_config(config, "eagle")
    head = init_from_target(hcfg, params, -1)
    rng = np.random.default_rng(1)  # perturbed so the head is not a pass-through copy of the target's last layer
    head = jax.tree_util.tree_map(
        lambda a: a if a.dtype.kind in "iu" else a + 0.05 * rng.standard_normal(a.shape).astype(a.dtype), head)
    save_head(str(tmp_path), hcfg, head, dtype="float32")
    spec = SpeculativeConfig(method="eagle", model=str(tmp_path), top_k=3, depth=3, total_tokens=8)
    lines = []
    result = tune.tune(tiny_llm(config, params), spec, PROMPTS, max_new_tokens=12, validate=True,
                       log=lines.append, tree_sizes=(2, 6, 40))
    text = "\n".join(lines)
    assert result["tree_sizes"] == [2, 6] and "tree size 40 skipped" in text
    assert result["chosen_tree_size"] in (0, 2, 6)  # 0: plain decoding, when no size is predicted to pay
    pred = result["prediction"]
    assert set(pred) == {0, 2, 6} and pred[0]["speedup"] == 1.0
    assert result["chosen_tree_size"] == max(pred, key=lambda s: pred[s]["tokens_per_s"])
    assert result["trees"] == {2: {"top_k": 3, "depth": 2, "total_tokens": 2},
                               6: {"top_k": 3, "depth": 3, "total_tokens": 6}}
    assert result["measured"][0] == {"tokens_per_s": result["plain_tokens_per_s"], "speedup": 1.0}
    assert result["adaptive"]["setting"] in (2, 6) and result["adaptive"]["tokens_per_s"] > 0
    fastest = max(result["measured"], key=lambda s: result["measured"][s]["tokens_per_s"])
    assert result["chosen_at_least_as_fast_as_every_setting"] == (result["chosen_tree_size"] == fastest)
    for s in (2, 6):
        a = result["acceptance"][s]
        assert 0 <= a["accepted"] <= a["drafted"] and a["verify_steps"] > 0
        assert pred[s]["expected_tokens"] == pytest.approx(1 + a["accepted"] / a["verify_steps"])
        assert result["costs"]["step_s"][s] > 0 and result["costs"]["draft_s"][s] > 0
        assert result["measured"][s]["tokens_per_s"] > 0
        m = result["measured"][s]["speedup"]
        assert result["errors"][s] == pytest.approx((pred[s]["speedup"] - m) / m)
    assert set(result) >= {"method", "skipped", "costs", "acceptance", "prediction", "chosen_tree_size",
                           "plain_tokens_per_s", "measured", "measured_fastest_tree_size", "chosen_error",
                           "chosen_within_tolerance"}
    assert result["measured_fastest_tree_size"] == fastest
    assert result["chosen_within_tolerance"] == (abs(result["chosen_error"]) <= 0.15)
    assert "<- chosen" in text and "% target" in text
    json.loads(json.dumps(result))  # what `specjax tune --json` writes


@pytest.mark.slow  # ~40 s: compiles the speculative loop at two gammas
def test_tune_chain_end_to_end_on_ngram(target):
    config, params = target
    lines = []
    # 1-token matches: the tiny random model does not continue its prompts, so 3-token keys would never match.
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1)
    result = tune.tune(tiny_llm(config, params), spec, PROMPTS, gammas=(1, 2), max_new_tokens=12, validate=True,
                       log=lines.append)
    pred, measured = result["prediction"], result["measured"]
    assert set(pred) == set(measured) == {0, 1, 2}
    assert result["chosen_gamma"] == max(sorted(pred), key=lambda g: pred[g]["tokens_per_s"])
    assert measured[0]["speedup"] == 1.0 and result["adaptive"]["setting"] in (1, 2)
    fastest = max(measured, key=lambda g: measured[g]["tokens_per_s"])
    assert result["measured_fastest_gamma"] == fastest
    assert result["chosen_at_least_as_fast_as_every_setting"] == (result["chosen_gamma"] == fastest)
    assert "with back-off on" in "\n".join(lines)
    json.loads(json.dumps(result))


def test_says_when_no_setting_beats_plain_decoding():
    said = []
    assert not tune._say_if_it_pays(0.8, said.append)
    assert "plain decoding" in said[0] and "0.80x" in said[0]
    said.clear()
    assert tune._say_if_it_pays(1.2, said.append) and said == []


# ============================================================================================ timing
@pytest.mark.parametrize("force_verify", [False, True])
def test_timed_runs_compile_nothing_after_the_warm_up(target, monkeypatch, force_verify):
    """Prompts of two length buckets: warm_up compiles both, so the timed repetitions compile nothing (a compile
    inside one setting's timed run once skewed a whole validation table). With `force_verify` (the cost runs)
    every speculative step is a verify step and the output is still plain greedy."""
    config, params = target
    llm = tiny_llm(config, params)
    prompts = [PROMPTS[0], list(range(1, 41))]  # buckets 16 and 64
    assert len({tune.prompt_bucket(llm, p) for p in prompts}) == 2
    sp = tune.SamplingParams(max_new_tokens=6)
    specs = {tune.PLAIN: None, 2: SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=False)}
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for spec in specs.values():
            tune.warm_up(llm, prompts, spec, sp, force_verify)
        assert compiles, "the warm-up should have compiled the two buckets"
        compiles.clear()
        monkeypatch.setattr(tune, "warm_up", lambda *a: None)  # time the runs alone
        runs = tune.timed_runs(llm, prompts, specs, sp, reps=2, force_verify=force_verify)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    for run in runs.values():
        assert run.tokens == sum(o.metrics.new_tokens - 1 for o in run.outputs) and run.decode_s > 0
    assert runs[tune.PLAIN].verify_steps == 0 and runs[tune.PLAIN].plain_steps == runs[tune.PLAIN].tokens
    assert runs[2].verify_steps + runs[2].plain_steps == sum(o.metrics.target_forwards - 1 for o in runs[2].outputs)
    assert [o.token_ids for o in runs[2].outputs] == [o.token_ids for o in runs[tune.PLAIN].outputs]
    if force_verify:
        assert runs[2].plain_steps == 0 and runs[2].verify_steps > 0


def test_loop_costs_time_forced_verify_steps(monkeypatch):
    """The cost runs force every step to verify; a plain step left in a run (a host-side drafter's loop) is
    charged at the plain cost: step_s = (decode time - plain steps * plain step) / verify steps."""
    runs = {tune.PLAIN: tune.Run(decode_s=1.0, tokens=100),
            2: tune.Run(decode_s=2.0, tokens=80, verify_steps=30, plain_steps=10)}
    forced = []

    def fake_runs(llm, prompts, specs, sp, reps, force_verify=False):
        forced.append(force_verify)
        return {k: runs[k] for k in specs}

    monkeypatch.setattr(tune, "timed_runs", fake_runs)
    settings = {2: SpeculativeConfig(method="ngram", num_speculative_tokens=2)}
    costs = tune.measure_loop_costs(None, settings, [], None)
    assert forced == [True]
    assert costs.plain_s == pytest.approx(0.01)
    assert costs.step_s[2] == pytest.approx((2.0 - 10 * 0.01) / 30)
    runs[2] = tune.Run(decode_s=1.0, tokens=100, plain_steps=100)
    with pytest.raises(tune.TuneError, match="verified no step"):
        tune.measure_loop_costs(None, settings, [], None)


def test_cost_prompts_are_the_ones_with_most_verify_steps():
    acc = tune.Acceptance(per_prompt_verify_steps=[3, 0, 9, 5])
    assert tune.cost_prompts(["a", "b", "c", "d"], acc, 2) == ["c", "d"]


def test_tune_p_min_sweeps_candidates_on_one_draft_build(tmp_path):
    """p_min candidates share one drafter build and one compiled loop (p_min is traced); every candidate gets a
    measured acceptance, a timed step and a prediction, and the chosen one is among them."""
    from spec_helpers import save_hf_llama
    from specjax import spec_engine

    tc = tiny_config(64)
    tp = tiny_params(tc, seed=0)
    dc = tiny_config(64, num_layers=1)
    dp = tiny_params(dc, seed=1)
    dp["embed"], dp["lm_head"] = tp["embed"], tp["lm_head"]
    path = save_hf_llama(str(tmp_path / "draft"), dc, dp)
    llm = tiny_llm(tc, tp)
    llm.encode_prompt = lambda p, chat=True: list(p)
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    r = tune.tune_p_min(llm, SpeculativeConfig(method="draft_model", model=path), 3, [[7, 3, 9, 12, 40]],
                        [0.0, 0.3], sp, log=lambda *a: None, reps=1, num_cost_prompts=1)
    loops = spec_engine.spec_loop._cache_size()
    assert r["chosen_p_min"] in (0.0, 0.3) and sorted(r["prediction"]) == [0.0, 0.3]
    assert set(r["costs"]["step_s"]) == {0.0, 0.3} and all(t > 0 for t in r["costs"]["step_s"].values())
    assert r["acceptance"][0.3]["drafted"] <= r["acceptance"][0.0]["drafted"]
    tune.tune_p_min(llm, SpeculativeConfig(method="draft_model", model=path), 3, [[7, 3, 9, 12, 40]], [0.6], sp,
                    log=lambda *a: None, reps=1, num_cost_prompts=1)
    assert spec_engine.spec_loop._cache_size() == loops, "a new p_min compiled another loop"
