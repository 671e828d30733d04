"""Check a jitted program against a platform's compile policy by walking its jaxpr.

Neuron's compiler (neuronx-cc) rejects or mishandles some XLA constructs that CPU, GPU and TPU accept. The
checker finds them in the jaxpr of an entry point, before anything is sent to a compiler, so the rules can be
enforced on a machine without the Neuron SDK. It recurses into every sub-jaxpr (jit/pjit, scan, while, cond,
custom_jvp/custom_vjp, closed_call, remat) and, per `CompilePolicy`:

errors (the program is not valid under the policy)
  * ``cond`` (lax.cond / lax.switch) where the policy has no cond;
  * ``while`` whose trip count is not static: only the shape a constant-bound fori_loop lowers to passes
    (the predicate compares a counter, initialised from a compile-time constant and advanced by a constant
    each iteration, against a compile-time constant or a loop-invariant carry initialised from one);
  * host callbacks (pure_callback, io_callback, debug_callback, debug_print, ...);
  * PRNG operations of an implementation other than the policy's (``threefry2x32`` under Neuron, whose
    documented advice is the ``rbg`` implementation), the raw ``threefry2x32`` primitive, and an
    ``rng_bit_generator`` with an explicit non-default algorithm (neuronx-cc error NCC_EVRF006);
  * Neuron only: ``reduce_precision`` (unsupported) and ``pallas_call`` (Pallas has no Neuron lowering).

warnings (valid, but known to be slow or fragile on the platform)
  * ``sort`` / ``top_k`` where the policy prefers sort-free code;
  * every ``scatter*`` (noting whether its indices depend on runtime data);
  * ``gather`` whose indices depend on runtime data (anything derived from the entry point's arguments;
    indices built only from constants, iota and loop counters do not count).

"Runtime data" is a forward data-flow property: literals, closed-over constants and values computed only from
them are static; the entry point's arguments are data; loop carries are static only while every iteration
keeps them so (a fixed point over the loop body).

`check_jaxpr` returns a `JaxprReport` (errors and warnings grouped by primitive and reason, with counts and
source locations); `hlo_census` adds what the lowered StableHLO contains (the loops that scan and rbg
batching lower to, custom calls). `specjax.backends.neuron.check_entry_points` runs both over every Neuron
entry point and bucket.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Callable, Iterable, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from specjax.backends.registry import CompilePolicy, get_compile_policy
from specjax.errors import SpecjaxError

__all__ = [
    "CALLBACK_PRIMITIVES",
    "Finding",
    "JaxprReport",
    "PolicyViolationError",
    "check_function",
    "check_jaxpr",
    "hlo_census",
    "merge_counts",
    "static_trip_count_problem",
]

CALLBACK_PRIMITIVES = frozenset({
    "pure_callback", "io_callback", "debug_callback", "debug_print", "callback", "outside_call",
    "host_callback_call", "check",
})
_COMPARES = frozenset({"lt", "le", "gt", "ge", "ne"})
_RANDOM_KEY_OPS = frozenset({"random_seed", "random_bits", "random_fold_in", "random_split"})
_SORTS = frozenset({"sort", "top_k", "approx_top_k"})
# Primitives whose outputs are not a function of their inputs alone.
_IMPURE = frozenset({"rng_uniform", "iota_random"}) | CALLBACK_PRIMITIVES
_MAX_LOCATIONS = 3
_ROOTS = ("specjax", "backends", "kernels", "tests")


class PolicyViolationError(SpecjaxError, ValueError):
    """A compiled entry point contains constructs its platform's compile policy forbids."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One kind of problem: a primitive, why it is flagged, how often, and where (source locations)."""

    severity: str  # "error" | "warning"
    primitive: str
    reason: str
    count: int
    locations: tuple[str, ...]  # up to a few "file.py:line (function)" entries

    def __str__(self) -> str:
        where = f" at {', '.join(self.locations)}" if self.locations else ""
        return f"{self.severity}: {self.primitive} x{self.count}: {self.reason}{where}"


@dataclasses.dataclass
class JaxprReport:
    """What `check_jaxpr` found in one program.

    Attributes:
      name: the checked program (entry point and bucket).
      policy: the CompilePolicy checked against.
      errors / warnings: grouped findings.
      primitive_counts: every primitive seen (sub-jaxprs included, each loop body counted once).
      hlo_ops: StableHLO op counts of the lowered program when a census was added, else empty.
    """

    name: str
    policy: CompilePolicy
    errors: list[Finding]
    warnings: list[Finding]
    primitive_counts: collections.Counter
    hlo_ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def ok(self) -> bool:
        return not self.errors

    def count(self, primitive: str, severity: str | None = None) -> int:
        """Total count of findings about `primitive` (optionally of one severity)."""
        found = self.errors + self.warnings
        return sum(f.count for f in found if f.primitive == primitive and severity in (None, f.severity))

    def summary(self) -> str:
        head = f"{self.name} [{self.policy.platform}]: {'OK' if self.ok else 'FAILED'}"
        head += f" ({len(self.errors)} error kinds, {len(self.warnings)} warning kinds)"
        return "\n".join([head] + [f"  {f}" for f in self.errors + self.warnings])

    def raise_for_errors(self) -> None:
        """Raise PolicyViolationError naming every error (and how to fix the usual ones)."""
        if self.errors:
            lines = "; ".join(str(f) for f in self.errors)
            raise PolicyViolationError(
                f"{self.name} is not valid under the {self.policy.platform} compile policy: {lines}. "
                "Replace lax.cond by selects (jnp.where), data-dependent while loops by a static loop plus a "
                "host loop across calls, callbacks by returned values, and threefry keys by the rbg PRNG.")


def _location(eqn) -> str:
    try:
        from jax._src import source_info_util

        text = source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - private helper; a location is only a hint
        return ""
    # "/long/path/specjax/kv_cache.py:52:9 (write_kv)" -> "specjax/kv_cache.py:52 (write_kv)"
    m = re.match(r"(.*?):(\d+)(?::\d+)? ?(\(.*\))?$", text)
    if not m:
        return text
    path, line, func = m.groups()
    parts = path.replace(os.sep, "/").split("/")
    # From the package folder on ("specjax/kv_cache.py", "specjax/models/llama.py"); else the last two parts.
    roots = [i for i, part in enumerate(parts) if part in _ROOTS]
    short = "/".join(parts[roots[-1]:] if roots else parts[-2:])
    return f"{short}:{line}" + (f" {func}" if func else "")


def _key_impl_name(eqn) -> str | None:
    """The PRNG implementation name ("threefry2x32", "rbg", ...) of a random_* eqn, if it has one."""
    impl = eqn.params.get("impl")
    if impl is None:
        for v in list(eqn.invars) + list(eqn.outvars):
            impl = getattr(getattr(getattr(v, "aval", None), "dtype", None), "_impl", None)
            if impl is not None:
                break
    return None if impl is None else getattr(impl, "name", str(impl))


def _subjaxprs(params: dict) -> list[tuple[str, ClosedJaxpr | Jaxpr]]:
    out = []
    for key, val in params.items():
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for i, v in enumerate(vals):
            if isinstance(v, (ClosedJaxpr, Jaxpr)):
                out.append((key if len(vals) == 1 else f"{key}[{i}]", v))
    return out


def scan_operands(eqn, values: list) -> tuple[list, list, list]:
    """A scan equation's operands (or anything in their order) split into (consts, initial carry, xs). jax 0.10
    records the counts as num_consts / num_carry; 0.11 replaced them by a flat tree of the three groups (ft_in)."""
    p = eqn.params
    if "num_consts" in p:
        nc, nk = p["num_consts"], p["num_carry"]
        return list(values[:nc]), list(values[nc:nc + nk]), list(values[nc + nk:])
    consts, init, xs = p["ft_in"].update(list(values)).unpack()
    return list(consts), list(init), list(xs)


def _open(j: ClosedJaxpr | Jaxpr) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


class _Walker:
    """Forward walk with a static/data flag per variable; findings are recorded only when `record` is on
    (loop bodies are first walked silently to reach the fixed point of their carries)."""

    def __init__(self, policy: CompilePolicy):
        self.policy = policy
        self.record = True
        self.found: dict[tuple[str, str, str], list] = {}
        self.counts: collections.Counter = collections.Counter()
        # Locations of the enclosing call eqns: an eqn inside a library jit (jnp.take, jax.random.uniform) has
        # no user frame of its own, so it is reported where the call into the library was made.
        self.where: list[str] = []

    # ----------------------------------------------------------------------------------------- findings
    def flag(self, severity: str, eqn, reason: str) -> None:
        if not self.record:
            return
        entry = self.found.setdefault((severity, eqn.primitive.name, reason), [0, []])
        entry[0] += 1
        loc = _location(eqn) or next((w for w in reversed(self.where) if w), "")
        if loc and loc not in entry[1] and len(entry[1]) < _MAX_LOCATIONS:
            entry[1].append(loc)

    def findings(self, severity: str) -> list[Finding]:
        out = [Finding(s, p, r, n, tuple(locs)) for (s, p, r), (n, locs) in self.found.items() if s == severity]
        return sorted(out, key=lambda f: (-f.count, f.primitive, f.reason))

    # ----------------------------------------------------------------------------------------- data flow
    def walk(self, jaxpr: Jaxpr, in_static: Sequence[bool]) -> list[bool]:
        static: dict = {v: True for v in jaxpr.constvars}
        static.update(zip(jaxpr.invars, in_static))
        flag = lambda a: True if isinstance(a, Literal) else static.get(a, False)
        for eqn in jaxpr.eqns:
            nested = self.record and bool(_subjaxprs(eqn.params))
            if nested:
                self.where.append(_location(eqn))
            try:
                outs = self.visit(eqn, [flag(a) for a in eqn.invars])
            finally:
                if nested:
                    self.where.pop()
            static.update(zip(eqn.outvars, outs))
        return [flag(v) for v in jaxpr.outvars]

    def silently(self, fn: Callable, *args):
        saved, self.record = self.record, False
        try:
            return fn(*args)
        finally:
            self.record = saved

    def loop_fixed_point(self, body: Jaxpr, consts: list[bool], init: list[bool], rest: list[bool]) -> list[bool]:
        """Carry flags of a loop: a carry stays static only while the body keeps it static."""
        carry = list(init)
        for _ in range(len(carry) + 1):
            out = self.silently(self.walk, body, consts + carry + rest)[:len(carry)]
            new = [c and o for c, o in zip(carry, out)]
            if new == carry:
                break
            carry = new
        return carry

    # ----------------------------------------------------------------------------------------- rules
    def visit(self, eqn, ins: list[bool]) -> list[bool]:
        name = eqn.primitive.name
        p = self.policy
        if self.record:
            self.counts[name] += 1
        if name == "cond":
            if not p.allows_cond:
                self.flag("error", eqn, "lax.cond/lax.switch is not supported; compute both sides and select")
            return self.visit_cond(eqn, ins)
        if name == "while":
            return self.visit_while(eqn, ins)
        if name == "scan":
            return self.visit_scan(eqn, ins)
        if name in CALLBACK_PRIMITIVES or "callback" in name:
            if not p.allows_callbacks:
                self.flag("error", eqn, "host callbacks are not supported in compiled code")
            return [False] * len(eqn.outvars)
        if name == "threefry2x32" and p.rng_impl != "threefry2x32":
            self.flag("error", eqn, f"threefry hash in compiled code; use the {p.rng_impl} PRNG")
        if name in _RANDOM_KEY_OPS:
            impl = _key_impl_name(eqn)
            # Platforms whose policy keeps JAX's default (threefry) run every implementation; the others need theirs.
            allowed = {p.rng_impl} | ({"unsafe_rbg"} if p.rng_impl == "rbg" else set())
            if impl is not None and impl not in allowed and not p.rng_impl.startswith("threefry"):
                self.flag("error", eqn, f"{impl} PRNG keys; this platform needs {p.rng_impl} "
                                        f"(jax.default_prng_impl({p.rng_impl!r}) while tracing)")
        if name == "rng_bit_generator":
            alg = eqn.params.get("algorithm")
            if p.platform == "neuron" and alg is not None and alg != jax.lax.RandomAlgorithm.RNG_DEFAULT:
                self.flag("error", eqn, f"rng_bit_generator with {alg}; neuronx-cc accepts only RNG_DEFAULT")
        if p.platform == "neuron" and name == "reduce_precision":
            self.flag("error", eqn, "reduce_precision is not supported by neuronx-cc")
        if name == "pallas_call":
            if p.platform == "neuron":
                self.flag("error", eqn, "Pallas kernels have no Neuron lowering")
            return [False] * len(eqn.outvars)  # the kernel body is not XLA: not walked
        if name in _SORTS and p.prefer_sort_free:
            self.flag("warning", eqn, "sort; neuronx-cc supports only simple comparators and sorts slowly")
        # Neuron-specific advice: data-dependent gather/scatter has been miscompiled silently by neuronx-cc.
        if name.startswith("scatter") and p.platform == "neuron":
            dep = "data-dependent" if not ins[1] else "static"
            self.flag("warning", eqn, f"scatter with {dep} indices (prefer dynamic_update_slice or selects)")
        if name == "gather" and not ins[1] and p.platform == "neuron":
            self.flag("warning", eqn, "gather with data-dependent indices (prefer one-hot matmuls or selects)")
        subs = _subjaxprs(eqn.params)
        if subs:
            outs = None
            for _, sub in subs:
                inner = _open(sub)
                flags = ins if len(inner.invars) == len(ins) else [False] * len(inner.invars)
                res = self.walk(inner, flags)
                if outs is None and len(res) == len(eqn.outvars):
                    outs = res
            return outs if outs is not None else [all(ins)] * len(eqn.outvars)
        pure = name not in _IMPURE and not eqn.effects
        return [pure and all(ins)] * len(eqn.outvars)

    def visit_cond(self, eqn, ins: list[bool]) -> list[bool]:
        outs = [True] * len(eqn.outvars)
        for branch in eqn.params["branches"]:
            res = self.walk(_open(branch), ins[1:])
            outs = [a and b for a, b in zip(outs, res)]
        return [o and ins[0] for o in outs]

    def visit_scan(self, eqn, ins: list[bool]) -> list[bool]:
        body = _open(eqn.params["jaxpr"])
        consts, init, xs = scan_operands(eqn, ins)
        nk = len(init)
        carry = self.loop_fixed_point(body, consts, init, xs)
        outs = self.walk(body, consts + carry + xs)
        return carry + outs[nk:]

    def visit_while(self, eqn, ins: list[bool]) -> list[bool]:
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        cond, body = _open(eqn.params["cond_jaxpr"]), _open(eqn.params["body_jaxpr"])
        cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        if not self.policy.allows_dynamic_while:
            reason = static_trip_count_problem(eqn, cconsts, bconsts, init)
            if reason is not None:
                self.flag("error", eqn, f"while loop without a static trip count ({reason}); use lax.scan or "
                                        "fori_loop with constant bounds, and loop across calls on the host")
        carry = self.loop_fixed_point(body, bconsts, init, [])
        self.walk(cond, cconsts + carry)
        self.walk(body, bconsts + carry)
        return carry


def static_trip_count_problem(eqn, cond_consts: list[bool], body_consts: list[bool], init: list[bool]) -> str | None:
    """None if a `while` eqn has a compile-time trip count, else why not.

    Accepted shape (what fori_loop / a counted while lower to): the predicate is one compare between a counter
    carry and a bound; the counter starts from a static value and the body adds/subtracts a static step; the
    bound is a literal, a static constant, or a carry the body passes through unchanged from a static start.
    """
    cond = eqn.params["cond_jaxpr"]
    body = eqn.params["body_jaxpr"]
    cj, bj = _open(cond), _open(body)
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cconst_vars = set(cj.constvars) | {v for v, s in zip(cj.invars[:cn], cond_consts) if s}
    carry_in = {v: i for i, v in enumerate(cj.invars[cn:])}
    producers = {o: e for e in cj.eqns for o in e.outvars}
    pred = cj.outvars[0]
    if isinstance(pred, Literal):
        return None if not pred.val else "the predicate is always true"
    cmp = producers.get(pred)
    if cmp is None or cmp.primitive.name not in _COMPARES:
        what = "a loop argument" if cmp is None else f"'{cmp.primitive.name}'"
        return f"the predicate is {what}, not a compare of a counter against a constant"

    def unwrap(a):  # look through dtype conversions of the compared values
        e = producers.get(a) if not isinstance(a, Literal) else None
        while e is not None and e.primitive.name == "convert_element_type":
            a = e.invars[0]
            e = producers.get(a) if not isinstance(a, Literal) else None
        return a

    def classify(a):
        a = unwrap(a)
        if isinstance(a, Literal) or a in cconst_vars:
            return ("const", None)
        if a in carry_in:
            return ("carry", carry_in[a])
        return ("other", None)

    kinds = [classify(a) for a in cmp.invars]
    bin_ = bj.invars[bn:]
    bconst_vars = set(bj.constvars) | {v for v, s in zip(bj.invars[:bn], body_consts) if s}
    bprod = {o: e for e in bj.eqns for o in e.outvars}

    def is_counter(j: int) -> bool:
        if not init[j]:
            return False
        e = bprod.get(bj.outvars[j])
        if e is None or e.primitive.name not in ("add", "sub"):
            return False
        a, b = e.invars
        step_static = lambda x: isinstance(x, Literal) or x in bconst_vars
        return (a is bin_[j] and step_static(b)) or (e.primitive.name == "add" and b is bin_[j] and step_static(a))

    def is_invariant(j: int) -> bool:
        return init[j] and bj.outvars[j] is bin_[j]

    counters = [j for kind, j in kinds if kind == "carry" and is_counter(j)]
    if len(counters) != 1:
        return "no carry advances by a constant step from a static start"
    for kind, j in kinds:
        if kind == "carry" and j == counters[0]:
            continue
        if kind == "const" or (kind == "carry" and is_invariant(j)):
            continue
        return "the bound depends on runtime data"
    return None


def check_jaxpr(jaxpr: ClosedJaxpr | Jaxpr, policy: CompilePolicy | str | None = "neuron", *,
                name: str = "program", static_args: Sequence[bool] | None = None) -> JaxprReport:
    """Check one (closed) jaxpr against a compile policy.

    Args:
      jaxpr: e.g. `jax.make_jaxpr(f)(*args)` or `jax.jit(f).trace(*args).jaxpr`.
      policy: a CompilePolicy or a platform name ("neuron" by default).
      name: label for the report.
      static_args: per top-level input, whether it is a compile-time constant (default: all are runtime data).
    Returns:
      JaxprReport with grouped errors and warnings.
    """
    pol = policy if isinstance(policy, CompilePolicy) else get_compile_policy(policy)
    inner = _open(jaxpr)
    flags = list(static_args) if static_args is not None else [False] * len(inner.invars)
    if len(flags) != len(inner.invars):
        raise ValueError(f"static_args has {len(flags)} entries for a jaxpr with {len(inner.invars)} inputs")
    w = _Walker(pol)
    w.walk(inner, flags)
    return JaxprReport(name, pol, w.findings("error"), w.findings("warning"), w.counts)


def check_function(fn: Callable, *args, policy: CompilePolicy | str | None = "neuron", name: str | None = None,
                   **kwargs) -> JaxprReport:
    """Trace `fn(*args, **kwargs)` (arrays or ShapeDtypeStructs) and check its jaxpr."""
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    return check_jaxpr(closed, policy, name=name or getattr(fn, "__name__", "program"))


_HLO_OP = re.compile(r"\b(stablehlo|mhlo|chlo)\.([a-z_]+)")
_CUSTOM_CALL_TARGET = re.compile(r"custom_call\s*@([\w.$-]+)|call_target_name\s*=\s*\"([^\"]+)\"")
_RNG_ALG = re.compile(r"rng_bit_generator[^\n]*algorithm\s*=\s*(\w+)")


def hlo_census(report: JaxprReport, hlo_text: str) -> JaxprReport:
    """Add the op counts of the lowered StableHLO (`jax.jit(f).lower(...).as_text()`) to a report.

    The jaxpr check is the one that decides loops (a scan is a static loop by construction); the census shows
    what the device compiler receives: every scan and the rbg key batching become `while` ops there, and
    custom calls are named. Errors: `case`/`if` ops where the policy has no cond, callback custom calls where
    it has no callbacks, rng_bit_generator with a non-default algorithm under Neuron.
    """
    ops = collections.Counter(f"{d}.{op}" for d, op in _HLO_OP.findall(hlo_text))
    targets = collections.Counter(a or b for a, b in _CUSTOM_CALL_TARGET.findall(hlo_text))
    for t, n in targets.items():
        ops[f"custom_call:{t}"] += n
    pol = report.policy
    errors = list(report.errors)
    branchy = ops["stablehlo.case"] + ops["stablehlo.if"]
    if branchy and not pol.allows_cond:
        errors.append(Finding("error", "hlo:case/if", "conditional in the lowered program", branchy, ()))
    callbacks = sum(n for t, n in targets.items() if "callback" in t.lower())
    if callbacks and not pol.allows_callbacks:
        errors.append(Finding("error", "hlo:custom_call", "host callback custom call", callbacks, ()))
    bad_rng = [a for a in _RNG_ALG.findall(hlo_text) if a.upper() not in ("DEFAULT", "RNG_DEFAULT")]
    if bad_rng and pol.platform == "neuron":
        errors.append(Finding("error", "hlo:rng_bit_generator", f"algorithm {bad_rng[0]}", len(bad_rng), ()))
    return dataclasses.replace(report, errors=errors, hlo_ops=ops)


def merge_counts(reports: Iterable[JaxprReport]) -> dict[str, dict[str, int]]:
    """{primitive: {"errors": n, "warnings": n}} summed over reports (for a compact overview)."""
    out: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"errors": 0, "warnings": 0})
    for r in reports:
        for f in r.errors:
            out[f.primitive]["errors"] += f.count
        for f in r.warnings:
            out[f.primitive]["warnings"] += f.count
    return dict(out)
