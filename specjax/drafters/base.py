"""The one drafter interface.

A drafter is a frozen, hashable dataclass holding only static settings (it is a static jit argument); its
weights travel separately as `dparams` and its evolving state as `dstate`, both pytrees. Three pure steps:

    init(dparams, target_params, prompts [B, P], prompt_lens [B], capacity, features [B, P, F] | None) -> dstate
    propose(dparams, dstate, ctx: DraftContext) -> (Proposal, dstate)
    update(dparams, dstate, ctx: DraftContext, result: AcceptResult) -> dstate
    observe_plain(dparams, dstate, ctx: DraftContext) -> dstate   # the engine decodes ctx.last_token plainly
                                                                   # this step (back-off); keep caches in step,
                                                                   # at once or deferred to a later step

`propose` must leave dstate equivalent to what `observe_plain` would have left (the same later proposals; entries
past ctx.lengths that a later step overwrites may differ, and work `observe_plain` defers may be done): when a
proposal turns out empty the engine decodes plainly without calling `observe_plain` again.

`tree` fixes the node budget N and the maximum depth of every proposal; `mode` names how the proposal was
drawn, which decides the acceptance rule ("deterministic" for lookups and top-k trees, "iid" / "wor" for
sampled drafts, whose q the proposal must carry).
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple, Protocol

import jax

from specjax.sampling import SamplingArrays
from specjax.tree import TreeSpec


class DraftContext(NamedTuple):
    history: jax.Array  # [B, Hc] int32: prompt + every emitted token (last_token included)
    hist_len: jax.Array  # [B] int32
    last_token: jax.Array  # [B] int32: the root of the next tree, not yet in the target's cache
    lengths: jax.Array  # [B] int32: committed target cache entries (= hist_len - 1)
    sampling: SamplingArrays
    step: jax.Array  # [B] int32: RNG stream position
    target_hidden: Any  # (feats [B, D+1, F] of the root + accepted nodes of the last step, count [B]) or None
    # Static (a Python bool, not an array): whether the compile policy allows lax.cond (see process_logits).
    allow_cond: bool = True


class Proposal(NamedTuple):
    tokens: jax.Array  # [B, N] int32; node 0 is the root (= ctx.last_token)
    parents: jax.Array  # [B, N] int32; parents[:, 0] = -1
    valid: jax.Array  # [B, N] bool; padding nodes False (never accepted, never anyone's parent)
    q: Any  # [B, N, V] float32: q[:, i] = distribution the children of node i were drawn from; None if deterministic


class Drafter(Protocol):
    tree: TreeSpec
    mode: str
    features: tuple  # target features read from ctx.target_hidden: () none, "final" and/or layer indices

    def init(self, dparams, target_params, prompts, prompt_lens, capacity: int, features=None): ...

    def propose(self, dparams, dstate, ctx: DraftContext): ...

    def update(self, dparams, dstate, ctx: DraftContext, result): ...

    def observe_plain(self, dparams, dstate, ctx: DraftContext): ...


class Stateless:
    """Mixin for drafters that keep no state between steps (lookups, Medusa heads): `init` returns an empty
    pytree and `update` / `observe_plain` leave it as it is."""

    def init(self, dparams, target_params, prompts, prompt_lens, capacity, features=None):
        return ()

    def update(self, dparams, dstate, ctx, result):
        return dstate

    def observe_plain(self, dparams, dstate, ctx):
        return dstate


def find_packaged(path: str) -> tuple[str | None, str]:
    """(the path that exists, or None; the packaged candidate): `path` as given, else relative to the installed
    specjax package, where the shipped drafts and heads live (`assets/...`)."""
    packaged = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
    for candidate in (path, packaged):
        if os.path.exists(candidate):
            return candidate, packaged
    return None, packaged
