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
  output and KV capacity, tree size from the drafter) compiled ahead of time by
  `runners.neuron.NeuronRunner.warmup`; a run afterwards calls the compiled executables directly, so it cannot trigger a compilation.

`backends.jaxpr_check` enforces the rules on every entry point and bucket (`check_entry_points`). Without the
Neuron SDK (as on every machine specjax is tested on) the same program runs on the platform JAX has, which
`runners.neuron.generate_neuron` says once (`note_platform`).

This module holds the policy only (buckets, tracing scope, errors, checking, compile counting); the runner that
compiles and steps the entry points is `specjax.runners.neuron`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import warnings
from typing import Iterable, Sequence

import jax

from specjax.backends.jaxpr_check import JaxprReport, PolicyViolationError, check_jaxpr, hlo_census
from specjax.backends.registry import CompilePolicy, get_compile_policy
from specjax.buckets import Buckets
from specjax.errors import SpecjaxError

__all__ = [
    "NEURON_BATCHES",
    "BucketTable",
    "CompileCounter",
    "NeuronBucketError",
    "NeuronFallbackWarning",
    "NeuronPolicyError",
    "PolicyViolationError",
    "bucket_for",
    "bucket_name",
    "bucket_table",
    "check_entry_points",
    "count_compilations",
    "neuron_available",
    "neuron_tracing",
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


def note_platform() -> None:
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


def bucket_name(b: Buckets) -> str:
    return f"b{b.batch}/p{b.prompt_len}/n{b.max_new}/s{b.capacity}"


# ----------------------------------------------------------------------------------------------- checking


def check_entry_points(runner, buckets: Iterable[Buckets], *, hlo: bool = False
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
            report = check_jaxpr(traced.jaxpr, runner.policy, name=f"{name} {bucket_name(b)}")
            out[(b, name)] = hlo_census(report, text) if hlo else report
    return out
