"""Tree topologies for verification, built once on the host with NumPy and cached.

A `TreeSpec` is frozen and hashable, so it can be a static jit argument: node 0 is the root (the last
committed token, verified as the first query), nodes are in topological order (parent < child), siblings in
drafted order. A chain of gamma tokens is the one-branch tree `chain(gamma)`. Dynamic trees (EAGLE-2, suffix
decoding) keep a static node budget and max depth and pass their per-step parents as arrays.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from specjax.errors import SpecjaxError


class TreeError(SpecjaxError, ValueError):
    """A tree description is malformed."""


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    parents: tuple[int, ...]  # [N]; parents[0] = -1

    def __post_init__(self):
        p = self.parents
        if not p or p[0] != -1:
            raise TreeError("a tree starts with the root: parents[0] must be -1")
        for j, q in enumerate(p[1:], start=1):
            if not 0 <= q < j:
                raise TreeError(f"node {j} has parent {q}; parents must come before their children (0 <= parent < node)")

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @functools.cached_property
    def parents_array(self) -> np.ndarray:
        return np.asarray(self.parents, np.int32)

    @functools.cached_property
    def depth(self) -> np.ndarray:
        """[N] int32, root at depth 0."""
        d = np.zeros(self.num_nodes, np.int32)
        for j in range(1, self.num_nodes):
            d[j] = d[self.parents[j]] + 1
        return d

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @functools.cached_property
    def ancestor_mask(self) -> np.ndarray:
        """[N, N] bool: m[i, j] iff node j is node i or one of its ancestors (what query i may attend to)."""
        n = self.num_nodes
        m = np.eye(n, dtype=bool)
        for j in range(1, n):
            m[j] |= m[self.parents[j]]
        return m

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents) if j)


@functools.lru_cache(maxsize=None)
def chain(gamma: int) -> TreeSpec:
    """The root followed by gamma drafted tokens in a line."""
    if gamma < 1:
        raise TreeError(f"a chain needs at least one speculative token, got {gamma}")
    return TreeSpec((-1,) + tuple(range(gamma)))


@functools.lru_cache(maxsize=None)
def from_choices(choices: tuple[tuple[int, ...], ...]) -> tuple[TreeSpec, np.ndarray]:
    """Medusa-style choices (paths of top-k ranks per depth) -> (TreeSpec, rank [N] int32).

    Nodes are ordered by depth, then lexicographically, so parents precede children and siblings appear in
    rank order; rank[j] is node j's rank among the candidates of its depth (-1 for the root).
    """
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    index = {(): 0}
    parents, rank = [-1], [-1]
    for path in paths:
        if not path:
            continue
        if path[:-1] not in index:
            raise TreeError(f"choice {list(path)} has no parent {list(path[:-1])} in the list")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        rank.append(path[-1])
    return TreeSpec(tuple(parents)), np.asarray(rank, np.int32)


def ancestor_mask_from_parents(parents, max_depth: int):
    """On-device ancestor-or-self mask for per-sequence trees. parents [B, N] int32 -> [B, N, N] bool.

    Transitive closure by repeated squaring of the one-step relation: ceil(log2(max_depth + 1)) boolean
    matmuls, no data-dependent loops (dynamic trees change their parents every step).
    """
    import jax.numpy as jnp

    B, N = parents.shape
    eye = jnp.eye(N, dtype=bool)[None]
    step = (parents[:, :, None] == jnp.arange(N)[None, None, :]) | eye  # [B, N, N]
    reach = step.astype(jnp.float32)
    hops = 1
    while hops < max_depth + 1:
        reach = jnp.minimum(jnp.einsum("bij,bjk->bik", reach, reach), 1.0)
        hops *= 2
    return reach > 0


def depth_from_parents(parents, max_depth: int):
    """parents [B, N] -> depth [B, N] int32 by repeated parent lookup (one-hot, no gather)."""
    import jax.numpy as jnp

    mask = ancestor_mask_from_parents(parents, max_depth)
    return jnp.sum(mask, axis=-1).astype(jnp.int32) - 1


def as_batch(tree: TreeSpec, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(parents [B, N], depth [B, N]) of a static tree, for the per-sequence arrays the verify step takes."""
    return (np.broadcast_to(tree.parents_array, (batch, tree.num_nodes)).copy(),
            np.broadcast_to(tree.depth, (batch, tree.num_nodes)).copy())


def validate_choices(choices: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    out = tuple(tuple(int(r) for r in c) for c in choices)
    if any(r < 0 for c in out for r in c):
        raise TreeError("tree choices hold top-k ranks, which are >= 0")
    return out
