"""Host side of speculative generation: build the drafter from a SpeculativeConfig, run the engine, report.

`generate(llm, ...)` is what `LLM.generate(..., speculative_config=...)` calls. JAX drafters run the fused
on-device loop (`spec_engine.spec_loop`); with `profile=True`, and for host-side drafters (suffix decoding),
the host steps the same jitted verify+accept function and times drafting and verification apart.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import acceptance, engine, spec_engine
from specjax.config import SpeculativeConfig
from specjax.drafters.base import Proposal
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.models.llama import fuse_projections
from specjax.errors import SpecjaxError


class SpeculativeConfigError(SpecjaxError, ValueError):
    """The speculative configuration cannot be used with this target model."""


def build_drafter(llm, spec: SpeculativeConfig):
    """(drafter, dparams) for a config; cached on the LLM so repeated calls reuse weights and compilations."""
    # The whole frozen config is the key: any option may shape the drafter (suffix depth, tree choices, ...).
    key = spec
    if key in llm._drafters:
        return llm._drafters[key]
    g = spec.num_speculative_tokens
    if spec.method == "ngram":
        built = NgramDrafter(g, spec.prompt_lookup_min, spec.prompt_lookup_max), {}
    elif spec.method == "draft_model":
        built = _draft_model(llm, spec)
    elif spec.method == "suffix":
        from specjax.drafters.suffix import SuffixDrafter

        built = SuffixDrafter.from_config(spec), {}
    elif spec.method == "medusa":
        from specjax.drafters import medusa

        built = medusa.load(spec.model, llm.params, llm.config.hidden_size, llm.config.vocab_size,
                            num_speculative_tokens=spec.num_speculative_tokens, tree_choices=spec.tree_choices,
                            acceptance_rule=spec.acceptance,
                            typical_posterior_threshold=spec.typical_posterior_threshold,
                            typical_posterior_alpha=spec.typical_posterior_alpha)
    elif spec.method in ("eagle", "eagle3"):
        from specjax.drafters.eagle import build_eagle

        built = build_eagle(llm, spec)
    else:
        raise SpeculativeConfigError(
            f"speculative method {spec.method!r} is not available in this build of specjax; "
            "available: 'ngram', 'draft_model', 'suffix', 'medusa', 'eagle', 'eagle3'")
    built = _with_acceptance(built, spec)
    if spec.lookup_tokens:
        from specjax.drafters.with_lookup import WithLookup

        lookup = NgramDrafter(spec.lookup_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        built = WithLookup(built[0], lookup), built[1]
    llm._drafters[key] = built
    return built


def _with_acceptance(built, spec: SpeculativeConfig):
    """Apply `acceptance: typical` (lossy, opt-in) to a drafter whose candidates are deterministic."""
    drafter, dparams = built
    if spec.acceptance != "typical" or isinstance(drafter.mode, acceptance.TypicalMode):
        return built
    if drafter.mode != "deterministic":
        raise SpeculativeConfigError(
            f"acceptance 'typical' needs deterministic drafts (medusa, eagle, eagle3, ngram, suffix); method "
            f"{spec.method!r} samples its drafts, so use acceptance 'lossless'")
    mode = acceptance.TypicalMode(spec.typical_posterior_threshold, spec.typical_posterior_alpha)
    return dataclasses.replace(drafter, mode=mode), dparams


def _draft_model(llm, spec: SpeculativeConfig):
    from specjax.models.loading import load_model, resolve_model

    path = resolve_draft_path(spec.model)
    cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else None
    if cfg_file and "specjax_draft" in pathlib.Path(cfg_file).read_text():
        from specjax.train.draft_model import load_draft

        config, params, d2t = load_draft(path, llm.params)
        if config.vocab_size != llm.config.vocab_size:
            raise SpeculativeConfigError(
                f"draft model {spec.model!r} was built for a vocabulary of {config.vocab_size} tokens, the target "
                f"has {llm.config.vocab_size}; a draft must share the target's tokenizer")
        dparams = {"params": fuse_projections(jax.tree_util.tree_map(lambda a: a.astype(llm.params["embed"].dtype),
                                                                     params)),
                   "d2t": jnp.asarray(d2t, jnp.int32)}
    else:
        resolve_model(path)
        loaded = load_model(path, llm.dtype, with_tokenizer=False)
        config = loaded.config
        if config.vocab_size != llm.config.vocab_size:
            raise SpeculativeConfigError(
                f"draft model {spec.model!r} has a vocabulary of {config.vocab_size} tokens, the target has "
                f"{llm.config.vocab_size}; a draft must share the target's tokenizer")
        dparams = {"params": fuse_projections(loaded.params)}
    return DraftModelDrafter(config, spec.num_speculative_tokens, llm.config.vocab_size), dparams


def adaptive_rule(drafter, spec: SpeculativeConfig):
    """The back-off rule for a drafter: below `min_gain` accepted tokens per verify step, speculation costs more
    than it yields on this hardware. A draft model pays for its own forwards, so it needs more acceptance than a
    free lookup. None when the config turns adaptation off."""
    if not spec.adaptive:
        return None
    # Defaults where calibration has not measured this hardware yet, from this project's CPU measurements: with the
    # CPU kernels a verify step of gamma + 1 = 5 tokens costs 0.96-1.20 plain steps inside the loop at batch 1
    # (reports/spec_bench_cpu/ngram_gamma/), so a lookup pays from ~0.2 accepted tokens per step (0.25 leaves a
    # margin); a draft model also pays gamma draft forwards.
    if isinstance(drafter, DraftModelDrafter):
        return spec_engine.Adaptive(min_gain=0.9)
    if drafter.features:
        # Head drafters (Medusa, EAGLE) verify trees of 8-33 nodes and run a head per level: a step costs several
        # plain steps on this CPU, so they need more accepted tokens, and probe rarely once they backed off.
        return spec_engine.Adaptive(min_gain=max(0.9, 0.1 * drafter.tree.num_nodes), probe_every=64)
    # Lookups (n-gram, suffix): each request starts optimistic, with no gain carried over from the last one.
    return spec_engine.Adaptive(min_gain=0.25, carry_prior=False)


def resolve_draft_path(model: str | None) -> str:
    """A draft path as given, or relative to the installed package (the shipped `assets/...` drafts)."""
    if model is None:
        raise SpeculativeConfigError("method 'draft_model' needs `model`: the path of the draft model")
    if os.path.exists(model):
        return model
    packaged = os.path.join(os.path.dirname(os.path.abspath(__file__)), model)
    if os.path.exists(packaged):
        return packaged
    raise SpeculativeConfigError(f"draft model path {model!r} does not exist (also looked in {packaged})")


def generate(llm, prompts, ids, params, spec: SpeculativeConfig, *, profile: bool = False,
             force_verify: bool = False):
    """Speculative generation of `ids` (token lists, one per prompt) for `LLM.generate`. profile: step from the
    host and time draft against verify. force_verify: every step of a device loop verifies, also where the
    drafter found nothing (a lookup miss verifies the root alone; steps the back-off rule turns plain stay
    plain); for timing verify steps (`tune`), not for serving: a miss then costs a verify instead of a plain
    step. Greedy output is the same either way."""
    drafter, dparams = build_drafter(llm, spec)
    extra = drafter.tree.num_nodes
    for i, (t, sp) in enumerate(zip(ids, params)):
        llm._check(i, t, sp, extra)
    n = len(ids)
    b = engine.make_buckets(n, max(map(len, ids)), max(p.max_new_tokens for p in params), extra_slots=extra,
                            num_stop=llm.num_stop(params))
    from specjax.api import pad_prompts

    tokens, lens, active = pad_prompts(ids, b.batch, b.prompt_len)
    sampling = llm.sampling_arrays(params, b.batch, b.num_stop)
    t0 = time.perf_counter()
    state = spec_engine.spec_prefill(llm.params, llm.config, dparams, drafter, b, tokens, lens, active, sampling)
    jax.block_until_ready(state.dec.last_token)
    ttft = time.perf_counter() - t0
    draft_time = verify_time = None
    host = None
    if getattr(drafter, "host_side", False):
        from specjax.drafters.suffix import SuffixHostState
        from specjax.drafters.suffix_tree import SuffixIndex

        if "suffix_global" not in llm._drafters:
            llm._drafters["suffix_global"] = [SuffixIndex(drafter.max_depth, max_sequences=SUFFIX_GLOBAL_SEQS), 0]
        glob = llm._drafters["suffix_global"]
        host = SuffixHostState(drafter, glob[0], ids)
    adaptive = adaptive_rule(drafter, spec)
    key = ("break_even", spec, b.batch)
    if host is not None or profile:
        # Profiling times every drafted step, so it never backs off; host-side drafters back off on the host.
        state, draft_time, verify_time = host_loop(llm, drafter, dparams, state, sampling, n, host,
                                                   None if profile else adaptive, key)
    else:
        state = device_loop(llm, drafter, dparams, state, sampling, adaptive, key, force_verify)
    jax.block_until_ready(state.dec.num_new)
    total = time.perf_counter() - t0
    if host is not None:
        outs = np.asarray(state.dec.out_tokens)
        glob[1] = host.finish([outs[i, :int(state.dec.num_new[i])].tolist() for i in range(n)], glob[1])
    return [llm._output(prompts[i], ids[i], np.asarray(state.dec.out_tokens[i, :int(state.dec.num_new[i])]),
                        np.asarray(state.dec.finish[i]), ttft, total,
                        **spec_metrics(state.stats, i, draft_time, verify_time, spec.is_lossy))
            for i in range(n)]


SUFFIX_GLOBAL_SEQS = 256  # earlier generations kept in the global suffix cache (FIFO)


NO_LIMIT = 2 ** 30
CALIBRATION_STEPS = 6  # steps timed per kind (speculative, plain) on the first generation of a config
CALIBRATION_MIN_VERIFY = 3  # verify steps a speculative chunk needs before its timing says anything


def device_loop(llm, drafter, dparams, state, sampling, adaptive, key, force_verify: bool = False):
    """Run `spec_loop` to the end. With a back-off rule, the first generation of a (config, batch bucket)
    calibrates its break-even on this hardware (`calibrate`); later ones reuse it from the LLM's cache.
    force_verify: every drafted step verifies, also where nothing was proposed (for timing verify steps, see
    `tune`); steps the back-off rule turns plain stay plain."""
    def run(state, steps: int, min_gain: float, force: bool = False):
        return spec_engine.spec_loop(llm.params, llm.config, dparams, drafter, state, sampling, jnp.int32(steps),
                                     attention_fn=llm._attention_fn, adaptive=adaptive,
                                     min_gain=jnp.float32(min_gain), force_verify=jnp.bool_(force or force_verify))

    if adaptive is None:
        # None (not False) when not forced: the loop compiled for ordinary generations stays the one used.
        return spec_engine.spec_loop(llm.params, llm.config, dparams, drafter, state, sampling,
                                     jnp.int32(NO_LIMIT), attention_fn=llm._attention_fn,
                                     force_verify=jnp.bool_(True) if force_verify else None)
    floor = llm._drafters.get(key)
    prior = llm._drafters.get(_prior_key(key)) if adaptive.carry_prior else None
    if prior is not None:
        state = state._replace(gain=jnp.full(state.gain.shape, prior, jnp.float32))
    if floor is None:
        state, floor = calibrate(run, state)
        if floor is not None:
            llm._drafters[key] = floor
    state = run(state, NO_LIMIT, adaptive.min_gain if floor is None else floor)
    _remember_gain(llm, key, state.stats)
    return state


def _prior_key(key):
    return ("gain_prior",) + tuple(key[1:])


def _is_learned(key) -> bool:
    return key == "suffix_global" or (isinstance(key, tuple) and key[:1] == ("gain_prior",))


def learned_state(llm) -> dict:
    """A deep copy of what one generation passes to the next: the suffix drafter's global index of earlier
    outputs and the back-off's gain priors (the break-even floors and built drafters are not included: they
    describe the hardware and the weights, not the requests). For `restore_learned`."""
    return {k: copy.deepcopy(v) for k, v in llm._drafters.items() if _is_learned(k)}


def restore_learned(llm, saved: dict) -> None:
    """Put back a `learned_state` snapshot. A benchmark that repeats one request restores it before each
    repetition: otherwise the repeat finds its own answer in the suffix index (measured: suffix acceptance
    0.99 on every Spec-Bench category at 2 repetitions, against 0.58 at one) and its own acceptance as prior."""
    for k in [k for k in llm._drafters if _is_learned(k)]:
        del llm._drafters[k]
    llm._drafters.update(copy.deepcopy(saved))


def _remember_gain(llm, key, stats) -> None:
    """Keep the mean accepted tokens per verify step of this generation as the starting gain of the next one
    with the same config and batch bucket: a drafter that did not pay starts backed off (and probes) instead of
    paying for its first verify steps again; one that paid starts speculating.

    The probe gap is not kept: each request starts probing at `probe_every`. Acceptance is a property of the
    prompt (an n-gram lookup pays on extraction and nowhere else), and a gap carried over from requests the
    drafter could not help grew past the length of a whole generation, so a request it could help never
    probed (Spec-Bench, 2026-11-30: no method verified a single step on 13 prompts)."""
    verify = int(np.sum(np.asarray(stats.verify_steps)))
    if verify:
        llm._drafters[_prior_key(key)] = float(np.sum(np.asarray(stats.accepted))) / verify


def calibrate(run, state, steps: int = CALIBRATION_STEPS, rounds: int = 2, clock=time.perf_counter,
              min_verify: int = CALIBRATION_MIN_VERIFY):
    """Measure the back-off break-even on this hardware from the generation's own first steps (they emit real
    tokens: both kinds of step are lossless). One warm-up step compiles; then `rounds` times, `steps`
    forced-speculative and `steps` forced-plain steps are timed, and each kind keeps its fastest round (the
    least disturbed by anything else running). A speculative step costs `ratio` plain steps and yields
    1 + gain tokens, so speculation pays while gain >= ratio - 1. Returns (state, break-even gain, or None when
    the generation ended, or no round's speculative chunk verified at least `min_verify` steps: then the
    rule's default stands and the next generation calibrates again).

    The speculative chunks run with `force_verify`: a lookup miss verifies the root alone, at a verify step's
    cost, so every step of the chunk is a verify step. Without it a miss was a plain step charged at the plain
    chunk's step cost, and with one verify step among six the estimate was mostly the two chunks' timing noise:
    two processes on the same n-gram config calibrated 0.0 and 0.41 that way. A loop that cannot force (any
    non-verify step left in the chunk) is still handled by that subtraction and by `min_verify`.

    run(state, steps, min_gain, force_verify) -> state runs the jitted loop (`min_gain` and `force_verify` are
    traced: nothing recompiles); clock() -> seconds.
    """
    force_spec, force_plain = -1e9, 1e9
    state = run(state, 1, force_spec, True)

    def timed(state, k, g):
        c0 = np.asarray(state.counts).max(axis=0)
        t = clock()
        state = run(state, k, g, g == force_spec)
        c1 = np.asarray(state.counts).max(axis=0)  # waits for the loop
        return state, clock() - t, c1 - c0

    per_plain, per_verify = [], []
    for _ in range(rounds):
        state, t_spec, c_spec = timed(state, steps, force_spec)
        state, t_plain, c_plain = timed(state, steps, force_plain)
        if c_plain[0] == 0 or c_spec[1] == 0:
            break
        plain = t_plain / c_plain[0]
        per_plain.append(plain)
        if c_spec[1] >= min_verify:
            per_verify.append((t_spec - (c_spec[0] - c_spec[1]) * plain) / c_spec[1])
    if not per_verify:
        return state, None
    return state, max(0.0, min(per_verify) / min(per_plain) - 1.0)


def _warm_verify_sizes(llm, drafter, dparams, state, sampling) -> None:
    """Compile the verify of every node count `spec_engine.trim_proposal` may pick, and the plain step, once per
    (drafter, state shapes), before the first step. Compiled on first need instead, a size stalled a generation midway (Spec-Bench
    at T = 1: one suffix request at 1.2 tok/s). Each size runs once on a copy of the state, which is discarded."""
    shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(state))
    key = ("verify_sizes_warm", drafter, shapes)
    if key in llm._drafters:
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
                                                            sampling, attention_fn=llm._attention_fn,
                                                            features=drafter.features).dec.num_new)
    # The plain step too: a warm-up generation that stops at its first token never runs one.
    copy_ = jax.tree_util.tree_map(jnp.copy, state)
    jax.block_until_ready(spec_engine.plain_step_jit(llm.params, llm.config, dparams, drafter, copy_, sampling,
                                                     attention_fn=llm._attention_fn).dec.num_new)
    llm._drafters[key] = True


def host_loop(llm, drafter, dparams, state, sampling, n, host=None, adaptive=None, key=None):
    """Step from the host: propose (jitted, or on the host for host-side drafters), then the jitted
    verify+accept. Returns (state, draft seconds, verify seconds).

    A host-side drafter's deterministic proposal is cut to the smallest of `spec_engine.verify_sizes` node
    counts that holds it (`spec_engine.trim_proposal`): a short suffix match costs a short verify forward. Every
    size is compiled before the first step (`_warm_verify_sizes`), not when a proposal first needs it.

    With `adaptive`, the same back-off as the device loop (see `spec_engine.Adaptive`), with the break-even
    measured from this loop's own step times (the first step of each kind and of each verify size compiles and
    is not counted) and kept in the LLM's cache under `key`; a step where no row wants to or can speculate is a
    plain decode.
    """
    draft_t = verify_t = 0.0
    B = state.dec.finish.shape[0]
    carry = adaptive is not None and adaptive.carry_prior
    gain = np.full(B, llm._drafters.get(_prior_key(key), np.inf) if carry else np.inf)
    idle = np.zeros(B, np.int64)
    gap = np.zeros(B, np.int64)
    floor = None if adaptive is None else llm._drafters.get(key, adaptive.min_gain)
    trim = host is not None and not drafter.features and drafter.mode == "deterministic"
    if trim:
        _warm_verify_sizes(llm, drafter, dparams, state, sampling)
    times = {"plain": [], "verify": []}  # per-step seconds, compile steps dropped
    sizes_seen = set()  # node counts verified so far in this call (a new one compiles, or may)

    def plain(state):
        t = time.perf_counter()
        state = spec_engine.plain_step_jit(llm.params, llm.config, dparams, drafter, state, sampling,
                                           attention_fn=llm._attention_fn)
        jax.block_until_ready(state.dec.num_new)
        times["plain"].append(time.perf_counter() - t)
        return state

    while True:
        finish = np.asarray(state.dec.finish)
        running = finish == engine.FINISH_RUNNING
        if not np.any(running[:n]):
            break
        if adaptive is not None:
            g, gap, want, batch = spec_engine.backoff_decide(adaptive, floor, gain, idle, gap, running, xp=np)
            if not batch:
                state = plain(state)
                idle += 1
                if host is not None:
                    host.observe(state, n)
                continue
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
            idle += 1
        else:
            before = np.asarray(state.stats.accepted)
            tree = drafter.tree
            if trim:
                # A short host proposal is verified by a shorter forward (a few compiled sizes).
                proposal, tree = spec_engine.trim_proposal(proposal, tree, spec_engine.verify_sizes(tree))
            state = spec_engine.verify_accept_jit(llm.params, llm.config, tree, drafter.mode, state,
                                                  proposal, sampling, attention_fn=llm._attention_fn,
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
                gain, idle, gap = spec_engine.backoff_update(adaptive, floor, gain, g, idle, gap, want & running,
                                                             got, xp=np)
        if host is not None:
            host.observe(state, n)
        if adaptive is not None and len(times["plain"]) > 1 and times["verify"]:
            ratio = np.median(times["verify"]) / np.median(times["plain"][1:])
            floor = max(0.0, float(ratio) - 1.0)
            llm._drafters[key] = floor
    if adaptive is not None:
        _remember_gain(llm, key, state.stats)
    return state, draft_t, verify_t


def spec_metrics(stats, i: int, draft_time, verify_time, lossy: bool) -> dict:
    steps = int(stats.verify_steps[i])
    plain = int(stats.plain_steps[i])
    drafted = int(stats.drafted[i])
    accepted = int(stats.accepted[i])
    pd = np.asarray(stats.pos_drafted[i])
    pa = np.asarray(stats.pos_accepted[i])
    return dict(
        drafted=drafted, accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        # tokens per target forward; a plain step (nothing proposed anywhere in the batch) yields one
        mean_accepted_length=(accepted + steps + plain) / (steps + plain) if steps + plain else 1.0,
        verify_steps=steps, target_forwards=steps + plain + 1,
        per_position_acceptance=[float(a / d) if d else 0.0 for a, d in zip(pa, pd)],
        per_position_accepted=[int(a) for a in pa], per_position_drafted=[int(d) for d in pd],
        draft_time=draft_time, verify_time=verify_time, lossy=lossy,
    )
