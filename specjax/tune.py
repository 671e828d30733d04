"""Cost model and tuner: pick the speculation length that maximises predicted tokens/s on this hardware.

Model (Leviathan et al. 2023, generalised to measured per-position acceptance and measured costs):
    one verify step with gamma drafted tokens yields  E[tokens | gamma] = 1 + sum_{k <= gamma} P(depth k accepted)
    and costs                                           t_draft(gamma) + t_verify(gamma + 1)
    predicted tokens/s = E[tokens | gamma] / cost;  plain decoding = 1 / t_verify(1).
With i.i.d. acceptance alpha, E[tokens | gamma] = (1 - alpha^(gamma+1)) / (1 - alpha) (NOT the 1/(1-alpha*gamma)
that circulates); that closed form is printed next to the measured one. P(depth k accepted) comes from one
measurement run at the largest gamma: for a chain, truncating it to gamma' does not change whether the first
gamma' tokens are accepted, so one run gives the curve for every shorter gamma.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import SamplingParams, SpeculativeConfig


@dataclasses.dataclass
class Costs:
    verify_s: dict[int, float]  # tokens per target forward -> seconds
    draft_s: dict[int, float]  # gamma -> seconds of one propose


def _best_time(f, *args, reps: int = 5) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def measure_verify_costs(llm, sizes: Sequence[int], context: int = 256, capacity: int = 512) -> dict[int, float]:
    """Seconds of one target forward over n tokens (n in sizes) at batch 1 with `context` committed tokens."""
    from specjax.kv_cache import init_cache
    from specjax.models.llama import forward

    c = llm.config
    out = {}
    for n in sizes:
        cache = init_cache(c.num_layers, 1, capacity, c.num_kv_heads, c.head_dim, llm.params["embed"].dtype)
        cache = cache._replace(lengths=jnp.array([context], jnp.int32))
        tok = jnp.ones((1, n), jnp.int32)
        pos = context + jnp.arange(n)[None]
        f = jax.jit(lambda p, ca, t, ps: forward(p, c, t, ps, ca, attention_fn=llm._attention_fn).logits)
        out[n] = _best_time(f, llm.params, cache, tok, pos)
    return out


def measure_draft_costs(llm, spec: SpeculativeConfig, gammas: Sequence[int], prompt: list[int]) -> dict[int, float]:
    """Seconds of one propose of each gamma (0 for host-side or free drafters is measured too)."""
    from specjax import engine, spec_engine
    from specjax.api import pad_prompts
    from specjax.spec_api import build_drafter

    out = {}
    for g in gammas:
        s = dataclasses.replace(spec, num_speculative_tokens=g)
        drafter, dparams = build_drafter(llm, s)
        if getattr(drafter, "host_side", False):
            out[g] = 0.0  # host proposals are timed by the generation itself
            continue
        b = engine.make_buckets(1, len(prompt), 64, extra_slots=drafter.tree.num_nodes)
        toks, lens, act = pad_prompts([prompt], b.batch, b.prompt_len)
        sampling = llm.sampling_arrays([SamplingParams(max_new_tokens=64)], b.batch, b.num_stop)
        st = spec_engine.spec_prefill(llm.params, llm.config, dparams, drafter, b, toks, lens, act, sampling)
        out[g] = _best_time(lambda: spec_engine.propose_jit(dparams, drafter, st, sampling))
    return out


def expected_tokens(pos_accepted: np.ndarray, steps: int, gamma: int) -> float:
    """E[tokens per verify step] when the chain is cut to gamma, from per-depth accepted counts."""
    return 1.0 + float(np.sum(pos_accepted[:gamma])) / max(steps, 1)


def leviathan_expected_tokens(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predict(costs: Costs, pos_accepted: np.ndarray, steps: int, gammas: Sequence[int],
            plain_steps: int = 0) -> dict[int, dict]:
    """Predicted tokens/s per gamma. `plain_steps` are steps where nothing was proposed (an n-gram miss): they
    cost one plain forward and yield one token whatever gamma is."""
    plain = 1.0 / costs.verify_s[1]
    out = {}
    for g in gammas:
        e = expected_tokens(pos_accepted, steps, g)
        step = costs.draft_s.get(g, 0.0) + costs.verify_s[g + 1]
        tokens = plain_steps + steps * e
        seconds = plain_steps * costs.verify_s[1] + steps * step
        tps = tokens / seconds
        out[g] = {"expected_tokens": e, "step_s": step, "tokens_per_s": tps, "speedup": tps / plain}
    return out


def run_tokens_per_s(llm, prompts: list, spec: SpeculativeConfig | None, sp: SamplingParams) -> tuple[float, list]:
    """Measured tokens/s over the prompts at batch 1 (compile excluded), plus the outputs."""
    llm.generate(prompts[:1], sp, spec, chat=True)
    toks = 0
    t_total = 0.0
    outs = []
    for p in prompts:
        o = llm.generate([p], sp, spec, chat=True)[0]
        # decode-only time: TTFT (prefill) is the same for every method and not what speculation changes
        toks += o.metrics.new_tokens - 1
        t_total += o.metrics.total_time - o.metrics.time_to_first_token
        outs.append(o)
    return toks / t_total, outs


def tune(llm, spec: SpeculativeConfig, prompts: list, gammas: Sequence[int] = (1, 2, 4, 6, 8),
         max_new_tokens: int = 64, validate: bool = True, log=print) -> dict:
    """Measure costs and acceptance, choose gamma, then (validate) measure every gamma for the comparison."""
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    gmax = max(gammas)
    log(f"measuring target forward cost for 1..{gmax + 1} tokens")
    costs = Costs(measure_verify_costs(llm, range(1, gmax + 2)), {})
    log("  " + ", ".join(f"{n}: {1000 * t:.1f} ms" for n, t in costs.verify_s.items()))
    first = llm.encode_prompt(prompts[0], True)
    costs.draft_s = measure_draft_costs(llm, spec, gammas, first)
    log("draft cost per propose: " + ", ".join(f"γ={g}: {1000 * t:.1f} ms" for g, t in costs.draft_s.items()))
    probe = dataclasses.replace(spec, num_speculative_tokens=gmax, adaptive=False)
    log(f"measuring acceptance at γ={gmax} on {len(prompts)} prompts")
    pos = np.zeros(gmax)
    steps = plain_steps = 0
    accepted = drafted = 0
    for p in prompts:
        m = llm.generate([p], sp, probe, chat=True)[0].metrics
        pos += np.asarray(m.per_position_accepted, float)[:gmax]
        steps += m.verify_steps
        plain_steps += m.target_forwards - 1 - m.verify_steps
        accepted += m.accepted
        drafted += m.drafted
    alpha = accepted / drafted if drafted else 0.0
    pred = predict(costs, pos, steps, gammas, plain_steps)
    best = max(pred, key=lambda g: pred[g]["tokens_per_s"])
    result = {"costs": dataclasses.asdict(costs), "alpha": alpha, "per_position_accepted": pos.tolist(),
              "verify_steps": steps, "plain_steps": plain_steps, "prediction": pred, "chosen_gamma": best}
    log(f"alpha {alpha:.3f}; predicted best γ = {best} ({pred[best]['speedup']:.2f}x)")
    if validate:
        plain_tps, _ = run_tokens_per_s(llm, prompts, None, sp)
        measured = {}
        for g in gammas:
            # Back-off off, as in the model; production runs keep it on for the chosen gamma.
            s = dataclasses.replace(spec, num_speculative_tokens=g, adaptive=False)
            tps, _ = run_tokens_per_s(llm, prompts, s, sp)
            measured[g] = {"tokens_per_s": tps, "speedup": tps / plain_tps}
        result.update(plain_tokens_per_s=plain_tps, measured=measured)
        log(f"{'γ':>3} {'E[tok] meas':>11} {'E[tok] Leviathan':>16} {'pred x':>7} {'meas x':>7} {'error':>6}")
        for g in gammas:
            p, m = pred[g], measured[g]
            err = (p["speedup"] - m["speedup"]) / m["speedup"]
            log(f"{g:>3} {p['expected_tokens']:>11.2f} {leviathan_expected_tokens(alpha, g):>16.2f} "
                f"{p['speedup']:>7.2f} {m['speedup']:>7.2f} {100 * err:>5.0f}%" + ("  <- chosen" if g == best else ""))
        fastest = max(measured, key=lambda g: measured[g]["tokens_per_s"])
        result["measured_fastest_gamma"] = fastest
        log(f"chosen γ={best}: measured {measured[best]['speedup']:.2f}x; fastest measured γ={fastest}: "
            f"{measured[fastest]['speedup']:.2f}x")
    return result
