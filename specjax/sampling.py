"""Logits processing shared by plain decoding, the drafters and the acceptance sampler.

One function turns logits into the distribution that is actually sampled from: temperature, then top-k, then
top-p, each per request as arrays (so new values never recompile). temperature == 0 means greedy and yields the
one-hot of the argmax, which makes greedy a special case of every acceptance mode.

Top-k and top-p are sort-free: the cut-off value is found by bisection over the values themselves (32 halvings
of the value range), which needs only compares and sums. That keeps the program free of sorts (Neuron's
compiler handles them poorly) and costs O(32 V), small next to the LM head. Ties at the cut-off are all kept,
for p and q alike, so the processing stays a deterministic function of the logits.

Min-p comes last (after top-p, like Hugging Face's warper order): it keeps the tokens whose probability is at
least min_p times the most likely one's, a relative test that renormalisation does not change. `min_tokens`
bans the request's stop ids until that many tokens are out (`banned_stops`); the ban is applied before every
filter, so top-k counts allowed tokens only. The penalties (`penalize`) come first of all, on the raw logits,
as in vLLM: repetition divides positive and multiplies negative logits of every token seen in the prompt or the
output, then frequency subtracts per occurrence in the output and presence once per token present in it. They
depend on the tokens emitted before the one being sampled: plain decoding counts its output (`output_counts`),
a verify pass adds each tree node's own path (`path_counts`), so the distribution verification accepts against
is the one plain decoding samples from, node by node. `processed` is the one call that applies all of it from
the SamplingArrays; `token_logprobs` gives log-probabilities under the same processing.
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
    # Optional filters: None when no request of the batch uses them, so the programs of batches without them (and
    # compile policies that build these arrays themselves) keep their inputs.
    min_p: jax.Array | None = None  # [B] float32, 0 = off
    min_tokens: jax.Array | None = None  # [B] int32, 0 = off: stop ids banned while fewer tokens are out
    # Penalties (vLLM's semantics), all four set or all None: presence and frequency act on the output tokens,
    # repetition on the prompt's and the output's (`penalize`).
    presence_penalty: jax.Array | None = None  # [B] float32, 0 = off
    frequency_penalty: jax.Array | None = None  # [B] float32, 0 = off
    repetition_penalty: jax.Array | None = None  # [B] float32, 1 = off
    prompt_mask: jax.Array | None = None  # [B, V] bool: tokens of the row's prompt


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
                   min_p: jax.Array | None = None, banned: jax.Array | None = None,
                   allow_cond: bool = True) -> jax.Array:
    """logits [B, ..., V] -> probabilities [B, ..., V] float32 that sampling uses.

    temperature/top_k/top_p/min_p are [B] and broadcast over the middle axes (tree nodes, chain positions);
    min_p None = off for every row. banned: [B, ..., V] bool tokens given zero probability before any filter
    (greedy rows take the argmax of the others), or None; at least one token per row must stay allowed.
    allow_cond: skip, with `lax.cond`, the work no row of the batch needs: everything but the argmax when every
    row is greedy, the top-k bisection when no row sets top_k, the top-p bisection when no row sets top_p, the
    min-p cut when no row sets min_p. The skipped parts are exact no-ops for those rows, so the result is
    bit-identical either way; the bisections are costly per [V] row on a CPU, and a verify pass over a tree pays
    them once per node. False under compile policies without `lax.cond` (Neuron).
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    extra = logits.ndim - 2
    expand = lambda a: a.reshape(a.shape + (1,) * extra)
    t, k, tp = expand(temperature.astype(jnp.float32)), expand(top_k.astype(jnp.int32)), expand(top_p.astype(jnp.float32))
    mp = None if min_p is None else expand(min_p.astype(jnp.float32))
    argmax_of = logits if banned is None else jnp.where(banned, -jnp.inf, logits)
    greedy = jax.nn.one_hot(jnp.argmax(argmax_of, axis=-1), V, dtype=jnp.float32)
    kk = jnp.where(k > 0, jnp.minimum(k, V), V)

    def cut_top_k(scaled):
        # The bisection needs finite values: banned tokens sit at the lowest allowed value, where they are only
        # counted when k reaches every allowed token (and then everything allowed is kept anyway).
        finite = scaled if banned is None else jnp.where(
            banned, jnp.min(jnp.where(banned, jnp.inf, scaled), axis=-1, keepdims=True), scaled)
        kth = _top_k_threshold(finite, kk)
        return jnp.where(finite >= kth[..., None], scaled, -jnp.inf)

    def cut_top_p(probs):
        pth = _top_p_threshold(probs, tp)
        return jnp.where((tp[..., None] >= 1.0) | (probs >= pth[..., None]), probs, 0.0)

    def cut_min_p(probs):
        # Relative to the row's most likely token: the same set before or after renormalisation.
        return jnp.where(probs >= mp[..., None] * jnp.max(probs, axis=-1, keepdims=True), probs, 0.0)

    def maybe(needed, fn, x):
        return jax.lax.cond(needed, fn, lambda y: y, x) if allow_cond else fn(x)

    def sampled(logits):
        scaled = logits / jnp.where(t > 0, t, 1.0)[..., None]
        scaled = maybe(jnp.any(kk < V), cut_top_k, scaled)
        if banned is not None:
            scaled = jnp.where(banned, -jnp.inf, scaled)
        probs = maybe(jnp.any(tp < 1.0), cut_top_p, jax.nn.softmax(scaled, axis=-1))
        if mp is not None:
            probs = maybe(jnp.any(mp > 0.0), cut_min_p, probs)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
        return jnp.where((t > 0)[..., None], probs, greedy)

    if not allow_cond:
        return sampled(logits)
    return jax.lax.cond(jnp.any(t > 0), sampled, lambda _: greedy, logits)


def banned_stops(sampling: SamplingArrays, num_new: jax.Array, vocab_size: int) -> jax.Array | None:
    """[B, ..., V] bool: each row's stop ids while it has emitted fewer than its min_tokens, None when the batch
    has no min_tokens. num_new [B, ...] int32: tokens already emitted before the one being sampled (a verify
    pass gives each tree node the count plus its depth)."""
    if sampling.min_tokens is None:
        return None
    vocab = jnp.arange(vocab_size, dtype=jnp.int32)
    is_stop = jnp.any(sampling.stop_ids[:, :, None] == vocab[None, None, :], axis=1)  # [B, V]; -1 never matches
    extra = num_new.ndim - 1
    stop = is_stop.reshape(is_stop.shape[:1] + (1,) * extra + is_stop.shape[1:])
    early = num_new < sampling.min_tokens.reshape(sampling.min_tokens.shape + (1,) * extra)
    return stop & early[..., None]


def has_penalties(sampling: SamplingArrays) -> bool:
    """Whether the batch's SamplingArrays carry penalties (static: the arrays are present or None)."""
    return sampling.repetition_penalty is not None


def output_counts(out_tokens: jax.Array, num_new: jax.Array, vocab_size: int) -> jax.Array:
    """[B, V] int32 occurrences of each token among a row's first num_new [B] entries of out_tokens [B, M]
    (one scatter-add of B x M ones, not a one-hot over the vocabulary)."""
    B, M = out_tokens.shape
    ok = jnp.arange(M)[None, :] < num_new[:, None]
    idx = jnp.where(ok, out_tokens, vocab_size)  # out of range: dropped
    b = jnp.broadcast_to(jnp.arange(B)[:, None], (B, M))
    return jnp.zeros((B, vocab_size), jnp.int32).at[b, idx].add(1, mode="drop")


def path_counts(base: jax.Array, tokens: jax.Array, path_mask: jax.Array) -> jax.Array:
    """[B, N, V] int32: base [B, V] (the output so far, root included) plus, for each tree node n, the tokens
    of the nodes m with path_mask [B, N, N][b, n, m] (its drafted ancestors and itself, the root excluded by
    the caller): what plain decoding would have emitted before sampling the token after node n.
    tokens [B, N] int32."""
    B, N = tokens.shape
    V = base.shape[-1]
    idx = jnp.where(path_mask, tokens[:, None, :], V)  # [B, N, N]
    b = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, N, N))
    n = jnp.broadcast_to(jnp.arange(N)[None, :, None], (B, N, N))
    return jnp.broadcast_to(base[:, None, :], (B, N, V)).at[b, n, idx].add(1, mode="drop")


def penalize(logits: jax.Array, sampling: SamplingArrays, counts: jax.Array) -> jax.Array:
    """vLLM's penalties on raw logits [B, ..., V] given counts [B, ..., V] (output tokens emitted before the one
    being sampled): repetition over prompt and output tokens, then frequency and presence over the output.
    Rows with the neutral values (0, 0, 1) come out bit-identical. Returns float32 logits."""
    logits = logits.astype(jnp.float32)
    extra = logits.ndim - 2
    expand = lambda a: a.reshape(a.shape[:1] + (1,) * extra + a.shape[1:])  # noqa: E731
    rp = expand(sampling.repetition_penalty.astype(jnp.float32))[..., None]
    freq = expand(sampling.frequency_penalty.astype(jnp.float32))[..., None]
    pres = expand(sampling.presence_penalty.astype(jnp.float32))[..., None]
    present = counts > 0
    seen = present | expand(sampling.prompt_mask)
    logits = jnp.where(seen & (rp != 1.0), jnp.where(logits > 0, logits / rp, logits * rp), logits)
    return logits - freq * counts.astype(jnp.float32) - pres * present.astype(jnp.float32)


def _penalized(logits: jax.Array, sampling: SamplingArrays, counts: jax.Array | None, who: str) -> jax.Array:
    if not has_penalties(sampling):
        return logits
    if counts is None:
        raise ValueError(f"{who}: sampling has penalties, so pass counts (the output tokens emitted so far)")
    return penalize(logits, sampling, counts)


def processed(logits: jax.Array, sampling: SamplingArrays, num_new: jax.Array | None = None,
              counts: jax.Array | None = None, *, allow_cond: bool = True) -> jax.Array:
    """The distribution sampling draws from, every per-request option applied: logits [B, ..., V] ->
    probabilities [B, ..., V]. num_new [B, ...] int32 as in `banned_stops` (needed only when sampling has
    min_tokens); counts [B, ..., V] as in `penalize` (needed only when sampling has penalties). Plain decoding
    and the verify pass that accepts drafts must both build their target distribution here, so that
    acceptance stays lossless with respect to what plain decoding samples."""
    logits = _penalized(logits, sampling, counts, "processed")
    banned = None
    if sampling.min_tokens is not None:
        if num_new is None:
            raise ValueError("processed: sampling has min_tokens, so pass num_new (tokens emitted so far)")
        banned = banned_stops(sampling, num_new, logits.shape[-1])
    return process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p, min_p=sampling.min_p,
                          banned=banned, allow_cond=allow_cond)


def greedy_tokens(logits: jax.Array, sampling: SamplingArrays, num_new: jax.Array | None = None,
                  counts: jax.Array | None = None) -> jax.Array:
    """The greedy choice under `processed`'s rules without building the distribution: logits [B, ..., V] ->
    argmax [B, ...] int32 of the penalized logits over the tokens min_tokens allows (num_new and counts as in
    `processed`). For the greedy shortcuts of plain decoding and verification, which must pick what the one-hot
    of `processed` picks."""
    logits = _penalized(logits, sampling, counts, "greedy_tokens")
    if sampling.min_tokens is not None:
        if num_new is None:
            raise ValueError("greedy_tokens: sampling has min_tokens, so pass num_new (tokens emitted so far)")
        logits = jnp.where(banned_stops(sampling, num_new, logits.shape[-1]), -jnp.inf, logits)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, sampling: SamplingArrays,
                   k: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of `tokens` and of the k most likely tokens under the processed distribution.

    logits [B, T, V], tokens [B, T] int32, sampling's [B] temperature/top_k/top_p/min_p; k static (>= 1).
    Greedy rows (temperature 0) are scored at temperature 1 with their filters: a one-hot would say nothing.
    Computed in the log domain (log_softmax of the kept tokens), so small probabilities keep their precision;
    tokens the filters drop score -inf. Position j of T is the (j+1)-th emitted token (for min_tokens).
    Returns (logprob [B, T], rank [B, T] int32 (1 = most likely), top_logprobs [B, T, k], top_ids [B, T, k]).
    """
    B, T, V = logits.shape
    if has_penalties(sampling):
        # Position j is scored after tokens[:, :j]: an exclusive running count over the output.
        onehot = jax.nn.one_hot(tokens, V, dtype=jnp.int32)
        logits = penalize(logits, sampling, jnp.cumsum(onehot, axis=1) - onehot)
    t = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0).astype(jnp.float32)
    banned = banned_stops(sampling, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T)), V)
    probs = process_logits(logits, t, sampling.top_k, sampling.top_p, min_p=sampling.min_p, banned=banned,
                           allow_cond=False)
    scaled = logits.astype(jnp.float32) / t[:, None, None]
    logp = jax.nn.log_softmax(jnp.where(probs > 0, scaled, -jnp.inf), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    rank = 1 + jnp.sum(logp > chosen[..., None], axis=-1, dtype=jnp.int32)
    vals, ids = top_k(logp, k)
    return chosen, rank, vals, ids


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
    top-k over a 49k-entry vocabulary to a full sort of the row, many times the cost of its TopK kernel. Here each `block`-wide slice gives its own top k first, and a second top-k picks among
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
