"""Running one specjax program over a device mesh with JAX's own SPMD partitioning.

A mesh is a third input, not a seam: the same jitted functions run, with the params and the decode state placed
on the mesh with `NamedSharding`s, and XLA partitions every program from those placements. Two axes:

    data    the batch: each data slice runs its own rows (and, across processes, its own batch-job shard)
    model   tensor parallelism: attention heads (whole heads, with their KV heads), the MLP's hidden units and
            the vocabulary (the embedding and the LM head) are split across it

Logical axes of the params (`models.llama.param_axes`) map to mesh axes through `RULES`. A logical axis is split
only when its size divides the model axis; which ones do is settled once per (model, mesh) by `ShardingPlan`:
- vocab must divide (a vocab-parallel LM head is the point of the model axis): otherwise an error;
- kv heads: with attention='auto' (the default) attention is replicated over `model` when the KV heads do not
  divide it (SmolLM2-135M: 3 KV heads on model=4 or 8), with a warning; attention='shard' makes that an error;
- the MLP's hidden units are split when they divide, else replicated (a warning).
Under a mesh with model > 1 the layers run in the canonical layout (wq/wk/wv, w_gate/w_up): the fused inference
layout (`fuse_projections`) stacks q, k and v (and gate and up) along one axis, and a contiguous split of it
would hand a device q rows of one head and v rows of another.

Greedy paths need nothing special: XLA partitions `argmax` over vocab-sharded logits into a local argmax per
shard and a reduction of the per-shard (max, index) pairs ([B, T, shards] values, never the logits); tests read
this in the compiled HLO (`collectives`).

Tracing happens under `jax.set_mesh(mesh)` (`MeshPlan.context()`): the model reads the abstract mesh to put its
sharding hints (batch over data, KV heads over model) and to leave the CPU C++ kernels aside (custom calls would
make XLA gather their sharded operands).
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.config import ConfigError
from specjax.kv_cache import KVCache
from specjax.models.llama import LlamaConfig, param_axes

AXES = ("data", "model")
ATTENTION_MODES = ("auto", "shard")
# Logical axis -> mesh axis (None = replicated). `batch` is the leading axis of every decode-state leaf.
RULES = {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model", "embed": None}
SIMULATE_HINT = ("on CPU, simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=N set before "
                 "jax is imported")


class MeshError(ConfigError):
    """A mesh that cannot run: bad text, an unknown axis, sizes that do not divide the devices or the model."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh sizes: data x model devices. 0 = derived from the device count (the other axis divides it).
    attention: 'auto' | 'shard' (see the module docstring). Frozen and hashable."""

    data: int = 0
    model: int = 1
    attention: str = "auto"

    def __post_init__(self):
        for name in AXES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise MeshError(f"mesh axis {name}={v!r} must be an integer >= 1 (or 0 to derive it from the "
                                f"device count)")
        if self.attention not in ATTENTION_MODES:
            raise MeshError(f"mesh attention={self.attention!r}: use one of {', '.join(ATTENTION_MODES)}"
                            + _suggest(str(self.attention), ATTENTION_MODES))

    @classmethod
    def parse(cls, text: str) -> "MeshConfig":
        """'data=2,model=4' (either axis may be left out and is then derived; 'auto' = every device on data;
        'attention=shard' may follow)."""
        text = text.strip()
        if text in ("", "auto"):
            return cls()
        kw: dict[str, Any] = {}
        for part in text.split(","):
            m = re.fullmatch(r"\s*([A-Za-z_]+)\s*=\s*([A-Za-z0-9_]+)\s*", part)
            if not m:
                raise MeshError(f"mesh {text!r}: {part.strip()!r} is not axis=size; write e.g. 'data=2,model=4'")
            key, value = m.group(1), m.group(2)
            if key in kw:
                raise MeshError(f"mesh {text!r}: axis {key!r} given twice")
            if key == "attention":
                kw[key] = value
            elif key in AXES:
                if not value.isdigit():
                    raise MeshError(f"mesh {text!r}: {key}={value!r} must be a whole number of devices")
                kw[key] = int(value)
            else:
                raise MeshError(f"mesh {text!r}: unknown axis {key!r}; the axes are data and model"
                                + _suggest(key, AXES + ("attention",)))
        return cls(**kw)

    @classmethod
    def from_user(cls, value) -> "MeshConfig":
        """A MeshConfig from text ('data=2,model=4'), a mapping ({'data': 2, 'model': 4}) or a MeshConfig."""
        if isinstance(value, MeshConfig):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in AXES + ("attention",)]
            if unknown:
                raise MeshError(f"mesh: unknown axis {unknown[0]!r}; the axes are data and model"
                                + _suggest(str(unknown[0]), AXES + ("attention",)))
            return cls(**dict(value))
        raise MeshError(f"mesh must be text such as 'data=2,model=4', a dict, a MeshConfig or a jax.sharding.Mesh, "
                        f"not {type(value).__name__}")

    def sizes(self, num_devices: int) -> tuple[int, int]:
        """(data, model) for this many devices, derived axes filled in. Errors name the counts."""
        data, model = self.data, self.model
        if num_devices < 1:
            raise MeshError("no devices to build a mesh on")
        if data == 0 and model == 0:
            data, model = num_devices, 1
        elif data == 0:
            if num_devices % model:
                raise MeshError(f"mesh model={model} does not divide the {num_devices} devices; "
                                f"pick model from {_divisors(num_devices)}")
            data = num_devices // model
        elif model == 0:
            if num_devices % data:
                raise MeshError(f"mesh data={data} does not divide the {num_devices} devices; "
                                f"pick data from {_divisors(num_devices)}")
            model = num_devices // data
        n = data * model
        if n > num_devices:
            hint = f"; {SIMULATE_HINT}" if num_devices == 1 else ""
            raise MeshError(f"mesh data={data} x model={model} needs {n} devices, but {num_devices} "
                            f"{'is' if num_devices == 1 else 'are'} available{hint}")
        if num_devices % n:
            raise MeshError(f"mesh data={data} x model={model} = {n} devices does not divide the {num_devices} "
                            f"devices; use a product from {_divisors(num_devices)}")
        return data, model

    def build(self, devices=None) -> Mesh:
        """A jax Mesh with axes ('data', 'model') over the first data*model of `devices` (default: this
        process's devices; in a multi-process run tensor parallelism stays inside a host and the processes share
        a batch job through `runners.distributed`)."""
        devices = list(jax.local_devices() if devices is None else devices)
        data, model = self.sizes(len(devices))
        return Mesh(np.array(devices[:data * model], dtype=object).reshape(data, model), AXES)

    def text(self) -> str:
        out = ",".join(f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a))
        return out + ("" if self.attention == "auto" else f",attention={self.attention}") or "auto"


def make_mesh(spec="auto", devices=None) -> Mesh:
    """A ('data', 'model') Mesh from text, a mapping, a MeshConfig, or a jax Mesh (checked and returned)."""
    if isinstance(spec, Mesh):
        check_mesh(spec)
        return spec
    return MeshConfig.from_user(spec).build(devices)


def check_mesh(mesh: Mesh) -> None:
    """A user's own jax Mesh must name its axes data and model (an axis of size 1 may be left out)."""
    for name in mesh.axis_names:
        if name not in AXES:
            raise MeshError(f"mesh axis {name!r} is unknown; name the axes data and model" + _suggest(name, AXES))


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _divisors(n: int) -> str:
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def axis_size(mesh: Mesh, name: str) -> int:
    return int(mesh.shape[name]) if name in mesh.axis_names else 1


# ------------------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Which logical axes of one model are split on one mesh: the resolved `RULES`.

    mesh: the jax Mesh; sharded: the logical axes actually split over `model` (a subset of heads/kv_heads, mlp,
    vocab); notes: why the others are not (for the warning and the docs)."""

    mesh: Mesh
    sharded: frozenset
    notes: tuple[str, ...] = ()

    @property
    def data(self) -> int:
        return axis_size(self.mesh, "data")

    @property
    def model(self) -> int:
        return axis_size(self.mesh, "model")

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        if logical == "batch":
            return "data" if self.data > 1 else None
        return RULES[logical] if logical in self.sharded else None

    def spec(self, logical_axes: tuple) -> P:
        return P(*(self.mesh_axis(a) for a in logical_axes))

    def sharding(self, logical_axes: tuple) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def context(self):
        """The context every program runs and traces in (`jax.set_mesh`)."""
        return jax.set_mesh(self.mesh)


def plan_for(config: LlamaConfig, mesh: Mesh, attention: str = "auto", *, warn: bool = True) -> ShardingPlan:
    """Resolve the rules for `config` on `mesh` (see the module docstring). Raises MeshError when the model axis
    cannot split the vocabulary, or the KV heads under attention='shard'."""
    check_mesh(mesh)
    m = axis_size(mesh, "model")
    sharded, notes = set(), []
    if m > 1:
        if config.vocab_size % m:
            raise MeshError(f"mesh model={m} does not divide the vocabulary ({config.vocab_size} tokens): the LM head "
                            f"is split over the model axis; pick model from {_divisors(math.gcd(config.vocab_size, mesh.size))}")
        sharded.add("vocab")
        heads_ok = config.num_kv_heads % m == 0  # then num_heads divides too: it is a multiple of num_kv_heads
        if attention == "shard" and not heads_ok:
            raise MeshError(f"mesh model={m} does not divide the {config.num_kv_heads} KV heads "
                            f"({config.num_heads} query heads); pick model from {_divisors(config.num_kv_heads)}, "
                            f"or attention=auto to replicate attention over the model axis")
        if heads_ok:
            sharded.update(("heads", "kv_heads"))
        else:
            notes.append(f"attention replicated over model={m}: it does not divide the {config.num_kv_heads} KV heads")
        if config.intermediate_size % m == 0:
            sharded.add("mlp")
        else:
            notes.append(f"MLP replicated over model={m}: it does not divide {config.intermediate_size} hidden units")
    if warn and notes:
        warnings.warn("; ".join(notes), stacklevel=3)
    return ShardingPlan(mesh, frozenset(sharded), tuple(notes))


def check_batch(plan: ShardingPlan, batch: int) -> None:
    """The batch must fill every data slice alike."""
    if batch % plan.data:
        raise MeshError(f"batch of {batch} rows does not split over data={plan.data}; use a multiple of {plan.data}")


# ------------------------------------------------------------------------------------------------ placement


def unfuse_projections(params: dict, config: LlamaConfig) -> dict:
    """The canonical layout (wq/wk/wv, wo, w_gate/w_up, w_down; see models.llama) of params in the fused
    inference layout; canonical layers pass through. A new tree."""
    nq, nkv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    F = config.intermediate_size

    def unfuse(lp: dict) -> dict:
        if "wqkv_t" not in lp:
            return dict(lp)
        out = {k: v for k, v in lp.items() if k in ("attn_norm", "mlp_norm", "q_norm", "k_norm")}
        w = lp["wqkv_t"]  # [(Hq + 2 Hkv) D, H]
        out["wq"], out["wk"], out["wv"] = w[:nq].T, w[nq:nq + nkv].T, w[nq + nkv:].T
        if "bqkv" in lp:
            b = lp["bqkv"]
            out["bq"], out["bk"], out["bv"] = b[:nq], b[nq:nq + nkv], b[nq + nkv:]
        out["wo"] = lp["wo_t"].T
        out["w_gate"], out["w_up"] = lp["w_gu_t"][:F].T, lp["w_gu_t"][F:].T
        out["w_down"] = lp["w_down_t"].T
        return out

    return {**params, "layers": [unfuse(lp) for lp in params["layers"]]}


def place_params(params: dict, config: LlamaConfig, plan: ShardingPlan) -> dict:
    """The params on the plan's mesh: with model > 1 in the canonical layout, each leaf split by its logical
    axes; with model = 1 as they are (fused or not), replicated on every device."""
    if plan.model == 1:
        rep = plan.replicated()
        return jax.tree_util.tree_map(lambda a: jax.device_put(a, rep), params)
    canon = unfuse_projections(params, config)
    axes = param_axes(config)
    return jax.tree_util.tree_map(lambda a, ax: jax.device_put(a, plan.sharding(ax)), canon, axes,
                                  is_leaf=lambda x: isinstance(x, tuple))


def replicate(tree, plan: ShardingPlan):
    """Every array leaf of a tree (a drafter's params) replicated on the mesh: small drafts run replicated."""
    rep = plan.replicated()
    return jax.tree_util.tree_map(lambda a: jax.device_put(a, rep) if isinstance(a, (jax.Array, np.ndarray)) else a,
                                  tree)


def cache_spec(plan: ShardingPlan, cache: KVCache) -> KVCache:
    """PartitionSpecs of a KV cache: k/v [B, Hkv, S, D] (and an int8 cache's scales [B, Hkv, S]) batch over data,
    KV heads over model (when attention is split), lengths [B] over data."""
    kv, sc = plan.spec(("batch", "kv_heads", None, None)), plan.spec(("batch", "kv_heads", None))
    return KVCache(tuple(kv for _ in cache.k), tuple(kv for _ in cache.v), plan.spec(("batch",)),
                   tuple(sc for _ in cache.k_scale), tuple(sc for _ in cache.v_scale))


def place_state(state, plan: ShardingPlan):
    """A decode state (any pytree whose array leaves lead with the batch axis, KVCaches inside it) on the mesh:
    rows over data, KV heads over model. Leaves whose batch does not split over data stay replicated."""
    def put(x, spec):
        return jax.device_put(x, NamedSharding(plan.mesh, spec))

    def place(node):
        if isinstance(node, KVCache):
            if node.lengths.shape[0] % plan.data:
                return jax.tree_util.tree_map(lambda a: put(a, P()), node)
            return jax.tree_util.tree_map(put, node, cache_spec(plan, node))
        if isinstance(node, (jax.Array, np.ndarray)):
            split = node.ndim >= 1 and node.shape[0] % plan.data == 0
            return put(node, plan.spec(("batch",) + (None,) * (node.ndim - 1)) if split else P())
        return node

    return jax.tree_util.tree_map(place, state, is_leaf=lambda x: isinstance(x, KVCache))


def describe(plan: ShardingPlan, params: dict) -> dict:
    """{'mesh': {'data': d, 'model': m}, 'sharded': [...], 'notes': [...], 'bytes_per_device': n}: what the plan
    did, for logs and reports."""
    per_device = 0
    for leaf in jax.tree_util.tree_leaves(params):
        shard = leaf.sharding.shard_shape(leaf.shape) if hasattr(leaf, "sharding") else leaf.shape
        per_device += int(np.prod(shard)) * jnp.dtype(leaf.dtype).itemsize
    return {"mesh": {"data": plan.data, "model": plan.model}, "sharded": sorted(plan.sharded),
            "notes": list(plan.notes), "bytes_per_device": per_device}


# ------------------------------------------------------------------------------------------------ HLO checks


_COLLECTIVE = re.compile(r"=\s*(\(?[a-z0-9]+\[[^\]]*\][^=]*?)\s(all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")


def collectives(hlo_text: str) -> list[tuple[str, str]]:
    """(op, result shape text) of every collective in compiled HLO text (`.lower(...).compile().as_text()`)."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            out.append((m.group(2), m.group(1).strip()))
    return out


def gathers_of_axis(hlo_text: str, size: int) -> list[str]:
    """Result shapes of the all-gathers whose result has an axis of exactly `size` (the full vocabulary: an
    all-gather of whole logits rows or of the vocab-split embedding)."""
    hits = []
    for op, shape in collectives(hlo_text):
        if op != "all-gather":
            continue
        dims = [int(d) for d in re.findall(r"\d+", shape.split("[", 1)[1].split("]", 1)[0])] if "[" in shape else []
        if size in dims:
            hits.append(shape)
    return hits


@contextlib.contextmanager
def maybe_context(plan: ShardingPlan | None):
    """plan.context() when there is a plan, else nothing."""
    if plan is None:
        yield
    else:
        with plan.context():
            yield
