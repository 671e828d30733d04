"""JAX's persistent compilation cache, on by default, in a directory that a CPU or version change never reuses.

XLA compiles every specjax program (prefill, decode loop, speculative loop) for the host CPU on first use, which
costs seconds per process. `enable()` points JAX's persistent cache at a user cache directory so a second process
loads the compiled programs instead. The directory is `cache_root()/xla/<key>`, where the key names the jax and
jaxlib versions, the OS, the machine architecture and a short hash of the CPU's feature flags: XLA:CPU emits code
for the features of the host it compiled on, so a cache copied to (or shared with) another CPU must never be
read there, and neither may one written by another jaxlib.

`SPECJAX_CACHE_DIR` moves the root (default `$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`);
`SPECJAX_COMPILATION_CACHE=0` turns the cache off. A cache directory the user already gave JAX
(`JAX_COMPILATION_CACHE_DIR` or `jax.config.update`) is left as it is.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import platform
import re
import sys
import tempfile
import warnings

import jax
import jaxlib

ENV_ROOT = "SPECJAX_CACHE_DIR"
ENV_SWITCH = "SPECJAX_COMPILATION_CACHE"
_OFF = ("0", "false", "off", "no")
# Programs that compile faster than JAX's default threshold (1 s) are not written by default, but a cold start
# runs dozens of them (weight conversions, sampling, the first decode steps) and together they cost seconds; a
# cached entry loads in milliseconds. Only used when the user has not chosen a threshold through the environment.
MIN_COMPILE_TIME_SECS = 0.0

_warned: set[str] = set()


def cache_root() -> pathlib.Path:
    """specjax's cache root: `$SPECJAX_CACHE_DIR`, else `$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`."""
    root = os.environ.get(ENV_ROOT)
    if root:
        return pathlib.Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "specjax"


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The CPU's feature flags, sorted: the first `flags` (x86) or `Features` (ARM) line of `cpuinfo` (default
    /proc/cpuinfo). Empty where there is no such line (macOS, Windows, a sandbox hiding /proc)."""
    text = _read_cpuinfo() if cpuinfo is None else cpuinfo
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", text, flags=re.MULTILINE)
    return tuple(sorted(set(match.group(1).split()))) if match else ()


def cpu_fingerprint(flags: tuple[str, ...] | None = None) -> str:
    """A short stable name for the host CPU's instruction set: a hash of its feature flags, or, where the flags
    cannot be read, of `platform.processor()` (marked `nf-`, so the two kinds never collide)."""
    flags = cpu_flags() if flags is None else flags
    if flags:
        return hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12]
    return "nf-" + hashlib.sha256((platform.processor() or "unknown").encode()).hexdigest()[:9]


def cache_key(*, jax_version: str | None = None, jaxlib_version: str | None = None, system: str | None = None,
              machine: str | None = None, cpu: str | None = None) -> str:
    """The sub-directory name the compiled programs live under; each part defaults to this process's value (the
    arguments exist so a test can vary one). Only filename-safe characters."""
    parts = (f"jax{jax_version or jax.__version__}", f"jaxlib{jaxlib_version or jaxlib.__version__}",
             system or sys.platform, machine or platform.machine() or "unknown", cpu or cpu_fingerprint())
    return re.sub(r"[^A-Za-z0-9._+-]", "_", "-".join(parts))


def default_dir() -> pathlib.Path:
    """Where `enable()` puts the cache when given no path: `cache_root()/xla/cache_key()`."""
    return cache_root() / "xla" / cache_key()


def switched_off() -> bool:
    """Whether `SPECJAX_COMPILATION_CACHE` turns the cache off (0, false, off or no)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in _OFF


def _writable(directory: pathlib.Path) -> str | None:
    """None when `directory` exists (created if needed) and takes a file, else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def enable(path: str | os.PathLike | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache and returns its directory, or None when it stays off.

    path: the root of the XLA cache (default `cache_root()/xla`); the programs go in its `cache_key()`
    sub-directory. Returns None when `SPECJAX_COMPILATION_CACHE=0`, or when the directory cannot be written (a
    RuntimeWarning says so once per directory; the process goes on compiling without a cache). When JAX already
    has a cache directory (the user's, or one set by an earlier call) that one is kept and returned. Calling it
    again is free."""
    if switched_off():
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return str(current)
    target = (pathlib.Path(path).expanduser() / cache_key()) if path is not None else default_dir()
    problem = _writable(target)
    if problem is not None:
        if str(target) not in _warned:
            _warned.add(str(target))
            warnings.warn(f"specjax: the compilation cache directory {target} is not writable ({problem}); "
                          f"programs are compiled in every process. Set {ENV_ROOT} to a writable directory, or "
                          f"{ENV_SWITCH}=0 to silence this.", RuntimeWarning, stacklevel=2)
        return None
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    jax.config.update("jax_compilation_cache_dir", str(target))
    return str(target)


@functools.lru_cache(maxsize=None)
def host_fingerprint() -> str:
    """`cpu_fingerprint()` of this host, read once per process (for other caches keyed by the CPU)."""
    return cpu_fingerprint()


__all__ = ["ENV_ROOT", "ENV_SWITCH", "MIN_COMPILE_TIME_SECS", "cache_key", "cache_root", "cpu_flags",
           "cpu_fingerprint", "default_dir", "enable", "host_fingerprint", "switched_off"]
