"""Dequantized GGUF weights kept on disk, so that a second process does not dequantize the file again.

Expanding a quantized GGUF file's blocks to float (NumPy, one thread) is most of a warm start's load time. After
the first load, `store` writes the expanded params as one safetensors file under `cache_root()/weights/`; `load`
reads them back, which is a copy from the page cache. An entry's name hashes the GGUF file's absolute path,
size and modification time, the dtype and `FORMAT` (raised whenever the loader's output changes), so an edited or
replaced file, or another specjax version's layout, never reads a stale entry; a cached tree whose shapes do not
match the config is dropped by the caller and the file read again.

Files under `MIN_FILE_BYTES` are not cached (they dequantize faster than a cache entry is written). At most
`MAX_ENTRIES` entries are kept, the least recently used go first, and entries whose GGUF file is gone are removed
when another is written. `SPECJAX_WEIGHT_CACHE=0` turns the cache off; `SPECJAX_CACHE_DIR` moves it with the
compilation cache (`specjax.compile_cache.cache_root`). A cache that cannot be written (read-only or full disk)
costs nothing but the warning.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
import warnings

import numpy as np

ENV_SWITCH = "SPECJAX_WEIGHT_CACHE"
FORMAT = 1
MIN_FILE_BYTES = 16 * 2 ** 20
MAX_ENTRIES = 8
_OFF = ("0", "false", "off", "no")


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF


def directory() -> pathlib.Path:
    from specjax.compile_cache import cache_root

    return cache_root() / "weights"


def _source(path: str) -> tuple[str, int, int]:
    real = os.path.realpath(path)
    st = os.stat(real)
    return real, st.st_size, st.st_mtime_ns


def entry_path(path: str, dtype: str) -> pathlib.Path:
    """Where the entry of GGUF file `path` loaded as `dtype` lives (whether or not it exists)."""
    real, size, mtime = _source(path)
    key = hashlib.sha256(json.dumps([FORMAT, real, size, mtime, dtype]).encode()).hexdigest()[:24]
    return directory() / f"{key}.safetensors"


def _wanted(path: str) -> bool:
    try:
        return enabled() and os.path.getsize(path) >= MIN_FILE_BYTES
    except OSError:
        return False


def flatten(params: dict) -> dict[str, np.ndarray]:
    """{"embed": .., "layers": [{name: ..}, ..], ..} -> {"embed": .., "layers.0.name": .., ..}, every array
    C-contiguous (the loader's transposed views would otherwise be written in their memory order)."""
    flat = {k: v for k, v in params.items() if k != "layers"}
    for i, layer in enumerate(params["layers"]):
        flat.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return {k: np.ascontiguousarray(v) for k, v in flat.items()}


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    """The inverse of `flatten`."""
    params: dict = {k: v for k, v in flat.items() if not k.startswith("layers.")}
    layers: dict[int, dict] = {}
    for k, v in flat.items():
        if k.startswith("layers."):
            _, i, name = k.split(".", 2)
            layers.setdefault(int(i), {})[name] = v
    params["layers"] = [layers[i] for i in range(len(layers))]
    return params


def load(path: str, dtype: str) -> dict | None:
    """The cached params of GGUF file `path` as `dtype` (NumPy arrays), or None (no entry, cache off, or an
    unreadable entry, which is removed)."""
    if not _wanted(path):
        return None
    entry = entry_path(path, dtype)
    if not entry.is_file():
        return None
    try:
        flat = _map(entry)
    except (OSError, ValueError, KeyError, TypeError):
        entry.unlink(missing_ok=True)
        return None
    os.utime(entry)  # least recently used goes first
    return unflatten(flat)


def _map(entry: pathlib.Path) -> dict[str, np.ndarray]:
    """The entry's tensors as read-only arrays over one memory map of the file (no copy: the device transfer
    that follows is the only one), after `safe_files.safetensors_header` has checked the header against the file."""
    from specjax.models.safe_files import map_safetensors

    return map_safetensors(str(entry), ValueError)


def drop(path: str, dtype: str) -> None:
    """Remove the entry of `path` as `dtype` (the caller found it does not fit the config)."""
    entry_path(path, dtype).unlink(missing_ok=True)


def store(path: str, dtype: str, params: dict) -> None:
    """Write the params of GGUF file `path` as `dtype` (atomically: a crash leaves no partial entry), then prune."""
    if not _wanted(path):
        return
    from safetensors.numpy import save_file

    entry = entry_path(path, dtype)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(flatten(params), tmp, metadata={"source": _source(path)[0], "dtype": dtype})
            os.replace(tmp, entry)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        prune()
    except OSError as e:
        warnings.warn(f"specjax could not write its weight cache at {entry.parent} ({e}); the GGUF file will be "
                      f"dequantized again next time (set {ENV_SWITCH}=0 to stop trying)", stacklevel=3)


def _source_of(entry: pathlib.Path) -> str | None:
    """The GGUF path recorded in an entry's header (safetensors metadata), None if unreadable."""
    try:
        with open(entry, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        return header.get("__metadata__", {}).get("source")
    except (OSError, ValueError):
        return None


def prune(max_entries: int | None = None) -> None:
    """Remove entries whose GGUF file is gone, then all but the `max_entries` (default `MAX_ENTRIES`) most
    recently used."""
    max_entries = MAX_ENTRIES if max_entries is None else max_entries
    d = directory()
    entries = sorted(d.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
    kept = []
    for e in entries:
        src = _source_of(e)
        if src is None or not os.path.exists(src):
            e.unlink(missing_ok=True)
        else:
            kept.append(e)
    for e in kept[max_entries:]:
        e.unlink(missing_ok=True)
