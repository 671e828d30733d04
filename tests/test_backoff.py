"""The back-off rule's break-even, measured on the hardware, and what it must not cost.

* `backoff.calibrate` turns timed speculative and plain steps into the break-even gain (ratio - 1); its
  speculative chunks force every step to verify (a lookup miss too), and a loop that leaves plain steps in the
  chunk has them taken out of the verify cost;
* through `LLM.generate`, the calibration runs the one compiled speculative loop (the break-even is traced),
  is cached per (config, batch bucket), and the output still equals plain greedy output;
* a repeat generation in the same bucket, with other sampling values, compiles nothing.
"""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from spec_helpers import tiny_config, tiny_llm, tiny_params
from specjax import spec_engine
from specjax.backoff import Adaptive, backoff_decide, backoff_update
from specjax import backoff
from specjax.runners import speculative
from specjax.config import SamplingParams, SpeculativeConfig
from specjax.drafters.draft_model import DraftModelDrafter

V = 96


class FakeLoop:
    """Stands in for the jitted loop: each step is a verify (cost `verify`) unless it is forced plain or falls
    in `misses` (a lookup miss, decoded plainly at cost `plain`, unless the call forces verification and the
    loop `can_force`); the clock advances by the cost."""

    def __init__(self, verify: float, plain: float, misses: set[int], length: int = 10 ** 6,
                 can_force: bool = False):
        self.now, self.step = 0.0, 0
        self.verify, self.plain, self.misses, self.length = verify, plain, misses, length
        self.can_force = can_force
        self.calls, self.forced = [], []

    def clock(self) -> float:
        return self.now

    def __call__(self, state, steps: int, min_gain: float, force_verify: bool = False):
        self.calls.append((steps, min_gain))
        self.forced.append(force_verify)
        counts = np.asarray(state.counts).copy()
        for _ in range(steps):
            if self.step >= self.length:
                break
            spec = min_gain < 0 and (self.step not in self.misses or (force_verify and self.can_force))
            self.now += self.verify if spec else self.plain
            counts += np.array([1, int(spec)])
            self.step += 1
        return types.SimpleNamespace(counts=jnp.asarray(counts))


def start():
    return types.SimpleNamespace(counts=jnp.zeros((1, 2), jnp.int32))  # [B, 2]


def test_calibrate_gives_ratio_minus_one():
    loop = FakeLoop(verify=0.09, plain=0.03, misses={2, 4})  # two misses inside the timed speculative chunk
    _, floor = backoff.calibrate(loop, start(), steps=6, rounds=1, clock=loop.clock)
    assert floor == pytest.approx(2.0)  # a verify costs 3 plain steps: 2 accepted tokens to break even
    # warm-up (compile) step, forced speculative chunk, forced plain chunk
    assert [s for s, _ in loop.calls] == [1, 6, 6]
    assert loop.calls[1][1] < 0 < loop.calls[2][1]


def test_calibrate_keeps_the_fastest_round_of_each_kind():
    """A chunk slowed by something else running (the first speculative one, twice as slow) does not move the
    break-even."""
    loop = FakeLoop(verify=0.09, plain=0.03, misses={2, 4})
    real_call = loop.__call__
    calls = iter(range(100))

    def disturbed(state, steps, min_gain, force_verify=False):
        slow = next(calls) == 1  # the first timed speculative chunk
        loop.verify, loop.plain = (0.18, 0.06) if slow else (0.09, 0.03)
        return real_call(state, steps, min_gain, force_verify)

    _, floor = backoff.calibrate(disturbed, start(), steps=6, rounds=2, clock=loop.clock)
    assert floor == pytest.approx(2.0)
    assert [s for s, _ in loop.calls] == [1, 6, 6, 6, 6]


def test_calibrate_forces_verification_in_its_speculative_chunks():
    """Lookup misses inside the speculative chunk verify too (the loop is told to force them), so a chunk where
    the drafter found almost nothing still times six verify steps; the plain chunks are not forced."""
    misses = {1, 2, 3, 4, 5}
    loop = FakeLoop(verify=0.09, plain=0.03, misses=misses, can_force=True)
    _, floor = backoff.calibrate(loop, start(), steps=6, rounds=1, clock=loop.clock)
    assert floor == pytest.approx(2.0)
    assert loop.forced == [True, True, False]
    # The same misses in a loop that cannot force leave one verify step in the chunk: no estimate.
    loop = FakeLoop(verify=0.09, plain=0.03, misses=misses)
    _, floor = backoff.calibrate(loop, start(), steps=6, rounds=1, clock=loop.clock)
    assert floor is None


def test_calibrate_clamps_cheap_verification_at_zero():
    loop = FakeLoop(verify=0.02, plain=0.03, misses=set())
    _, floor = backoff.calibrate(loop, start(), steps=4, clock=loop.clock)
    assert floor == 0.0


def test_calibrate_ignores_rounds_with_few_verify_steps():
    """A speculative chunk with one or two verify steps among six times mostly noise: such a round gives no
    estimate; a later round whose chunk verified enough does, and with none the result is None (the default
    break-even stands)."""
    few = {1, 2, 3, 4}  # the first timed speculative chunk (steps 1-6) verifies only steps 5 and 6
    loop = FakeLoop(verify=0.09, plain=0.03, misses=few)
    _, floor = backoff.calibrate(loop, start(), steps=6, rounds=1, clock=loop.clock)
    assert floor is None
    loop = FakeLoop(verify=0.09, plain=0.03, misses=few)
    _, floor = backoff.calibrate(loop, start(), steps=6, rounds=2, clock=loop.clock)
    assert floor == pytest.approx(2.0)  # from the second round, where all six steps verified
    loop = FakeLoop(verify=0.09, plain=0.03, misses=few)
    _, floor = backoff.calibrate(loop, start(), steps=6, rounds=1, clock=loop.clock, min_verify=2)
    assert floor == pytest.approx(2.0)


def test_calibrate_gives_up_when_the_generation_ends():
    loop = FakeLoop(verify=0.09, plain=0.03, misses=set(), length=5)  # finished inside the speculative chunk
    _, floor = backoff.calibrate(loop, start(), steps=6, clock=loop.clock)
    assert floor is None
    loop = FakeLoop(verify=0.09, plain=0.03, misses=set(range(100)))  # never had anything to verify
    _, floor = backoff.calibrate(loop, start(), steps=6, clock=loop.clock)
    assert floor is None


def test_generate_calibrates_once_in_one_compiled_loop():
    config = tiny_config(V)
    llm = tiny_llm(config, tiny_params(config, seed=3))
    rng = np.random.default_rng(0)
    # Repetitive prompts, so the n-gram drafter has matches to verify during calibration.
    motif = rng.integers(1, V, 6).tolist()
    prompts = [motif * 4 + [1, 2], motif * 3 + [5]]
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = llm.generate(prompts, greedy)
    # 1-token matches, so that the calibration's first steps have drafts to verify whatever the model emits.
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    before = spec_engine.spec_loop._cache_size()
    out = llm.generate(prompts, greedy, speculative_config=spec)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert spec_engine.spec_loop._cache_size() == before + 1, "calibration compiled more than the one loop"
    floors = dict(llm.runtime.break_even)
    assert len(floors) == 1 and list(floors.values())[0] >= 0.0
    assert sum(o.metrics.verify_steps for o in out) > 0
    # The next generation of this config starts from this one's mean accepted tokens per verify step.
    prior = llm.runtime.gain_priors[(spec, 2)]
    assert prior == pytest.approx(sum(o.metrics.accepted for o in out) / sum(o.metrics.verify_steps for o in out))
    # Same bucket, other prompt lengths and sampling values: the cached break-even, nothing compiled.
    again = llm.generate([prompts[1], prompts[0][:-3]], [SamplingParams(max_new_tokens=30, temperature=0.8, seed=4,
                                                                          ignore_eos=True), greedy],
                         speculative_config=spec)
    assert len(again[0].token_ids) == 30 and len(again[1].token_ids) == 40
    assert spec_engine.spec_loop._cache_size() == before + 1
    assert dict(llm.runtime.break_even) == floors


def test_each_call_starts_probing_at_probe_every():
    """Calls a drafter cannot help back it off and grow their probe gap; a later call must still probe after
    `probe_every` plain steps (acceptance belongs to the prompt). With a gap carried over between calls it grew
    past the whole generation and the later call never verified."""
    config = tiny_config(V)
    rng = np.random.default_rng(2)
    motif = rng.integers(1, V, 5).tolist()
    prompt = [motif * 5]
    # 1-token matches: the tiny random model does not continue the motif, so longer keys would never match.
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    llm = tiny_llm(config, tiny_params(config, seed=3))
    llm.runtime.break_even[(spec, 1)] = 50.0  # skip calibration: speculation never pays
    long = SamplingParams(max_new_tokens=100, ignore_eos=True)
    for _ in range(3):
        assert llm.generate(prompt, long, speculative_config=spec)[0].metrics.verify_steps >= 1
    rule = backoff.adaptive_rule(*speculative.drafter_for(llm, spec)[:1], spec)
    short = SamplingParams(max_new_tokens=rule.probe_every + 8, ignore_eos=True)
    assert llm.generate(prompt, short, speculative_config=spec)[0].metrics.verify_steps >= 1


def test_probe_gap_doubles_after_failed_probes_and_resets_on_success():
    """One row, break-even 1.0: it backs off, probes after 4 idle steps, then 8, 16, 16 (the cap) while its
    probes fail; a successful probe brings it back to speculating with the gap reset. Device and host share
    these two functions."""
    rule = Adaptive(min_gain=1.0, probe_every=4, max_gap_factor=4)
    floor = 1.0
    gain, idle, gap = np.array([np.inf]), np.array([0]), np.array([0])
    running = np.array([True])
    probes, log = [], []
    for step in range(80):
        g, gap, want, batch = backoff_decide(rule, floor, gain, idle, gap, running, xp=np)
        if not (batch and want[0]):
            idle = idle + 1  # a plain step
            continue
        probes.append(step)
        got = np.array([3.0 if step >= 60 else 0.0])  # the drafter starts to help at step 60
        gain, idle, gap = backoff_update(rule, floor, gain, g, idle, gap, np.array([True]), got, xp=np)
        log.append(int(gap[0]))
    # steps 0, 1: the optimistic seed (2.0) decays below 1.0 after two empty verifies, then gaps 4, 8, 16, 16
    assert probes[:6] == [0, 1, 6, 15, 32, 49], probes
    assert log[:6] == [4, 4, 8, 16, 16, 16]
    # first probe at or after step 60 succeeds (gain 0.7 * g + 0.9 >= 1.0): gap back to 4, speculating on
    after = [p for p in probes if p >= 60]
    assert after == list(range(after[0], 80)) and log[-1] == 4


def test_batch_backs_off_only_when_the_mean_gain_is_low():
    rule = Adaptive(min_gain=1.0, probe_every=4)
    idle, gap = np.zeros(4, int), np.zeros(4, int)
    running = np.array([True, True, True, False])
    _, _, want, batch = backoff_decide(rule, 1.0, np.array([3.0, 0.1, 0.1, 9.0]), idle, gap, running,
                                                   xp=np)
    assert list(want) == [True, False, False, True] and batch  # (3 + 0 + 0) / 3 running rows >= 1
    _, _, _, batch = backoff_decide(rule, 1.0, np.array([2.0, 0.1, 0.1, 9.0]), idle, gap, running,
                                                xp=np)
    assert not batch  # 2 / 3 < 1: the finished row's high gain does not count
    _, _, _, batch = backoff_decide(rule, 1.0, np.array([2.0, 0.1, 0.1, 9.0]), np.array([0, 0, 16, 0]),
                                                gap, running, xp=np)
    assert batch  # a row idle for four gaps forces a probe of the batch


def test_batch_of_rarely_hitting_rows_backs_off():
    """Four rows that each propose on one step in four (an n-gram that rarely matches) and get 2 tokens when they
    do: some row proposes at every step, so the batch pays a verify forward every step for a mean of 0.5 accepted
    tokens per row, below the break-even of 1. Counting a row's misses in the steps it rode along in as 0 makes
    the batch back off; counting hits only (gain 2) would keep it verifying at a loss forever."""
    rule = Adaptive(min_gain=1.0, probe_every=4, max_gap_factor=8)
    B, floor = 4, 1.0
    gain, idle, gap = np.full(B, np.inf), np.zeros(B, int), np.zeros(B, int)
    running = np.ones(B, bool)
    verified = []
    for step in range(200):
        g, gap, want, batch = backoff_decide(rule, floor, gain, idle, gap, running, xp=np)
        hits = (np.arange(B) + step) % 4 == 0
        if not (batch and np.any(hits & want)):
            idle = idle + 1
            verified.append(False)
            continue
        got = np.where(hits & want, 2.0, 0.0)
        gain, idle, gap = backoff_update(rule, floor, gain, g, idle, gap, want & running, got, xp=np)
        verified.append(True)
    assert sum(verified[100:]) <= 20, sum(verified[100:])  # a few probes, not a verify every step
    assert np.all(gain < floor)


def test_lookups_start_each_call_optimistic_whatever_the_last_call_gained():
    """A lookup's acceptance belongs to the prompt: a call after one that gained nothing (gain prior 0) must
    still speculate from its first steps, long before a probe would come. Model drafters keep the prior."""
    config = tiny_config(V)
    rng = np.random.default_rng(5)
    motif = rng.integers(1, V, 5).tolist()
    prompt = [motif * 5]
    # 1-token matches: the tiny random model does not continue the motif, so longer keys would never match.
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    llm = tiny_llm(config, tiny_params(config, seed=3))
    rule = backoff.adaptive_rule(*speculative.drafter_for(llm, spec)[:1], spec)
    assert not rule.carry_prior
    llm.runtime.break_even[(spec, 1)] = 0.5  # skip calibration
    llm.runtime.gain_priors[(spec, 1)] = 0.0  # the last call accepted nothing
    short = SamplingParams(max_new_tokens=rule.probe_every // 2, ignore_eos=True)
    assert llm.generate(prompt, short, speculative_config=spec)[0].metrics.verify_steps >= 1
    draft = SpeculativeConfig(method="draft_model", model="unused", num_speculative_tokens=3)
    model_rule = backoff.adaptive_rule(DraftModelDrafter(tiny_config(V, num_layers=1), 3), draft)
    assert model_rule.carry_prior


def test_force_verify_verifies_every_step_and_keeps_greedy_output():
    """`force_verify` (the tuner's timing, back-off off): an n-gram generation whose lookups mostly miss still
    verifies at every step, and emits the plain greedy tokens. Without it the misses are plain steps."""
    config = tiny_config(V)
    llm = tiny_llm(config, tiny_params(config, seed=5))
    rng = np.random.default_rng(1)
    prompts = [rng.permutation(V)[:20].tolist(), rng.permutation(V)[:13].tolist()]  # no repeated token
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = llm.generate(prompts, greedy)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, adaptive=False)
    params = [greedy] * len(prompts)
    normal = speculative.generate(llm, prompts, prompts, params, spec)
    forced = speculative.generate(llm, prompts, prompts, params, spec, force_verify=True)
    for p, n, f in zip(plain, normal, forced):
        assert f.token_ids == p.token_ids == n.token_ids
        # every decode step after the prefill's token is a verify step
        assert f.metrics.verify_steps == f.metrics.target_forwards - 1
        assert n.metrics.verify_steps < n.metrics.target_forwards - 1
