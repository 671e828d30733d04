"""Logits processing shared by plain decoding, the drafters and the acceptance sampler.

One function turns logits into the distribution that is actually sampled from: temperature, then top-k, then
top-p, each per request as arrays (so new values never recompile). temperature == 0 means greedy and yields the
one-hot of the argmax, which makes greedy a special case of every acceptance mode.

Top-k and top-p are sort-free: the cut-off value is found by bisection over the values themselves (32 halvings
of the value range), which needs only compares and sums. That keeps the program free of sorts (Neuron's
compiler handles them poorly) and costs O(32 V), small next to the LM head. Ties at the cut-off are all kept,
for p and q alike, so the processing stays a deterministic function of the logits.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_BISECT_STEPS = 32


class SamplingArrays(NamedTuple):
    """Per-request sampling values as arrays, batch-first. Built by `specjax.api` from SamplingParams."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    seed: jax.Array  # [B] uint32
    max_new_tokens: jax.Array  # [B] int32
    stop_ids: jax.Array  # [B, K] int32, -1 = unused slot


def _top_k_threshold(x: jax.Array, k: jax.Array) -> jax.Array:
    """Largest t with count(x >= t) >= k. x [..., V] (finite), k [...] int -> [...]."""
    lo = jnp.min(x, axis=-1)
    hi = jnp.max(x, axis=-1)

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) / 2
        ok = jnp.sum(x >= mid[..., None], axis=-1) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    # hi itself may already keep k values (when the k-th largest value is exactly hi).
    return jnp.where(jnp.sum(x >= hi[..., None], axis=-1) >= k, hi, lo)


def _top_p_threshold(p: jax.Array, top_p: jax.Array) -> jax.Array:
    """Largest t with sum(p[p >= t]) >= top_p. p [..., V] probabilities, top_p [...] -> [...]."""
    lo = jnp.zeros(p.shape[:-1], p.dtype)
    hi = jnp.max(p, axis=-1)

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) / 2
        ok = jnp.sum(jnp.where(p >= mid[..., None], p, 0.0), axis=-1) >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return jnp.where(jnp.sum(jnp.where(p >= hi[..., None], p, 0.0), axis=-1) >= top_p, hi, lo)


def process_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                   allow_cond: bool = True) -> jax.Array:
    """logits [B, ..., V] -> probabilities [B, ..., V] float32 that sampling uses.

    temperature/top_k/top_p are [B] and broadcast over the middle axes (tree nodes, chain positions).
    allow_cond: skip, with `lax.cond`, the work no row of the batch needs: everything but the argmax when every
    row is greedy, the top-k bisection when no row sets top_k, the top-p bisection when no row sets top_p. The
    skipped parts are exact no-ops for those rows, so the result is bit-identical either way; the bisections
    cost about 1.7 ms per [V] row on a CPU core, which a verify pass over a tree pays once per node. False under
    compile policies without `lax.cond` (Neuron).
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    extra = logits.ndim - 2
    expand = lambda a: a.reshape(a.shape + (1,) * extra)
    t, k, tp = expand(temperature.astype(jnp.float32)), expand(top_k.astype(jnp.int32)), expand(top_p.astype(jnp.float32))
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    kk = jnp.where(k > 0, jnp.minimum(k, V), V)

    def cut_top_k(scaled):
        kth = _top_k_threshold(scaled, kk)
        return jnp.where(scaled >= kth[..., None], scaled, -jnp.inf)

    def cut_top_p(probs):
        pth = _top_p_threshold(probs, tp)
        return jnp.where((tp[..., None] >= 1.0) | (probs >= pth[..., None]), probs, 0.0)

    def maybe(needed, fn, x):
        return jax.lax.cond(needed, fn, lambda y: y, x) if allow_cond else fn(x)

    def sampled(logits):
        scaled = logits / jnp.where(t > 0, t, 1.0)[..., None]
        scaled = maybe(jnp.any(kk < V), cut_top_k, scaled)
        probs = maybe(jnp.any(tp < 1.0), cut_top_p, jax.nn.softmax(scaled, axis=-1))
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
        return jnp.where((t > 0)[..., None], probs, greedy)

    if not allow_cond:
        return sampled(logits)
    return jax.lax.cond(jnp.any(t > 0), sampled, lambda _: greedy, logits)


def sample(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF sample, probs [..., V] (need not be normalised), u [...] -> [...] int32. The one sampling
    routine of specjax (plain decoding, drafters and the acceptance sampler's final token all use it); it never
    returns a zero-probability token."""
    from specjax.acceptance import sample_from

    return sample_from(probs, u)


def top_k(x: jax.Array, k: int, *, block: int = 1024) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis, computed in two stages: x [..., V] -> (values [..., k], indices
    [..., k] int32), best first, ties to the lower index (the same result as `lax.top_k`).

    Why: inside a `lax.while_loop` whose body stores the k indices (a per-step record), XLA:CPU lowers one
    top-k over a 49k-entry vocabulary to a full sort of the row, about 20 ms per row on a CPU core, 40x the cost
    of its TopK kernel. Here each `block`-wide slice gives its own top k first, and a second top-k picks among
    those V / block * k survivors, so any lowering sorts short rows only. Every true top-k entry is the top k of
    its own block, which is why the two stages are exact.
    """
    V = x.shape[-1]
    if k > V:
        raise ValueError(f"top_k: k = {k} is larger than the last axis ({V})")
    if V <= 2 * block or k > block:
        vals, idx = jax.lax.top_k(x, k)
        return vals, idx.astype(jnp.int32)
    n = -(-V // block)
    pad = n * block - V
    if pad:  # padding sorts last: -inf, and a higher index than any real entry, so a real -inf still wins ties
        fill = jnp.full(x.shape[:-1] + (pad,), -jnp.inf, x.dtype)
        x = jnp.concatenate([x, fill], axis=-1)
    blocks = x.reshape(x.shape[:-1] + (n, block))
    v1, i1 = jax.lax.top_k(blocks, k)  # [..., n, k]
    i1 = i1.astype(jnp.int32) + (jnp.arange(n, dtype=jnp.int32) * block)[:, None]
    flat = x.shape[:-1] + (n * k,)
    # Survivors are laid out block by block, each block's best first, so ties still resolve to the lower index.
    vals, j = jax.lax.top_k(v1.reshape(flat), k)
    return vals, jnp.take_along_axis(i1.reshape(flat), j, axis=-1)


def request_key(seed: jax.Array, step: jax.Array, stream: int = 0) -> jax.Array:
    """Deterministic per-request key for a decode step: the same seed gives the same tokens in any batch."""
    key = jax.random.PRNGKey(seed)
    return jax.random.fold_in(jax.random.fold_in(key, step), stream)


def uniforms(seed: jax.Array, step: jax.Array, shape: tuple[int, ...], stream: int = 0) -> jax.Array:
    """[B, *shape] uniforms, one independent stream per request (seed [B], step [B] or scalar)."""
    step = jnp.broadcast_to(step, seed.shape)
    return jax.vmap(lambda s, i: jax.random.uniform(request_key(s, i, stream), shape))(seed, step)
