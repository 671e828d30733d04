"""The kernel table: every implementation of every op, and the one rule that picks one (see docs/kernels.md).

An op is a computation the model needs (`matmul`, `quant_matmul`, `attention`, `kv_write`, `tree_attention`); an
implementation is one way to run it (XLA's operations, a C++ CPU kernel, a Pallas kernel), registered with

- `platforms`: where it compiles ("cpu", "gpu", "tpu", "neuron"; None = every platform);
- `priority`: higher is tried first;
- `is_supported(*args, **kwargs)`: whether it can take these inputs, from static shapes and dtypes only (it is
  evaluated at trace time, and on jax.ShapeDtypeStruct alike);
- `prefers(*args, **kwargs)`: the `auto` policy's extra condition (e.g. a row limit where the kernel measured
  faster); an override naming the implementation skips it;
- `custom_call`: an XLA custom call, which XLA cannot partition: never chosen under a device mesh;
- `needs_build`: a C++ CPU kernel: chosen only once `specjax.kernels.cpu_build` has built the library (without a
  compiler specjax warns once, naming the fallback, and the next implementation runs).

The selection rule, one for every (platform, op), evaluated when a function is traced: the highest-priority
implementation registered for the platform that is supported (and preferred, and built, and not a custom call
under a mesh). An XLA implementation registered for every platform and supporting everything ends every list.

The one override: `SPECJAX_KERNELS="matmul=xla,attention=kernel"` (comma-separated `op=implementation`; `auto`
restores the rule). The named implementation is tried first, without its `prefers` condition; where it cannot take
the inputs (or is not built, or a mesh is set) the rule goes on as usual. An unknown op or implementation is a
KernelSelectionError suggesting the closest valid name. Read at trace time: set it before a process first generates.

Adding an op: `define_op(name, signature)`, then `register(op, impl, fn, ...)` for each implementation (an XLA one
on every platform first), all in `specjax.backends.table`; the wrappers themselves live in `specjax.kernels`. Call
it as `call(op, *args, **kwargs)`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Callable

import jax

from specjax.errors import SpecjaxError
from specjax.kernels import cpu_build

ENV = "SPECJAX_KERNELS"
PLATFORMS = ("cpu", "gpu", "tpu", "neuron")
AUTO = "auto"


class KernelSelectionError(SpecjaxError, ValueError):
    """An unknown op or implementation (in SPECJAX_KERNELS or a registration), or no implementation that runs."""


def _always(*args, **kwargs) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Op:
    """One op: its name and call signature (for docs and error messages)."""

    name: str
    signature: str


@dataclasses.dataclass(frozen=True)
class Impl:
    """One registered implementation of an op (see the module docstring for the fields' meaning).

    interpretable / takes_interpret concern Pallas kernels: usable on any platform in the Pallas interpreter, and
    whether fn accepts `interpret=`."""

    op: str
    name: str
    fn: Callable[..., Any]
    platforms: frozenset[str] | None
    is_supported: Callable[..., bool] = _always
    priority: int = 0
    prefers: Callable[..., bool] = _always
    custom_call: bool = False
    needs_build: tuple[str, str] | None = None  # (what, fallback) for the one-time "unavailable" warning
    interpretable: bool = False
    takes_interpret: bool = False

    def runs_on(self, platform: str) -> bool:
        return self.platforms is None or platform in self.platforms


OPS: dict[str, Op] = {}
TABLE: dict[str, dict[str, Impl]] = {}


def define_op(name: str, signature: str) -> Op:
    """Declare an op (once); its implementations are then registered with `register`."""
    op = Op(name, signature)
    OPS[name] = op
    TABLE.setdefault(name, {})
    return op


def normalize_platform(platform: str | None = None) -> str:
    """'cuda'/'rocm' -> 'gpu'; None -> jax.default_backend(). An unknown name is returned as it is (only
    implementations registered for every platform run there)."""
    name = (platform or jax.default_backend()).lower()
    return {"cuda": "gpu", "rocm": "gpu"}.get(name, name)


def under_mesh() -> bool:
    """Whether the function being traced runs over a device mesh (`jax.set_mesh`, see specjax.mesh). Custom calls
    are not chosen there: XLA cannot partition them and would gather their sharded operands whole."""
    return not jax.sharding.get_abstract_mesh().empty


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _check_op(op: str, where: str) -> None:
    if op not in TABLE:
        raise KernelSelectionError(f"unknown op {op!r} in {where}; {_suggest(op, TABLE)}"
                                   f"ops: {', '.join(sorted(TABLE))}")


def register(op: str, name: str, fn: Callable[..., Any], platforms=None, is_supported=None, *, priority: int = 0,
             prefers=None, custom_call: bool = False, needs_build: tuple[str, str] | None = None,
             interpretable: bool = False, takes_interpret: bool | None = None) -> Impl:
    """Register (or replace) implementation `name` of `op` (see the module docstring); returns the Impl."""
    _check_op(op, "register()")
    if name == AUTO:
        raise KernelSelectionError(f"{AUTO!r} is reserved for the selection rule; register under another name")
    plats = None
    if platforms is not None:
        plats = frozenset(normalize_platform(p) for p in platforms)
        unknown = sorted(plats - set(PLATFORMS))
        if unknown:
            raise KernelSelectionError(f"unknown platform {unknown[0]!r}; expected one of {PLATFORMS}")
    impl = Impl(op, name, fn, plats, is_supported or _always, priority, prefers or _always, custom_call,
                needs_build, interpretable, interpretable if takes_interpret is None else takes_interpret)
    TABLE[op][name] = impl
    return impl


def implementations(op: str, platform: str | None = None) -> tuple[Impl, ...]:
    """The implementations of `op` (those registered for `platform` when given), highest priority first."""
    _check_op(op, "implementations()")
    impls = TABLE[op].values()
    if platform is not None:
        plat = normalize_platform(platform)
        impls = [i for i in impls if i.runs_on(plat)]
    return tuple(sorted(impls, key=lambda i: -i.priority))


def parse_overrides(text: str) -> dict[str, str]:
    """'matmul=xla, attention=kernel' -> {'matmul': 'xla', 'attention': 'kernel'}, every name checked against the
    table (KernelSelectionError with the closest valid name otherwise)."""
    out: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        op, sep, impl = (s.strip() for s in item.partition("="))
        if not sep or not op or not impl:
            raise KernelSelectionError(f"{ENV}: {item!r} is not op=implementation (e.g. {ENV}='matmul=xla')")
        _check_op(op, ENV)
        names = [AUTO, *sorted(TABLE[op])]
        if impl not in names:
            raise KernelSelectionError(f"unknown implementation {impl!r} of op {op!r} in {ENV}; "
                                       f"{_suggest(impl, names)}choices: {', '.join(names)}")
        out[op] = impl
    return out


# The variables SPECJAX_KERNELS replaced: set, they are an error naming the new spelling rather than ignored.
_RETIRED = {"SPECJAX_CPU_MATMUL": "matmul", "SPECJAX_CPU_ATTENTION": "attention", "SPECJAX_CPU_KV_WRITE": "kv_write",
            "SPECJAX_QUANT_MATMUL": "quant_matmul"}


def overrides() -> dict[str, str]:
    """The overrides in effect: `SPECJAX_KERNELS`, parsed and checked."""
    for variable, op in _RETIRED.items():
        if variable in os.environ:
            value = os.environ[variable].strip().lower() or AUTO
            raise KernelSelectionError(f"{variable} is no longer read: set {ENV}='{op}={value}' instead (and unset "
                                       f"{variable}); see docs/kernels.md")
    return parse_overrides(os.environ.get(ENV, ""))


def override(op: str) -> str:
    """The implementation SPECJAX_KERNELS names for `op`, or 'auto'."""
    return overrides().get(op, AUTO)


def choose(op: str, candidates, args: tuple, kwargs: dict, forced: str | None = None) -> Impl | None:
    """The selection rule over `candidates` (highest priority first): the first that is supported, preferred
    (unless it is `forced`, which goes first), built, and not a custom call under a mesh. None if none is."""
    if forced is not None:
        candidates = sorted(candidates, key=lambda i: i.name != forced)
    mesh = under_mesh()
    for impl in candidates:
        if impl.custom_call and mesh:
            continue
        if not impl.is_supported(*args, **kwargs):
            continue
        if impl.name != forced and not impl.prefers(*args, **kwargs):
            continue
        if impl.needs_build is not None and not cpu_build.available():
            cpu_build.warn_unavailable(*impl.needs_build)
            continue
        return impl
    return None


def select(op: str, *args, platform: str | None = None, **kwargs) -> Impl:
    """The implementation of `op` that a call with these arguments runs on `platform` (None: JAX's default)."""
    plat = normalize_platform(platform)
    forced = override(op)
    impl = choose(op, implementations(op, plat), args, kwargs, None if forced == AUTO else forced)
    if impl is None:
        raise KernelSelectionError(f"no implementation of {op} runs these inputs on {plat}; registered there: "
                                   f"{', '.join(i.name for i in implementations(op, plat)) or 'none'}")
    return impl


def call(op: str, *args, **kwargs):
    """Run `op` with the implementation `select` picks (inside a traced function: the choice is static)."""
    return select(op, *args, **kwargs).fn(*args, **kwargs)


def policy(op: str) -> str:
    """One line for run records: the override in effect for `op` and whether the CPU kernels are built."""
    chosen = override(op)
    candidates = TABLE[op].values() if chosen == AUTO else [TABLE[op][chosen]]
    if all(impl.needs_build is None for impl in candidates):
        return chosen
    built = "built" if cpu_build.available() else "unavailable: " + cpu_build.unavailable_reason()
    return f"{chosen} (kernels {built})"


__all__ = ["AUTO", "ENV", "OPS", "PLATFORMS", "TABLE", "Impl", "KernelSelectionError", "Op", "call", "choose",
           "define_op", "implementations", "normalize_platform", "override", "overrides", "parse_overrides",
           "policy", "register", "select", "under_mesh"]
