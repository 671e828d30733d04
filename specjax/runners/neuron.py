"""The Neuron runner: the policy of `specjax.backends.neuron` (no cond, no data-dependent loop, rbg PRNG, fixed
shapes) applied to the engines' fixed-shape entry points, compiled ahead of time per bucket and stepped from the
host; and the host-driver variant (`runners.base`) that generates with it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import engine, spec_engine
from specjax.backends.jaxpr_check import JaxprReport, check_jaxpr, hlo_census
from specjax.backends.neuron import (BucketTable, NeuronBucketError, NeuronPolicyError, bucket_for, bucket_name,
                                     neuron_tracing, note_platform)
from specjax.backends.registry import CompilePolicy, get_compile_policy
from specjax.buckets import Buckets
from specjax.config import SpeculativeConfig
from specjax.drafters.base import capabilities_of
from specjax.requests import encode_prompt, normalise, spec_metrics
from specjax.runners.base import DeviceVariant, generate as run_variant
from specjax.runners.speculative import drafter_for
from specjax.sampling import SamplingArrays

logger = logging.getLogger("specjax.neuron")


def _abstract(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


def _sampling_spec(b: Buckets) -> SamplingArrays:
    f, i = jnp.float32, jnp.int32
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
    return SamplingArrays(S((b.batch,), f), S((b.batch,), i), S((b.batch,), f), S((b.batch,), jnp.uint32),
                          S((b.batch,), i), S((b.batch, b.num_stop), i))


@dataclasses.dataclass
class _Compiled:
    prefill: Any  # jax.stages.Compiled
    step: Any
    reports: dict  # entry name -> JaxprReport (None when warmed up without checking)
    seconds: float  # trace + lower + compile time of both entry points


class NeuronRunner:
    """AOT-compiled Neuron entry points for one target (and optionally one drafter), per bucket.

    Entry points (each one jitted program per bucket):
      "prefill": prefill the target (and drafter); emits each sequence's first token.
      "step": one fused step for every sequence, `steps_per_call` times unrolled: propose + verify + accept +
        compact (`spec_step` with allow_cond=policy.allows_cond, False under Neuron) with a drafter,
        `engine.decode_step` without. The state is donated, so the KV caches are updated in place.
    `run` loops "step" from the host until every real sequence finished.

    Args:
      params, config: the target model.
      drafter, dparams: a device drafter (n-gram, draft model, feature drafters) and its weights; None = plain.
      steps_per_call: fused steps per compiled call (unrolled at trace time).
      policy: the CompilePolicy to trace and check under (default: Neuron's).
    """

    ENTRY_POINTS = ("prefill", "step")

    def __init__(self, params: dict, config, drafter=None, dparams=None, *, steps_per_call: int = 1,
                 policy: CompilePolicy | None = None):
        if steps_per_call < 1:
            raise NeuronPolicyError(f"steps_per_call must be >= 1, got {steps_per_call}")
        if capabilities_of(drafter).host_side:
            raise NeuronPolicyError(
                f"{type(drafter).__name__} proposes on the host; the Neuron runner fuses drafting into the "
                "compiled step, so use a device drafter ('ngram' or 'draft_model')")
        self.params = params
        self.config = config
        self.drafter = drafter
        self.dparams = {} if dparams is None else dparams
        self.steps_per_call = steps_per_call
        self.policy = policy or get_compile_policy("neuron")
        self._compiled: dict[Buckets, _Compiled] = {}
        self._jitted: dict[Buckets, dict] = {}

    @property
    def tree_nodes(self) -> int:
        """KV slots one step writes past the committed length."""
        return 1 if self.drafter is None else self.drafter.tree.num_nodes

    def jitted(self, bucket: Buckets) -> dict[str, tuple[Callable, tuple]]:
        """{entry name: (jitted function, abstract arguments)} for one bucket.

        Nothing is compiled; the prefill is traced once, abstractly, for the shapes of the state the step takes.
        """
        if bucket in self._jitted:
            return self._jitted[bucket]
        b, c = bucket, self.config
        P = _abstract(self.params)
        tok = jax.ShapeDtypeStruct((b.batch, b.prompt_len), jnp.int32)
        lens = jax.ShapeDtypeStruct((b.batch,), jnp.int32)
        act = jax.ShapeDtypeStruct((b.batch,), jnp.bool_)
        samp = _sampling_spec(b)
        if self.drafter is None:
            pre = engine.prefill_program(c, b)
            pre_args = (P, tok, lens, act, samp)
            step = engine.unrolled_step_program(c, self.steps_per_call, self.policy.allows_cond)
        else:
            D = _abstract(self.dparams)
            pre = spec_engine.spec_prefill_program(c, self.drafter, b)
            pre_args = (P, D, tok, lens, act, samp)
            step = spec_engine.fused_step_program(c, self.drafter, self.steps_per_call, self.policy.allows_cond)
        with neuron_tracing(self.policy):
            state = jax.eval_shape(pre, *pre_args)
        step_args = (P, state, samp) if self.drafter is None else (P, D, state, samp)
        self._jitted[bucket] = {"prefill": (pre, pre_args), "step": (step, step_args)}
        return self._jitted[bucket]

    def trace(self, bucket: Buckets, name: str):
        """jax.stages.Traced of one entry point under the Neuron policy (its `.jaxpr` is what is checked)."""
        fn, args = self.jitted(bucket)[name]
        with neuron_tracing(self.policy):
            return fn.trace(*args)

    def warmup(self, buckets: Iterable[Buckets], *, check: bool = True, hlo: bool = False) -> dict[Buckets, float]:
        """Trace, check, lower and compile every entry point for every bucket (ahead of time).

        check: run the jaxpr checker and raise PolicyViolationError on errors (warnings are kept in `reports`).
        hlo: also count the ops of the lowered StableHLO into the reports.
        Returns {bucket: seconds spent}; buckets already compiled are skipped (0 s).
        """
        out = {}
        for b in buckets:
            if b in self._compiled:
                out[b] = 0.0
                continue
            if b.capacity < b.prompt_len + b.max_new + self.tree_nodes:
                raise NeuronBucketError(
                    f"bucket capacity {b.capacity} < prompt {b.prompt_len} + max_new {b.max_new} + "
                    f"{self.tree_nodes} tree slots; build buckets with bucket_table(..., tree_nodes="
                    f"{self.tree_nodes})")
            t0 = time.perf_counter()
            lowered, reports = {}, {}
            # Check every entry point before compiling any: a violation costs only traces.
            for name, (fn, args) in self.jitted(b).items():
                with neuron_tracing(self.policy):
                    traced = fn.trace(*args)
                    lowered[name] = traced.lower()
                report = None
                if check:
                    report = check_jaxpr(traced.jaxpr, self.policy, name=f"{name} {bucket_name(b)}")
                    if hlo:
                        report = hlo_census(report, lowered[name].as_text())
                    report.raise_for_errors()
                reports[name] = report
            compiled = {name: low.compile() for name, low in lowered.items()}
            seconds = time.perf_counter() - t0
            self._compiled[b] = _Compiled(compiled["prefill"], compiled["step"], reports, seconds)
            logger.info("compiled Neuron bucket %s in %.1f s", bucket_name(b), seconds)
            out[b] = seconds
        return out

    def compiled_buckets(self) -> tuple[Buckets, ...]:
        return tuple(self._compiled)

    def reports(self, bucket: Buckets) -> dict[str, JaxprReport | None]:
        """The checker's reports of a warmed-up bucket."""
        return dict(self._entry(bucket).reports)

    def _entry(self, bucket: Buckets) -> _Compiled:
        got = self._compiled.get(bucket)
        if got is None:
            raise NeuronBucketError(f"bucket {bucket_name(bucket)} was not compiled; call warmup([bucket]) first")
        return got

    def prefill(self, bucket: Buckets, prompts, prompt_lens, active, sampling: SamplingArrays):
        """Run the compiled prefill: prompts [B, P] int32, prompt_lens [B] int32, active [B] bool."""
        if any(a is not None and s is None for a, s in zip(sampling, _sampling_spec(bucket))):
            # The ahead-of-time programs take the six basic arrays only.
            from specjax.requests import RequestError

            raise RequestError("min_p, min_tokens and the presence / frequency / repetition penalties are not "
                               "supported on the 'neuron' backend yet; leave them off or use backend 'auto'")
        c = self._entry(bucket)
        if self.drafter is None:
            return c.prefill(self.params, prompts, prompt_lens, active, sampling)
        return c.prefill(self.params, self.dparams, prompts, prompt_lens, active, sampling)

    def step(self, bucket: Buckets, state, sampling: SamplingArrays):
        """Run the compiled fused step once (`steps_per_call` steps); `state` is donated."""
        c = self._entry(bucket)
        if self.drafter is None:
            return c.step(self.params, state, sampling)
        return c.step(self.params, self.dparams, state, sampling)

    def run(self, bucket: Buckets, prompts, prompt_lens, active, sampling: SamplingArrays, num_real: int):
        """Prefill, then step from the host until the first `num_real` rows finished.

        Returns (final state, number of step calls, prefill seconds).
        """
        t0 = time.perf_counter()
        state = self.prefill(bucket, prompts, prompt_lens, active, sampling)
        jax.block_until_ready(self._dec(state).last_token)
        t_prefill = time.perf_counter() - t0
        state, calls = self.loop(bucket, state, sampling, num_real)
        return state, calls, t_prefill

    def loop(self, bucket: Buckets, state, sampling: SamplingArrays, num_real: int):
        """Step from the host until the first `num_real` rows finished. Returns (state, step calls).

        Every step emits at least one token per running sequence, so the loop ends within max_new calls; more
        would be an engine bug and raises."""
        calls = 0
        limit = -(-bucket.max_new // self.steps_per_call) + 1
        while np.any(np.asarray(self._dec(state).finish)[:num_real] == engine.FINISH_RUNNING):
            if calls >= limit:
                raise RuntimeError(f"generation did not finish within {limit} fused steps of bucket "
                                   f"{bucket_name(bucket)}; a running sequence emitted nothing")
            state = self.step(bucket, state, sampling)
            calls += 1
        return state, calls

    def _dec(self, state):
        return state if self.drafter is None else state.dec


_RUNNERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def runner_for(llm, drafter=None, dparams=None, steps_per_call: int = 1) -> NeuronRunner:
    """The NeuronRunner generate_neuron uses for this LLM and drafter (created once, kept while the LLM lives)."""
    cache = _RUNNERS.setdefault(llm, {})
    key = (drafter, steps_per_call)
    if key not in cache:
        cache[key] = NeuronRunner(llm.params, llm.config, drafter, dparams, steps_per_call=steps_per_call)
    return cache[key]


class NeuronVariant(DeviceVariant):
    """The host driver's variant under the Neuron policy: the runner's compiled prefill, its fused step looped
    from the host. table: the bucket table to pick from (default: the smallest power-of-two bucket); buckets not
    yet compiled are compiled (and checked) when picked. lossy: the drafter's acceptance is lossy (metrics)."""

    def __init__(self, llm, drafter=None, dparams=None, *, steps_per_call: int = 1,
                 table: BucketTable | None = None, lossy: bool = False):
        self.runner = runner_for(llm, drafter, dparams, steps_per_call)
        self.drafter, self.table, self.lossy = drafter, table, lossy
        self.extra_slots = 0 if drafter is None else self.runner.tree_nodes

    def buckets(self, n, max_prompt, max_new, num_stop):
        b = (self.table.select(n, max_prompt, max_new) if self.table is not None
             else bucket_for(n, max_prompt, max_new, self.runner.tree_nodes, num_stop))
        self.runner.warmup([b])
        return b

    def prefill(self, b, tokens, lens, active, sampling):
        return self.runner.prefill(b, tokens, lens, active, sampling)

    def state_shapes(self, b, sampling):
        _, args = self.runner.jitted(b)["step"]
        return args[-2]  # the step's abstract state: what the prefill returns

    def tracing(self):
        return neuron_tracing(self.runner.policy)

    def dec(self, state):
        return self.runner._dec(state)

    def with_dec(self, state, dec):
        return dec if self.drafter is None else state._replace(dec=dec)

    def loop(self, b, state, sampling, ids):
        return self.runner.loop(b, state, sampling, len(ids))[0]

    def until_free(self, b, state, sampling, max_steps: int):
        return self.runner.step(b, state, sampling)

    def finish(self, state, new_ids):
        if self.drafter is None:
            return super().finish(state, new_ids)
        stats = jax.device_get(state.stats)  # host copies: no eager device ops
        return [spec_metrics(stats, i, None, None, self.lossy) for i in range(len(new_ids))]


def generate_neuron(llm, prompts_token_ids, sampling_params=None, speculative_config=None, *,
                    table: BucketTable | None = None, steps_per_call: int = 1):
    """Generate under the Neuron policy on whatever platform JAX has (says so once when it is not Neuron).

    Args:
      llm: a specjax.api.LLM.
      prompts_token_ids: a list of token-id lists (or one list).
      sampling_params: one SamplingParams/dict for all prompts, or one per prompt (None: defaults).
      speculative_config: None (plain decoding), a dict or a SpeculativeConfig with a device drafter
        ('ngram' or 'draft_model').
      table: the bucket table to pick from (default: the smallest power-of-two bucket for this batch);
        buckets not yet compiled are compiled (and checked) on first use.
      steps_per_call: fused steps per compiled call (unrolled; fewer host round trips, longer compiles).
    Returns:
      list[RequestOutput], as LLM.generate. Sampled tokens use the rbg PRNG, so they differ from the default
      path's for the same seed; greedy output is the same.
    """
    note_platform()
    prompts, params = normalise(prompts_token_ids, sampling_params)
    ids = [encode_prompt(llm.tokenizer, llm.config.vocab_size, p, False) for p in prompts]
    spec = SpeculativeConfig.from_user(speculative_config)
    drafter = dparams = None
    if spec.enabled:
        drafter, dparams = drafter_for(llm, spec)
        if drafter.capabilities.host_side:
            raise NeuronPolicyError(
                f"speculative method {spec.method!r} proposes on the host; under the Neuron policy drafting is "
                "fused into the compiled step: use 'ngram' or 'draft_model'")
    variant = NeuronVariant(llm, drafter, dparams, steps_per_call=steps_per_call, table=table, lossy=spec.is_lossy)
    return run_variant(llm, prompts, ids, params, variant)
