"""The back-off rule, whole: when a sequence stops speculating, when it probes again, and the break-even it is
measured against.

`Adaptive` holds the rule's constants; `backoff_decide` / `backoff_update` are its pure per-step decision
(jax.numpy inside `spec_engine`'s device loop, NumPy in the host loop); `adaptive_rule` picks the constants
for a drafter; `calibrate` measures the break-even on this hardware from a generation's own first steps;
`mean_gain` is what one generation passes to the next as its starting gain.
"""
from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

NO_LIMIT = 2 ** 30
CALIBRATION_STEPS = 6  # steps timed per kind (speculative, plain) on the first generation of a config
CALIBRATION_MIN_VERIFY = 3  # verify steps a speculative chunk needs before its timing says anything


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Per-sequence back-off, so that speculation is never much slower than plain decoding.

    Each sequence keeps a running mean of accepted tokens per verify step (`gain`; the host seeds it with the
    previous generation's mean for the same config, or it starts optimistic at `min_gain + 1`). A speculative
    step yields 1 + gain tokens for the cost of `ratio` plain steps, so it pays while gain >= ratio - 1: that break-even is `min_gain`. Below it the
    sequence stops speculating (its proposals are masked out, which is lossless: a root-only tree is a plain
    step) and decodes plainly; after a gap of plain steps it probes again. The gap starts at `probe_every`,
    doubles after every failed probe up to `probe_every * max_gap_factor`, and resets when a probe succeeds,
    so a sequence the drafter cannot help pays for few probes. When no sequence of the batch speculates, the
    step is a plain one-token decode (where the compile policy allows `lax.cond`).

    `min_gain` here is the default; `spec_loop` takes a traced `min_gain` that overrides it, so that a
    break-even measured on this hardware (`calibrate`) changes no compiled program.
    """

    min_gain: float = 0.3
    probe_every: int = 16
    decay: float = 0.7
    max_gap_factor: int = 8
    # Seed a request's gain with the previous request's mean (same config and batch bucket; host side, see
    # `mean_gain`). Off for lookups: their acceptance belongs to the prompt, not to the drafter,
    # and a prior from a prompt with nothing to copy kept the next prompt backed off where copying paid.
    carry_prior: bool = True


def backoff_decide(adaptive: Adaptive, floor, gain, idle, gap, running, xp=jnp):
    """The back-off decision before a step (pure; `xp` is jax.numpy on device, numpy in the host loop).

    floor [] break-even gain; gain [B] (inf = no verify yet), idle [B], gap [B] (0 = `probe_every`),
    running [B] bool. Returns (seeded gain [B], gap [B], want [B] bool: the row speculates if the batch does,
    batch [] bool: the batch speculates). The verify forward costs the same for every row (fixed shapes), so
    the batch speculates when the mean gain over running rows (non-wanting rows as 0) reaches the
    break-even, or when some row has been idle for four gaps (so a batch that backed off can find acceptance
    again)."""
    g = xp.where(xp.isinf(gain), floor + 1, gain)
    gap = xp.where(gap == 0, adaptive.probe_every, gap)
    want = (g >= floor) | (idle >= gap)
    n_run = xp.maximum(xp.sum(running), 1)
    batch_gain = xp.sum(xp.where(want & running, xp.maximum(g, floor), 0.0)) / n_run
    batch = (batch_gain >= floor) | xp.any(running & (idle >= 4 * gap))
    return g, gap, want, batch


def backoff_update(adaptive: Adaptive, floor, gain, g, idle, gap, took, got, xp=jnp):
    """The back-off state after a verify step (pure). gain [B] as stored, g/gap [B] from `backoff_decide`,
    took [B] bool: the row took part in the verify (running and wanting to speculate), got [B] accepted tokens.

    A row that took part but had nothing to propose (an n-gram miss) counts as 0 accepted: in a batch the verify
    forward is paid whenever any row proposes, so a row's gain must be its mean over the verify steps it rode
    along in, not over its hits only (which kept a batch of rarely-hitting rows speculating below plain speed). At batch 1
    a step where the only row has nothing to propose is a plain step, so there the two means coincide.
    Returns (gain, idle, gap)."""
    new = adaptive.decay * g + (1 - adaptive.decay) * got
    failed_probe = took & (g < floor) & (new < floor)
    limit = adaptive.probe_every * adaptive.max_gap_factor
    gap = xp.where(failed_probe, xp.minimum(2 * gap, limit),
                   xp.where(took & (new >= floor), adaptive.probe_every, gap))
    return xp.where(took, new, gain), xp.where(took, 0, idle + 1), gap


def adaptive_rule(drafter, spec):
    """The back-off rule for a drafter: below `min_gain` accepted tokens per verify step, speculation costs more
    than it yields on this hardware. A draft model pays for its own forwards, so it needs more acceptance than a
    free lookup. None when the config turns adaptation off."""
    if not spec.adaptive:
        return None
    # Defaults where calibration has not measured this hardware yet, from this project's CPU runs: with the CPU
    # kernels a verify step of gamma + 1 = 5 tokens costs about one plain step inside the loop at batch 1 (the
    # figures: reports/spec_bench_cpu/ngram_gamma/README.md), so a lookup pays from a small fraction of an accepted
    # token per step (0.25 leaves a margin); a draft model also pays gamma draft forwards.
    if drafter.capabilities.runs_draft_model:
        return Adaptive(min_gain=0.9)
    if drafter.features:
        # Head drafters (Medusa, EAGLE) verify trees of 8-33 nodes and run a head per level: a step costs several
        # plain steps on this CPU, so they need more accepted tokens, and probe rarely once they backed off.
        return Adaptive(min_gain=max(0.9, 0.1 * drafter.tree.num_nodes), probe_every=64)
    # Lookups (n-gram, suffix): each request starts optimistic, with no gain carried over from the last one.
    return Adaptive(min_gain=0.25, carry_prior=False)


def mean_gain(stats) -> float | None:
    """Mean accepted tokens per verify step of a generation (SpecStats), None when it verified nothing: the
    starting gain of the next generation with the same config and batch bucket. A drafter that did not pay
    starts backed off (and probes) instead of paying for its first verify steps again; one that paid starts
    speculating.

    The probe gap is not kept: each request starts probing at `probe_every`. Acceptance is a property of the
    prompt (an n-gram lookup pays on extraction and nowhere else), and a gap carried over from requests the
    drafter could not help grew past the length of a whole generation, so a request it could help never
    probed (Spec-Bench, 2026-11-30: no method verified a single step on 13 prompts)."""
    verify = int(np.sum(np.asarray(stats.verify_steps)))
    if not verify:
        return None
    return float(np.sum(np.asarray(stats.accepted))) / verify


def calibrate(run, state, steps: int = CALIBRATION_STEPS, rounds: int = 2, clock=time.perf_counter,
              min_verify: int = CALIBRATION_MIN_VERIFY):
    """Measure the back-off break-even on this hardware from the generation's own first steps (they emit real
    tokens: both kinds of step are lossless). One warm-up step compiles; then `rounds` times, `steps`
    forced-speculative and `steps` forced-plain steps are timed, and each kind keeps its fastest round (the
    least disturbed by anything else running). A speculative step costs `ratio` plain steps and yields
    1 + gain tokens, so speculation pays while gain >= ratio - 1. Returns (state, break-even gain, or None when
    the generation ended, or no round's speculative chunk verified at least `min_verify` steps: then the
    rule's default stands and the next generation calibrates again).

    The speculative chunks run with `force_verify`: a lookup miss verifies the root alone, at a verify step's
    cost, so every step of the chunk is a verify step. Without it a miss was a plain step charged at the plain
    chunk's step cost, and with one verify step among six the estimate was mostly the two chunks' timing noise:
    two processes on the same n-gram config calibrated 0.0 and 0.41 that way. A loop that cannot force (any
    non-verify step left in the chunk) is still handled by that subtraction and by `min_verify`.

    run(state, steps, min_gain, force_verify) -> state runs the jitted loop (`min_gain` and `force_verify` are
    traced: nothing recompiles); clock() -> seconds.
    """
    force_spec, force_plain = -1e9, 1e9
    state = run(state, 1, force_spec, True)

    def timed(state, k, g):
        c0 = np.asarray(state.counts).max(axis=0)
        t = clock()
        state = run(state, k, g, g == force_spec)
        c1 = np.asarray(state.counts).max(axis=0)  # waits for the loop
        return state, clock() - t, c1 - c0

    per_plain, per_verify = [], []
    for _ in range(rounds):
        state, t_spec, c_spec = timed(state, steps, force_spec)
        state, t_plain, c_plain = timed(state, steps, force_plain)
        if c_plain[0] == 0 or c_spec[1] == 0:
            break
        plain = t_plain / c_plain[0]
        per_plain.append(plain)
        if c_spec[1] >= min_verify:
            per_verify.append((t_spec - (c_spec[0] - c_spec[1]) * plain) / c_spec[1])
    if not per_verify:
        return state, None
    return state, max(0.0, min(per_verify) / min(per_plain) - 1.0)
