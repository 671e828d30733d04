"""Suffix decoding as a drafter: host-side suffix trees proposing a tree per step (see `suffix_tree`).

The index lives on the host, so this drafter does not run inside the on-device loop: the host proposes with
NumPy, then calls the same jitted verify+accept step as every other drafter. Settings are a frozen dataclass
(like every drafter); the indexes are explicit host state in `SuffixHostState`: one per-request index (prompt
and generation so far) and a global index of earlier requests' outputs, which the caller keeps across calls.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import DrafterCapabilities, Proposal, Stateless
from specjax.drafters.suffix_tree import SuffixIndex, proposal_to_fixed, speculate
from specjax.tree import TreeSpec


@dataclasses.dataclass(frozen=True)
class SuffixDrafter(Stateless):
    num_speculative_tokens: int = 8  # node budget per step (the tree's N - 1)
    max_depth: int = 24  # longest suffix indexed
    max_spec_factor: float = 1.0  # speculate at most factor * match length tokens
    min_token_prob: float = 0.1
    max_tree_depth: int = 8
    mode: str = "deterministic"
    features: tuple = ()
    capabilities = DrafterCapabilities(host_side=True)  # a class attribute, not a field

    @classmethod
    def from_config(cls, spec) -> "SuffixDrafter":
        g = spec.num_speculative_tokens
        return cls(g, spec.suffix_max_depth, spec.suffix_max_spec_factor, spec.suffix_min_token_prob, min(g, 8))

    @property
    def tree(self) -> TreeSpec:
        # The node budget and the depth bound: proposals fill N = budget + 1 nodes with their own parents.
        return TreeSpec((-1,) + tuple(range(self.max_tree_depth)) + (0,) * (self.num_speculative_tokens - self.max_tree_depth))


class SuffixHostState:
    """Host indexes for one generate call; `global_index` outlives it (the LLM keeps one)."""

    def __init__(self, drafter: SuffixDrafter, global_index: SuffixIndex, prompts: list[list[int]]):
        self.drafter = drafter
        self.global_index = global_index
        self.local = []
        self.seen = []
        for i, p in enumerate(prompts):
            idx = SuffixIndex(drafter.max_depth)
            idx.add_sequence(0, p)
            self.local.append(idx)
            self.seen.append(len(p))

    def propose(self, state, n: int) -> Proposal:
        d = self.drafter
        N = d.tree.num_nodes
        hist = np.asarray(state.history)
        hlen = np.asarray(state.prompt_lens + state.dec.num_new)
        last = np.asarray(state.dec.last_token)
        B = hist.shape[0]
        tokens = np.zeros((B, N), np.int32)
        parents = np.zeros((B, N), np.int32)
        valid = np.zeros((B, N), bool)
        parents[:, 0] = -1
        valid[:, 0] = True
        for b in range(n):
            ctx = hist[b, :hlen[b]]
            prop = speculate([self.local[b], self.global_index], ctx, max_spec_tokens=d.num_speculative_tokens,
                             max_spec_factor=d.max_spec_factor, min_token_prob=d.min_token_prob, max_nodes=N - 1,
                             max_draft_depth=d.max_tree_depth)
            tokens[b], parents[b], valid[b] = proposal_to_fixed(prop, N)
        tokens[:, 0] = last
        return Proposal(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(valid), None)

    def observe(self, state, n: int) -> None:
        """Index the tokens emitted since the last call into each request's own index."""
        hist = np.asarray(state.history)
        hlen = np.asarray(state.prompt_lens + state.dec.num_new)
        for b in range(n):
            if hlen[b] > self.seen[b]:
                self.local[b].extend(0, hist[b, self.seen[b]:hlen[b]].tolist())
                self.seen[b] = int(hlen[b])

    def finish(self, outputs: list[list[int]], next_id: int) -> int:
        """Add finished generations to the global cache (FIFO-bounded by the index); returns the next id."""
        for out in outputs:
            if out:
                self.global_index.add_sequence(next_id, out)
                next_id += 1
        return next_id
