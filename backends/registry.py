"""Named verify (tree) attention for `attention_impl`, and what each platform's compiler tolerates.

The implementations are the kernel table's op `tree_attention` (`specjax.backends.ops`, rows in
`specjax.backends.table`); this module resolves a name (`attention_impl`) to a callable the model takes as its
`attention_fn`. They all share one signature:

    fn(q, k, v, lengths, tree_mask, *, scale=None, **options) -> out
      q [B, T, Hq, D], k/v [B, Hkv, S, D], lengths [B] int, tree_mask [B, T, T] bool -> out [B, T, Hq, D]

k/v are one layer's KV cache in the model's own head-major layout (see specjax.kv_cache), passed as they are: no
transposed copy per layer and step.

`get_attention(name, platform)` returns such a callable with the options bound. "auto" returns a dispatcher that,
at trace time (shapes are static), calls the highest-priority implementation registered for the platform whose
`is_supported(q, k, v, lengths, tree_mask)` accepts the shapes: the table's one selection rule
(`ops.choose`, honouring `SPECJAX_KERNELS=tree_attention=...`); the jnp reference accepts everything, so "auto"
always has a fallback. Without an `attention_fn` the model runs the op `attention` instead (the new tokens passed
apart from the cache: XLA's prefix attention, or the C++ kernel on cpu), which is what `attention_impl="auto"`
gives on cpu and neuron.

`CompilePolicy` records per platform what the rest of specjax may emit in a compiled step (the Neuron backend
checks jaxprs against it).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax

from specjax.backends import ops
from specjax.backends import table as _table  # noqa: F401  (registers the built-in rows)
from specjax.errors import SpecjaxError

PLATFORMS = ("cpu", "gpu", "tpu", "neuron")
ATTENTION_NAMES = ("auto", "reference", "pallas", "pallas_triton", "pallas_tpu", "lse_merge")
_PALLAS_BY_PLATFORM = {"gpu": "pallas_triton", "tpu": "pallas_tpu"}


class AttentionUnavailableError(SpecjaxError, ValueError):
    """The requested attention implementation does not exist or cannot run on the requested platform."""


def normalize_platform(platform: str | None = None) -> str:
    """'cuda'/'rocm' -> 'gpu'; None -> jax.default_backend(). Raises AttentionUnavailableError for unknown names."""
    name = (platform or jax.default_backend()).lower()
    name = {"cuda": "gpu", "rocm": "gpu"}.get(name, name)
    if name not in PLATFORMS:
        raise AttentionUnavailableError(f"unknown platform {platform!r}; expected one of {PLATFORMS}.")
    return name


# ----------------------------------------------------------------------------------------------- compile policy


@dataclasses.dataclass(frozen=True)
class CompilePolicy:
    """What a compiled specjax step may contain on one platform.

    Attributes:
      platform: "cpu" | "gpu" | "tpu" | "neuron".
      allows_cond: lax.cond / lax.switch may appear in compiled code.
      allows_dynamic_while: lax.while_loop with a data-dependent trip count may appear.
      allows_callbacks: host callbacks (jax.debug.*, io_callback, checkify) may appear.
      rng_impl: PRNG implementation to use (value for `jax_default_prng_impl`).
      prefer_sort_free: avoid lax.sort / top_k where an equivalent sort-free formulation exists.
    """

    platform: str
    allows_cond: bool
    allows_dynamic_while: bool
    allows_callbacks: bool
    rng_impl: str
    prefer_sort_free: bool


COMPILE_POLICIES: dict[str, CompilePolicy] = {
    "cpu": CompilePolicy("cpu", True, True, True, "threefry2x32", False),
    "gpu": CompilePolicy("gpu", True, True, True, "threefry2x32", False),
    "tpu": CompilePolicy("tpu", True, True, True, "threefry2x32", False),
    # Documented limits of JAX on Neuron: no cond, static-trip-count loops only, no host callbacks, threefry only
    # partly supported (use rbg), sort only with simple comparators.
    "neuron": CompilePolicy("neuron", False, False, False, "rbg", True),
}


def get_compile_policy(platform: str | None = None) -> CompilePolicy:
    """The CompilePolicy of `platform` (None -> jax.default_backend())."""
    return COMPILE_POLICIES[normalize_platform(platform)]


# ------------------------------------------------------------------------------------------ attention registry


AttentionImpl = ops.Impl  # one row of the table: name, fn, platforms, is_supported, priority, interpretable, ...
_REGISTRY: dict[str, AttentionImpl] = ops.TABLE["tree_attention"]  # the table's rows, not a copy


def register_attention(
    name: str,
    fn: Callable[..., Any],
    platforms,
    is_supported: Callable[..., bool] | None = None,
    *,
    priority: int = 0,
    interpretable: bool = False,
    takes_interpret: bool | None = None,
) -> AttentionImpl:
    """Register (or replace) an attention implementation.

    Args:
      name: registry key ("auto" and "pallas" are reserved).
      fn: fn(q, k, v, lengths, tree_mask, *, scale=None, **options) -> out [B, T, Hq, D].
      platforms: iterable of platform names from PLATFORMS.
      is_supported: shape/dtype predicate (None: supports everything).
      priority: "auto" tries implementations in decreasing priority.
      interpretable: a Pallas kernel: usable on any platform when interpret is set.
      takes_interpret: fn accepts `interpret=`; None -> same as interpretable.
    Returns:
      the registered AttentionImpl.
    """
    if name in ("auto", "pallas"):
        raise AttentionUnavailableError(f"{name!r} is reserved for dispatch; register under another name.")
    plats = [normalize_platform(p) for p in platforms]
    return ops.register("tree_attention", name, fn, plats, is_supported, priority=priority,
                        interpretable=interpretable, takes_interpret=takes_interpret)


def registered_attention() -> dict[str, AttentionImpl]:
    """A copy of the registry: name -> AttentionImpl."""
    return dict(_REGISTRY)


def _usable(impl: AttentionImpl, platform: str, interpret) -> bool:
    return impl.runs_on(platform) or (impl.interpretable and bool(interpret))


def available_attention(platform: str | None = None, *, interpret=False) -> tuple[str, ...]:
    """Names get_attention accepts on `platform` ("auto" first, then by decreasing priority)."""
    plat = normalize_platform(platform)
    impls = sorted((i for i in _REGISTRY.values() if _usable(i, plat, interpret)), key=lambda i: -i.priority)
    names = ["auto"]
    if plat in _PALLAS_BY_PLATFORM or (interpret and "pallas_triton" in _REGISTRY):
        names.append("pallas")
    return tuple(names + [i.name for i in impls])


@dataclasses.dataclass(frozen=True)
class AttentionFn:
    """A resolved attention callable: call it like the implementations; hashable, so usable as a static arg.

    Attributes:
      name: the implementation name, or "auto".
      platform: the platform it was resolved for.
      candidates: implementations tried in order ("auto"), or the single one.
      options: keyword options bound into the implementation (for inspection), as sorted (key, value) pairs.
    """

    name: str
    platform: str
    candidates: tuple[AttentionImpl, ...]
    options: tuple[tuple[str, Any], ...] = ()

    def select(self, q, k, v, lengths, tree_mask) -> AttentionImpl:
        """The implementation a call with these shapes runs."""
        if len(self.candidates) == 1:
            # A named implementation: let it raise its own precise UnsupportedConfigError.
            return self.candidates[0]
        forced = ops.override("tree_attention")
        impl = ops.choose("tree_attention", self.candidates, (q, k, v, lengths, tree_mask), {},
                          None if forced == ops.AUTO else forced)
        if impl is not None:
            return impl
        raise AttentionUnavailableError(
            f"no attention implementation on {self.platform} supports q{tuple(q.shape)} {q.dtype}, "
            f"k{tuple(k.shape)}; tried {[c.name for c in self.candidates]}."
        )

    def __call__(self, q, k, v, lengths, tree_mask, *, scale=None):
        impl = self.select(q, k, v, lengths, tree_mask)
        return impl.fn(q, k, v, lengths, tree_mask, scale=scale)


def get_attention(name: str = "auto", platform: str | None = None, *, interpret=False, **options) -> AttentionFn:
    """Resolve an attention implementation for a platform.

    Args:
      name: "auto" | "reference" | "pallas" | "pallas_triton" | "pallas_tpu" | "lse_merge" | another registered name.
        "pallas" means the platform's Pallas kernel (pallas_triton on gpu, pallas_tpu on tpu; with interpret on
        cpu, pallas_triton).
      platform: "cpu" | "gpu" | "tpu" | "neuron" (also "cuda"/"rocm"); None -> jax.default_backend().
      interpret: run a Pallas kernel in the Pallas interpreter (True or interpret params) so it works on any
        platform, e.g. `get_attention("pallas_triton", interpret=True)` on CPU.
      **options: keyword options of a named implementation (e.g. block_sizes=..., prefix_impl=...).
    Returns:
      AttentionFn: call as fn(q, k, v, lengths, tree_mask, *, scale=None) -> out [B, T, Hq, D].
    Raises:
      AttentionUnavailableError: unknown name, or the implementation cannot run on the platform (the message lists
        what can).
    """
    plat = normalize_platform(platform)
    if name == "auto":
        if options:
            raise AttentionUnavailableError(
                f"options {sorted(options)} need a named implementation; 'auto' picks per shape and takes none."
            )
        candidates = sorted(
            (i for i in _REGISTRY.values() if i.runs_on(plat)), key=lambda i: -i.priority
        )
        if not candidates:
            raise AttentionUnavailableError(f"no attention implementation is registered for platform {plat!r}.")
        bound = tuple(_bind(i, interpret) for i in candidates)
        return AttentionFn("auto", plat, bound)
    if name == "pallas":
        resolved = _PALLAS_BY_PLATFORM.get(plat) or ("pallas_triton" if interpret else None)
        if resolved is None:
            raise AttentionUnavailableError(
                f"no Pallas kernel compiles natively on {plat!r}; available there: "
                f"{', '.join(available_attention(plat))} (or pass interpret=True to run one in the interpreter)."
            )
        name = resolved
    impl = _REGISTRY.get(name)
    if impl is None:
        raise AttentionUnavailableError(
            f"unknown attention {name!r}; registered: {', '.join(['auto', 'pallas', *sorted(_REGISTRY)])}."
        )
    if not _usable(impl, plat, interpret):
        hint = " (or pass interpret=True to run it in the Pallas interpreter)" if impl.interpretable else ""
        raise AttentionUnavailableError(
            f"attention {name!r} is not available on {plat!r}; available there: "
            f"{', '.join(available_attention(plat, interpret=interpret))}{hint}."
        )
    bound = _bind(impl, interpret, **options)
    return AttentionFn(name, plat, (bound,), tuple(sorted(options.items())))


def _bind(impl: AttentionImpl, interpret, **options) -> AttentionImpl:
    """The impl with interpret (when requested and accepted) and options bound into fn."""
    if impl.takes_interpret and interpret:
        options = {"interpret": interpret, **options}
    fn = functools.partial(impl.fn, **options) if options else impl.fn
    return dataclasses.replace(impl, fn=fn)
