"""The tuner: pick the speculation length (chain drafters) or the draft tree size (tree drafters) that maximises
predicted tokens/s on this hardware, by measuring acceptance and step costs and feeding them to the cost model
(`specjax.tools.cost_model`, where the formulas are); then, to check the model, measure every candidate.

Chain drafters (ngram, draft_model, suffix): acceptance is measured once, at the largest gamma (a chain cut to a
shorter gamma accepts the same first tokens); the i.i.d. closed form of Leviathan et al. is printed next to the
measured E[tokens] in the validation table.

Costs are timed inside the real generation loop, not in micro-benchmarks: a short generation at each setting (two
prompts, speculation forced on, every step verifying even on a lookup miss) gives the seconds of one speculative
step, draft and verify and acceptance together, and a plain generation the seconds of one plain step. A forward
timed alone at a fixed context was noisy and costlier than the same forward inside the compiled loop
(reports/tune_cpu). Every timed generation runs after a warm-up that compiled every prompt bucket it meets, and
each prompt keeps its fastest of `reps` runs.

Tree drafters (medusa, eagle, eagle3): a size s is s drafted nodes (root excluded). Which path wins depends on
every branch kept, and an EAGLE tree re-ranks its candidates with the budget, so acceptance cannot be read off one
run by truncation: it is measured at every size. For eagle/eagle3 size s is total_tokens = s with depth
min(depth, s); for medusa it is the first s paths of the heads' default tree, which is ordered best-first, so
every prefix is a valid tree.

Plain decoding is a candidate too (setting OFF = 0, speedup 1 by definition): where nothing is predicted to pay,
the tuner recommends no speculation, and its validation measures every setting against that choice.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from specjax.config import SamplingParams, SpeculativeConfig
from specjax.errors import SpecjaxError
from specjax.tools.cost_model import (
    OFF,
    Acceptance,
    Costs,
    best_speculative,
    choose,
    leviathan_expected_tokens,
    predict,
    predict_tree,
    with_plain,
)

TREE_METHODS = ("medusa", "eagle", "eagle3")
DEFAULT_GAMMAS = (1, 2, 4, 6, 8)
DEFAULT_TREE_SIZES = (4, 8, 12, 20, 32)
DEFAULT_P_MINS = (0.0, 0.3, 0.5, 0.7, 0.9)  # draft_model: candidate p_min at the chosen gamma (0 = off)
TOLERANCE = 0.15  # |predicted - measured| / measured speedup the cost model should stay within


class TuneError(SpecjaxError, ValueError):
    """The tuner cannot run with these settings; the message says which and how to fix them."""


def _best_time(f, *args, reps: int = 5) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def prompt_bucket(llm, prompt) -> int:
    """The prompt-length bucket a chat prompt compiles for (`make_buckets` rounds to a power of two)."""
    from specjax.buckets import make_buckets

    return make_buckets(1, len(llm.encode_prompt(prompt, True)), 1).prompt_len


def warm_up(llm, prompts: list, spec: SpeculativeConfig | None, sp: SamplingParams,
            force_verify: bool = False) -> None:
    """Generate one prompt of every prompt bucket among `prompts`, so that timed runs compile nothing (a compile
    inside a timed run once made one setting look much faster than the rest: it alone had been warmed on all)."""
    seen = {}
    for p in prompts:
        seen.setdefault(prompt_bucket(llm, p), p)
    for p in seen.values():
        _as_first_request(llm, p, sp, spec, force_verify)


@dataclasses.dataclass
class Run:
    """One setting's generations at batch 1, each prompt's fastest of the repetitions (compile excluded)."""

    decode_s: float = 0.0  # wall time after the first token (prefill is the same for every method)
    tokens: int = 0  # tokens emitted after the first
    verify_steps: int = 0
    plain_steps: int = 0  # steps that decoded one token without a verify (nothing proposed)
    outputs: list = dataclasses.field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


def _as_first_request(llm, prompt, sp: SamplingParams, spec: SpeculativeConfig | None,
                      force_verify: bool = False):
    """Generate `prompt` as a first request: no suffix index of earlier outputs, no back-off gain prior
    (`speculative.learned_state`; the measured break-even stays). Tuning generates the same prompts many times, for
    several settings of one drafter: a later generation would otherwise find the prompt's answer in the suffix
    index and its acceptance in the prior. The caller puts the LLM's own learned state back afterwards.
    force_verify: every step of a speculative generation verifies (`speculative.generate`)."""
    from specjax.runners import speculative
    from specjax.runners.speculative import restore_learned

    restore_learned(llm, {})
    if spec is None or not force_verify:
        return llm.generate([prompt], sp, spec, chat=True)[0]
    spec = SpeculativeConfig.from_user(spec)
    return speculative.generate(llm, [prompt], [llm.encode_prompt(prompt, True)], [sp], spec, force_verify=True)[0]


def timed_runs(llm, prompts: list, specs: dict, sp: SamplingParams, reps: int = 2,
               force_verify: bool = False) -> dict:
    """{key: Run} for every {key: spec or None (plain)}: warm up each, then `reps` rounds, each generating every
    prompt with every setting in turn, keeping each (setting, prompt)'s fastest decode. The rounds interleave the
    settings, so a slow spell of the machine hits them all instead of one setting's whole run. Every generation
    starts as a first request (`_as_first_request`). force_verify: every speculative step verifies, also on a
    lookup miss (for timing verify steps; the warm-up compiles that loop)."""
    from specjax.runners.speculative import learned_state, restore_learned

    saved = learned_state(llm)
    for spec in specs.values():
        warm_up(llm, prompts, spec, sp, force_verify)
    best: dict = {}
    for _ in range(max(reps, 1)):
        for key, spec in specs.items():
            for i, p in enumerate(prompts):
                o = _as_first_request(llm, p, sp, spec, force_verify)
                t = o.metrics.total_time - o.metrics.time_to_first_token
                if (key, i) not in best or t < best[key, i][0]:
                    best[key, i] = (t, o)
    restore_learned(llm, saved)
    runs = {}
    for key in specs:
        run = Run()
        for i in range(len(prompts)):
            t, o = best[key, i]
            m = o.metrics
            forwards = m.new_tokens if m.target_forwards is None else m.target_forwards  # plain: prefill + 1/token
            run.decode_s += t
            run.tokens += m.new_tokens - 1
            run.verify_steps += m.verify_steps or 0
            run.plain_steps += forwards - 1 - (m.verify_steps or 0)
            run.outputs.append(o)
        runs[key] = run
    return runs


PLAIN = "plain"  # key of the plain baseline in `timed_runs`
ADAPTIVE = "adaptive"  # key of the best speculative setting with back-off on, in the validation runs


def measure_loop_costs(llm, settings: dict[int, SpeculativeConfig], prompts: list, sp: SamplingParams,
                       reps: int = 2) -> Costs:
    """Seconds of one plain step and of one speculative step of every setting, timed inside the generation loop on
    `prompts`, back-off off and every step verifying (`force_verify`: a lookup miss verifies the root alone, at a
    verify step's cost). So a setting's time divides by its steps, all of them verify steps. Before, a lookup's
    misses were plain steps charged at the plain run's step cost and the rest put on its few verify steps, whose
    cost then carried the timing noise of the whole run (n-gram gamma 4: 1.46 plain steps, against 0.96-1.20
    with every step verifying, reports/spec_bench_cpu/ngram_gamma). A loop that leaves plain steps anyway (a
    host-side drafter's) still has them charged at the plain step's cost."""
    runs = timed_runs(llm, prompts, {PLAIN: None} | {k: dataclasses.replace(s, adaptive=False)
                                                    for k, s in settings.items()}, sp, reps, force_verify=True)
    plain_s = runs[PLAIN].decode_s / max(runs[PLAIN].tokens, 1)
    step_s = {}
    for k in settings:
        r = runs[k]
        if r.verify_steps == 0:
            raise TuneError(f"setting {k} verified no step on the cost prompts (each stopped at its first token?), "
                            "so its step cost cannot be timed; pass longer generations (-n) or more prompts")
        step_s[k] = max(r.decode_s - r.plain_steps * plain_s, 0.0) / r.verify_steps
    return Costs(plain_s, step_s)


def measure_draft_cost(llm, spec: SpeculativeConfig, prompt: list[int]) -> float:
    """Seconds of one propose of the drafter `spec` builds (any drafter, chain or tree) after prefilling `prompt`;
    0 for host-side drafters, whose proposals are timed by the generation itself."""
    from specjax import spec_engine
    from specjax.buckets import make_buckets
    from specjax.requests import pad_prompts
    from specjax.runners.speculative import drafter_for

    drafter, dparams = drafter_for(llm, spec)
    if drafter.capabilities.host_side:
        return 0.0
    b = make_buckets(1, len(prompt), 64, extra_slots=drafter.tree.num_nodes)
    toks, lens, act = pad_prompts([prompt], b.batch, b.prompt_len)
    sampling = llm.sampling_arrays([SamplingParams(max_new_tokens=64)], b.batch, b.num_stop)
    st = spec_engine.spec_prefill(llm.params, llm.config, dparams, drafter, b, toks, lens, act, sampling)
    return _best_time(lambda: spec_engine.propose_jit(dparams, drafter, st, sampling))


def measure_draft_costs(llm, spec: SpeculativeConfig, gammas: Sequence[int], prompt: list[int]) -> dict[int, float]:
    """Seconds of one propose of each gamma (0 for host-side or free drafters is measured too)."""
    return {g: measure_draft_cost(llm, dataclasses.replace(spec, num_speculative_tokens=g), prompt) for g in gammas}


def measure_acceptance(llm, spec: SpeculativeConfig, prompts: list, sp: SamplingParams, width: int) -> Acceptance:
    """Acceptance counts of `spec` over the prompts at batch 1; per-position counts cut/padded to `width`."""
    from specjax.runners.speculative import learned_state, restore_learned

    saved = learned_state(llm)
    acc = Acceptance(per_position_accepted=[0] * width)
    for p in prompts:
        m = _as_first_request(llm, p, sp, spec).metrics
        pos = list(m.per_position_accepted)[:width]
        acc.per_position_accepted = [a + b for a, b in zip(acc.per_position_accepted, pos + [0] * (width - len(pos)))]
        acc.verify_steps += m.verify_steps
        acc.plain_steps += m.target_forwards - 1 - m.verify_steps
        acc.accepted += m.accepted
        acc.drafted += m.drafted
        acc.per_prompt_verify_steps.append(m.verify_steps)
    restore_learned(llm, saved)
    return acc


# ============================================================================================ tree sizes
def eagle_tree_sizes(top_k: int, depth: int, sizes: Sequence[int]) -> tuple[dict[int, tuple[int, int]], list[str]]:
    """({size: (depth, total_tokens)}, skip messages) for an EAGLE tree of `top_k` and at most `depth` levels.

    Size s drafts s nodes at depth min(depth, s); the expansion yields top_k + (d - 1) * top_k^2 candidates, so
    larger sizes cannot be filled and are skipped."""
    valid, skipped = {}, []
    for s in sorted(set(sizes)):
        d = min(depth, s)
        most = top_k + (d - 1) * top_k ** 2
        if s < 1:
            skipped.append(f"tree size {s} skipped: a tree drafts at least 1 node")
        elif s > most:
            skipped.append(f"tree size {s} skipped: top_k {top_k} and depth {d} generate only {most} candidates "
                           "(top_k + (depth - 1) * top_k^2); raise top_k to try it")
        else:
            valid[s] = (d, s)
    return valid, skipped


def medusa_tree_choices(base: Sequence[Sequence[int]], sizes: Sequence[int]) -> tuple[dict[int, tuple], list[str]]:
    """({size: the first `size` paths of `base`}, skip messages). `base` is a tree ordered best-first (each path
    after its parent); a size above len(base) is skipped and the whole tree tried in its place. A prefix that is
    not a tree (a path before its parent) is skipped too."""
    from specjax.tree import TreeError, from_choices, validate_choices

    base = validate_choices(base)
    wanted = sorted(set(sizes))
    skipped = [f"tree size {s} skipped: a tree drafts at least 1 node" for s in wanted if s < 1]
    over = [s for s in wanted if s > len(base)]
    if over:
        skipped.append(f"tree size(s) {', '.join(map(str, over))} skipped: the heads' default tree has only "
                       f"{len(base)} paths; trying {len(base)}")
    valid = {}
    for s in sorted({s for s in wanted if 1 <= s <= len(base)} | ({len(base)} if over else set())):
        choices = base[:s]
        try:
            from_choices(choices)
        except TreeError as e:
            skipped.append(f"tree size {s} skipped: its first {s} paths are not a tree ({e})")
            continue
        valid[s] = choices
    return valid, skipped


def tree_configs(llm, spec: SpeculativeConfig, sizes: Sequence[int]) -> tuple[dict[int, SpeculativeConfig], list[str]]:
    """({size: the SpeculativeConfig drafting that many nodes, back-off off}, skip messages) for a tree method.

    With `lookup_tokens` g the size counts the lookup branch too (g lookup nodes + size - g head nodes), so sizes
    up to g, which would leave the head no node, are skipped."""
    g = spec.lookup_tokens
    short = [s for s in sorted(set(sizes)) if g and 1 <= s <= g]
    sizes = [s for s in sizes if s not in short]
    settings, skipped = _tree_configs(llm, spec, sizes)
    if short:
        skipped.append(f"tree size(s) {', '.join(map(str, short))} skipped: lookup_tokens {g} takes {g} of the "
                       f"nodes and the head needs at least one; use sizes above {g} or lower lookup_tokens")
    return settings, skipped


def _tree_configs(llm, spec: SpeculativeConfig, sizes: Sequence[int]) -> tuple[dict[int, SpeculativeConfig], list[str]]:
    from specjax.runners.speculative import drafter_for

    if spec.method == "medusa":
        drafter, _ = drafter_for(llm, dataclasses.replace(spec, tree_choices=None))
        found, skipped = medusa_tree_choices(drafter.choices, sizes)
        if spec.tree_choices is not None:
            skipped.insert(0, f"configured tree_choices ({len(spec.tree_choices)} paths) not used: sizes are "
                              "prefixes of the heads' best-first default tree")
        return {s: dataclasses.replace(spec, tree_choices=c, adaptive=False) for s, c in found.items()}, skipped
    if spec.method in ("eagle", "eagle3"):
        found, skipped = eagle_tree_sizes(spec.top_k, spec.depth, sizes)
        return {s: dataclasses.replace(spec, depth=d, total_tokens=t, adaptive=False)
                for s, (d, t) in found.items()}, skipped
    raise TuneError(f"method {spec.method!r} drafts a chain, not a tree; tune its gamma instead "
                     f"(tree methods: {', '.join(TREE_METHODS)})")


def _tree_depth(spec: SpeculativeConfig) -> int:
    """Deepest drafted level of a config from `tree_configs` (a lookup branch of `lookup_tokens` nodes is a
    chain under the root, so it can reach below the head's levels)."""
    head = max(map(len, spec.tree_choices)) if spec.method == "medusa" else spec.depth
    return max(head, spec.lookup_tokens)


# ============================================================================================ validation
def validate_settings(llm, prompts: list, sp: SamplingParams, settings: dict[int, SpeculativeConfig],
                      pred: dict[int, dict], chosen: int, label: str,
                      columns: Sequence[tuple[str, Callable[[int], float]]], log=print, reps: int = 2) -> dict:
    """Measure plain decoding and every setting end to end, print predicted against measured speedup (one row per
    setting; `columns` are extra (header, value of setting) columns), and say whether the chosen setting's error is
    within TOLERANCE. Setting OFF (plain decoding) is the baseline run itself. The best speculative setting is
    also measured with back-off on (`adaptive`, what the engine runs by default) and printed below the table.
    Returns the entries `tune` adds to its result."""
    best_spec = best_speculative(pred)
    specs = {PLAIN: None} | dict(settings) | {ADAPTIVE: dataclasses.replace(settings[best_spec], adaptive=True)}
    runs = timed_runs(llm, prompts, specs, sp, reps)
    plain_tps = runs[PLAIN].tokens_per_s
    measured = {k: {"tokens_per_s": runs[k].tokens_per_s, "speedup": runs[k].tokens_per_s / plain_tps}
                for k in settings}
    if OFF in pred:
        measured = {OFF: {"tokens_per_s": plain_tps, "speedup": 1.0}} | measured
    errors = {k: (pred[k]["speedup"] - measured[k]["speedup"]) / measured[k]["speedup"] for k in measured}
    w = max(3, len(label))
    log(f"{label:>{w}} " + "".join(f"{h:>{max(len(h), 6)}} " for h, _ in columns)
        + f"{'pred x':>7} {'meas x':>7} {'error':>6}")
    for k in measured:
        log(f"{k:>{w}} " + "".join(f"{f(k):>{max(len(h), 6)}.2f} " if k != OFF else f"{'-':>{max(len(h), 6)}} "
                                   for h, f in columns)
            + f"{pred[k]['speedup']:>7.2f} {measured[k]['speedup']:>7.2f} {100 * errors[k]:>5.0f}%"
            + ("  (plain)" if k == OFF else "") + ("  <- chosen" if k == chosen else ""))
    fastest = max(measured, key=lambda k: measured[k]["tokens_per_s"])
    ok = abs(errors[chosen]) <= TOLERANCE
    adaptive = runs[ADAPTIVE].tokens_per_s / plain_tps
    log(f"{label}={best_spec} with back-off on (the engine's default): measured {adaptive:.2f}x")
    log(f"chosen {label}={chosen}{' (speculation off)' if chosen == OFF else ''}: measured "
        f"{measured[chosen]['speedup']:.2f}x; fastest measured {label}={fastest}: {measured[fastest]['speedup']:.2f}x")
    log(f"chosen {label}={chosen}: predicted speedup error {100 * errors[chosen]:+.1f}% "
        f"({'within' if ok else 'OUTSIDE'} the {100 * TOLERANCE:.0f}% target)")
    return {"plain_tokens_per_s": plain_tps, "measured": measured, "errors": errors, "measured_fastest": fastest,
            "chosen_error": errors[chosen], "chosen_within_tolerance": ok,
            "chosen_at_least_as_fast_as_every_setting": measured[chosen]["tokens_per_s"] >= measured[fastest]["tokens_per_s"],
            "adaptive": {"setting": best_spec, "tokens_per_s": runs[ADAPTIVE].tokens_per_s, "speedup": adaptive}}


# ============================================================================================ tuners
def _say_if_it_pays(speedup: float, log) -> bool:
    """Whether the best setting is predicted to beat plain decoding; when not, say what the engine will do."""
    if speedup >= 1.0:
        return True
    log(f"no setting is predicted to beat plain decoding here ({speedup:.2f}x at best): with `adaptive` on (the "
        "default) the engine backs off to plain steps on such prompts; for this workload plain decoding "
        "(speculative_config=None) is the faster choice")
    return False


def _log_costs(costs: Costs, label: str, log) -> None:
    log(f"  plain step {1000 * costs.plain_s:.1f} ms; speculative step (draft + verify + accept): "
        + ", ".join(f"{label}={k}: {1000 * t:.1f} ms ({t / costs.plain_s:.2f}x)" for k, t in costs.step_s.items()))
    if costs.draft_s:
        log("  of which one propose (timed alone): "
            + ", ".join(f"{label}={k}: {1000 * t:.1f} ms" for k, t in costs.draft_s.items()))


def cost_prompts(prompts: list, acc: Acceptance, n: int) -> list:
    """The n prompts with the most verify steps in the acceptance run (a prompt the drafter never continues
    cannot time a speculative step)."""
    order = sorted(range(len(prompts)), key=lambda i: -acc.per_prompt_verify_steps[i])
    return [prompts[i] for i in sorted(order[:n])]


def tune(llm, spec: SpeculativeConfig, prompts: list, gammas: Sequence[int] = DEFAULT_GAMMAS,
         max_new_tokens: int = 64, validate: bool = True, log=print,
         tree_sizes: Sequence[int] = DEFAULT_TREE_SIZES, reps: int = 2, num_cost_prompts: int = 3,
         p_mins: Sequence[float] = DEFAULT_P_MINS) -> dict:
    """Measure acceptance and costs and choose gamma (chain methods, from `gammas`) or the tree size (medusa, eagle,
    eagle3, from `tree_sizes`); then (validate) measure every candidate end to end for the comparison. A draft
    model then has its p_min chosen at that gamma (`tune_p_min`, from `p_mins`; empty: not tuned).

    Costs are timed in the generation loop on the `num_cost_prompts` prompts with the most verify steps; every
    timed generation keeps each prompt's fastest of `reps` runs."""
    if spec.method in TREE_METHODS:
        return tune_tree(llm, spec, prompts, tree_sizes, max_new_tokens, validate, log, reps, num_cost_prompts)
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    gmax = max(gammas)
    probe = dataclasses.replace(spec, num_speculative_tokens=gmax, adaptive=False)
    log(f"measuring acceptance at γ={gmax} on {len(prompts)} prompts")
    acc = measure_acceptance(llm, probe, prompts, sp, gmax)
    pos = np.asarray(acc.per_position_accepted, float)
    alpha = acc.alpha
    settings = {g: dataclasses.replace(spec, num_speculative_tokens=g, adaptive=False) for g in gammas}
    cprompts = cost_prompts(prompts, acc, num_cost_prompts)
    log(f"timing plain and speculative steps in the generation loop on {len(cprompts)} prompts")
    costs = measure_loop_costs(llm, settings, cprompts, sp, reps)
    costs.draft_s = measure_draft_costs(llm, spec, gammas, llm.encode_prompt(cprompts[0], True))
    _log_costs(costs, "γ", log)
    pred = with_plain(costs, predict(costs, pos, acc.verify_steps, gammas, acc.plain_steps))
    best = choose(pred)
    result = {"costs": dataclasses.asdict(costs), "alpha": alpha, "per_position_accepted": pos.tolist(),
              "verify_steps": acc.verify_steps, "plain_steps": acc.plain_steps, "prediction": pred,
              "chosen_gamma": best}
    log(f"alpha {alpha:.3f}; predicted best γ = {best}{' (speculation off)' if best == OFF else ''} "
        f"({pred[best]['speedup']:.2f}x)")
    result["speculation_pays"] = _say_if_it_pays(pred[best_speculative(pred)]["speedup"], log)
    if validate:
        # Back-off off, as in the model; production runs keep it on for the chosen gamma.
        v = validate_settings(llm, prompts, sp, settings, pred, best, "γ",
                              [("E[tok] meas", lambda g: pred[g]["expected_tokens"]),
                               ("E[tok] Leviathan", lambda g: leviathan_expected_tokens(alpha, g))], log, reps)
        v["measured_fastest_gamma"] = v.pop("measured_fastest")
        result.update(v)
    if spec.method == "draft_model" and p_mins and best != OFF:
        result["p_min"] = tune_p_min(llm, spec, best, prompts, p_mins, sp, log, reps, num_cost_prompts)
    return result


def tune_p_min(llm, spec: SpeculativeConfig, gamma: int, prompts: list, p_mins: Sequence[float],
               sp: SamplingParams, log=print, reps: int = 2, num_cost_prompts: int = 3) -> dict:
    """Choose a draft model's p_min at `gamma`: p_min cuts chains, so it changes both the acceptance per step and
    the draft cost of a step (the draft stops its forwards once every row has stopped): each candidate's
    acceptance is measured, its step timed in the generation loop, and the cost model's prediction (as for a
    tree size: measured tokens per verify step over measured step time) picks the best. p_min is a traced value
    (`DraftModelDrafter`): the sweep loads the draft once and compiles one loop."""
    cands = sorted(set(float(p) for p in p_mins))
    key = {i + 1: p for i, p in enumerate(cands)}  # setting keys start at 1: 0 is OFF (plain decoding)
    settings = {k: dataclasses.replace(spec, num_speculative_tokens=gamma, p_min=p, adaptive=False)
                for k, p in key.items()}
    log(f"measuring acceptance at γ={gamma} for p_min {', '.join(f'{p:g}' for p in cands)} on {len(prompts)} prompts")
    acceptance = {k: measure_acceptance(llm, s, prompts, sp, gamma) for k, s in settings.items()}
    cprompts = cost_prompts(prompts, acceptance[1], num_cost_prompts)
    costs = measure_loop_costs(llm, settings, cprompts, sp, reps)
    pred = with_plain(costs, predict_tree(costs, acceptance))
    best = best_speculative(pred)
    for k, p in key.items():
        log(f"  p_min {p:g}: {acceptance[k].expected_tokens:.2f} tokens/verify step, step "
            f"{1000 * costs.step_s[k]:.1f} ms ({costs.step_s[k] / costs.plain_s:.2f} plain steps), predicted "
            f"{pred[k]['speedup']:.2f}x" + ("  <- chosen" if k == best else ""))
    return {"gamma": gamma, "candidates": cands, "chosen_p_min": key[best],
            "prediction": {key[k]: v for k, v in pred.items() if k != OFF},
            "costs": dataclasses.asdict(costs) | {"step_s": {key[k]: t for k, t in costs.step_s.items()}},
            "acceptance": {key[k]: dataclasses.asdict(a) for k, a in acceptance.items()}}


def tune_tree(llm, spec: SpeculativeConfig, prompts: list, tree_sizes: Sequence[int] = DEFAULT_TREE_SIZES,
              max_new_tokens: int = 64, validate: bool = True, log=print, reps: int = 2,
              num_cost_prompts: int = 3) -> dict:
    """Choose the draft tree size of a tree method (medusa, eagle, eagle3): measure the acceptance at every valid
    size s, time a step of each size in the generation loop, predict tokens/s, pick the best; then (validate)
    measure every size end to end."""
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    settings, skipped = tree_configs(llm, spec, tree_sizes)
    for msg in skipped:
        log(msg)
    if not settings:
        raise TuneError(f"no valid tree size among {list(tree_sizes)} for method {spec.method!r}; pass "
                         "--tree-sizes with sizes the method allows (see the messages above)")
    sizes = sorted(settings)
    log(f"measuring acceptance at tree sizes {', '.join(map(str, sizes))} on {len(prompts)} prompts")
    acceptance = {s: measure_acceptance(llm, settings[s], prompts, sp, _tree_depth(settings[s])) for s in sizes}
    cprompts = cost_prompts(prompts, acceptance[sizes[-1]], num_cost_prompts)
    log(f"timing plain and speculative steps in the generation loop on {len(cprompts)} prompts")
    costs = measure_loop_costs(llm, settings, cprompts, sp, reps)
    first = llm.encode_prompt(cprompts[0], True)
    costs.draft_s = {s: measure_draft_cost(llm, settings[s], first) for s in sizes}
    _log_costs(costs, "s", log)
    pred = with_plain(costs, predict_tree(costs, acceptance))
    best = choose(pred)
    tree = {s: ({"tree_choices": [list(c) for c in settings[s].tree_choices]} if spec.method == "medusa"
                else {"top_k": settings[s].top_k, "depth": settings[s].depth, "total_tokens": settings[s].total_tokens})
            for s in sizes}
    result = {"method": spec.method, "tree_sizes": sizes, "skipped": skipped, "trees": tree,
              "costs": dataclasses.asdict(costs),
              "acceptance": {s: dataclasses.asdict(a) | {"alpha": a.alpha} for s, a in acceptance.items()},
              "prediction": pred, "chosen_tree_size": best}
    log(f"predicted best tree size = {best}{' (speculation off)' if best == OFF else ''} "
        f"({pred[best]['expected_tokens']:.2f} tokens/step, {pred[best]['speedup']:.2f}x)")
    result["speculation_pays"] = _say_if_it_pays(pred[best_speculative(pred)]["speedup"], log)
    if validate:
        v = validate_settings(llm, prompts, sp, settings, pred, best, "size",
                              [("E[tok] meas", lambda s: pred[s]["expected_tokens"]),
                               ("alpha", lambda s: acceptance[s].alpha)], log, reps)
        v["measured_fastest_tree_size"] = v.pop("measured_fastest")
        result.update(v)
    return result
