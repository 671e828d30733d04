"""Jitted entry points of plain decoding: prefill and the on-device decode loop.

Shape-setting values live in the frozen `Buckets` (a static argument); per-request values travel in
`SamplingArrays`, so a new prompt length in the same bucket or new sampling values never trace again.
Every entry point is jitted here and only here, with the decode state donated (its KV cache is updated in
place across calls).

The last emitted token of each sequence is NOT yet in the KV cache: the next forward (a one-token decode step,
or a speculative verify step with that token as the tree root) writes it. This is the invariant the
speculative engine shares.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.buckets import Buckets
from specjax.kernels import cpu_matmul
from specjax.kv_cache import KVCache, init_cache, map_entries
from specjax.models.llama import LlamaConfig, forward
from specjax.sampling import (SamplingArrays, greedy_tokens, has_penalties, output_counts, processed, sample,
                              uniforms)

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
# The target produced NaN or infinite logits for the row (a corrupt checkpoint, an overflow): the row stops
# without sampling from them, and the host reports it.
FINISH_ERROR = 3


def nonfinite_rows(logits: jax.Array) -> jax.Array:
    """[B] bool: rows of logits [B, ..., V] holding a NaN or an infinity anywhere."""
    return ~jnp.all(jnp.isfinite(logits), axis=tuple(range(1, logits.ndim)))


def fail_rows(state: DecodeState, bad: jax.Array) -> DecodeState:
    """The state with running rows where bad [B] finished as FINISH_ERROR."""
    return state._replace(finish=jnp.where(bad & (state.finish == FINISH_RUNNING), FINISH_ERROR, state.finish))


class DecodeState(NamedTuple):
    cache: KVCache
    last_token: jax.Array  # [B] int32: emitted, not yet in the cache
    out_tokens: jax.Array  # [B, max_new] int32 (-1 = empty)
    num_new: jax.Array  # [B] int32 tokens emitted so far
    finish: jax.Array  # [B] int32 FINISH_*
    step: jax.Array  # [B] int32 decode steps taken (RNG stream position)


def emit(state: DecodeState, tokens: jax.Array, count: jax.Array, sampling: SamplingArrays) -> DecodeState:
    """Append up to K tokens per sequence to the output, honouring stop ids and max_new_tokens exactly.

    tokens [B, K] int32, count [B] int32 (how many of the K are offered). The run is cut after the first stop
    token (which is kept, like eos in HF) and at the request's budget; finished rows take nothing.
    Returns the state with out_tokens/num_new/finish/last_token updated (the cache is untouched).
    """
    B, K = tokens.shape
    j = jnp.arange(K)[None, :]
    active = state.finish == FINISH_RUNNING
    is_stop = jnp.any(tokens[:, :, None] == sampling.stop_ids[:, None, :], axis=-1)  # -1 padding never matches
    offered = (j < count[:, None]) & active[:, None]
    budget = sampling.max_new_tokens - state.num_new  # [B]
    # Position of the first stop among the offered tokens (K if none): tokens after it are dropped.
    first_stop = jnp.min(jnp.where(is_stop & offered, j, K), axis=1)
    take = jnp.minimum(jnp.minimum(jnp.where(active, count, 0), first_stop + 1), jnp.maximum(budget, 0))
    keep = j < take[:, None]
    dst = state.num_new[:, None] + j
    b = jnp.arange(B)[:, None]
    out = state.out_tokens.at[b, jnp.where(keep, dst, state.out_tokens.shape[1])].set(tokens, mode="drop")
    num_new = state.num_new + take
    stopped = active & (first_stop < take)
    hit_len = active & ~stopped & (num_new >= sampling.max_new_tokens)
    finish = jnp.where(stopped, FINISH_STOP, jnp.where(hit_len, FINISH_LENGTH, state.finish))
    last = jnp.take_along_axis(tokens, jnp.clip(take - 1, 0, K - 1)[:, None], axis=1)[:, 0]
    last_token = jnp.where(take > 0, last, state.last_token)
    return state._replace(out_tokens=out, num_new=num_new, finish=finish, last_token=last_token)


def prefill_core(params: dict, config: LlamaConfig, buckets: Buckets, prompts: jax.Array, prompt_lens: jax.Array,
                 active: jax.Array, sampling: SamplingArrays, features: tuple = ()):
    """Prefill right-padded prompts [B, P] (lengths [B]) and emit each sequence's first token. Pure.

    active [B] bool marks real rows (inactive padding rows start finished). features: target features to
    return for every prompt position (see `target_features`); () returns None.
    Returns (DecodeState, features [B, P, F] or None).

    With buckets.prefill_chunk = C > 0 (and C < P), each row is prefilled alone, C tokens at a time, for only the
    chunks its own prompt covers: a batch pays the sum of its rows' lengths (rounded up to C), not B times the
    longest, and a row's prefill is the same computation whatever the batch (batch-invariant). The loops are
    data-dependent, so compile policies without them (Neuron) use buckets with prefill_chunk = 0.
    """
    c = config
    B, P = prompts.shape
    cache = init_cache(c.num_layers, B, buckets.capacity, c.num_kv_heads, c.head_dim, params["embed"].dtype,
                       buckets.kv_dtype)
    C = buckets.prefill_chunk
    if 0 < C < P:
        if P % C:
            raise ValueError(f"prompt bucket {P} is not a multiple of the prefill chunk {C}")
        cache, last_logits, feats = _prefill_rows(params, c, cache, prompts, prompt_lens, active, C, features)
    else:
        positions = jnp.broadcast_to(jnp.arange(P)[None, :], (B, P))
        out = forward(params, c, prompts, positions, cache, logit_positions=(prompt_lens - 1)[:, None],
                      hidden_layers=feature_layers(features))
        cache, last_logits = out.cache, out.logits[:, 0]
        feats = target_features(out, features) if features else None
    return first_token_state(cache._replace(lengths=prompt_lens.astype(jnp.int32)), last_logits, active, sampling,
                             buckets.max_new), feats


def first_token_state(cache: KVCache, last_logits: jax.Array, active: jax.Array, sampling: SamplingArrays,
                      max_new: int) -> DecodeState:
    """The decode state right after a prefill: sample each row's first token from its last prompt logits [B, V]
    and emit it. cache: the prefilled cache, lengths = prompt lengths. Pure."""
    B, V = last_logits.shape
    # No lax.cond here: every compile policy (Neuron's too) compiles this prefill, and it samples one row once.
    nothing = jnp.zeros((B,), jnp.int32)
    counts = jnp.zeros((B, V), jnp.int32) if has_penalties(sampling) else None
    probs = processed(last_logits, sampling, nothing, counts, allow_cond=False)
    step0 = jnp.zeros((B,), jnp.int32)
    first = sample(probs, uniforms(sampling.seed, step0, ())).astype(jnp.int32)
    state = DecodeState(
        cache=cache,
        last_token=first,
        out_tokens=jnp.full((B, max_new), -1, jnp.int32),
        num_new=jnp.zeros((B,), jnp.int32),
        finish=jnp.where(active, FINISH_RUNNING, FINISH_LENGTH).astype(jnp.int32),
        step=step0 + 1,
    )
    bad = nonfinite_rows(last_logits)
    return fail_rows(emit(state, first[:, None], jnp.where(bad, 0, 1).astype(jnp.int32), sampling), bad)


@functools.partial(jax.jit, static_argnames=("config", "max_new"))
def prefill_after_prefix(params: dict, config: LlamaConfig, prefix: KVCache, suffix: jax.Array,
                         suffix_lens: jax.Array, active: jax.Array, sampling: SamplingArrays,
                         max_new: int) -> DecodeState:
    """Prefill a prompt that begins with a prefix whose KV is already computed: prefix is a batch-1 cache
    (lengths [1] = Lp, its capacity the state's), suffix [1, S] the rest of the prompt, right-padded (lengths [1]
    >= 1, Lp + S <= capacity). Only the suffix tokens run, attending to the prefix's slots; the first token is
    sampled as `prefill` samples it. Jitted; nothing donated (the prefix is reused)."""
    B, S = suffix.shape
    positions = prefix.lengths[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
    out = forward(params, config, suffix, positions, prefix, logit_positions=(suffix_lens - 1)[:, None])
    cache = out.cache._replace(lengths=(prefix.lengths + suffix_lens).astype(jnp.int32))
    return first_token_state(cache, out.logits[:, 0], active, sampling, max_new)


def _prefill_rows(params: dict, config: LlamaConfig, cache: KVCache, prompts: jax.Array, prompt_lens: jax.Array,
                  active: jax.Array, C: int, features: tuple):
    """Chunked per-row prefill (see `prefill_core`): prompts [B, P] -> (cache with every row's prompt written,
    logits at each row's last prompt position [B, V] float32, features [B, P, F] or None). Inactive rows are
    skipped (their cache stays zero, their logits zero). Pure."""
    c = config
    B, P = prompts.shape
    n_chunks = jnp.where(active, -(-prompt_lens // C), 0).astype(jnp.int32)  # [B]
    dtype = params["embed"].dtype
    logits0 = jnp.zeros((B, c.vocab_size), jnp.float32)
    feats0 = jnp.zeros((B, P, len(features) * c.hidden_size), dtype) if features else None
    row_of = lambda a, b: jax.lax.dynamic_slice_in_dim(a, b, 1, axis=0)
    put_row = lambda a, r, b: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), b, axis=0)

    def chunk(b, carry):
        j, cache, logits, feats = carry
        start = j * C
        toks = jax.lax.dynamic_slice(prompts, (b, start), (1, C))  # [1, C]
        pos = (start + jnp.arange(C, dtype=jnp.int32))[None, :]
        last = prompt_lens[b] - 1  # this row's last prompt position: its logits sample the first token
        row = map_entries(lambda a: row_of(a, b), cache, lengths=start[None])
        out = forward(params, c, toks, pos, row, logit_positions=jnp.clip(last - start, 0, C - 1)[None, None],
                      hidden_layers=feature_layers(features))
        cache = map_entries(lambda a, r: put_row(a, r, b), cache, out.cache)
        here = (last >= start) & (last < start + C)
        logits = put_row(logits, jnp.where(here, out.logits[:, 0], row_of(logits, b)), b)
        if features:
            feats = jax.lax.dynamic_update_slice(feats, target_features(out, features).astype(feats.dtype),
                                                 (b, start, 0))
        return j + 1, cache, logits, feats

    def row(b, carry):
        cache, logits, feats = carry
        _, cache, logits, feats = jax.lax.while_loop(lambda cr: cr[0] < n_chunks[b], functools.partial(chunk, b),
                                                     (jnp.int32(0), cache, logits, feats))
        return cache, logits, feats

    return jax.lax.fori_loop(0, B, row, (cache, logits0, feats0))


def feature_layers(features: tuple) -> tuple[int, ...]:
    """The integer layer indices in a feature spec (entries are layer indices or "final")."""
    return tuple(f for f in features if f != "final")


def target_features(out, features: tuple) -> jax.Array:
    """Target features a drafter asked for, concatenated: [B, T, F].

    Each entry is "final" (the hidden state the LM head reads, after the last norm: EAGLE-1/2 and Medusa) or a
    layer index (that layer's residual output: EAGLE-3's low/mid/high layers).
    """
    layers = feature_layers(features)
    parts = []
    for f in features:
        parts.append(out.hidden if f == "final" else out.layer_hidden[layers.index(f)])
    return jnp.concatenate(parts, axis=-1)


@functools.partial(jax.jit, static_argnames=("config", "buckets"))
def prefill(params: dict, config: LlamaConfig, buckets: Buckets, prompts: jax.Array, prompt_lens: jax.Array,
            active: jax.Array, sampling: SamplingArrays) -> DecodeState:
    """`prefill_core` for plain decoding. Jitted; nothing donated."""
    return prefill_core(params, config, buckets, prompts, prompt_lens, active, sampling)[0]


def decode_step(params: dict, config: LlamaConfig, state: DecodeState, sampling: SamplingArrays,
                attention_fn=None, allow_cond: bool = True) -> DecodeState:
    """One plain decode step for every sequence: forward the last token, sample, emit. Pure, not jitted.
    allow_cond: False under compile policies without `lax.cond` (see `process_logits`)."""
    return decode_step_features(params, config, state, sampling, attention_fn, allow_cond=allow_cond)[0]


def decode_step_features(params: dict, config: LlamaConfig, state: DecodeState, sampling: SamplingArrays,
                         attention_fn=None, features: tuple = (),
                         allow_cond: bool = True) -> tuple[DecodeState, jax.Array | None]:
    """`decode_step` that also returns the target features of the decoded token ([B, 1, F], None without
    `features`): a feature drafter backed off to plain decoding still needs them for its next proposal."""
    return decode_step_deferred(params, config, state, sampling, attention_fn, features, allow_cond, True)[:2]


def decode_step_deferred(params: dict, config: LlamaConfig, state: DecodeState, sampling: SamplingArrays,
                         attention_fn=None, features: tuple = (), allow_cond: bool = True, write_cache: bool = False):
    """`decode_step_features` that also returns the decoded token's K/V, `forward`'s new_kv (each [B, 1, Hkv, D]),
    and with write_cache=False leaves them out of the cache for the caller to write at the old lengths (the
    returned state's lengths already count the token). Pure, not jitted."""
    cache = state.cache
    with cpu_matmul.row_invariant():  # the products a verify block of the same tokens computes
        out = forward(params, config, state.last_token[:, None], cache.lengths[:, None], cache,
                      attention_fn=attention_fn, hidden_layers=feature_layers(features), write_cache=write_cache)
    logits = out.logits[:, 0]
    # The output so far (the token being forwarded included) for the penalties; None when the batch has none.
    counts = output_counts(state.out_tokens, state.num_new, logits.shape[-1]) if has_penalties(sampling) else None

    def sampled(logits):  # [B, V] -> [B]
        probs = processed(logits, sampling, state.num_new, counts, allow_cond=allow_cond)
        return sample(probs, uniforms(sampling.seed, state.step, ())).astype(jnp.int32)

    def greedy(logits):
        # What `sampled` returns for greedy rows (the one-hot of the argmax, sampled), without the uniforms, the
        # cumulative sum and the one-hot over the vocabulary.
        return greedy_tokens(logits, sampling, state.num_new, counts)

    if allow_cond:
        tok = jax.lax.cond(jnp.any(sampling.temperature > 0), sampled, greedy, logits)
    else:
        tok = sampled(logits)
    running = state.finish == FINISH_RUNNING
    cache = out.cache._replace(lengths=cache.lengths + running.astype(jnp.int32))
    state = state._replace(cache=cache, step=state.step + running.astype(jnp.int32))
    feats = target_features(out, features) if features else None
    bad = nonfinite_rows(logits)
    state = fail_rows(emit(state, tok[:, None], jnp.where(bad, 0, 1).astype(jnp.int32), sampling), bad)
    return state, feats, out.new_kv


@functools.partial(jax.jit, static_argnames=("config", "attention_fn"), donate_argnames=("state",))
def decode_loop(params: dict, config: LlamaConfig, state: DecodeState, sampling: SamplingArrays,
                max_steps: jax.Array, attention_fn=None) -> DecodeState:
    """Decode until every sequence finished or `max_steps` (a traced scalar) steps were taken.

    The whole loop is one `lax.while_loop` on device. A host streaming tokens calls it repeatedly with a small
    max_steps; a plain generation calls it once with a large one: the same compiled program either way.
    Jitted; `state` is donated (its KV cache is reused in place).
    """
    def cond(carry):
        st, i = carry
        return jnp.any(st.finish == FINISH_RUNNING) & (i < max_steps)

    def body(carry):
        st, i = carry
        return decode_step(params, config, st, sampling, attention_fn), i + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
    return state


def until_free(finish_of, step_fn, state, max_steps: jax.Array):
    """Step until a running row finishes, nothing runs, or `max_steps` (traced) steps: a continuous-batching host
    then refills that slot at the earliest step instead of letting it idle until a fixed chunk of steps ends.
    finish_of(state) -> [B] FINISH_*; step_fn(state) -> state. Pure, not jitted."""
    count = lambda st: jnp.sum(finish_of(st) == FINISH_RUNNING)
    start = count(state)

    def cond(carry):
        st, i = carry
        n = count(st)
        return (n == start) & (n > 0) & (i < max_steps)

    def body(carry):
        st, i = carry
        return step_fn(st), i + 1

    return jax.lax.while_loop(cond, body, (state, jnp.int32(0)))[0]


@functools.partial(jax.jit, static_argnames=("config", "attention_fn"), donate_argnames=("state",))
def decode_until_free(params: dict, config: LlamaConfig, state: DecodeState, sampling: SamplingArrays,
                      max_steps: jax.Array, attention_fn=None) -> DecodeState:
    """Plain decoding of every slot until one finishes (or `max_steps`, traced). Jitted; `state` donated."""
    step = lambda st: decode_step(params, config, st, sampling, attention_fn)
    return until_free(lambda st: st.finish, step, state, max_steps)


@functools.partial(jax.jit, donate_argnames=("state",))
def insert_row(state, row, slot: jax.Array):
    """Copy the batch-1 state `row` into row `slot` (traced int32) of the batch state.

    Every leaf of DecodeState / SpecState is batch-first (KV cache [B, Hkv, S, D] per layer and an int8 cache's
    scales [B, Hkv, S], lengths [B], output [B, max_new], history [B, Hc], stats [B] / [B, D], drafter caches), so
    one scatter per leaf moves a whole request. Jitted; `state` donated: the caches are updated in place."""
    return jax.tree_util.tree_map(lambda a, r: a.at[slot].set(r[0]), state, row)


# Fixed-shape entry points for compile policies without data-dependent loops (Neuron): the static settings are
# bound with functools.partial, so the jitted function takes arrays only and can be traced, checked and compiled
# ahead of time per bucket (`runners.neuron.NeuronRunner`).


def _prefill_fixed(params, prompts, prompt_lens, active, sampling, *, config, buckets):
    return prefill_core(params, config, buckets, prompts, prompt_lens, active, sampling)[0]


def _unrolled_steps(params, state, sampling, *, config, steps, allow_cond=False):
    for _ in range(steps):  # unrolled at trace time: no loop in the program
        state = decode_step(params, config, state, sampling, allow_cond=allow_cond)
    return state


def prefill_program(config: LlamaConfig, buckets: Buckets):
    """Jitted prefill(params, prompts [B, P], prompt_lens [B], active [B], sampling) for one bucket."""
    return jax.jit(functools.partial(_prefill_fixed, config=config, buckets=buckets))


def unrolled_step_program(config: LlamaConfig, steps: int, allow_cond: bool):
    """Jitted step(params, state, sampling): `steps` plain decode steps unrolled (no loop). `state` donated."""
    return jax.jit(functools.partial(_unrolled_steps, config=config, steps=steps, allow_cond=allow_cond),
                   donate_argnums=(1,))
