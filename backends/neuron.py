"""The Neuron (Trainium / Inferentia 2) backend: specjax's XLA program under Neuron's compile rules.

JAX reaches Neuron through the `libneuronxla` PJRT plug-in and the `neuronx-cc` compiler. Their documented
limits decide how the program is shaped here (see docs/neuron.md):

* no `lax.cond` and no data-dependent `while`: one jitted, straight-line step per call (`fused_step`:
  propose + verify + accept + compact for every sequence, `spec_step(..., allow_cond=False)`; the draft model's
  loop is a `lax.scan` with a static trip count) and a host loop across steps until every sequence finished.
  Plain decoding likewise steps `engine.decode_step` from the host;
* the `rbg` PRNG instead of threefry: every entry point is traced under `jax.default_prng_impl("rbg")` and a
  jit-cache context of its own (`neuron_tracing`), because the PRNG setting is not part of JAX's jit cache
  key: without the context a program traced for one policy could be reused under the other;
* no host callbacks, sort-free top-k/top-p (`specjax.sampling` already is);
* every shape fixed at compile time: shapes come from a bucket table (batch 1/2/4/8, power-of-two prompt,
  output and KV capacity, tree size from the drafter) compiled ahead of time by `NeuronRunner.warmup`; a run
  afterwards calls the compiled executables directly, so it cannot trigger a compilation.

`backends.jaxpr_check` enforces the rules on every entry point and bucket (`check_entry_points`). Without the
Neuron SDK (as on every machine specjax is tested on) the same program runs on the platform JAX has, which
`generate_neuron` says once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import engine, spec_engine
from specjax.backends.jaxpr_check import JaxprReport, PolicyViolationError, check_jaxpr, hlo_census
from specjax.backends.registry import CompilePolicy, get_compile_policy
from specjax.engine import Buckets
from specjax.sampling import SamplingArrays
from specjax.errors import SpecjaxError

__all__ = [
    "NEURON_BATCHES",
    "BucketTable",
    "CompileCounter",
    "NeuronBucketError",
    "NeuronFallbackWarning",
    "NeuronPolicyError",
    "NeuronRunner",
    "PolicyViolationError",
    "bucket_for",
    "bucket_table",
    "check_entry_points",
    "count_compilations",
    "generate_neuron",
    "neuron_available",
    "neuron_tracing",
    "runner_for",
]

logger = logging.getLogger("specjax.neuron")

NEURON_BATCHES = (1, 2, 4, 8)
# A jit-cache context: entry points traced for the Neuron policy never share cache entries with the default
# path (jax_default_prng_impl alone is not part of the cache key). Created once, at import.
_NEURON_CONTEXT = jax.make_user_context(default_value=None)
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


class NeuronPolicyError(SpecjaxError, ValueError):
    """A request or drafter cannot run under the Neuron compile policy."""


class NeuronBucketError(SpecjaxError, ValueError):
    """No bucket of the table fits a request."""


class NeuronFallbackWarning(RuntimeWarning):
    """The Neuron-policy program runs on another platform (no Neuron SDK or device)."""


# ----------------------------------------------------------------------------------------------- policy scope


@contextlib.contextmanager
def neuron_tracing(policy: CompilePolicy | None = None):
    """Trace (and look up jit caches) under the Neuron policy: its PRNG implementation and its own cache context."""
    pol = policy or get_compile_policy("neuron")
    with jax.default_prng_impl(pol.rng_impl), _NEURON_CONTEXT(pol.platform):
        yield


def neuron_available() -> bool:
    """True when JAX runs on Neuron devices (the Neuron PJRT plug-in is installed and selected)."""
    return jax.default_backend() == "neuron"


_NOTED: set[str] = set()


def _note_platform() -> None:
    """Say once per process and platform that the Neuron-policy program runs elsewhere."""
    plat = jax.default_backend()
    if plat == "neuron" or plat in _NOTED:
        return
    _NOTED.add(plat)
    sdk = any(importlib.util.find_spec(m) is not None for m in ("libneuronxla", "jax_neuronx"))
    why = "Neuron devices not selected" if sdk else "Neuron SDK not found"
    msg = f"{why}; running the Neuron-policy program on {plat}"
    logger.warning(msg)
    warnings.warn(msg, NeuronFallbackWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------- buckets


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_at_least(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _bucket(batch: int, prompt_len: int, max_new: int, tree_nodes: int, num_stop: int) -> Buckets:
    if batch not in NEURON_BATCHES:
        raise NeuronBucketError(f"batch bucket {batch} is not one of {NEURON_BATCHES}")
    for what, v in (("prompt length", prompt_len), ("max_new", max_new), ("num_stop", num_stop)):
        if not _is_pow2(v):
            raise NeuronBucketError(f"{what} bucket {v} is not a power of two; use {_pow2_at_least(v)}")
    # Spare slots for the tree: rejected drafts are written past the committed length, never over live entries.
    return Buckets(batch, prompt_len, max_new, _pow2_at_least(prompt_len + max_new + tree_nodes), num_stop)


@dataclasses.dataclass(frozen=True)
class BucketTable:
    """The static shapes compiled ahead of time (engine.Buckets with power-of-two capacity), smallest first."""

    buckets: tuple[Buckets, ...]

    def select(self, num_requests: int, max_prompt: int, max_new: int) -> Buckets:
        """The smallest bucket (by batch, then KV capacity) that holds the requests."""
        fits = [b for b in self.buckets
                if b.batch >= num_requests and b.prompt_len >= max_prompt and b.max_new >= max_new]
        if not fits:
            big = max(self.buckets, key=lambda b: (b.batch, b.prompt_len, b.max_new))
            raise NeuronBucketError(
                f"no compiled bucket holds {num_requests} requests with prompts up to {max_prompt} tokens and "
                f"max_new_tokens {max_new} (largest: batch {big.batch}, prompt {big.prompt_len}, "
                f"max_new {big.max_new}); split the batch, shorten the requests, or add a bucket to the table")
        return min(fits, key=lambda b: (b.batch, b.capacity, b.prompt_len, b.max_new))


def bucket_table(batches: Sequence[int] = NEURON_BATCHES, prompt_lens: Sequence[int] = (64, 256),
                 max_news: Sequence[int] = (64, 256), tree_nodes: int = 1, num_stop: int = 4) -> BucketTable:
    """Every combination of batch, prompt-length and output buckets (each a power of two).

    tree_nodes: KV slots one step writes past the committed length (the drafter's `tree.num_nodes`; 1 for
    plain decoding); it sets each bucket's capacity to the next power of two of prompt + max_new + tree_nodes.
    """
    if tree_nodes < 1:
        raise NeuronBucketError(f"tree_nodes must be >= 1 (the root is always written), got {tree_nodes}")
    out = {_bucket(b, p, n, tree_nodes, num_stop) for b in batches for p in prompt_lens for n in max_news}
    return BucketTable(tuple(sorted(out, key=lambda b: (b.batch, b.capacity, b.prompt_len, b.max_new))))


def bucket_for(num_requests: int, max_prompt: int, max_new: int, tree_nodes: int = 1, num_stop: int = 4) -> Buckets:
    """The smallest power-of-two bucket for one batch of requests (prompt and output buckets at least 16)."""
    if num_requests > NEURON_BATCHES[-1]:
        raise NeuronBucketError(
            f"{num_requests} requests exceed the largest Neuron batch bucket ({NEURON_BATCHES[-1]}); "
            "split them into batches of at most that many")
    batch = next(b for b in NEURON_BATCHES if b >= num_requests)
    return _bucket(batch, _pow2_at_least(max_prompt, 16), _pow2_at_least(max_new, 16), tree_nodes,
                   _pow2_at_least(num_stop, 4))


# ----------------------------------------------------------------------------------------------- compile counting


@dataclasses.dataclass
class CompileCounter:
    """Backend compilations and jaxpr traces seen while counting (names of the compiled functions)."""

    compiles: int = 0
    traces: int = 0
    names: list = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def count_compilations():
    """Count XLA compilations and jaxpr traces in the block (jax.monitoring duration events)."""
    counter = CompileCounter()

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            counter.compiles += 1
            counter.names.append(kwargs.get("fun_name", "?"))
        elif event == _TRACE_EVENT:
            counter.traces += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# ----------------------------------------------------------------------------------------------- entry points
# Pure functions of arrays only; static settings are bound with functools.partial before jitting.


def _plain_prefill(params, prompts, prompt_lens, active, sampling, *, config, buckets):
    return engine.prefill(params, config, buckets, prompts, prompt_lens, active, sampling)


def _plain_step(params, state, sampling, *, config, steps, allow_cond=False):
    for _ in range(steps):  # unrolled at trace time: no loop in the program
        state = engine.decode_step(params, config, state, sampling, allow_cond=allow_cond)
    return state


def _spec_prefill(params, dparams, prompts, prompt_lens, active, sampling, *, config, drafter, buckets):
    return spec_engine.spec_prefill(params, config, dparams, drafter, buckets, prompts, prompt_lens, active, sampling)


def _fused_step(params, dparams, state, sampling, *, config, drafter, steps, allow_cond=False):
    for _ in range(steps):
        state = spec_engine.spec_step(params, config, dparams, drafter, state, sampling, None, allow_cond=allow_cond)
    return state


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
        if drafter is not None and getattr(drafter, "host_side", False):
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
            pre = jax.jit(functools.partial(_plain_prefill, config=c, buckets=b))
            pre_args = (P, tok, lens, act, samp)
            step = jax.jit(functools.partial(_plain_step, config=c, steps=self.steps_per_call,
                                             allow_cond=self.policy.allows_cond), donate_argnums=(1,))
        else:
            D = _abstract(self.dparams)
            pre = jax.jit(functools.partial(_spec_prefill, config=c, drafter=self.drafter, buckets=b))
            pre_args = (P, D, tok, lens, act, samp)
            step = jax.jit(functools.partial(_fused_step, config=c, drafter=self.drafter, steps=self.steps_per_call,
                                             allow_cond=self.policy.allows_cond), donate_argnums=(2,))
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
                    report = check_jaxpr(traced.jaxpr, self.policy, name=f"{name} {_bucket_name(b)}")
                    if hlo:
                        report = hlo_census(report, lowered[name].as_text())
                    report.raise_for_errors()
                reports[name] = report
            compiled = {name: low.compile() for name, low in lowered.items()}
            seconds = time.perf_counter() - t0
            self._compiled[b] = _Compiled(compiled["prefill"], compiled["step"], reports, seconds)
            logger.info("compiled Neuron bucket %s in %.1f s", _bucket_name(b), seconds)
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
            raise NeuronBucketError(f"bucket {_bucket_name(bucket)} was not compiled; call warmup([bucket]) first")
        return got

    def prefill(self, bucket: Buckets, prompts, prompt_lens, active, sampling: SamplingArrays):
        """Run the compiled prefill: prompts [B, P] int32, prompt_lens [B] int32, active [B] bool."""
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

        Returns (final state, number of step calls, prefill seconds). Every step emits at least one token per
        running sequence, so the loop ends within max_new calls; more would be an engine bug and raises.
        """
        t0 = time.perf_counter()
        state = self.prefill(bucket, prompts, prompt_lens, active, sampling)
        dec = lambda s: s if self.drafter is None else s.dec
        jax.block_until_ready(dec(state).last_token)
        t_prefill = time.perf_counter() - t0
        calls = 0
        limit = -(-bucket.max_new // self.steps_per_call) + 1
        while np.any(np.asarray(dec(state).finish)[:num_real] == engine.FINISH_RUNNING):
            if calls >= limit:
                raise RuntimeError(f"generation did not finish within {limit} fused steps of bucket "
                                   f"{_bucket_name(bucket)}; a running sequence emitted nothing")
            state = self.step(bucket, state, sampling)
            calls += 1
        return state, calls, t_prefill


def _bucket_name(b: Buckets) -> str:
    return f"b{b.batch}/p{b.prompt_len}/n{b.max_new}/s{b.capacity}"


# ----------------------------------------------------------------------------------------------- checking


def check_entry_points(runner: NeuronRunner, buckets: Iterable[Buckets], *, hlo: bool = False
                       ) -> dict[tuple[Buckets, str], JaxprReport]:
    """Check every entry point of `runner` for every bucket against its policy (nothing is compiled).

    Returns {(bucket, entry name): JaxprReport}; callers decide whether errors fail (`report.ok`).
    """
    out = {}
    for b in buckets:
        for name, (fn, args) in runner.jitted(b).items():
            with neuron_tracing(runner.policy):
                traced = fn.trace(*args)
                text = traced.lower().as_text() if hlo else None
            report = check_jaxpr(traced.jaxpr, runner.policy, name=f"{name} {_bucket_name(b)}")
            out[(b, name)] = hlo_census(report, text) if hlo else report
    return out


# ----------------------------------------------------------------------------------------------- generation

_RUNNERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def runner_for(llm, drafter=None, dparams=None, steps_per_call: int = 1) -> NeuronRunner:
    """The NeuronRunner generate_neuron uses for this LLM and drafter (created once, kept while the LLM lives)."""
    cache = _RUNNERS.setdefault(llm, {})
    key = (drafter, steps_per_call)
    if key not in cache:
        cache[key] = NeuronRunner(llm.params, llm.config, drafter, dparams, steps_per_call=steps_per_call)
    return cache[key]


def _device_inputs(llm, ids: list[list[int]], params: list, b: Buckets):
    """(prompts [B, P], prompt_lens [B], active [B], SamplingArrays) on the device, built in NumPy and
    transferred by the API's own helpers, so nothing compiles for a new bucket shape during a generation."""
    from specjax.api import pad_prompts

    tokens, lens, active = pad_prompts(ids, b.batch, b.prompt_len)
    return tokens, lens, active, llm.sampling_arrays(list(params), b.batch, b.num_stop)


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
    from specjax.runners import speculative as spec_api
    from specjax.config import SpeculativeConfig

    _note_platform()
    prompts, params = llm._normalise(prompts_token_ids, sampling_params)
    ids = [llm.encode_prompt(p, False) for p in prompts]
    spec = SpeculativeConfig.from_user(speculative_config)
    drafter = dparams = None
    if spec.enabled:
        drafter, dparams = spec_api.build_drafter(llm, spec)
        if getattr(drafter, "host_side", False):
            raise NeuronPolicyError(
                f"speculative method {spec.method!r} proposes on the host; under the Neuron policy drafting is "
                "fused into the compiled step: use 'ngram' or 'draft_model'")
    runner = runner_for(llm, drafter, dparams, steps_per_call)
    for i, (t, sp) in enumerate(zip(ids, params)):
        llm._check(i, t, sp, runner.tree_nodes if drafter is not None else 0)
    n = len(ids)
    max_prompt, max_new = max(map(len, ids)), max(p.max_new_tokens for p in params)
    bucket = (table.select(n, max_prompt, max_new) if table is not None
              else bucket_for(n, max_prompt, max_new, runner.tree_nodes))
    runner.warmup([bucket])
    tokens, lens, active, sampling = _device_inputs(llm, ids, params, bucket)
    t0 = time.perf_counter()
    state, _, ttft = runner.run(bucket, tokens, lens, active, sampling, n)
    dec = state if drafter is None else state.dec
    out_tokens, num_new, finish = (np.asarray(a) for a in (dec.out_tokens, dec.num_new, dec.finish))
    total = time.perf_counter() - t0
    stats = None if drafter is None else jax.device_get(state.stats)  # host copies: no eager device ops
    outs = []
    for i in range(n):
        extra = {}
        if stats is not None:
            extra = spec_api.spec_metrics(stats, i, None, None, spec.is_lossy)
        outs.append(llm._output(prompts[i], ids[i], out_tokens[i, :num_new[i]], finish[i], ttft, total, **extra))
    return outs

