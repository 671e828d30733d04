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

A draft model samples its chain, so a lookup cannot share its tree (siblings drawn two ways have no one
acceptance rule); `DraftWithLookup` picks per row instead: the lookup chain where the context matches, the draft
model's chain elsewhere, one verify either way. Which one is decided by the context alone, before any draft
randomness, and a looked-up token is a draw from a point mass: its q row is one-hot, so the draft model's
acceptance rule (iid) keeps the target distribution on both kinds of rows.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.drafters.base import DraftContext, DrafterBase, DrafterCapabilities, Proposal
from specjax.drafters.ngram import NgramDrafter
from specjax.tree import TreeSpec, chain
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


@dataclasses.dataclass(frozen=True)
class DraftWithLookup(DrafterBase):
    """A draft model (`DraftModelDrafter`) with n-gram lookup: rows whose context matches propose the looked-up
    chain (up to `lookup.num_speculative_tokens`), the others the draft model's chain; a chain of
    max(gamma, lookup tokens) nodes verified in one call. Build with `around`, which widens the draft model's
    first forward to take the accepted looked-up tokens in (they never went through the draft)."""

    base: Any  # a DraftModelDrafter
    lookup: NgramDrafter

    @classmethod
    def around(cls, base, lookup: NgramDrafter) -> "DraftWithLookup":
        return cls(dataclasses.replace(base, window=max(base.window, lookup.num_speculative_tokens + 2)), lookup)

    def __post_init__(self):
        if self.base.window < self.lookup.num_speculative_tokens + 2:
            raise MergedDrafterError(f"the draft model's first forward covers {self.base.window} tokens; a lookup "
                                     f"of {self.lookup.num_speculative_tokens} needs "
                                     f"{self.lookup.num_speculative_tokens + 2} (build with DraftWithLookup.around)")

    @property
    def mode(self):
        return self.base.mode

    @property
    def features(self) -> tuple:
        return ()

    @property
    def capabilities(self) -> DrafterCapabilities:
        return self.base.capabilities

    @property
    def tree(self) -> TreeSpec:
        return chain(max(self.base.num_speculative_tokens, self.lookup.num_speculative_tokens))

    def init(self, dparams, target_params, prompts, prompt_lens, capacity, features=None):
        return self.base.init(dparams, target_params, prompts, prompt_lens, capacity, features)

    def update(self, dparams, dstate, ctx, result):
        return self.base.update(dparams, dstate, ctx, result)

    def observe_plain(self, dparams, dstate, ctx: DraftContext):
        return self.base.observe_plain(dparams, dstate, ctx)

    @staticmethod
    def _lookup_q(tokens, V: int, dtype):
        """q of a looked-up chain tokens [B, N] -> [B, N, V]: q[:, i] drew node i + 1, a point mass on its token
        (the last row, past the chain, is never read)."""
        return jax.nn.one_hot(jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1), V, dtype=dtype)

    def propose(self, dparams, dstate, ctx: DraftContext):
        look, _ = self.lookup.propose({}, (), ctx)
        hit = look.valid[:, 1]  # [B]
        draft, dstate = self.base.propose(dparams, dstate, ctx, skip=hit)
        # A row that proposes the lookup chain drafted nothing past its root: only the draft cache entries up to
        # the root hold committed tokens (the next first forward takes in whatever of the chain is accepted).
        dstate = dstate._replace(lengths=jnp.where(hit, ctx.lengths + 1, dstate.lengths))
        N = self.tree.num_nodes
        pad = lambda a, fill: jnp.pad(a, ((0, 0), (0, N - a.shape[1])) + ((0, 0),) * (a.ndim - 2),  # noqa: E731
                                      constant_values=fill)
        tokens, valid = pad(look.tokens, 0), pad(look.valid, False)
        look_q = self._lookup_q(tokens, draft.q.shape[-1], draft.q.dtype)
        h, h3 = hit[:, None], hit[:, None, None]
        return Proposal(jnp.where(h, tokens, pad(draft.tokens, 0)),
                        jnp.broadcast_to(jnp.asarray(self.tree.parents_array), tokens.shape),
                        jnp.where(h, valid, pad(draft.valid, False)),
                        jnp.where(h3, look_q, pad(draft.q, 0.0))), dstate
