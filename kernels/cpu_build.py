"""Builds and loads specjax's C++ CPU kernels (`kernels/cpu/*.cc`) as one library registered with XLA's FFI.

The sources are compiled on first use with the machine's C++ compiler (`$CXX`, else g++, c++ or clang++;
`-O3 -march=native`) into `specjax.compile_cache.cache_root()/kernels` (`$SPECJAX_CACHE_DIR`, else
`$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`), keyed by the sources, the compiler, the flags, the jaxlib
version and the host CPU's feature flags (`-march=native` code built on one CPU can crash another that shares the
cache directory), and every handler in `TARGETS` is registered for the CPU platform.
Without a compiler, or when the build fails, `available()` is False and `unavailable_reason()` says why; the
kernels' callers then warn once and keep XLA's own operations.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jaxlib

from specjax.compile_cache import cache_root, host_fingerprint
from specjax.errors import SpecjaxError

SOURCE_DIR = pathlib.Path(__file__).with_name("cpu")
# Compiled together into one library; tiles.h (included by both) is part of the cache key.
SOURCES = (SOURCE_DIR / "small_matmul.cc", SOURCE_DIR / "prefix_attention.cc", SOURCE_DIR / "quant_matmul.cc",
           SOURCE_DIR / "kv_write.cc", SOURCE_DIR / "gguf_matmul.cc",
           SOURCE_DIR / "gguf_matmul_q8.cc")
HEADERS = (SOURCE_DIR / "tiles.h", SOURCE_DIR / "gguf_blocks.h")
# FFI target name -> exported handler symbol.
TARGETS = {"specjax_small_matmul": "SpecjaxSmallMatmul", "specjax_prefix_attention": "SpecjaxPrefixAttention",
           "specjax_quant_matmul": "SpecjaxQuantMatmul", "specjax_kv_write": "SpecjaxKvWrite",
           "specjax_gguf_matmul": "SpecjaxGgufMatmul", "specjax_gguf_matmul_q8": "SpecjaxGgufMatmulQ8"}


_TRACING = threading.local()


@contextlib.contextmanager
def row_invariant():
    """Products and attention traced inside take the CPU kernels under `auto` whatever their number of rows or
    tokens (the kernel table's `prefers` conditions read it): a row's result then does not depend on the rows it
    shares a call with. Greedy speculation needs that: a verify block (a tree of 33 nodes at batch 4 is 132 rows)
    must give each token the bits of the one-token plain step, which a switch to XLA's dot above the row limits
    breaks; in bfloat16 those last bits flip real tokens. The engines trace their decode and verify steps inside
    it; prefill, which plain and speculative decoding share, does not need it. Read at trace time, like
    SPECJAX_KERNELS."""
    depth = getattr(_TRACING, "row_invariant", 0)
    _TRACING.row_invariant = depth + 1
    try:
        yield
    finally:
        _TRACING.row_invariant = depth


def in_row_invariant() -> bool:
    """Whether the function being traced is inside `row_invariant()`."""
    return bool(getattr(_TRACING, "row_invariant", 0))


class KernelBuildError(SpecjaxError, RuntimeError):
    """The C++ kernels could not be compiled or loaded; the message says why and how to get them."""


def cache_dir() -> pathlib.Path:
    return cache_root() / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _flags(compiler: str) -> list[str]:
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-march=native", "-isystem", jax.ffi.include_dir()]
    # Some virtual machines advertise AMX tiles without enabling them (llama.cpp dies there with SIGILL). The
    # kernels never ask for AMX, but keep the compiler from assuming it, where the compiler knows the flag.
    probe = subprocess.run([compiler, "-mno-amx-tile", "-x", "c++", "-E", "-o", os.devnull, "-"],
                           input=b"", capture_output=True)
    if probe.returncode == 0:
        flags += ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    return flags


def build_key(compiler: str, flags: list[str]) -> str:
    """The cached library's name suffix: a hash of the sources, `compiler`, `flags`, the jaxlib version and the host
    CPU's feature flags."""
    parts = [p.read_bytes() for p in (*SOURCES, *HEADERS) if p.is_file()]
    return hashlib.sha256(b"\0".join([*parts, compiler.encode(), " ".join(flags).encode(),
                                      jaxlib.__version__.encode(), host_fingerprint().encode()])).hexdigest()[:16]


def library_path() -> pathlib.Path:
    """Builds the kernel library if these sources, compiler, jaxlib and CPU have no cached build, and returns its
    path.

    Raises KernelBuildError when there is no C++ compiler or the build fails."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++: apt-get install g++)")
    flags = _flags(compiler)
    target = cache_dir() / f"specjax_cpu-{build_key(compiler, flags)}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build into a private file and rename it in place, so concurrent processes never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            tail = "\n".join([ln for ln in lines if "error" in ln][:5] or lines[-8:])
            names = ", ".join(p.name for p in SOURCES)
            raise KernelBuildError(f"building {names} with {compiler} failed:\n{tail}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str]:
    """(available, reason): builds, loads and registers the kernels once per process."""
    try:
        lib = ctypes.CDLL(str(library_path()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (KernelBuildError, OSError, AttributeError) as err:
        return False, str(err)
    return True, ""


def available() -> bool:
    """Whether the kernels are built and registered (building them on the first call)."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


@functools.lru_cache(maxsize=None)
def warn_unavailable(what: str, fallback: str) -> None:
    """Warns once per (kernel, fallback) that the kernels are unavailable, with the reason."""
    warnings.warn(f"specjax CPU {what} kernel unavailable, using {fallback} instead: {unavailable_reason()}",
                  RuntimeWarning, stacklevel=3)


__all__ = ["KernelBuildError", "SOURCES", "TARGETS", "available", "build_key", "cache_dir",
           "in_row_invariant", "library_path", "row_invariant", "unavailable_reason", "warn_unavailable"]
