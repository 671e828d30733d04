"""Speculative generation as a variant of the host driver (`runners.base`): the drafter of a SpeculativeConfig
(built once per LLM, `llm.runtime`), `spec_engine.spec_prefill`, then the loop.

JAX drafters run the fused on-device loop (`spec_engine.spec_loop`, `device_steps`); with `profile=True`, and for
host-side drafters (suffix decoding), the host steps the same jitted verify+accept function and times drafting
and verification apart (`host_steps`). Both back off by the rule of `specjax.backoff`. Both hand the state back
every `chunk` steps while streaming (`runners.base.stream_events`): the device loop is the same compiled
`spec_loop` called with a smaller step count (traced), so streaming compiles nothing more.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import engine, spec_engine
from specjax.backoff import (NO_LIMIT, Adaptive, adaptive_rule, backoff_decide, backoff_update, calibrate,
                             mean_gain)
from specjax.buckets import make_buckets
from specjax.config import SpeculativeConfig
from specjax.drafters.base import Proposal
from specjax.drafters.build import SpeculativeConfigError, build_drafter
from specjax.requests import spec_metrics
from specjax.runners.base import (SPEC_STREAM_CHUNK, DeviceVariant, chunk_views, generate as run_variant, run_to_end,
                                  stream_events)


def drafter_for(llm, spec: SpeculativeConfig) -> tuple:
    """(drafter, dparams) for a config, built once per LLM (`llm.runtime`), so repeated calls reuse weights and
    compilations. Configs that differ only in `p_min` share one build: p_min is a traced value in dparams, so
    the tuner's sweep over it loads no weights and compiles nothing."""
    spec = with_paired_draft(llm, spec)
    base = dataclasses.replace(spec, p_min=0.0) if spec.p_min else spec
    drafter, dparams = llm.runtime.drafter(base, lambda: build_drafter(base, llm.params, llm.config, llm.dtype))
    if spec.p_min:
        dparams = {**dparams, "p_min": jnp.float32(spec.p_min)}
    return drafter, dparams


def with_paired_draft(llm, spec: SpeculativeConfig) -> SpeculativeConfig:
    """A draft_model config naming `model: auto` -> the draft paired with the target (`resolve.PAIRED_DRAFTS`),
    loaded as its GGUF blocks when the target keeps its own (quantization 'gguf') and the config names none."""
    if spec.method != "draft_model" or str(spec.model).strip().lower() != "auto":
        return spec
    from specjax.models.resolve import PAIRED_DRAFTS, paired_draft

    draft = paired_draft(llm.model_spec)
    if draft is None:
        raise SpeculativeConfigError(f"model 'auto' drafts with the model paired with the target, but "
                                     f"{llm.model_spec!r} has none (pairs: {PAIRED_DRAFTS}); name the draft model")
    quantization = spec.quantization
    if quantization is None and llm.quantization == "gguf" and not draft.startswith("assets/"):
        quantization = "gguf"
    return dataclasses.replace(spec, model=draft, quantization=quantization)


class SpecVariant(DeviceVariant):
    """A drafter's speculative loop. adaptive: the back-off rule (None: always speculate); spec: its config
    (the cache key of break-even and gain prior; None for a bare drafter); profile / force_verify: see
    `generate`; stream: None, or called as stream(prompt_index, new_text) while decoding
    (`runners.base.generate`); chunk: speculative steps (verify or backed-off plain) per loop call while
    streaming."""

    def __init__(self, llm, drafter, dparams, *, adaptive: Adaptive | None = None,
                 spec: SpeculativeConfig | None = None, profile: bool = False, force_verify: bool = False,
                 stream: Callable[[int, str], None] | None = None, chunk: int = SPEC_STREAM_CHUNK):
        self.llm, self.drafter, self.dparams = llm, drafter, dparams
        self.adaptive, self.spec, self.profile, self.force_verify = adaptive, spec, profile, force_verify
        self.stream, self.chunk = stream, chunk
        self.extra_slots = drafter.tree.num_nodes
        self.host = None
        self.times = (None, None)  # (draft seconds, verify seconds) of a host-stepped loop

    def buckets(self, n, max_prompt, max_new, num_stop):
        return make_buckets(n, max_prompt, max_new, extra_slots=self.extra_slots, num_stop=num_stop,
                            kv_dtype=self.llm.kv_cache_dtype)

    def prefill(self, b, tokens, lens, active, sampling):
        return spec_engine.spec_prefill(self.llm.params, self.llm.config, self.dparams, self.drafter, b, tokens,
                                        lens, active, sampling)

    def dec(self, state):
        return state.dec

    def with_dec(self, state, dec):
        return state._replace(dec=dec)

    def loop(self, b, state, sampling, ids):
        return run_to_end(self._steps(b, state, sampling, ids, NO_LIMIT))

    def chunks(self, b, state, sampling, ids):
        return self._steps(b, state, sampling, ids, self.chunk)

    def _steps(self, b, state, sampling, ids, chunk: int):
        """The loop as a generator (a variant's `chunks`, see `runners.base`): yields the output every `chunk`
        steps, returns the finished state."""
        llm, drafter, dparams = self.llm, self.drafter, self.dparams
        key = (self.spec, b.batch)
        if drafter.capabilities.host_side:
            from specjax.drafters.suffix import SuffixHostState

            self.host = SuffixHostState(drafter, llm.runtime.suffix_index(drafter.max_depth).index, ids)
        if self.host is not None or self.profile:
            # Profiling times every drafted step, so it never backs off; host-side drafters back off on the host.
            state, *self.times = yield from host_steps(llm, drafter, dparams, state, sampling, len(ids),
                                                       self.host, None if self.profile else self.adaptive, key,
                                                       chunk)
            return state
        return (yield from device_steps(llm, drafter, dparams, state, sampling, self.adaptive, key,
                                        self.force_verify, chunk))

    def until_free(self, b, state, sampling, max_steps: int, min_gain: float | None = None, force: bool = False):
        """Steps until a slot frees (`spec_engine.spec_until_free`). With a back-off rule, min_gain is the
        break-even (None: the rule's default) and force verifies every step (calibration); both traced, so one
        program serves every value."""
        kw = {} if self.adaptive is None else dict(
            min_gain=jnp.float32(self.adaptive.min_gain if min_gain is None else min_gain),
            force_verify=jnp.bool_(force))
        return spec_engine.spec_until_free(self.llm.params, self.llm.config, self.dparams, self.drafter, state,
                                           sampling, np.int32(max_steps), attention_fn=self.llm.attention_fn,
                                           adaptive=self.adaptive, **kw)

    def slot_break_even(self, b, state, sampling) -> float | None:
        """The back-off break-even of the slot loop at batch b.batch: measured once per (config, batch bucket)
        and process (`backoff.calibrate` on `state`, whose running rows emit real tokens while it times them),
        then kept in `llm.runtime.break_even`. None without a back-off rule, or when the rows ended before a
        measurement (the rule's default then stands)."""
        if self.adaptive is None:
            return None
        key = (self.spec, b.batch)
        rt = self.llm.runtime
        if key not in rt.break_even:
            run = lambda st, steps, g, force: self.until_free(b, st, sampling, steps, g, force)  # noqa: E731
            _, floor = calibrate(run, state)
            if floor is None:
                return None
            rt.break_even[key] = floor
        return rt.break_even[key]

    def finish(self, state, new_ids: list[list[int]]) -> list[dict]:
        if self.host is not None:
            glob = self.llm.runtime.suffix_global
            glob.next_id = self.host.finish(new_ids, glob.next_id)
        stats = jax.device_get(state.stats)
        lossy = self.spec is not None and self.spec.is_lossy
        return [spec_metrics(stats, i, *self.times, lossy) for i in range(len(new_ids))]


def variant_for(llm, spec: SpeculativeConfig, *, profile: bool = False, force_verify: bool = False,
                stream: Callable[[int, str], None] | None = None, chunk: int = SPEC_STREAM_CHUNK) -> SpecVariant:
    """The SpecVariant of a config: its drafter (cached on the LLM) and back-off rule."""
    drafter, dparams = drafter_for(llm, spec)
    return SpecVariant(llm, drafter, dparams, adaptive=adaptive_rule(drafter, spec), spec=spec, profile=profile,
                       force_verify=force_verify, stream=stream, chunk=chunk)


def generate(llm, prompts, ids, params, spec: SpeculativeConfig, *, profile: bool = False,
             force_verify: bool = False, stream: Callable[[int, str], None] | None = None,
             chunk: int = SPEC_STREAM_CHUNK):
    """Speculative generation of `ids` (token lists, one per prompt) for `LLM.generate`. profile: step from the
    host and time draft against verify. force_verify: every step of a device loop verifies, also where the
    drafter found nothing (a lookup miss verifies the root alone; steps the back-off rule turns plain stay
    plain); for timing verify steps (`tune`), not for serving: a miss then costs a verify instead of a plain
    step. Greedy output is the same either way. stream: called as stream(prompt_index, new_text) while
    decoding, every `chunk` steps; the output is the same, token for token."""
    variant = variant_for(llm, spec, profile=profile, force_verify=force_verify, stream=stream, chunk=chunk)
    return run_variant(llm, prompts, ids, params, variant)


def generate_events(llm, prompts, ids, params, spec: SpeculativeConfig, *, chunk: int = SPEC_STREAM_CHUNK):
    """`generate` as a generator (`runners.base.stream_events`): yields (prompt_index, new_text) every `chunk`
    steps; its return value (`outs = yield from generate_events(...)`) is generate's list of RequestOutputs."""
    return stream_events(llm, prompts, ids, params, variant_for(llm, spec, chunk=chunk))


def device_loop(llm, drafter, dparams, state, sampling, adaptive, key, force_verify: bool = False):
    """Run `spec_loop` to the end (`device_steps` in one call); returns the finished state."""
    return run_to_end(device_steps(llm, drafter, dparams, state, sampling, adaptive, key, force_verify))


def device_steps(llm, drafter, dparams, state, sampling, adaptive, key, force_verify: bool = False,
                 chunk: int = NO_LIMIT):
    """Run `spec_loop` until every row finished; returns the finished state. A generator: with chunk = NO_LIMIT,
    one loop call and nothing yielded; otherwise at most `chunk` steps per call, one call ahead of the host,
    yielding each call's output (`runners.base.chunk_views`). Every call runs the one compiled loop (its step
    count is traced), and the
    state carries everything a step reads (caches, RNG step, back-off gains), so the tokens are the same for
    any chunk. With a back-off rule, the first generation of a (config, batch bucket) calibrates its
    break-even on this hardware (`calibrate`, before the first chunk); later ones reuse it from
    `llm.runtime.break_even`. force_verify: every drafted step verifies, also where nothing was proposed (for
    timing verify steps, see `tune`); steps the back-off rule turns plain stay plain."""
    def loop(state, steps, **kw):
        return spec_engine.spec_loop(llm.params, llm.config, dparams, drafter, state, sampling, steps,
                                     attention_fn=llm.attention_fn, **kw)

    steps = jnp.int32(chunk)
    rt = llm.runtime
    if adaptive is None:
        # None (not False) when not forced: the loop compiled for ordinary generations stays the one used.
        forced = jnp.bool_(True) if force_verify else None
        run = lambda state: loop(state, steps, force_verify=forced)  # noqa: E731
    else:
        def timed_run(state, steps: int, min_gain: float, force: bool = False):
            return loop(state, jnp.int32(steps), adaptive=adaptive, min_gain=jnp.float32(min_gain),
                        force_verify=jnp.bool_(force or force_verify))

        floor = rt.break_even.get(key)
        prior = rt.gain_priors.get(key) if adaptive.carry_prior else None
        if prior is not None:
            state = state._replace(gain=jnp.full(state.gain.shape, prior, jnp.float32))
        if floor is None:
            state, floor = calibrate(timed_run, state)
            if floor is not None:
                rt.break_even[key] = floor
        kw = dict(adaptive=adaptive, min_gain=jnp.float32(adaptive.min_gain if floor is None else floor),
                  force_verify=jnp.bool_(force_verify))
        run = lambda state: loop(state, steps, **kw)  # noqa: E731
    if chunk < NO_LIMIT:
        state = yield from chunk_views(run, state, lambda st: st.dec)
    else:
        state = run(state)
    if adaptive is not None:
        _remember_gain(rt, key, state.stats)
    return state


def learned_state(llm) -> dict:
    """A deep copy of what one generation passes to the next: the suffix drafter's global index of earlier
    outputs and the back-off's gain priors (the break-even floors and built drafters are not included: they
    describe the hardware and the weights, not the requests). For `restore_learned`."""
    return llm.runtime.learned_state()


def restore_learned(llm, saved: dict) -> None:
    """Put back a `learned_state` snapshot. A benchmark that repeats one request restores it before each
    repetition: otherwise the repeat finds its own answer in the suffix index (measured: suffix acceptance
    0.99 on every Spec-Bench category at 2 repetitions, against 0.58 at one) and its own acceptance as prior."""
    llm.runtime.restore_learned(saved)


def _remember_gain(runtime, key, stats) -> None:
    """Keep this generation's mean accepted tokens per verify step as the next one's starting gain
    (`backoff.mean_gain`)."""
    gain = mean_gain(stats)
    if gain is not None:
        runtime.gain_priors[key] = gain


def _warm_verify_sizes(llm, drafter, dparams, state, sampling) -> None:
    """Compile the verify of every node count `spec_engine.trim_proposal` may pick, and the plain step, once per
    (drafter, state shapes), before the first step. Compiled on first need instead, a size stalled a generation
    midway (a Spec-Bench request at T = 1 ran at a fraction of its speed). Each size runs once on a copy of the state, which is discarded."""
    shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(state))
    key = (drafter, shapes)
    if key in llm.runtime.warmed:
        return
    tree = drafter.tree
    B, N = state.dec.finish.shape[0], tree.num_nodes
    parents = jnp.broadcast_to(jnp.asarray(tree.parents_array), (B, N))
    for k in spec_engine.verify_sizes(tree):
        valid = jnp.broadcast_to(jnp.arange(N)[None, :] < k, (B, N))
        tokens = jnp.zeros((B, N), jnp.int32).at[:, 0].set(state.dec.last_token)
        proposal, t = spec_engine.trim_proposal(Proposal(tokens, parents, valid, None), tree,
                                                spec_engine.verify_sizes(tree))
        copy_ = jax.tree_util.tree_map(jnp.copy, state)
        jax.block_until_ready(spec_engine.verify_accept_jit(llm.params, llm.config, t, drafter.mode, copy_, proposal,
                                                            sampling, attention_fn=llm.attention_fn,
                                                            features=drafter.features).dec.num_new)
    # The plain step too: a warm-up generation that stops at its first token never runs one. And the loop of plain
    # steps a backed-off stretch runs (its step count is traced: one program for every stretch).
    copy_ = jax.tree_util.tree_map(jnp.copy, state)
    jax.block_until_ready(spec_engine.plain_step_jit(llm.params, llm.config, dparams, drafter, copy_, sampling,
                                                     attention_fn=llm.attention_fn).dec.num_new)
    copy_ = jax.tree_util.tree_map(jnp.copy, state)
    jax.block_until_ready(spec_engine.plain_steps_jit(llm.params, llm.config, dparams, drafter, copy_, sampling,
                                                      np.int32(1), attention_fn=llm.attention_fn).dec.num_new)
    llm.runtime.warmed.add(key)


def backed_off_steps(adaptive: Adaptive, floor, gain, idle, gap, running) -> int:
    """How many plain steps a batch that `backoff_decide` just backed off stays backed off: nothing it reads
    changes over plain steps but `idle`, and the decision can only turn at a row's probe (idle reaching its
    gap) or at four gaps (the batch-wide probe), so only those step counts are tried. At least 1."""
    _, gap_now, _, _ = backoff_decide(adaptive, floor, gain, idle, gap, running, xp=np)
    turns = sorted({int(j) for j in np.concatenate([gap_now - idle, 4 * gap_now - idle]) if j >= 1})
    for j in turns:
        if backoff_decide(adaptive, floor, gain, idle + j, gap, running, xp=np)[3]:
            return j
    return max(turns[-1] if turns else 1, 1)


def host_loop(llm, drafter, dparams, state, sampling, n, host=None, adaptive=None, key=None):
    """`host_steps` to the end. Returns (finished state, draft seconds, verify seconds)."""
    return run_to_end(host_steps(llm, drafter, dparams, state, sampling, n, host, adaptive, key))


def host_steps(llm, drafter, dparams, state, sampling, n, host=None, adaptive=None, key=None,
               chunk: int = NO_LIMIT):
    """Step from the host: propose (jitted, or on the host for host-side drafters), then the jitted
    verify+accept. A generator: yields the DecodeState every `chunk` steps (read before the next step donates
    it: the host waits for every step here anyway); returns (finished state, draft seconds, verify seconds),
    the time the caller spends between yields not counted.

    A host-side drafter's deterministic proposal is cut to the smallest of `spec_engine.verify_sizes` node
    counts that holds it (`spec_engine.trim_proposal`): a short suffix match costs a short verify forward. Every
    size is compiled before the first step (`_warm_verify_sizes`), not when a proposal first needs it.

    With `adaptive`, the same back-off as the device loop (see `backoff.Adaptive`), with the break-even
    measured from this loop's own step times (the first step of each kind and of each verify size compiles and
    is not counted) and kept in `llm.runtime.break_even` under `key`; a step where no row wants to or can speculate is a
    plain decode.
    """
    draft_t = verify_t = 0.0
    B = state.dec.finish.shape[0]
    carry = adaptive is not None and adaptive.carry_prior
    rt = llm.runtime
    gain = np.full(B, rt.gain_priors.get(key, np.inf) if carry else np.inf)
    idle = np.zeros(B, np.int64)
    gap = np.zeros(B, np.int64)
    floor = None if adaptive is None else rt.break_even.get(key, adaptive.min_gain)
    trim = host is not None and not drafter.features and drafter.mode == "deterministic"
    if trim:
        _warm_verify_sizes(llm, drafter, dparams, state, sampling)
    times = {"plain": [], "verify": []}  # per-step seconds, compile steps dropped
    sizes_seen = set()  # node counts verified so far in this call (a new one compiles, or may)

    def plain(state, steps: int = 1):
        t = time.perf_counter()
        if steps == 1:
            state = spec_engine.plain_step_jit(llm.params, llm.config, dparams, drafter, state, sampling,
                                               attention_fn=llm.attention_fn)
        else:
            state = spec_engine.plain_steps_jit(llm.params, llm.config, dparams, drafter, state, sampling,
                                                np.int32(steps), attention_fn=llm.attention_fn)
        jax.block_until_ready(state.dec.num_new)
        times["plain"].append((time.perf_counter() - t) / steps)
        return state

    done = 0  # steps taken
    next_yield = chunk
    while True:
        finish = np.asarray(state.dec.finish)
        running = finish == engine.FINISH_RUNNING
        if not np.any(running[:n]):
            break
        if done >= next_yield:
            yield state.dec
            next_yield += chunk
        if adaptive is not None:
            g, gap, want, batch = backoff_decide(adaptive, floor, gain, idle, gap, running, xp=np)
            if not batch:
                # The whole backed-off stretch up to the next probe in one device loop: stepped one token at a
                # time from the host, each plain step paid a dispatch and a host sync on top of the decode.
                k = min(backed_off_steps(adaptive, floor, gain, idle, gap, running), next_yield - done)
                state = plain(state, k)
                idle += k
                done += k
                if host is not None:
                    host.observe(state, n)
                continue
        done += 1
        t = time.perf_counter()
        if host is not None:
            proposal, dstate = host.propose(state, n), state.dstate
        else:
            proposal, dstate = spec_engine.propose_jit(dparams, drafter, state, sampling)
        if adaptive is not None:
            node = np.arange(proposal.valid.shape[1])[None, :]
            proposal = proposal._replace(valid=proposal.valid & jnp.asarray(want[:, None] | (node == 0)))
        jax.block_until_ready(proposal.tokens)
        t2 = time.perf_counter()
        had = np.any(np.asarray(proposal.valid)[:, 1:], axis=1) & running
        state = state._replace(dstate=dstate)
        if adaptive is not None and not np.any(had):
            draft_t += t2 - t
            state = plain(state)
            if host is not None:
                # A host-side drafter's miss is no free plain step: it paid the host's proposal and a host sync
                # per token. Counted as a step that gained nothing, a row that keeps missing backs off, and its
                # stretch of plain steps then runs on the device (`backed_off_steps`) until a probe.
                gain, idle, gap = backoff_update(adaptive, floor, gain, g, idle, gap, want & running,
                                                 np.zeros(B), xp=np)
            else:
                idle += 1
        else:
            before = np.asarray(state.stats.accepted)
            tree = drafter.tree
            if trim:
                # A short host proposal is verified by a shorter forward (a few compiled sizes).
                proposal, tree = spec_engine.trim_proposal(proposal, tree, spec_engine.verify_sizes(tree))
            state = spec_engine.verify_accept_jit(llm.params, llm.config, tree, drafter.mode, state,
                                                  proposal, sampling, attention_fn=llm.attention_fn,
                                                  features=drafter.features)
            jax.block_until_ready(state.dec.num_new)
            t3 = time.perf_counter()
            draft_t += t2 - t
            verify_t += t3 - t2
            if proposal.tokens.shape[1] in sizes_seen:  # not counted: compiled here unless warmed
                times["verify"].append(t3 - t)
            sizes_seen.add(proposal.tokens.shape[1])
            if adaptive is not None:
                got = np.asarray(state.stats.accepted) - before
                gain, idle, gap = backoff_update(adaptive, floor, gain, g, idle, gap, want & running,
                                                             got, xp=np)
        if host is not None:
            host.observe(state, n)
        if adaptive is not None and len(times["plain"]) > 1 and times["verify"]:
            ratio = np.median(times["verify"]) / np.median(times["plain"][1:])
            floor = max(0.0, float(ratio) - 1.0)
            rt.break_even[key] = floor
    if adaptive is not None:
        _remember_gain(rt, key, state.stats)
    return state, draft_t, verify_t
