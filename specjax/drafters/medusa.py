"""Medusa drafter: K heads on the target's last hidden state propose a static top-k token tree.

The engine hands the drafter the target's final hidden state ("final" feature) of the root and the accepted
nodes of the last verify step; the feature of the last accepted node, f = feats[b, count[b] - 1], is where the
target sampled the root of the next tree (ctx.last_token). Head k applied to f predicts the token k + 1
positions after that node, i.e. depth k of the new tree. The tree is static, given as Medusa choices (paths of
top-k ranks, `tree.from_choices`): a node at depth d with rank r carries the r-th best token of head d.

The candidate set is a deterministic function of the context, so the shared lossless rule for deterministic
trees (`mode="deterministic"`) keeps greedy and sampled outputs exactly the target's, siblings being distinct
tokens. `TypicalMode` selects Medusa's typical acceptance instead, which is LOSSY (it changes the output
distribution) and only used when a config asks for `acceptance: typical`.

Default tree: `DEFAULT_CHOICES`, built by `choices_from_accuracy` from the held-out rank accuracy of the
shipped SmolLM2 heads, with its node budget chosen from the measured verify cost on 2 CPU cores (see
specjax/assets/smollm2-135m-medusa/README.md). `chain_choices(k)` is the chain form (top-1 of each head).
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from specjax.acceptance import TypicalMode
from specjax.drafters.base import DraftContext, Proposal, Stateless
from specjax.heads.medusa import MedusaConfig, MedusaError, head_hidden, head_logits, top_candidates
from specjax.tree import TreeError, TreeSpec, from_choices, validate_choices

# 16 nodes (root + 15) for 4 heads, from the held-out rank accuracy of the shipped SmolLM2-135M heads; the budget
# comes from the verify cost measured against tree size (assets/smollm2-135m-medusa/README.md).
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (0, 0), (3,), (1, 0), (0, 1), (0, 0, 0), (4,), (2, 0), (0, 2), (1, 1), (0, 0, 1),
    (0, 1, 0), (0, 0, 0, 0),
)


def chain_choices(depth: int) -> tuple[tuple[int, ...], ...]:
    """The chain of the top-1 token of heads 1..depth: ((0,), (0, 0), ...)."""
    if depth < 1:
        raise TreeError(f"a Medusa chain needs depth >= 1, got {depth}")
    return tuple((0,) * d for d in range(1, depth + 1))


def choices_from_accuracy(acc, num_nodes: int) -> tuple[tuple[int, ...], ...]:
    """The tree of `num_nodes` drafted nodes (root excluded) with the largest expected accepted length.

    acc [D, R]: acc[d, r] = probability that rank r of head d + 1 is the right token. Assuming depths are
    independent, a path is accepted with the product of its ranks' accuracies and the expected number of
    accepted tokens is the sum of that over the nodes; taking the best paths greedily is optimal because a
    child never scores above its parent, and the result is prefix-closed. Paths are returned in the order taken.
    """
    acc = np.asarray(acc, np.float64)
    if acc.ndim != 2 or acc.size == 0:
        raise TreeError(f"acc must be [depth, ranks], got shape {acc.shape}")
    if np.any(acc < 0) or np.any(acc > 1):
        raise TreeError("acc holds probabilities in [0, 1]")
    D, R = acc.shape
    heap = [(-acc[0, r], (r,)) for r in range(R)]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < num_nodes:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < D:
            for r in range(R):
                heapq.heappush(heap, (neg * acc[len(path), r], path + (r,)))
    return tuple(out)


def expected_accepted(acc, choices) -> float:
    """Expected accepted draft tokens per step of a tree under the independence model of `choices_from_accuracy`."""
    acc = np.asarray(acc, np.float64)
    return float(sum(np.prod([acc[d, r] for d, r in enumerate(c)]) for c in choices))


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Stateless):
    """Static-tree Medusa drafter. dparams = `specjax.heads.medusa.draft_params(...)`; no drafter state."""

    heads: MedusaConfig
    choices: tuple[tuple[int, ...], ...] = DEFAULT_CHOICES
    mode: Any = "deterministic"  # or a TypicalMode (lossy, opt-in)
    features: tuple = ("final",)

    def __post_init__(self):
        choices = validate_choices(self.choices)
        object.__setattr__(self, "choices", choices)
        if not choices:
            raise TreeError("Medusa tree choices are empty; give at least one path such as [[0]]")
        from_choices(choices)  # raises TreeError for a path without its parent
        depth = max(map(len, choices))
        if depth > self.heads.num_heads:
            raise MedusaError(f"the tree is {depth} deep but the heads predict only {self.heads.num_heads} "
                              f"positions; drop the paths longer than {self.heads.num_heads}")
        top = max(r for c in choices for r in c)
        if top >= self.heads.out_vocab:
            raise MedusaError(f"the tree asks for rank {top} but the heads have only {self.heads.out_vocab} tokens")
        if self.mode != "deterministic" and not isinstance(self.mode, TypicalMode):
            raise MedusaError(f"Medusa proposes deterministic top-k trees: mode must be 'deterministic' (lossless) "
                              f"or a TypicalMode (lossy), got {self.mode!r}")

    @property
    def tree(self) -> TreeSpec:
        return from_choices(self.choices)[0]

    @property
    def lossy(self) -> bool:
        return isinstance(self.mode, TypicalMode)

    def propose(self, dparams, dstate, ctx: DraftContext):
        tree, rank = from_choices(self.choices)
        depth = tree.depth
        D = tree.max_depth
        feats, count = ctx.target_hidden  # [B, D1, F], [B]
        B = feats.shape[0]
        last = jnp.take_along_axis(feats, (count - 1)[:, None, None], axis=1)[:, 0]  # [B, F]
        logits = head_logits(head_hidden(dparams["blocks"], last, D), dparams["lm"])  # [B, D, Vd]
        k = int(rank.max()) + 1
        cand = top_candidates(logits, k, dparams.get("token_map"))  # [B, D, k] target ids, best first
        # Static gather: node j (depth >= 1) takes rank[j] of head depth[j].
        drafted = cand[:, depth[1:] - 1, rank[1:]]  # [B, N - 1]
        tokens = jnp.concatenate([ctx.last_token[:, None].astype(jnp.int32), drafted], axis=1)
        parents = jnp.broadcast_to(jnp.asarray(tree.parents_array), tokens.shape)
        valid = jnp.ones(tokens.shape, bool)
        return Proposal(tokens, parents, valid, None), dstate


def from_spec(heads: MedusaConfig, num_speculative_tokens: int, tree_choices: Sequence[Sequence[int]] | None,
              acceptance_rule: str = "lossless", typical_posterior_threshold: float = 0.09,
              typical_posterior_alpha: float = 0.3, default_choices=None) -> MedusaDrafter:
    """The drafter for SpeculativeConfig-style settings.

    tree_choices None -> `default_choices` (the heads' own, e.g. from their config.json) or DEFAULT_CHOICES, cut to
    depth min(num_speculative_tokens, heads); explicit choices deeper than the heads raise. acceptance_rule
    "typical" selects the lossy TypicalMode, "lossless" the exact deterministic rule.
    """
    if acceptance_rule not in ("lossless", "typical"):
        raise MedusaError(f"acceptance {acceptance_rule!r} must be 'lossless' or 'typical' (lossy)")
    mode = (TypicalMode(typical_posterior_threshold, typical_posterior_alpha) if acceptance_rule == "typical"
            else "deterministic")
    if tree_choices is None:
        depth = min(num_speculative_tokens, heads.num_heads)
        base = validate_choices(default_choices) if default_choices else DEFAULT_CHOICES
        choices = tuple(c for c in base if len(c) <= depth and max(c) < heads.out_vocab) or chain_choices(depth)
    else:
        choices = validate_choices(tree_choices)
    return MedusaDrafter(heads, choices, mode)


DEFAULT_HEADS = "assets/smollm2-135m-medusa"  # shipped heads for SmolLM2-135M-Instruct, relative to the package


def resolve_heads_path(model: str | None) -> str:
    """A heads directory as given, else relative to the installed package; None = the shipped SmolLM2 heads."""
    import os

    name = DEFAULT_HEADS if model is None else model
    if os.path.exists(name):
        return name
    packaged = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)
    if os.path.exists(packaged):
        return packaged
    raise MedusaError(f"Medusa heads {name!r} not found (also looked in {packaged}); set `model` to a heads "
                      "directory (FasterDecoding, vLLM or specjax layout)")


def load(model: str | None, target_params: dict, target_hidden: int, target_vocab: int, *,
         num_speculative_tokens: int = 4, tree_choices=None, acceptance_rule: str = "lossless",
         typical_posterior_threshold: float = 0.09, typical_posterior_alpha: float = 0.3):
    """(MedusaDrafter, dparams) for heads on disk and a target; the tree defaults to the heads' own
    (config.json `specjax_medusa.tree_choices`), else DEFAULT_CHOICES. Weights take the target's dtype."""
    from specjax.heads.medusa import draft_params
    from specjax.heads.medusa_io import load_medusa

    path = resolve_heads_path(model)
    config, params, meta = load_medusa(path, target_hidden, target_vocab, dtype=target_params["embed"].dtype)
    drafter = from_spec(config, num_speculative_tokens, tree_choices, acceptance_rule, typical_posterior_threshold,
                        typical_posterior_alpha, default_choices=meta.get("tree_choices"))
    return drafter, draft_params(config, params, target_params)
