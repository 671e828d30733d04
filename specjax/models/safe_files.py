"""Reading files specjax did not write: JSON configs, safetensors, pickles refused, config values checked.

Checkpoints come from the internet, so every reader here treats the file as hostile: sizes, counts and offsets
are checked against the file's own size before anything is allocated, nothing is unpickled, and every rejection
is an error of the caller's type (`error`, a `SpecjaxError` subclass) whose one-line message names the file and
the problem. The value checkers (`cfg_int`, `cfg_float`, ...) refuse wrongly typed or out-of-range config values
at load time, where the file can be named, instead of letting them fail deep inside JAX at generate time.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "PICKLE_SUFFIXES", "MAX_JSON_BYTES", "cfg_bool", "cfg_float", "cfg_int", "cfg_str", "check_rope_scaling",
    "is_pickle_name", "layer_indices", "looks_like_pickle", "pickle_refusal", "read_json_file", "read_safetensors_file",
    "safetensors_header",
]

# File name endings of pickle-based PyTorch / Lightning checkpoints: refused by name, never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# config.json, tokenizer_config.json and friends are kilobytes; 64 MiB leaves room for huge added-token tables.
MAX_JSON_BYTES = 64 << 20
# The safetensors format caps its JSON header at 100 MB; so do we.
MAX_SAFETENSORS_HEADER = 100_000_000
# Largest value accepted for a count or size read from a config (2^31 - 1: ids and positions are int32).
INT32_MAX = 2**31 - 1

_MISSING = object()


# ------------------------------------------------------------------------------------------------ pickles
def is_pickle_name(path: str) -> bool:
    """True for file names of pickle-based checkpoints (.bin .pt .pth .ckpt .pkl .pickle)."""
    return str(path).lower().endswith(PICKLE_SUFFIXES)


def looks_like_pickle(head: bytes, last: bytes = b"") -> bool:
    """True when a file's first bytes are a pickle (a protocol 2-5 opcode, or for protocols 0-1 a first opcode
    such as GLOBAL 'c' or MARK '(' with STOP '.' as the file's `last` byte) or a zip archive (torch.save)."""
    return (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) or head.startswith(b"PK\x03\x04") \
        or (head[:1] in (b"c", b"(", b"}", b"]") and last == b".")


def pickle_refusal(src: str, dst: str | None = None) -> str:
    """The one-line refusal for a pickled checkpoint at `src`, with the command that converts it to `dst`
    (default: `src` with a .safetensors ending). The command uses torch's weights-only loader, which does not
    run the pickle's code."""
    if dst is None:
        dst = os.path.splitext(src)[0] + ".safetensors"
    return (f"{src}: a pickled PyTorch checkpoint, which specjax never loads (unpickling can run arbitrary code); "
            f"convert it to safetensors once with: python -c \"import torch; from safetensors.torch import save_file; "
            f"sd = torch.load('{src}', map_location='cpu', weights_only=True); sd = sd.get('state_dict', sd); "
            f"save_file({{k: v.contiguous() for k, v in sd.items()}}, '{dst}')\"")


# ------------------------------------------------------------------------------------------------ JSON
MAX_INT_DIGITS = 100  # no config holds a longer integer; Python refuses to parse past 4300 digits anyway


def _int_parser(where: str, error: type):
    def parse(text: str) -> int:
        if len(text) > MAX_INT_DIGITS:
            raise error(f"{where}: an integer of {len(text)} digits; the file is corrupt or hostile")
        return int(text)

    return parse


def _no_duplicates(where: str, error: type):
    def hook(pairs: list) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                raise error(f"{where}: key {key!r} appears twice in one JSON object; the file is ambiguous")
            out[key] = value
        return out

    return hook


def loads_untrusted(text: str, where: str, error: type) -> Any:
    """json.loads for text that may be hostile: invalid JSON, nesting deep enough to exhaust the recursion limit,
    duplicate keys and integers longer than MAX_INT_DIGITS raise `error` naming `where`."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(where, error), parse_int=_int_parser(where, error))
    except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to read; the input is corrupt or hostile") from None


def read_json_file(path: str, error: type, *, max_bytes: int = MAX_JSON_BYTES, want_object: bool = True) -> Any:
    """Parse a JSON file that may be hostile. Non-UTF-8 bytes, invalid JSON, nesting deep enough to exhaust the
    recursion limit, duplicate keys, a file over `max_bytes` and (with `want_object`) a top level that is not an
    object all raise `error` naming the file."""
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise error(f"{path}: {size} bytes is too large for a JSON config (limit {max_bytes}); the file is "
                        "corrupt or not a config")
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); the file is corrupt") \
            from None
    data = loads_untrusted(text, path, error)
    if want_object and not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


# ------------------------------------------------------------------------------------------------ config values
def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def cfg_int(cfg: Mapping, key: str, where: str, error: type, default: Any = _MISSING, *, lo: int = 1,
            hi: int = INT32_MAX) -> int:
    """cfg[key] as an int in [lo, hi]. Booleans and non-integral numbers are refused; an integral float (64.0,
    as some exporters write) is accepted. Missing key: `default` (returned as is), else an error."""
    value = cfg.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise error(f"{where}: required key {key!r} is missing")
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{where}: {key} must be an integer, got {_describe(value)}")
    if not lo <= value <= hi:
        raise error(f"{where}: {key}={_describe(value)} is out of range [{lo}, {hi}]")
    return value


def cfg_float(cfg: Mapping, key: str, where: str, error: type, default: Any = _MISSING, *, gt: float | None = None,
              lt: float | None = None) -> float:
    """cfg[key] as a finite float with gt < value < lt (bounds optional). NaN, infinities, booleans and
    non-numbers are refused."""
    value = cfg.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise error(f"{where}: required key {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{where}: {key} must be a number, got {_describe(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise error(f"{where}: {key} is too large to be a float") from None
    if not math.isfinite(value):
        raise error(f"{where}: {key}={value} must be a finite number")
    if (gt is not None and not value > gt) or (lt is not None and not value < lt):
        bounds = " and ".join(f"{op} {v}" for op, v in ((">", gt), ("<", lt)) if v is not None)
        raise error(f"{where}: {key}={value} must be {bounds}")
    return value


def cfg_bool(cfg: Mapping, key: str, where: str, error: type, default: bool = False) -> bool:
    """cfg[key] as a bool; only true/false (or absent/null -> default) are accepted."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise error(f"{where}: {key} must be true or false, got {_describe(value)}")
    return value


def cfg_str(cfg: Mapping, key: str, where: str, error: type, default: Any = None) -> Any:
    """cfg[key] as a str (absent/null -> default)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise error(f"{where}: {key} must be a string, got {_describe(value)}")
    return value


def check_rope_scaling(scaling: Any, where: str, error: type) -> tuple | None:
    """A config's rope scaling dict, checked, as the sorted (key, value) tuple LlamaConfig stores; None for
    plain RoPE. Supported: linear {factor}, llama3 {factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}; every other type (yarn, dynamic, longrope, ...) is refused by name."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise error(f"{where}: rope_scaling must be an object, got {_describe(scaling)}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default" or (kind is None and set(scaling) <= {"rope_theta"}):
        return None
    if kind not in ("llama3", "linear"):
        raise error(f"{where}: unsupported rope_scaling type {_describe(kind)} (supported: llama3, linear); "
                    "specjax would compute wrong positions with it")
    cfg_float(scaling, "factor", where, error, gt=0.0)
    if kind == "llama3":
        lo = cfg_float(scaling, "low_freq_factor", where, error, gt=0.0)
        hi = cfg_float(scaling, "high_freq_factor", where, error, gt=0.0)
        if not hi > lo:
            raise error(f"{where}: rope_scaling high_freq_factor ({hi}) must exceed low_freq_factor ({lo})")
        cfg_int(scaling, "original_max_position_embeddings", where, error)
    # Lists and dicts (e.g. longrope factor tables) cannot sit in a hashable config; no supported type has them.
    return tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (list, dict)) and k != "rope_theta"))


def layer_indices(names, prefix: str, where: str, error: type) -> set[int]:
    """The layer numbers i of tensor names `{prefix}{i}.<rest>`. A number that is not a short decimal (a
    5,000-digit one, or '01') is refused rather than parsed."""
    found = set()
    for name in names:
        if not name.startswith(prefix):
            continue
        head = name[len(prefix):].split(".", 1)[0]
        if not head.isdigit() or len(head) > 6 or (len(head) > 1 and head[0] == "0") or not head.isascii():
            raise error(f"{where}: tensor {_describe(name)} has a malformed layer number")
        found.add(int(head))
    return found


# ------------------------------------------------------------------------------------------------ safetensors
# safetensors dtype -> (NumPy dtype name, itemsize in bytes)
_ST_DTYPES = {
    "F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("bfloat16", 2),
    "I64": ("<i8", 8), "I32": ("<i4", 4), "I16": ("<i2", 2), "I8": ("i1", 1),
    "U64": ("<u8", 8), "U32": ("<u4", 4), "U16": ("<u2", 2), "U8": ("u1", 1), "BOOL": ("?", 1),
}


def safetensors_header(path: str, error: type) -> tuple[dict[str, tuple[str, tuple, int, int]], int, int]:
    """Validate a safetensors file's header against the file without reading any tensor.

    Returns ({name: (dtype, shape, begin, end)} with absolute byte offsets, header length, file size). Checked:
    the 8-byte length against the file size and the 100 MB cap, UTF-8 JSON object, unique names, known dtype,
    a shape of non-negative ints, offsets in range whose length is exactly the shape's byte size, no overlap.
    A pickle or zip (torch.save) under a .safetensors name is refused with the conversion command."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(9)
            f.seek(max(0, size - 1))
            last = f.read(1)
            # A safetensors header length can start with the same bytes as a pickle; its JSON cannot.
            if looks_like_pickle(head, last) and head[8:9] != b"{":
                raise error(pickle_refusal(path, os.path.splitext(path)[0] + ".converted.safetensors"))
            if len(head) < 8:
                raise error(f"{path}: {size} bytes is too short for a safetensors file; it is truncated or corrupt")
            (n,) = struct.unpack("<Q", head[:8])
            f.seek(8)
            if n > min(MAX_SAFETENSORS_HEADER, size - 8):
                raise error(f"{path}: safetensors header claims {n} bytes but the file has {size}; it is truncated "
                            "or corrupt")
            raw = f.read(n)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) != n:
        raise error(f"{path}: the safetensors header is cut short; the file is truncated or corrupt")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path, error),
                            parse_int=_int_parser(path, error))
    except UnicodeDecodeError:
        raise error(f"{path}: the safetensors header is not UTF-8; the file is truncated or corrupt") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: the safetensors header is not valid JSON ({e.msg}); the file is truncated or corrupt") \
            from None
    except RecursionError:
        raise error(f"{path}: the safetensors header is nested too deeply; the file is corrupt") from None
    if not isinstance(header, dict):
        raise error(f"{path}: the safetensors header is not a JSON object; the file is corrupt")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise error(f"{path}: safetensors __metadata__ must map strings to strings")
    data_start = 8 + n
    out = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise error(f"{path}: tensor {_describe(name)}: header entry must hold exactly dtype, shape and "
                        "data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
            raise error(f"{path}: tensor {_describe(name)} has unsupported dtype {_describe(dtype)} (supported: "
                        f"{', '.join(_ST_DTYPES)})")
        if not isinstance(shape, list) or len(shape) > 8 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise error(f"{path}: tensor {_describe(name)} has an invalid shape {_describe(shape)}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(
                isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets):
            raise error(f"{path}: tensor {_describe(name)} has invalid data_offsets {_describe(offsets)}")
        begin, end = offsets
        nbytes = math.prod(shape) * _ST_DTYPES[dtype][1]
        if end < begin or end - begin != nbytes:
            raise error(f"{path}: tensor {_describe(name)} {dtype}{shape} needs {nbytes} bytes but its offsets "
                        f"[{begin}, {end}] span {end - begin}; the file is corrupt")
        if data_start + end > size:
            raise error(f"{path}: tensor {_describe(name)} runs past the end of the file ({data_start + end} > "
                        f"{size}); it is truncated or corrupt")
        out[name] = (dtype, tuple(shape), data_start + begin, data_start + end)
    spans = sorted((b, e, name) for name, (_, _, b, e) in out.items() if e > b)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise error(f"{path}: tensors {_describe(n0)} and {_describe(n1)} overlap in the file; it is corrupt")
    return out, n, size


def map_safetensors(path: str, error: type) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only view over one memory map of it, in the file's own dtype
    (bfloat16 as ml_dtypes'), after `safetensors_header` validated the layout. No copy: callers cast or copy."""
    header, _, _ = safetensors_header(path, error)
    if not header:
        return {}
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise error(f"{path}: cannot map the file ({e})") from None
    out = {}
    for name, (dtype, shape, begin, end) in header.items():
        np_name = _ST_DTYPES[dtype][0]
        np_dtype = _bfloat16() if np_name == "bfloat16" else np.dtype(np_name)
        out[name] = np.frombuffer(mm, dtype=np_dtype, count=math.prod(shape), offset=begin).reshape(shape)
    return out


def read_safetensors_file(path: str, error: type, *, float32: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a NumPy array, after `safetensors_header` validated the layout.
    Floating tensors (F16/BF16/F32/F64) become float32 when `float32`; integer and bool tensors keep their type."""
    out = {}
    for name, arr in map_safetensors(path, error).items():
        if float32 and (arr.dtype.kind == "f" or arr.dtype == _bfloat16()):
            out[name] = arr.astype(np.float32)
        else:
            out[name] = arr.astype(arr.dtype.newbyteorder("="))  # a private copy in native order, detached from the map
    return out


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)
