"""A CPU kernel for the few-row products of decoding: y [M, N] = x [M, K] . w [N, K]^T, w float32 or bfloat16.

XLA:CPU runs products with 2-16 rows (a verify block, a batch of one-token rows) through a general matrix-product
path that repacks the weight on each call, so verifying 5 tokens costs about twice a one-token step although both
read the same weights; and it runs bfloat16 products by first converting the weight to float32, which makes
bfloat16 decoding several times slower than float32. The C++ kernel (`cpu/small_matmul.cc`) streams each weight
row once, holds a 4-row x 6-token block of float32 accumulators in registers and widens bfloat16 in registers.

The four parts, as for every specjax kernel:
- kernel body: `cpu/small_matmul.cc`, an XLA FFI handler. It is compiled on first use with the machine's C++
  compiler (`$CXX`, else g++, c++ or clang++; `-O3 -march=native`) into a cache directory
  (`$SPECJAX_CACHE_DIR`, else `~/.cache/specjax`) keyed by the source, the flags and the jaxlib version, and
  registered with `jax.ffi`. Without a compiler, specjax warns once and uses XLA's dot.
- jitted wrapper: `small_matmul(x, w)`.
- pure-jnp reference: `small_matmul_reference(x, w)`.
- input validator: `validate_small_matmul_inputs(x, w)`.

`matmul_t(x, w)` is what the model calls for every projection: at trace time it picks the kernel or XLA's dot
from the platform, the dtypes and the number of rows, under `SPECJAX_CPU_MATMUL`:
- `auto` (default): the kernel on the CPU platform for float32 weights with 1-16 rows and bfloat16 weights with
  at most 64 rows (where it measured faster: reports/decode_cpu/README.md), XLA's dot otherwise;
- `kernel`: the kernel for every product it supports on the CPU platform (tests use this);
- `xla`: never the kernel.
The choice is made when a function is traced, so set the variable before the first generation of a process.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

ENV_MODE = "SPECJAX_CPU_MATMUL"
MODES = ("auto", "kernel", "xla")
FFI_TARGET = "specjax_small_matmul"
SOURCE = pathlib.Path(__file__).with_name("cpu") / "small_matmul.cc"
_SYMBOL = "SpecjaxSmallMatmul"
# Row limits of the `auto` policy: above 16 rows (float32) and 64 rows (bfloat16) XLA's blocked product wins or the
# kernel's gain is unmeasured. One-token float32 steps gain too (decode batch 1: 35.2 -> 39.5 tok/s, mean of four
# interleaved pairs), and plain and verify steps then share one summation order.
AUTO_F32_ROWS = (1, 16)
AUTO_BF16_ROWS = (1, 64)


class SmallMatmulInputError(ValueError):
    """Inputs the kernel cannot take (rank, shapes or dtypes), with what to change."""


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded; the message says why and how to get it."""


def mode() -> str:
    """The `SPECJAX_CPU_MATMUL` policy ('auto' when unset). An unknown value is an error naming the valid ones."""
    value = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV_MODE}={value!r} is not one of {', '.join(MODES)}")
    return value


# ------------------------------------------------------------------------------------------------ build and load


def cache_dir() -> pathlib.Path:
    root = os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specjax")
    return pathlib.Path(root) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _flags(compiler: str) -> list[str]:
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-march=native",
             "-isystem", jax.ffi.include_dir()]
    # Some virtual machines advertise AMX tiles without enabling them (llama.cpp dies there with SIGILL). The
    # kernel never asks for AMX, but keep the compiler from assuming it, where the compiler knows the flag.
    probe = subprocess.run([compiler, "-mno-amx-tile", "-x", "c++", "-E", "-o", os.devnull, "-"],
                           input=b"", capture_output=True)
    if probe.returncode == 0:
        flags += ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    return flags


def library_path() -> pathlib.Path:
    """Builds the kernel library if this source, compiler and jaxlib have no cached build, and returns its path.

    Raises KernelBuildError when there is no C++ compiler or the build fails."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++: apt-get install g++)")
    flags = _flags(compiler)
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags).encode(),
                                     jaxlib.__version__.encode()])).hexdigest()[:16]
    target = cache_dir() / f"small_matmul-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build into a private file and rename it in place, so concurrent processes never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            tail = "\n".join([ln for ln in lines if "error" in ln][:5] or lines[-8:])
            raise KernelBuildError(f"building {SOURCE.name} with {compiler} failed:\n{tail}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str]:
    """(available, reason): builds, loads and registers the kernel once per process."""
    try:
        lib = ctypes.CDLL(str(library_path()))
        jax.ffi.register_ffi_target(FFI_TARGET, jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")
    except (KernelBuildError, OSError, AttributeError) as err:
        return False, str(err)
    return True, ""


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


@functools.lru_cache(maxsize=None)
def _warn_unavailable(reason: str) -> None:
    warnings.warn(f"specjax CPU matmul kernel unavailable, using XLA's dot instead: {reason}", RuntimeWarning,
                  stacklevel=3)


# ------------------------------------------------------------------------------------------- reference, validator


def small_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] . w [N, K]^T -> [..., N] float32, in plain jnp (float32 math)."""
    return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), (((x.ndim - 1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


def validate_small_matmul_inputs(x, w) -> None:
    """Raises SmallMatmulInputError unless x [..., K] is floating and w [N, K] is float32 or bfloat16.

    Works on arrays and on jax.ShapeDtypeStruct alike (shapes and dtypes only)."""
    xs, ws = tuple(x.shape), tuple(w.shape)
    if len(xs) < 1:
        raise SmallMatmulInputError(f"x must have at least one axis [..., K], got shape {xs}")
    if len(ws) != 2:
        raise SmallMatmulInputError(f"w must be 2-D [N, K] (a weight stored [out, in]), got shape {ws}")
    if xs[-1] != ws[1]:
        raise SmallMatmulInputError(f"x [..., K={xs[-1]}] and w [N, K={ws[1]}] disagree on K")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise SmallMatmulInputError(f"x must be floating point, got {np.dtype(x.dtype).name}")
    if np.dtype(w.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise SmallMatmulInputError(f"w must be float32 or bfloat16, got {np.dtype(w.dtype).name}; cast the weight")


# ------------------------------------------------------------------------------------------------- the wrapper


def _ffi(x2: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), jnp.float32)
    # vmap runs the product once per mapped element: the weight is never broadcast.
    return jax.ffi.ffi_call(FFI_TARGET, out, vmap_method="sequential")(x2, w)


@jax.custom_vjp
def _kernel_2d(x2: jax.Array, w: jax.Array) -> jax.Array:
    return _ffi(x2, w)


def _kernel_fwd(x2, w):
    return _ffi(x2, w), (x2, w)


def _kernel_bwd(res, dy):
    # Gradients through XLA's dots: training runs large blocks, where the kernel is not meant to be used anyway.
    x2, w = res
    dx = jnp.dot(dy, w.astype(jnp.float32))
    dw = jnp.dot(dy.T, x2).astype(w.dtype)
    return dx, dw


_kernel_2d.defvjp(_kernel_fwd, _kernel_bwd)


def _small_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    validate_small_matmul_inputs(x, w)
    if not available():
        raise KernelBuildError(f"the CPU matmul kernel is unavailable: {unavailable_reason()}")
    lead = x.shape[:-1]
    y = _kernel_2d(x.reshape(-1, x.shape[-1]).astype(jnp.float32), w)
    return y.reshape(*lead, w.shape[0])


small_matmul = jax.jit(_small_matmul)
small_matmul.__doc__ = """x [..., K] . w [N, K]^T -> [..., N] float32 through the C++ kernel (CPU only).

Jitted entry point for direct use; models call `matmul_t`, which picks the kernel or XLA's dot. No donation:
nothing here is a cache. Raises SmallMatmulInputError on bad shapes or dtypes, KernelBuildError without a
compiler."""


def _rows(x) -> int:
    return int(np.prod(x.shape[:-1], dtype=np.int64))


def use_kernel(x, w) -> bool:
    """Whether `matmul_t` takes the kernel for these shapes and dtypes here (decided at trace time)."""
    m = mode()
    if m == "xla" or jax.default_backend() != "cpu":
        return False
    try:
        validate_small_matmul_inputs(x, w)
    except SmallMatmulInputError:
        return False
    if m == "auto":
        lo, hi = AUTO_BF16_ROWS if np.dtype(w.dtype) == np.dtype(jnp.bfloat16) else AUTO_F32_ROWS
        if not lo <= _rows(x) <= hi:
            return False
    if not available():
        _warn_unavailable(unavailable_reason())
        return False
    return True


def matmul_t(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """x [..., K] . w [N, K]^T -> [..., N] in `out_dtype` (default: the dtype XLA's dot would give).

    The model's projection: the kernel where `use_kernel` says so, else XLA's dot_general. Not jitted (called
    inside jitted forwards)."""
    if out_dtype is None:
        out_dtype = jnp.result_type(x.dtype, w.dtype)
    if use_kernel(x, w):
        lead = x.shape[:-1]
        y = _kernel_2d(x.reshape(-1, x.shape[-1]).astype(jnp.float32), w)
        return y.reshape(*lead, w.shape[0]).astype(out_dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_dtype)


__all__ = [
    "AUTO_BF16_ROWS", "AUTO_F32_ROWS", "ENV_MODE", "KernelBuildError", "SmallMatmulInputError", "available",
    "library_path", "matmul_t", "mode", "small_matmul", "small_matmul_reference", "unavailable_reason",
    "use_kernel", "validate_small_matmul_inputs",
]
