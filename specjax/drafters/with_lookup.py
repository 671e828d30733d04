"""A head drafter's token tree with a prompt-lookup chain merged in.

Heads (EAGLE, EAGLE-3, Medusa) guess the next tokens from the target's features; n-gram lookup copies what
followed the latest earlier occurrence of the last few tokens. They win on different text: lookups on extraction,
summarization and RAG answers that repeat the context, heads everywhere else. One verify pass can check both
(SpecInfer's merged token trees): where the lookup finds a match, its chain of g tokens becomes the root's first
branch (nodes 1..g) and the head keeps the first N - 1 - g nodes of its own proposal (nodes g+1..N-1, which are
closed under parents: heads emit parents before children, EAGLE-2 by descending score, Medusa by depth). Where
the lookup finds nothing the head's whole proposal is used. The node budget N, and so the verify cost, is the
head's.

The lookup chain goes first so that, when both propose the same first token, the acceptance walk (which takes the
first matching child) follows the lookup's longer continuation. Both parts are deterministic functions of the
context, so the merged tree uses the head's acceptance rule unchanged and stays lossless.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from specjax.drafters.base import DraftContext, DrafterBase, DrafterCapabilities, Proposal
from specjax.drafters.ngram import NgramDrafter
from specjax.tree import TreeSpec
from specjax.errors import SpecjaxError


class MergedDrafterError(SpecjaxError, ValueError):
    """A lookup cannot be merged into this drafter's tree; the message says why and what to change."""


@dataclasses.dataclass(frozen=True)
class WithLookup(DrafterBase):
    base: Any  # a drafter with deterministic (or typical) candidates: EagleDrafter, MedusaDrafter
    lookup: NgramDrafter

    def __post_init__(self):
        if self.base.mode in ("iid", "wor"):
            raise MergedDrafterError(f"lookup_tokens needs a drafter whose candidates are deterministic (eagle, "
                                     f"eagle3, medusa); this one samples its drafts (mode {self.base.mode!r})")
        n, g = self.base.tree.num_nodes, self.lookup.num_speculative_tokens
        if g > n - 2:
            raise MergedDrafterError(f"lookup_tokens ({g}) must leave the head at least one node of its {n - 1}-node "
                                     f"tree; use lookup_tokens <= {n - 2} or a larger tree")

    @property
    def mode(self):
        return self.base.mode

    @property
    def features(self) -> tuple:
        return self.base.features

    @property
    def capabilities(self) -> DrafterCapabilities:
        return self.base.capabilities

    @property
    def tree(self) -> TreeSpec:
        # The head's node budget; depth bound of either part. Per-step parents travel in the proposal.
        n = self.base.tree.num_nodes
        d = max(self.base.tree.max_depth, self.lookup.num_speculative_tokens)
        return TreeSpec((-1,) + tuple(range(d)) + (0,) * (n - 1 - d))

    def init(self, dparams, target_params, prompts, prompt_lens, capacity, features=None):
        return self.base.init(dparams, target_params, prompts, prompt_lens, capacity, features)

    def update(self, dparams, dstate, ctx, result):
        return self.base.update(dparams, dstate, ctx, result)

    def observe_plain(self, dparams, dstate, ctx: DraftContext):
        return self.base.observe_plain(dparams, dstate, ctx)

    def propose(self, dparams, dstate, ctx: DraftContext):
        head, dstate = self.base.propose(dparams, dstate, ctx)
        look, _ = self.lookup.propose({}, (), ctx)
        return merge(head, look), dstate


def merge(head: Proposal, look: Proposal) -> Proposal:
    """head: tokens/parents/valid [B, N]; look: a chain [B, g + 1] (root first) -> the merged proposal [B, N].

    Rows whose lookup found a match (its node 1 valid) get the lookup chain as nodes 1..g and the head's nodes
    1..N-1-g as nodes g+1..N-1 (parents shifted by g, the root staying 0); other rows keep the head's proposal.
    """
    B, N = head.tokens.shape
    g = look.tokens.shape[1] - 1
    keep = N - 1 - g  # head nodes kept behind the chain
    hp = head.parents[:, 1:1 + keep]
    tokens = jnp.concatenate([head.tokens[:, :1], look.tokens[:, 1:], head.tokens[:, 1:1 + keep]], axis=1)
    parents = jnp.concatenate([head.parents[:, :1], look.parents[:, 1:], jnp.where(hp > 0, hp + g, 0)], axis=1)
    valid = jnp.concatenate([head.valid[:, :1], look.valid[:, 1:], head.valid[:, 1:1 + keep]], axis=1)
    hit = look.valid[:, 1:2]  # [B, 1]
    return Proposal(jnp.where(hit, tokens, head.tokens), jnp.where(hit, parents, head.parents),
                    jnp.where(hit, valid, head.valid), None)
