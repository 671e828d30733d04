"""The speculative decoding cost model: predicted tokens/s of a setting from measured step costs and acceptance.

Pure arithmetic on the figures `specjax.tools.tune` measures; nothing here touches a model or a device.

Chain drafters (ngram, draft_model, suffix) -- Leviathan et al. 2023, generalised to measured per-position
acceptance and measured costs:
    one verify step with gamma drafted tokens yields  E[tokens | gamma] = 1 + sum_{k <= gamma} P(depth k accepted)
    and costs                                           t_draft(gamma) + t_verify(gamma + 1)
    predicted tokens/s = E[tokens | gamma] / cost;  plain decoding = 1 / t_verify(1).
With i.i.d. acceptance alpha, E[tokens | gamma] = (1 - alpha^(gamma+1)) / (1 - alpha) (NOT the 1/(1-alpha*gamma)
that circulates). P(depth k accepted) comes from one measurement run at the largest gamma: for a chain,
truncating it to gamma' does not change whether the first gamma' tokens are accepted, so one run gives the curve
for every shorter gamma.

Tree drafters (medusa, eagle, eagle3): a size s is s drafted nodes (root excluded); acceptance is measured at
every size, and a step yields E[tokens | s] = 1 + accepted / verify step at a cost of t_draft(s) + t_verify(s + 1).
A draft model's p_min is predicted the same way (`predict_tree` over settings keyed by candidate): it cuts chains
where the draft is unsure, which changes both the tokens per step and the draft's cost per step (the draft stops
its forwards once every row has stopped), so neither can be read off the run at p_min = 0.

Plain decoding is a candidate too (setting OFF = 0, speedup 1 by definition): where nothing is predicted to pay,
`choose` picks no speculation.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specjax.requests import tau

__all__ = ["OFF", "Costs", "Acceptance", "expected_tokens", "leviathan_expected_tokens", "predict", "predict_tree",
           "with_plain", "choose", "best_speculative"]

OFF = 0  # the setting "no speculation": plain decoding, a candidate like any gamma or tree size


@dataclasses.dataclass
class Costs:
    plain_s: float  # seconds of one plain decode step inside the generation loop
    step_s: dict[int, float]  # gamma (chain) or tree size -> seconds of one speculative step inside the loop
    draft_s: dict[int, float] = dataclasses.field(default_factory=dict)  # same keys -> one propose timed alone


@dataclasses.dataclass
class Acceptance:
    """Speculation counts summed over the prompts of one measurement run."""

    accepted: int = 0
    drafted: int = 0
    verify_steps: int = 0
    plain_steps: int = 0  # steps with nothing proposed (an n-gram miss): one plain forward, one token
    per_position_accepted: list = dataclasses.field(default_factory=list)
    per_prompt_verify_steps: list = dataclasses.field(default_factory=list)

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def expected_tokens(self) -> float:
        """Tokens per verify step (tau): the accepted drafts plus the one the target samples itself."""
        return tau(self.accepted, self.verify_steps)


def expected_tokens(pos_accepted: np.ndarray, steps: int, gamma: int) -> float:
    """E[tokens per verify step] when the chain is cut to gamma, from per-depth accepted counts."""
    return tau(float(np.sum(pos_accepted[:gamma])), steps)


def leviathan_expected_tokens(alpha: float, gamma: int) -> float:
    """E[tokens per step] of a gamma chain under i.i.d. acceptance alpha: 1 + alpha + ... + alpha^gamma."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _prediction(costs: Costs, key: int, e: float, steps: int, plain_steps: int) -> dict:
    """Predicted tokens/s of one setting: `steps` speculative steps of E[tokens] = e at `costs.step_s[key]` each,
    plus `plain_steps` plain steps of one token each."""
    plain = 1.0 / costs.plain_s
    step = costs.step_s[key]
    tokens = plain_steps + steps * e
    seconds = plain_steps * costs.plain_s + steps * step
    tps = tokens / seconds
    return {"expected_tokens": e, "step_s": step, "tokens_per_s": tps, "speedup": tps / plain}


def predict(costs: Costs, pos_accepted: np.ndarray, steps: int, gammas: Sequence[int],
            plain_steps: int = 0) -> dict[int, dict]:
    """Predicted tokens/s per gamma. `plain_steps` are steps where nothing was proposed (an n-gram miss): they
    cost one plain forward and yield one token whatever gamma is."""
    return {g: _prediction(costs, g, expected_tokens(pos_accepted, steps, g), steps, plain_steps) for g in gammas}


def predict_tree(costs: Costs, acceptance: dict[int, Acceptance]) -> dict[int, dict]:
    """Predicted tokens/s per tree size s from the acceptance measured at that size:
    (1 + accepted / verify step) / t_step(s), plain steps (if any) at one token each."""
    return {s: _prediction(costs, s, a.expected_tokens, a.verify_steps, a.plain_steps)
            for s, a in acceptance.items()}


def with_plain(costs: Costs, pred: dict[int, dict]) -> dict[int, dict]:
    """`pred` plus the setting OFF (plain decoding: one token per plain step, speedup 1 by definition), so that the
    tuner recommends no speculation where no setting is predicted to pay for itself."""
    plain = {"expected_tokens": 1.0, "step_s": costs.plain_s, "tokens_per_s": 1.0 / costs.plain_s, "speedup": 1.0}
    return {OFF: plain} | pred


def choose(pred: dict[int, dict]) -> int:
    """The setting with the largest predicted tokens/s (the smaller one on a tie: cheaper to run; OFF = 0 wins a
    tie with every speculative setting)."""
    return max(sorted(pred), key=lambda k: pred[k]["tokens_per_s"])


def best_speculative(pred: dict[int, dict]) -> int:
    return choose({k: v for k, v in pred.items() if k != OFF})
