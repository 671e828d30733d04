"""N-gram prompt lookup on device: match the last n tokens (n from max down to min) against the prompt and
everything generated so far, propose what followed the most recent earlier occurrence.

Vectorised with static shapes: for each n the whole history is compared at once ([B, Hc] compares per token of
the n-gram), the latest match wins, shorter n-grams are tried only where longer ones found nothing.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.drafters.base import DraftContext, Proposal, Stateless
from specjax.tree import TreeSpec, chain


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Stateless):
    num_speculative_tokens: int = 4
    min_n: int = 1
    max_n: int = 3
    mode: str = "deterministic"
    features: tuple = ()

    def __post_init__(self):
        if self.min_n < 1 or self.max_n < self.min_n:
            raise ValueError(f"n-gram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"min {self.min_n}, max {self.max_n}")

    @property
    def tree(self) -> TreeSpec:
        return chain(self.num_speculative_tokens)

    def propose(self, dparams, dstate, ctx: DraftContext):
        hist, hlen = ctx.history, ctx.hist_len
        B, Hc = hist.shape
        g = self.num_speculative_tokens
        i = jnp.arange(Hc)[None, :]
        found = jnp.zeros((B,), bool)
        start = jnp.zeros((B,), jnp.int32)
        for n in range(self.max_n, self.min_n - 1, -1):
            # key[b, k] = the last n tokens; match[b, i] iff hist[b, i:i+n] == key and a continuation exists
            key_pos = hlen[:, None] - n + jnp.arange(n)[None, :]
            key = jnp.take_along_axis(hist, jnp.clip(key_pos, 0, Hc - 1), axis=1)
            match = (i + n < hlen[:, None]) & (hlen[:, None] > n)
            for k in range(n):
                shifted = jnp.roll(hist, -k, axis=1)  # shifted[b, i] = hist[b, i + k]
                match &= shifted == key[:, k:k + 1]
            latest = jnp.max(jnp.where(match, i, -1), axis=1)
            take = ~found & (latest >= 0)
            start = jnp.where(take, latest + n, start)
            found |= take
        pos = start[:, None] + jnp.arange(g)[None, :]
        drafted = jnp.take_along_axis(hist, jnp.clip(pos, 0, Hc - 1), axis=1)
        ok = found[:, None] & (pos < hlen[:, None])
        tokens = jnp.concatenate([ctx.last_token[:, None], jnp.where(ok, drafted, 0)], axis=1).astype(jnp.int32)
        valid = jnp.concatenate([jnp.ones((B, 1), bool), ok], axis=1)
        parents = jnp.broadcast_to(jnp.asarray(self.tree.parents_array), (B, g + 1))
        return Proposal(tokens, parents, valid, None), dstate
