"""Weight-only quantized projections: int8 (per output channel), int4 (group-wise) and GGUF's blocks kept as the
file stores them (Q8_0 / Q4_0 / Q4_1 as QuantWeights below; Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K as a
`BlockWeight` of the file's own bytes, multiplied by `specjax.kernels.gguf_matmul`), behind one `linear(x, w)`
that the model calls for every projection.

A quantized weight is a `QuantWeight` pytree: codes and scales are its leaves (arrays), the format is static, so a
params tree holding them jits like any other and a change of format is a change of program. Weights are stored
[out, in] (the inference layout of `specjax.models.llama.fuse_projections`) and quantized along `in`:
    kind    codes                      scale / minimum            value of w[o, k]
    int8    int8 [N, K]                float32 [N, 1]             codes * scale                 (group = K)
    int4    uint8 [N, K/2] (4-bit)     float32 [N, K/group] (both) nibble * scale + minimum
    q8_0    int8 [N, K]                float16 [N, K/32]          codes * scale
    q4_0    uint8 [N, K/2]             float16 [N, K/32]          (nibble - 8) * scale
    q4_1    uint8 [N, K/2]             float16 [N, K/32] (both)   nibble * scale + minimum
4-bit codes are packed in GGUF's order inside every 32 values (byte j of a block: value j in the low nibble,
value j + 16 in the high one), so specjax's int4 and GGUF's Q4_0 / Q4_1 share one unpacking and one CPU kernel.

Where the product runs (`linear`) is the kernel table's choice (`specjax.backends.ops`), made at trace time:
float weights go through the op `matmul`, quantized ones through the op `quant_matmul`, whose implementations
live in `specjax.kernels.cpu_quant_matmul`: on the CPU platform with the C++ kernels built, the codes are widened
in registers and multiplied in the float32 kernel's order for any number of rows (one summation order for plain
steps and verify blocks is what keeps greedy speculation exact for a quantized target); elsewhere (GPU, TPU, no
compiler, under a mesh, `SPECJAX_KERNELS=quant_matmul=xla`) XLA: int8 as `(x @ codes^T) * scale` in x's dtype,
the other kinds dequantized inside the jitted forward and multiplied by XLA's dot.

W8A8 ("w8a8", lossy and labelled so): the int8 weights above, and every activation row quantized to int8 with its
own scale just before the product, which then runs as an int8 x int8 dot with int32 accumulation through Qwix
(`qwix.quantize` / `qwix.dot_general`, the maintained JAX quantization library; the `quant` extra). It changes the
model's logits (the activations are rounded), but integer accumulation is exact and each row's scale is its own,
so a plain step and a verify block still compute identical rows: greedy speculation stays equal to plain greedy
of the same W8A8 target. It pays where the hardware has int8 matrix units (TPU, GPU); XLA:CPU runs that dot far
slower than float32 (reports/quant_cpu/), so the CPU keeps weight-only int8 as its fast setting. Weight-only int8
and int4 do not go through Qwix: for a float activation Qwix widens and rescales the whole weight before the dot,
while `linear` multiplies by the widened codes and scales the output.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.backends import ops
from specjax.errors import SpecjaxError
from specjax.kernels import cpu_quant_matmul, gguf_matmul

QUANTIZATIONS = ("int8", "int4", "gguf", "w8a8")  # what LLM(quantization=...) accepts besides None
KINDS = ("int8", "int4", "q8_0", "q4_0", "q4_1", "w8a8")
GGUF_NATIVE = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGUF types kept as a QuantWeight by "gguf"
# GGUF types kept as stored by quantization="gguf" (`BlockWeight`, the file's bytes): the K-quants and Q5_0 / Q5_1.
# Q8_0 / Q4_0 / Q4_1 stay QuantWeights (`GGUF_NATIVE`) unless a fused matrix mixes them with these.
GGUF_BLOCKS = tuple(t for t in gguf_matmul.TYPES if t not in GGUF_NATIVE)
GGUF_KEPT = tuple(GGUF_NATIVE) + GGUF_BLOCKS  # every GGUF type quantization="gguf" keeps as stored
DEFAULT_GROUP_SIZE = 32  # GGUF Q4 block size: a Q4 file requantized at 32 lands on its own grid
BLOCK = cpu_quant_matmul.BLOCK  # GGUF block length, the granularity of 4-bit packing and of the CPU kernel


class QuantizationError(SpecjaxError, ValueError):
    """A quantization setting or weight that cannot be used, with what is supported."""


@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """A weight [N, K] stored [out, in] as codes and per-group scales (see the module docstring for each kind).

    codes int8 [N, K] (8-bit kinds) or uint8 [N, K/2] (4-bit kinds); scale [N, K/group] float32 (int8, int4) or
    float16 (GGUF kinds); minimum like scale for int4 and q4_1, else None. kind and group are static (pytree metadata)."""

    codes: jax.Array
    scale: jax.Array
    minimum: jax.Array | None
    kind: str
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [N, K] shape of the weight."""
        n, c = self.codes.shape
        return (int(n), int(c) * (1 if self.bits == 8 else 2))

    @property
    def bits(self) -> int:
        return cpu_quant_matmul.BITS[self.kind]

    @property
    def nbytes(self) -> int:
        """Bytes resident for this weight (codes, scales and minimums)."""
        leaves = [self.codes, self.scale] + ([self.minimum] if self.minimum is not None else [])
        return int(sum(a.size * np.dtype(a.dtype).itemsize for a in leaves))


jax.tree_util.register_dataclass(QuantWeight, data_fields=["codes", "scale", "minimum"],
                                 meta_fields=["kind", "group"])


@dataclasses.dataclass(frozen=True)
class BlockWeight:
    """A weight [N, k] as a GGUF file stores it: blocks uint8 [N, row_bytes], each row a run of ggml blocks of
    type `type_name` (`specjax.kernels.gguf_matmul.TYPES`). type_name and k are static (pytree metadata)."""

    blocks: jax.Array
    type_name: str
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), int(self.k))

    @property
    def nbytes(self) -> int:
        return int(self.blocks.size)


jax.tree_util.register_dataclass(BlockWeight, data_fields=["blocks"], meta_fields=["type_name", "k"])


@dataclasses.dataclass(frozen=True)
class RowStack:
    """Weights of different formats stacked along the output axis, as one [sum N, K] weight: a fused q/k/v or
    gate/up matrix whose parts a GGUF file stores in different types (Q4_K_M keeps some V rows in Q6_K). The
    product is each part's product, concatenated."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


jax.tree_util.register_dataclass(RowStack, data_fields=["parts"], meta_fields=[])


def is_quantized(w) -> bool:
    return isinstance(w, (QuantWeight, BlockWeight, RowStack))


def check_quantization(quantization: str | None) -> str | None:
    """The setting itself, or QuantizationError naming the supported ones."""
    if quantization is None or quantization in QUANTIZATIONS:
        return quantization
    raise QuantizationError(f"unknown quantization {quantization!r}; supported: None (float weights), "
                            + ", ".join(repr(q) for q in QUANTIZATIONS))


def check_lm_head(quantization: str | None, quantize_lm_head: bool | None) -> None:
    """quantize_lm_head: None (the setting's default: 'gguf' keeps the file's LM head as stored when its type is
    native, the other settings keep it float), True or False. True needs a quantization to follow."""
    if quantize_lm_head not in (None, True, False):
        raise QuantizationError(f"quantize_lm_head must be None, True or False, got {quantize_lm_head!r}")
    if quantize_lm_head and quantization is None:
        raise QuantizationError("quantize_lm_head=True quantizes the LM head like the layers, but quantization is "
                                f"None: pick one of {', '.join(QUANTIZATIONS)}, or drop quantize_lm_head")


# ------------------------------------------------------------------------------------------------ quantizers


def _as_2d(w, name: str) -> np.ndarray:
    a = np.asarray(jax.device_get(w), np.float32)
    if a.ndim != 2:
        raise QuantizationError(f"{name}: only 2-D weights [out, in] are quantized, got shape {a.shape}")
    return a


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """uint8 values in [0, 16) [N, K] (K a multiple of 32) -> uint8 [N, K/2] in GGUF's order per 32-block (the
    inverse of `specjax.kernels.cpu_quant_matmul.unpack_nibbles`)."""
    n, k = nibbles.shape
    b = nibbles.reshape(n, k // BLOCK, 2, BLOCK // 2).astype(np.uint8)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)


def quantize_int8(w, name: str = "weight") -> QuantWeight:
    """Symmetric int8 with one float32 scale per output row: w [N, K] (stored [out, in]) -> QuantWeight.
    |w - dequantize| <= scale / 2 = max|w[o]| / 254 per row."""
    a = _as_2d(w, name)
    amax = np.abs(a).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    codes = np.clip(np.rint(a / scale), -127, 127).astype(np.int8)
    return QuantWeight(jnp.asarray(codes), jnp.asarray(scale), None, "int8", a.shape[1])


def quantize_w8a8(w, name: str = "weight") -> QuantWeight:
    """`quantize_int8`'s codes and scales, marked for int8 activations at product time (see the module docstring)."""
    return dataclasses.replace(quantize_int8(w, name), kind="w8a8")


def _qwix():
    try:
        import qwix
    except ImportError:
        raise QuantizationError('quantization="w8a8" runs through Qwix, which is not installed: pip install -e '
                                '".[quant]" (from a checkout) or pip install "specjax[quant]"') from None
    return qwix


def w8a8_matmul(x: jax.Array, w: QuantWeight) -> jax.Array:
    """x [..., K] -> [..., N] float32: x quantized to int8 per row (symmetric, its own scale), times the int8 codes
    with int32 accumulation, rescaled by both scales (Qwix)."""
    qwix = _qwix()
    from qwix._src.core.qarray import QArray

    rows = list(range(x.ndim - 1))
    qx = qwix.quantize(x.astype(jnp.float32), jnp.int8, channelwise_axes=rows)
    qw = QArray(qvalue=w.codes, scale=w.scale.astype(jnp.float32), zero_point=None, qtype=jnp.int8)
    return qwix.dot_general(qx, qw, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def quantize_int4(w, group_size: int = DEFAULT_GROUP_SIZE, name: str = "weight") -> QuantWeight:
    """Asymmetric 4-bit codes with a float32 scale and minimum per `group_size` inputs of each row (the form of
    GGUF's Q4_1, with any group): w [N, K] -> QuantWeight, value = nibble * scale + minimum. group_size must be a
    positive multiple of 32 that divides K. |w - dequantize| <= scale / 2 = (max - min) / 30 per group.
    (Symmetric codes, (nibble - 8) * scale, lost too much: on SmolLM2's weights, already 4-bit with a minimum in
    the GGUF, they moved the logits by up to 21 where these stay near the int8 error.)"""
    a = _as_2d(w, name)
    n, k = a.shape
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size <= 0 \
            or group_size % BLOCK:
        raise QuantizationError(f"int4 group_size must be a positive multiple of {BLOCK}, got {group_size!r}")
    if k % group_size:
        divisors = [g for g in range(BLOCK, k + 1, BLOCK) if k % g == 0]
        raise QuantizationError(f"{name}: int4 group_size {group_size} does not divide the input dimension {k}; "
                                f"use one of {divisors[:8]}" if divisors else
                                f"{name}: int4 needs an input dimension that is a multiple of {BLOCK}, got {k}")
    g = a.reshape(n, k // group_size, group_size)
    lo, hi = g.min(axis=2), g.max(axis=2)
    scale = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)  # [N, K/group]
    minimum = lo.astype(np.float32)
    q = np.clip(np.rint((g - minimum[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    return QuantWeight(jnp.asarray(pack_nibbles(q.reshape(n, k))), jnp.asarray(scale), jnp.asarray(minimum),
                       "int4", group_size)


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int], name: str = "tensor") -> QuantWeight:
    """A GGUF tensor's bytes as stored (uint8 [nbytes]) of type Q8_0, Q4_0 or Q4_1 and [out, in] shape -> the
    QuantWeight of the same values (no dequantization: scales stay float16, codes stay packed)."""
    if type_name not in GGUF_NATIVE:
        raise QuantizationError(f"{name}: GGUF type {type_name} is not kept natively; supported: "
                                f"{', '.join(GGUF_NATIVE)} (other types are dequantized to float)")
    n, k = shape
    if k % BLOCK:
        raise QuantizationError(f"{name}: input dimension {k} is not a multiple of the GGUF block {BLOCK}")
    kind = GGUF_NATIVE[type_name]
    head = {"q8_0": 2, "q4_0": 2, "q4_1": 4}[kind]
    body = BLOCK if kind == "q8_0" else BLOCK // 2
    raw = np.asarray(raw, np.uint8)
    if raw.size != n * (k // BLOCK) * (head + body):
        raise QuantizationError(f"{name}: {raw.size} bytes do not hold a {type_name} tensor of shape {shape}")
    blocks = raw.reshape(n, k // BLOCK, head + body)
    scale = np.ascontiguousarray(blocks[:, :, 0:2]).view("<f2").reshape(n, k // BLOCK).astype(np.float16)
    minimum = None
    if kind == "q4_1":
        minimum = jnp.asarray(np.ascontiguousarray(blocks[:, :, 2:4]).view("<f2").reshape(n, k // BLOCK)
                              .astype(np.float16))
    codes = np.ascontiguousarray(blocks[:, :, head:]).reshape(n, -1)
    if kind == "q8_0":
        codes = codes.view(np.int8)
    return QuantWeight(jnp.asarray(codes), jnp.asarray(scale), minimum, kind, BLOCK)


def from_gguf_raw(raw: np.ndarray, type_name: str, shape: tuple[int, int], name: str = "tensor") -> BlockWeight:
    """A GGUF tensor's bytes as stored (uint8 [nbytes], e.g. a view of the memory-mapped file) of one of
    `GGUF_BLOCKS` and [out, in] shape -> the BlockWeight holding those bytes, nothing decoded."""
    if type_name not in gguf_matmul.TYPES:
        raise QuantizationError(f"{name}: GGUF type {type_name} is not kept as stored; supported: "
                                f"{', '.join(GGUF_KEPT)} (other types are dequantized to float)")
    n, k = shape
    try:
        width = gguf_matmul.row_bytes(type_name, k)
    except gguf_matmul.GgufMatmulInputError as err:
        raise QuantizationError(f"{name}: {err}") from None
    raw = np.asarray(raw).view(np.uint8).reshape(-1)
    if raw.size != n * width:
        raise QuantizationError(f"{name}: {raw.size} bytes do not hold a {type_name} tensor of shape {shape}")
    return BlockWeight(jnp.asarray(raw.reshape(n, width)), type_name, k)


def take_rows(w, index: np.ndarray):
    """The weight with its output rows reordered (`w[index]`): blocks run along the input axis, so rows move whole."""
    idx = np.asarray(index)
    if isinstance(w, BlockWeight):
        return dataclasses.replace(w, blocks=w.blocks[idx])
    return dataclasses.replace(w, codes=w.codes[idx], scale=w.scale[idx],
                               minimum=None if w.minimum is None else w.minimum[idx])


def _format(w):
    """What decides whether two weights concatenate into one: their class and static format."""
    if isinstance(w, BlockWeight):
        return (BlockWeight, w.type_name, w.k)
    return (QuantWeight, w.kind, w.group, w.shape[1])


def concat_rows(ws: list):
    """Weights stacked along the output axis (q/k/v and gate/up fusion): neighbours of one format concatenate into
    one weight; when formats differ, a RowStack of those runs."""
    if len({w.shape[1] for w in ws}) != 1:
        raise QuantizationError(f"cannot fuse weights of different widths: {sorted({w.shape[1] for w in ws})}")
    flat = [p for w in ws for p in (w.parts if isinstance(w, RowStack) else [w])]
    runs: list[list] = []
    for w in flat:
        if runs and _format(runs[-1][0]) == _format(w):
            runs[-1].append(w)
        else:
            runs.append([w])
    cat = lambda xs: jnp.concatenate(xs, axis=0)  # noqa: E731
    merged = []
    for run in runs:
        w = run[0]
        if len(run) == 1:
            merged.append(w)
        elif isinstance(w, BlockWeight):
            merged.append(dataclasses.replace(w, blocks=cat([r.blocks for r in run])))
        else:
            merged.append(dataclasses.replace(w, codes=cat([r.codes for r in run]), scale=cat([r.scale for r in run]),
                                              minimum=None if w.minimum is None else cat([r.minimum for r in run])))
    return merged[0] if len(merged) == 1 else RowStack(tuple(merged))


def dequantize(w, dtype=jnp.float32) -> jax.Array:
    """The float weight [N, K] a quantized weight stands for, computed in float32 and cast to `dtype` (jnp;
    jittable)."""
    if isinstance(w, BlockWeight):
        return gguf_matmul.dequantize(w.blocks, w.type_name, w.k, dtype)
    if isinstance(w, RowStack):
        return jnp.concatenate([dequantize(p, dtype) for p in w.parts], axis=0)
    return cpu_quant_matmul.dequantize(w.codes, w.scale, w.minimum, kind=w.kind, group=w.group, dtype=dtype)


# --------------------------------------------------------------------------------------------- the product


def linear(x: jax.Array, w, *, out_dtype=None) -> jax.Array:
    """x [..., K] times a weight stored [out, in] ([N, K]) -> [..., N]: the model's one projection.

    Float weights: the op `matmul` (out_dtype default: the dtype XLA's dot gives). A quantized weight gives x's
    dtype by default: W8A8 through Qwix, GGUF blocks (BlockWeight) through the op `gguf_matmul`, the other kinds
    through the op `quant_matmul` (see the module docstring); a RowStack part by part."""
    if not is_quantized(w):
        return ops.call("matmul", x, w, out_dtype=out_dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if isinstance(w, RowStack):
        return jnp.concatenate([linear(x, p, out_dtype=out_dtype) for p in w.parts], axis=-1)
    if isinstance(w, BlockWeight):
        return ops.call("gguf_matmul", x, w.blocks, type_name=w.type_name, out_dtype=out_dtype)
    if w.kind == "w8a8":
        return w8a8_matmul(x, w).astype(out_dtype)
    return ops.call("quant_matmul", x, w.codes, w.scale, w.minimum, kind=w.kind, group=w.group, out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------- params trees

QUANTIZED_KEYS = ("wqkv_t", "wo_t", "w_gu_t", "w_down_t")  # the projections of the inference layout


def quantize_params(params: dict, quantization: str, *, group_size: int = DEFAULT_GROUP_SIZE,
                    lm_head: bool = False) -> dict:
    """Params in the inference layout (`fuse_projections`) with every layer projection quantized to
    `quantization` ('int8' or 'int4'); norms, biases and the embedding stay float. lm_head=True adds the LM head
    as a quantized 'lm_head_q' [V, H] (from `lm_head` or the tied embedding), which `llama.lm_head` then reads;
    the float embedding stays for the token lookup and for drafters that share it. A new tree."""
    if quantization not in ("int8", "int4", "w8a8"):
        raise QuantizationError(f"quantize_params takes 'int8', 'int4' or 'w8a8', got {quantization!r} ('gguf' "
                                "keeps a GGUF file's own blocks: load the model with quantization='gguf')")
    if quantization == "w8a8":
        _qwix()
    quant = {"int8": quantize_int8, "w8a8": quantize_w8a8,
             "int4": lambda w, name: quantize_int4(w, group_size, name)}[quantization]
    layers = []
    for i, lp in enumerate(params["layers"]):
        if "wqkv_t" not in lp:
            raise QuantizationError("quantize_params needs the inference layout: call llama.fuse_projections first")
        layers.append({key: (quant(v, f"layers[{i}].{key}") if key in QUANTIZED_KEYS and not is_quantized(v)
                             else v) for key, v in lp.items()})
    out = {**params, "layers": layers}
    if lm_head and "lm_head_q" not in params:
        rows = params["lm_head"].T if "lm_head" in params else params["embed"]
        out["lm_head_q"] = quant(rows, "lm_head")
    return out


def weight_bytes(params) -> int:
    """Bytes of every array in a params tree (quantized weights by their codes and scales)."""
    return int(sum(a.size * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(params)))


def step_weight_bytes(params) -> int:
    """Bytes a one-token decode step reads from the weights: everything except the embedding table, of which it
    gathers one row (but the tied embedding is the LM head when there is no lm_head / lm_head_q)."""
    total = weight_bytes(params)
    if "lm_head" in params or "lm_head_q" in params:
        total -= weight_bytes(params["embed"])
    return total


__all__ = [
    "BLOCK", "BlockWeight", "DEFAULT_GROUP_SIZE", "GGUF_BLOCKS", "GGUF_KEPT", "GGUF_NATIVE", "KINDS", "QUANTIZATIONS",
    "QUANTIZED_KEYS", "QuantWeight", "QuantizationError", "RowStack", "check_lm_head", "check_quantization",
    "concat_rows", "dequantize", "from_gguf_blocks", "from_gguf_raw",
    "is_quantized", "linear", "pack_nibbles", "quantize_int4", "quantize_int8",
    "quantize_params", "quantize_w8a8", "step_weight_bytes", "take_rows", "w8a8_matmul", "weight_bytes",
]
