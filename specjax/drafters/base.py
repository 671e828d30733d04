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
sampled drafts, whose q the proposal must carry); `features` names the target features the drafter reads (empty:
none, so the engines skip collecting them).

What a runner must know about a drafter before it runs one is declared, never probed: `capabilities` (a frozen
`DrafterCapabilities`) says whether it proposes on the host and which draft model's KV cache it allocates. Every
drafter derives from `DrafterBase`, whose default is a device-side drafter without a cache of its own;
`capabilities_of(None)` is plain decoding's.
"""
from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class DrafterCapabilities:
    """What the runners ask of a drafter before they run it.

    host_side: proposes on the host (a Python index stepped between jitted verify calls), so it cannot run
        inside a fused device loop: the batch job, the serving engine, the Neuron policy and the queued
        `LLM.generate` path refuse it or route around it, and the tuner and stream benchmark skip it.
    draft_config: the LlamaConfig of the draft model whose own KV cache the drafter allocates beside the
        target's (memory preflight counts it, back-off asks more acceptance of it), or None.
    """

    host_side: bool = False
    draft_config: Any = None

    @property
    def runs_draft_model(self) -> bool:
        return self.draft_config is not None


DEVICE_SIDE = DrafterCapabilities()


class Drafter(Protocol):
    tree: TreeSpec
    mode: str
    features: tuple  # target features read from ctx.target_hidden: () none, "final" and/or layer indices
    capabilities: DrafterCapabilities

    def init(self, dparams, target_params, prompts, prompt_lens, capacity: int, features=None): ...

    def propose(self, dparams, dstate, ctx: DraftContext): ...

    def update(self, dparams, dstate, ctx: DraftContext, result): ...

    def observe_plain(self, dparams, dstate, ctx: DraftContext): ...


class DrafterBase:
    """The base every drafter derives from: declares the default capabilities (device side, no draft-model
    cache). A drafter that differs overrides `capabilities` with a class attribute or a property."""

    capabilities: DrafterCapabilities = DEVICE_SIDE


def capabilities_of(drafter) -> DrafterCapabilities:
    """A drafter's declared capabilities; plain decoding (no drafter) has the defaults."""
    return DEVICE_SIDE if drafter is None else drafter.capabilities


class Stateless(DrafterBase):
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
