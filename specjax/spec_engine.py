"""The speculative engine: draft -> verify (one target forward over every proposed node) -> accept -> write the accepted K/V.

One pure step function, `spec_step`, shared by every drafter:
  1. the drafter proposes a tree (a chain is a one-branch tree) whose root is the last emitted token;
  2. the target runs ONE forward over all N nodes, writing their K/V at [length, length + N), with the
     ancestor mask and positions length + depth(node);
  3. the shared acceptance sampler (`specjax.acceptance`) walks the tree with the target's processed
     distributions, giving the accepted path and one more token (correction or bonus);
  4. the accepted path's K/V go into place (`kv_cache.write_path`), the tokens are emitted with exact stop and
     max_new_tokens handling, and the per-position acceptance counters advance.

`spec_loop` runs the step in a `lax.while_loop` on device (drafters that are JAX functions); host-side drafters
and profiling call `verify_accept` per step from the host with the proposal computed outside.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import acceptance
from specjax.backoff import Adaptive, backoff_decide, backoff_update
from specjax.drafters.base import DraftContext, Proposal
from specjax.engine import (FINISH_RUNNING, Buckets, DecodeState, decode_step_deferred, emit, fail_rows,
                            feature_layers, prefill_core, target_features, until_free)
from specjax.kernels import cpu_matmul
from specjax.kv_cache import gather_path, write_path
from specjax.models.llama import LlamaConfig, forward
from specjax.sampling import (SamplingArrays, greedy_tokens, has_penalties, output_counts, path_counts, processed,
                              uniforms)
from specjax.tree import TreeSpec, ancestor_mask_from_parents, chain

TARGET_STREAM = 1  # RNG stream of the acceptance uniforms


class SpecStats(NamedTuple):
    verify_steps: jax.Array  # [B] int32 target verify forwards
    drafted: jax.Array  # [B] int32 valid drafted nodes offered (a tree counts all its nodes)
    accepted: jax.Array  # [B] int32 accepted draft tokens
    pos_drafted: jax.Array  # [B, D] int32 steps that had a valid proposal at depth k + 1
    pos_accepted: jax.Array  # [B, D] int32 steps whose depth k + 1 was accepted
    plain_steps: jax.Array  # [B] int32 steps decoded without speculation (nothing proposed)


class SpecState(NamedTuple):
    dec: DecodeState
    history: jax.Array  # [B, Hc] int32: prompt followed by the emitted tokens
    prompt_lens: jax.Array  # [B] int32
    dstate: Any  # drafter state
    hidden: Any  # drafters with `features`: (feats [B, D+1, F] of the root and accepted nodes, count [B]); else None
    stats: SpecStats
    gain: jax.Array  # [B] float32 running mean of accepted tokens per verify step; inf before the first one
    idle: jax.Array  # [B] int32 steps since this sequence last speculated
    gap: jax.Array  # [B] int32 plain steps before a backed-off sequence probes again (0 = Adaptive.probe_every)
    # [B, 2] int32 batch steps run, batch steps that ran a verify forward (for calibration); the same in every
    # row, kept per row so that every leaf leads with the batch axis (continuous batching moves rows)
    counts: jax.Array


def _write_history(history, prompt_lens, old_new, state: DecodeState):
    """Copy the tokens `emit` just appended to out_tokens into the history buffer."""
    B, Hc = history.shape
    K = state.out_tokens.shape[1]
    j = jnp.arange(K)[None, :]
    fresh = (j >= old_new[:, None]) & (j < state.num_new[:, None])
    dst = jnp.where(fresh, prompt_lens[:, None] + j, Hc)
    return history.at[jnp.arange(B)[:, None], dst].set(state.out_tokens, mode="drop")


def context(state: SpecState, sampling: SamplingArrays, allow_cond: bool = True) -> DraftContext:
    hist_len = state.prompt_lens + state.dec.num_new
    return DraftContext(state.history, hist_len, state.dec.last_token, state.dec.cache.lengths, sampling,
                        state.dec.step, state.hidden, allow_cond)


@functools.partial(jax.jit, static_argnames=("config", "drafter", "buckets"))
def spec_prefill(params, config: LlamaConfig, dparams, drafter, buckets: Buckets, prompts, prompt_lens, active,
                 sampling: SamplingArrays) -> SpecState:
    """Prefill the target (first token emitted) and the drafter. Jitted; nothing donated."""
    feats_spec = drafter.features
    dec, feats = prefill_core(params, config, buckets, prompts, prompt_lens, active, sampling, feats_spec)
    B, P = prompts.shape
    Hc = buckets.prompt_len + buckets.max_new
    history = jnp.zeros((B, Hc), jnp.int32).at[:, :P].set(prompts)
    history = _write_history(history, prompt_lens, jnp.zeros_like(prompt_lens), dec)
    dstate = drafter.init(dparams, params, prompts, prompt_lens, buckets.capacity, feats)
    hidden = None
    if feats_spec:
        # The last prompt position plays the role of the last accepted node until the first verify step.
        last = jnp.take_along_axis(feats, (prompt_lens - 1)[:, None, None], axis=1)  # [B, 1, F]
        D1 = drafter.tree.max_depth + 1
        hidden = (jnp.concatenate([last, jnp.zeros((B, D1 - 1, last.shape[-1]), last.dtype)], axis=1),
                  jnp.ones((B,), jnp.int32))
    D = drafter.tree.max_depth
    zB = jnp.zeros((B,), jnp.int32)
    stats = SpecStats(zB, zB, zB, jnp.zeros((B, D), jnp.int32), jnp.zeros((B, D), jnp.int32), zB)
    return SpecState(dec, history, prompt_lens.astype(jnp.int32), dstate, hidden, stats,
                     jnp.full((B,), jnp.inf, jnp.float32), zB, zB, jnp.zeros((B, 2), jnp.int32))


def verify_accept(params, config: LlamaConfig, tree: TreeSpec, mode, state: SpecState, proposal: Proposal,
                  sampling: SamplingArrays, attention_fn=None, features: tuple = (),
                  allow_cond: bool = True) -> tuple[SpecState, acceptance.AcceptResult]:
    """Verify a proposal with one target forward and accept; returns the advanced state. Pure, not jitted.

    proposal.tokens [B, N] (root = last_token), parents/valid [B, N], q [B, N, V] or None.
    mode: the drafter's acceptance mode ("deterministic" / "iid" / "wor", or a lossy `acceptance.TypicalMode`).
    features: target features the drafter reads (stored in state.hidden for the root and accepted nodes).
    allow_cond: False under compile policies without `lax.cond` (see `process_logits`).
    """
    state, result, pending = _verify_accept(params, config, tree, mode, state, proposal, sampling, attention_fn,
                                            features, allow_cond)
    return _write_pending(state, pending), result


def _write_pending(state: SpecState, pending) -> SpecState:
    new_kv, base = pending
    return state._replace(dec=state.dec._replace(cache=write_path(state.dec.cache, new_kv, base)))


def _verify_accept(params, config: LlamaConfig, tree: TreeSpec, mode, state: SpecState, proposal: Proposal,
                   sampling: SamplingArrays, attention_fn, features: tuple, allow_cond: bool):
    """`verify_accept` with the accepted path's K/V not yet in the cache: returns (state, result, pending), pending
    = (K/V of the root and the accepted path [B, D+1, Hkv, D] per layer, base [B]) for `_write_pending`; the
    state's lengths already count the accepted tokens. `spec_step` writes after its verify-or-plain `lax.cond`:
    written inside a branch, the cache was copied whole at every verify step (XLA gives each branch its own
    operand tuple, and a buffer in both could be updated in place by only one of them)."""
    dec = state.dec
    cache = dec.cache
    B, N = proposal.tokens.shape
    D = tree.max_depth
    # Built from the proposal's parents on device (a few tiny boolean matmuls), so static and dynamic trees
    # share one path; `tree` only bounds the node count and the depth.
    tree_mask = ancestor_mask_from_parents(proposal.parents, D)
    depth = jnp.sum(tree_mask, axis=-1).astype(jnp.int32) - 1
    # Padding nodes see only themselves and are seen by nobody, so they cannot disturb real nodes.
    eye = jnp.eye(N, dtype=bool)[None]
    tree_mask = (tree_mask & proposal.valid[:, None, :]) | eye
    positions = cache.lengths[:, None] + depth
    # Other attention backends read the new nodes from the cache: they get them written here, and the accepted
    # path is written again, in order, by `_write_pending`.
    with cpu_matmul.row_invariant():  # each node's products as in a one-token plain step (see there)
        out = forward(params, config, proposal.tokens, positions, cache, tree_mask, attention_fn=attention_fn,
                      hidden_layers=feature_layers(features), write_cache=attention_fn is not None)

    # Each node's logits give the token after it: min_tokens and the penalties see the output plus the node's
    # drafted path (the root is already in the output), as plain decoding would at that point.
    num_new = dec.num_new[:, None] + depth  # [B, N]
    counts = None
    if has_penalties(sampling):
        drafted_path = tree_mask & (jnp.arange(N) > 0)[None, None, :]
        counts = path_counts(output_counts(dec.out_tokens, dec.num_new, out.logits.shape[-1]), proposal.tokens,
                             drafted_path)  # [B, N, V]

    def general(logits):
        p = processed(logits, sampling, num_new, counts, allow_cond=allow_cond)  # [B, N, V]
        u = uniforms(sampling.seed, dec.step, (N + 1,), stream=TARGET_STREAM)
        return acceptance.accept(proposal.tokens, proposal.parents, proposal.valid, p, proposal.q,
                                 u[:, :N], u[:, N], mode)

    def greedy(logits):  # the same AcceptResult from the argmax alone (see greedy_accept_tree)
        return acceptance.greedy_accept_tree(proposal.tokens, proposal.parents, proposal.valid,
                                             greedy_tokens(logits, sampling, num_new, counts))

    if allow_cond and not isinstance(mode, acceptance.TypicalMode):
        result = jax.lax.cond(jnp.any(sampling.temperature > 0), general, greedy, out.logits)
    else:
        result = general(out.logits)
    running = dec.finish == FINISH_RUNNING
    path = acceptance.accepted_path(result.accepted, depth, D)  # [B, D]
    src = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), path], axis=1)
    # Non-finite target logits: every emitted token was decided by the logits of a node on the accepted path
    # (the root, the accepted nodes), so a row keeps the drafted tokens decided before the first such node on
    # its path and stops there (FINISH_ERROR), as plain decoding stops at the step whose logits are not finite.
    # Nodes off the path (rejected drafts) do not count.
    on_path = jnp.arange(D + 1)[None, :] <= result.num_accepted[:, None]  # [B, D + 1]
    finite = jnp.all(jnp.isfinite(jnp.take_along_axis(out.logits, src[:, :, None], axis=1)), axis=-1)
    first_bad = jnp.min(jnp.where(on_path & ~finite, jnp.arange(D + 1)[None, :], D + 1), axis=1)  # [B]
    bad = first_bad <= result.num_accepted
    n_acc = jnp.where(bad, first_bad, result.num_accepted)
    keep = jnp.where(running, 1 + n_acc, 0)
    base = cache.lengths
    pending = (gather_path(out.new_kv, src), base)
    cache = out.cache._replace(lengths=base + keep.astype(jnp.int32))
    run_tokens = jnp.concatenate([jnp.take_along_axis(proposal.tokens, path, axis=1), result.next_token[:, None]], axis=1)
    # emit needs the tokens in order with the correction/bonus right after the last accepted one.
    j = jnp.arange(D + 1)[None, :]
    run_tokens = jnp.where(j < n_acc[:, None], run_tokens,
                           jnp.where(j == n_acc[:, None], result.next_token[:, None], 0))
    old_new = dec.num_new
    dec = dec._replace(cache=cache, step=dec.step + running.astype(jnp.int32))
    dec = fail_rows(emit(dec, run_tokens, jnp.where(bad, n_acc, n_acc + 1), sampling), bad)
    history = _write_history(state.history, state.prompt_lens, old_new, dec)
    st = state.stats
    # The state's per-depth counters span the drafter's full depth; a trimmed verify (`trim_proposal`) has a
    # smaller bound D and leaves the deeper counters as they are.
    D_all = st.pos_drafted.shape[1]
    node_depth_valid = proposal.valid & (depth > 0)
    # drafted per depth: did this step propose anything at depth k + 1
    at_depth = (depth[:, :, None] == (jnp.arange(D_all) + 1)[None, None, :]) & node_depth_valid[:, :, None]
    pos_drafted = jnp.any(at_depth, axis=1)
    pos_acc = (jnp.arange(D_all)[None, :] < n_acc[:, None])
    r = running.astype(jnp.int32)
    stats = SpecStats(
        verify_steps=st.verify_steps + r,
        drafted=st.drafted + r * jnp.sum(node_depth_valid, axis=1).astype(jnp.int32),
        accepted=st.accepted + r * n_acc,
        pos_drafted=st.pos_drafted + r[:, None] * pos_drafted.astype(jnp.int32),
        pos_accepted=st.pos_accepted + r[:, None] * pos_acc.astype(jnp.int32),
        plain_steps=st.plain_steps,
    )
    hidden = None
    if features:
        feats = target_features(out, features)  # [B, N, F]
        hidden = (jnp.take_along_axis(feats, src[:, :, None], axis=1), 1 + n_acc)
    return state._replace(dec=dec, history=history, stats=stats, hidden=hidden), result, pending


def plain_step(params, config: LlamaConfig, dparams, drafter, state: SpecState, sampling: SamplingArrays,
               attention_fn=None, observe: bool = True) -> SpecState:
    """One plain decode step inside a speculative generation (nothing verified): the drafter observes it (unless
    `observe` is False: the caller already let it, see `spec_step`), the history and the features the drafter
    reads advance. Pure, not jitted."""
    return _write_pending(*_plain_step(params, config, dparams, drafter, state, sampling, attention_fn, observe))


def _plain_step(params, config: LlamaConfig, dparams, drafter, state: SpecState, sampling: SamplingArrays,
                attention_fn, observe: bool):
    """`plain_step` with the token's K/V not yet in the cache: (state, pending) as `_verify_accept` gives them,
    pending's K/V [B, 1, Hkv, D] per layer."""
    old_new = state.dec.num_new
    base = state.dec.cache.lengths
    if observe:
        state = state._replace(dstate=drafter.observe_plain(dparams, state.dstate, context(state, sampling)))
    dec, feats, new_kv = decode_step_deferred(params, config, state.dec, sampling, attention_fn, drafter.features,
                                              write_cache=attention_fn is not None)
    r = (state.dec.finish == FINISH_RUNNING).astype(jnp.int32)
    stats = state.stats._replace(plain_steps=state.stats.plain_steps + r)
    hidden = state.hidden
    if feats is not None:
        # The decoded token (the old root) is now the last committed node: its feature alone, count 1.
        pad = jnp.zeros((feats.shape[0], hidden[0].shape[1] - 1, feats.shape[-1]), hidden[0].dtype)
        hidden = (jnp.concatenate([feats.astype(hidden[0].dtype), pad], axis=1), jnp.ones_like(hidden[1]))
    return state._replace(dec=dec, history=_write_history(state.history, state.prompt_lens, old_new, dec),
                          stats=stats, idle=state.idle + 1, hidden=hidden,
                          counts=state.counts + jnp.array([1, 0], jnp.int32)), (new_kv, base)


def spec_step(params, config: LlamaConfig, dparams, drafter, state: SpecState, sampling: SamplingArrays,
              attention_fn=None, allow_cond: bool = True, adaptive: Adaptive | None = None,
              min_gain: jax.Array | None = None, force_verify: jax.Array | None = None) -> SpecState:
    """One speculative step for every sequence. Pure, not jitted.

    allow_cond: decode one plain token instead of verifying when no sequence of the batch has anything to
    verify (an n-gram miss everywhere, or every sequence backed off); off under compile policies without
    `lax.cond` (Neuron), where masked proposals are verified instead (same tokens, more compute).
    adaptive: the per-sequence back-off rule, None = always speculate.
    min_gain: [] float32 break-even gain overriding `adaptive.min_gain` (traced: no recompile), or None.
    force_verify: [] bool (traced), or None = False: take the verify branch even where nothing was proposed (a
    lookup miss verifies the root alone, at a full verify's cost, and emits the target's own token). For timing
    verify steps: a chunk of steps that all verify measures their cost without charging misses at a guessed
    plain-step cost (`backoff.calibrate`, `tune.measure_loop_costs`).
    """
    running = state.dec.finish == FINISH_RUNNING
    if adaptive is None:
        want = jnp.ones_like(running)
    else:
        floor = jnp.float32(adaptive.min_gain) if min_gain is None else min_gain.astype(jnp.float32)
        g, gap, want, batch = backoff_decide(adaptive, floor, state.gain, state.idle, state.gap, running)
    ctx = context(state, sampling, allow_cond)

    def draft(state):
        proposal, dstate = drafter.propose(dparams, state.dstate, ctx)
        node = jnp.arange(proposal.valid.shape[1])[None, :]
        return proposal._replace(valid=proposal.valid & (want[:, None] | (node == 0))), dstate

    def no_draft(state):
        # No proposal, so this step is a plain one: the drafter observes it here. In the plain branch below, which
        # also writes the target's KV cache, the drafter's cache update cost a step time growing with the context,
        # like a copy of the target's cache (EAGLE-3 on a long RAG prompt: reports/spec_bench_cpu/backoff_observe/).
        shapes = jax.eval_shape(draft, state)[0]
        return (jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
                drafter.observe_plain(dparams, state.dstate, ctx))

    # Two conds one after the other, never one inside the other: the draft (or nothing, when the batch backs off),
    # then the verify or a plain step. Both branches of the second update the target KV cache; inside another
    # cond's branch XLA:CPU copied every cache layer twice per verify step, even with region analysis on.
    if allow_cond and adaptive is not None:
        proposal, dstate = jax.lax.cond(batch, draft, no_draft, state)
    else:
        proposal, dstate = draft(state)
    state = state._replace(dstate=dstate)
    had = jnp.any(proposal.valid[:, 1:], axis=1) & running
    if force_verify is not None:
        # Only where a proposal was made (its root is valid): a batch that backed off has observed a plain step.
        had = had | (force_verify & running & proposal.valid[:, 0])

    P = drafter.tree.max_depth + 1

    def plain(state):
        # Observed already: by `no_draft`, or by `propose`, which writes whatever `observe_plain` would (the
        # Drafter contract) when it ran and proposed nothing. Its one token's K/V, padded to the verify's P
        # entries: the padding lands in free slots past the new length.
        new, (new_kv, base) = _plain_step(params, config, dparams, drafter, state, sampling, attention_fn,
                                          observe=False)
        pad = lambda a: jnp.pad(a, ((0, 0), (0, P - 1), (0, 0), (0, 0)))  # noqa: E731
        return new, (jax.tree_util.tree_map(pad, new_kv), base)

    def verify(state):
        before = state.stats.accepted
        new, result, pending = _verify_accept(params, config, drafter.tree, drafter.mode, state, proposal,
                                              sampling, attention_fn, drafter.features, allow_cond)
        new = new._replace(dstate=drafter.update(dparams, new.dstate, ctx, result), counts=state.counts + 1)
        if adaptive is not None:
            got = (new.stats.accepted - before).astype(jnp.float32)
            gain, idle, gap_new = backoff_update(adaptive, floor, state.gain, g, state.idle, gap, want & running,
                                                 got)
            new = new._replace(gain=gain, idle=idle, gap=gap_new)
        return new, pending

    # Both branches leave the target cache alone and hand back the K/V to write, written once after the cond:
    # see `_verify_accept`.
    state, pending = verify(state) if not allow_cond else jax.lax.cond(jnp.any(had), verify, plain, state)
    return _write_pending(state, pending)


@functools.partial(jax.jit, static_argnames=("config", "drafter", "attention_fn", "allow_cond", "adaptive"),
                   donate_argnames=("state",))
def spec_loop(params, config: LlamaConfig, dparams, drafter, state: SpecState, sampling: SamplingArrays,
              max_steps: jax.Array, attention_fn=None, allow_cond: bool = True,
              adaptive: Adaptive | None = None, min_gain: jax.Array | None = None,
              force_verify: jax.Array | None = None) -> SpecState:
    """Speculate until every sequence finished or `max_steps` (traced) steps ran: one `lax.while_loop`.

    min_gain: [] float32 traced break-even of the back-off rule (see `Adaptive`), or None for its default.
    force_verify: [] bool traced, or None: every step verifies, also where nothing was proposed (see `spec_step`).
    Jitted; `state` is donated (target and draft KV caches are updated in place).
    """
    def cond(carry):
        st, i = carry
        return jnp.any(st.dec.finish == FINISH_RUNNING) & (i < max_steps)

    def body(carry):
        st, i = carry
        return spec_step(params, config, dparams, drafter, st, sampling, attention_fn, allow_cond, adaptive,
                         min_gain, force_verify), i + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
    return state


def trim_proposal(proposal: Proposal, tree: TreeSpec, sizes: Sequence[int]) -> tuple[Proposal, TreeSpec]:
    """Cut a host-side proposal to the smallest node count in `sizes` that holds every valid node of every row,
    so that a short proposal is verified by a shorter target forward (on a CPU a 2-token verify costs about
    1.4 plain steps, a 5-token one about 1.9). Host-side, not jitted: it picks which compiled verify to call.

    proposal.tokens/parents/valid [B, N] with the valid nodes of each row first (node 0, the root, always
    valid) and q None; tree the drafter's TreeSpec (N nodes); sizes ascending node counts, each <= N.
    Returns (proposal [B, k], depth-bound tree): the returned TreeSpec is a chain whose depth min(D, k - 1)
    bounds every path of k nodes, which is all `verify_accept` reads of it. Exact: the cut nodes are padding,
    never accepted, and the verify of k nodes computes the same logits for the nodes it keeps."""
    if proposal.q is not None:
        raise ValueError("trim_proposal takes deterministic proposals only (q is None)")
    valid = np.asarray(proposal.valid)
    N = valid.shape[1]
    if N != tree.num_nodes:
        raise ValueError(f"proposal has {N} nodes, the tree {tree.num_nodes}")
    used = int(np.max(np.where(valid, np.arange(N)[None, :] + 1, 1)))
    k = next((s for s in sorted(sizes) if used <= s <= N), N)
    if k == N:
        return proposal, tree
    cut = Proposal(proposal.tokens[:, :k], proposal.parents[:, :k], proposal.valid[:, :k], None)
    return cut, chain(min(tree.max_depth, k - 1))


def verify_sizes(tree: TreeSpec) -> tuple[int, ...]:
    """The node counts a host-side drafter's proposals are cut to (`trim_proposal`): 2, 3, 5, 9, ... below the
    tree's N, then N. Each is one compiled verify; powers of two plus the root keep the count logarithmic."""
    N = tree.num_nodes
    out, s = [], 1
    while s + 1 < N:
        out.append(s + 1)
        s *= 2
    return tuple(out) + (N,)


@functools.partial(jax.jit, static_argnames=("config", "tree", "mode", "attention_fn", "features"),
                   donate_argnames=("state",))
def verify_accept_jit(params, config: LlamaConfig, tree: TreeSpec, mode, state: SpecState, proposal: Proposal,
                      sampling: SamplingArrays, attention_fn=None, features: tuple = ()) -> SpecState:
    """`verify_accept` as a jitted entry point for host-side drafters (suffix decoding) and profiling.
    Jitted; `state` is donated."""
    return verify_accept(params, config, tree, mode, state, proposal, sampling, attention_fn, features)[0]


@functools.partial(jax.jit, static_argnames=("config", "drafter", "attention_fn"), donate_argnames=("state",))
def plain_step_jit(params, config: LlamaConfig, dparams, drafter, state: SpecState, sampling: SamplingArrays,
                   attention_fn=None) -> SpecState:
    """`plain_step` as a jitted entry point for the host loop (a step where nothing is worth verifying).
    Jitted; `state` is donated."""
    return plain_step(params, config, dparams, drafter, state, sampling, attention_fn)


@functools.partial(jax.jit, static_argnames=("config", "drafter", "attention_fn"), donate_argnames=("state",))
def plain_steps_jit(params, config: LlamaConfig, dparams, drafter, state: SpecState, sampling: SamplingArrays,
                    steps: jax.Array, attention_fn=None) -> SpecState:
    """Up to `steps` (traced) `plain_step`s in one on-device loop, stopping early when every row finished: the
    host loop's backed-off stretch between two probes, one dispatch and one host sync for all of it instead of
    one per token. Jitted; `state` is donated."""
    def cond(carry):
        st, i = carry
        return jnp.any(st.dec.finish == FINISH_RUNNING) & (i < steps)

    def body(carry):
        st, i = carry
        return plain_step(params, config, dparams, drafter, st, sampling, attention_fn), i + 1

    return jax.lax.while_loop(cond, body, (state, jnp.int32(0)))[0]


@functools.partial(jax.jit, static_argnames=("drafter",))
def propose_jit(dparams, drafter, state: SpecState, sampling: SamplingArrays):
    """The drafter's propose step alone (to time drafting apart from verification). Jitted."""
    return drafter.propose(dparams, state.dstate, context(state, sampling))


@functools.partial(jax.jit, static_argnames=("config", "drafter", "attention_fn", "adaptive"),
                   donate_argnames=("state",))
def spec_until_free(params, config: LlamaConfig, dparams, drafter, state: SpecState, sampling: SamplingArrays,
                    max_steps: jax.Array, attention_fn=None, adaptive: Adaptive | None = None,
                    min_gain: jax.Array | None = None, force_verify: jax.Array | None = None) -> SpecState:
    """Speculative steps of every slot until one finishes (or `max_steps`, traced); for continuous batching.
    min_gain / force_verify: traced, as in `spec_loop` (the break-even measured at this batch size). Jitted;
    `state` donated."""
    step = lambda st: spec_step(params, config, dparams, drafter, st, sampling, attention_fn, adaptive=adaptive,
                                min_gain=min_gain, force_verify=force_verify)
    return until_free(lambda st: st.dec.finish, step, state, max_steps)


def _spec_prefill_fixed(params, dparams, prompts, prompt_lens, active, sampling, *, config, drafter, buckets):
    return spec_prefill(params, config, dparams, drafter, buckets, prompts, prompt_lens, active, sampling)


def _fused_steps(params, dparams, state, sampling, *, config, drafter, steps, allow_cond=False):
    for _ in range(steps):  # unrolled at trace time: no loop in the program
        state = spec_step(params, config, dparams, drafter, state, sampling, None, allow_cond=allow_cond)
    return state


def spec_prefill_program(config: LlamaConfig, drafter, buckets: Buckets):
    """Jitted prefill(params, dparams, prompts [B, P], prompt_lens [B], active [B], sampling) for one bucket
    (fixed shapes, for ahead-of-time compilation)."""
    return jax.jit(functools.partial(_spec_prefill_fixed, config=config, drafter=drafter, buckets=buckets))


def fused_step_program(config: LlamaConfig, drafter, steps: int, allow_cond: bool):
    """Jitted step(params, dparams, state, sampling): `steps` fused propose + verify + accept steps unrolled,
    with `lax.cond` only when `allow_cond`. `state` donated."""
    return jax.jit(functools.partial(_fused_steps, config=config, drafter=drafter, steps=steps,
                                     allow_cond=allow_cond), donate_argnums=(2,))
