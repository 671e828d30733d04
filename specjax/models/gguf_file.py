"""A bounded reader for GGUF files from untrusted sources.

`gguf.GGUFReader` trusts the counts and offsets it reads: one array length sent it into an unbounded loop (5.6 GB
in 102 s), a data offset of 2^64 - 64 wrapped around and loaded garbage, overlapping or misaligned tensors loaded.
This reader checks every count, length, type, shape and offset against the bytes actually left in the file before
it allocates or reads anything, so its work and memory are bounded by the file size, and every rejection is one
error (of the caller's type) naming the file and the problem.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count; metadata as
(string key, u32 value type, value); tensor infos as (string name, u32 n_dims, u64 dims[n_dims] innermost first,
u32 ggml type, u64 offset relative to the data section); padding to `general.alignment` (default 32); data.
A string is a u64 byte length and UTF-8 bytes; an array is a u32 element type, a u64 count and the elements.

Strings stay as bytes until asked for (`get`), so a damaged string in a key nobody reads does not stop a load,
and one that is read gives an error naming its key.

Split models (llama.cpp's gguf-split: `<name>-00001-of-0000N.gguf` ... `<name>-0000N-of-0000N.gguf`, each with
`split.no`, `split.count` and `split.tensors.count`; the metadata in the first) load through `read_gguf_split`
given the first file: one `GGUFFile` over every shard's tensors.
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import os
import re
import struct
from typing import Any

import numpy as np

from specjax.errors import SpecjaxError
from specjax.models.safe_files import looks_like_pickle

__all__ = ["GGUFError", "GGUFFile", "GGUFShards", "GGUFTensor", "read_gguf", "read_gguf_split"]

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 65535
MAX_TENSOR_NAME_BYTES = 4096
MAX_ARRAY_LEN = 1 << 26  # far above any real vocabulary or merge list; the file size bounds it further
MAX_SPLITS = 99999  # the five digits of gguf-split's file names
# gguf-split's file names: <prefix>-<shard, from 1>-of-<count>.gguf, five digits each.
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$")

# GGUF value types: id -> (name, struct format or None for string/array, size in bytes)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = \
    range(13)
_SCALARS = {
    _UINT8: ("B", 1), _INT8: ("b", 1), _UINT16: ("<H", 2), _INT16: ("<h", 2), _UINT32: ("<I", 4),
    _INT32: ("<i", 4), _FLOAT32: ("<f", 4), _BOOL: ("B", 1), _UINT64: ("<Q", 8), _INT64: ("<q", 8),
    _FLOAT64: ("<d", 8),
}
_NP_SCALARS = {
    _UINT8: "u1", _INT8: "i1", _UINT16: "<u2", _INT16: "<i2", _UINT32: "<u4", _INT32: "<i4", _FLOAT32: "<f4",
    _BOOL: "u1", _UINT64: "<u8", _INT64: "<i8", _FLOAT64: "<f8",
}
TYPE_NAMES = {_UINT8: "UINT8", _INT8: "INT8", _UINT16: "UINT16", _INT16: "INT16", _UINT32: "UINT32", _INT32: "INT32",
              _FLOAT32: "FLOAT32", _BOOL: "BOOL", _STRING: "STRING", _ARRAY: "ARRAY", _UINT64: "UINT64",
              _INT64: "INT64", _FLOAT64: "FLOAT64"}


class GGUFError(SpecjaxError, ValueError):
    """A GGUF file is truncated, corrupt or hostile (the default error type of `read_gguf`)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry. dims: GGUF order (innermost first); shape: reversed, i.e. NumPy/PyTorch order."""

    name: str
    qtype: int  # gguf.GGMLQuantizationType value
    dims: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.qtype).name


@dataclasses.dataclass(frozen=True)
class _Value:
    vtype: int
    value: Any  # int | float | bool | bytes | list[bytes] | np.ndarray (numeric arrays)
    subtype: int | None = None


class GGUFFile:
    """A parsed GGUF header plus lazy access to tensor data. Build it with `read_gguf`."""

    def __init__(self, path: str, error: type, version: int, fields: dict, tensors: dict, alignment: int,
                 data_offset: int, file_size: int, buffer: Any):
        self.path = path
        self.error = error
        self.version = version
        self._fields: dict[str, _Value] = fields
        self.tensors: dict[str, GGUFTensor] = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self.file_size = file_size
        self._buffer = buffer

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def keys(self) -> list[str]:
        return list(self._fields)

    def type_of(self, key: str) -> str | None:
        """The GGUF type of a metadata value ('UINT32', 'STRING', 'ARRAY[STRING]', ...), None if absent."""
        v = self._fields.get(key)
        if v is None:
            return None
        name = TYPE_NAMES[v.vtype]
        return f"{name}[{TYPE_NAMES[v.subtype]}]" if v.vtype == _ARRAY else name

    def length(self, key: str) -> int | None:
        """Number of elements of an array value without decoding it; None if absent or not an array."""
        v = self._fields.get(key)
        return len(v.value) if v is not None and v.vtype == _ARRAY else None

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as int / float / bool / str / list; `default` if absent. Strings are decoded here;
        bytes that are not UTF-8 raise the file's error naming the key."""
        v = self._fields.get(key)
        if v is None:
            return default
        if v.vtype == _STRING:
            return self._decode(key, v.value)
        if v.vtype == _ARRAY:
            if v.subtype == _STRING:
                return [self._decode(key, b, i) for i, b in enumerate(v.value)]
            if v.subtype == _BOOL:
                return [bool(x) for x in v.value.tolist()]
            return v.value.tolist()
        return v.value

    def _decode(self, key: str, raw: bytes, index: int | None = None) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            at = f" item {index}" if index is not None else ""
            raise self.error(f"{self.path}: metadata {key!r}{at} is not valid UTF-8 (byte {e.start}); the file is "
                             "corrupt") from None

    def raw_tensor(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as stored: a read-only uint8 view [nbytes] of the mapped file (no copy)."""
        return np.frombuffer(self._buffer, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)

    def tensor_float32(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor dequantized to a new float32 array of `tensor.shape` (PyTorch order). Types the gguf
        package cannot dequantize, and integer types, raise the file's error naming the tensor and type."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

        qtype = GGMLQuantizationType(tensor.qtype)
        if qtype.name in ("I8", "I16", "I32", "I64"):
            raise self.error(f"{self.path}: tensor {tensor.name} has integer type {qtype.name}; model weights must be "
                             "floating point or quantized")
        raw = self.raw_tensor(tensor)
        try:
            if qtype == GGMLQuantizationType.F32:
                arr = raw.view("<f4").astype(np.float32)
            elif qtype == GGMLQuantizationType.F16:
                arr = raw.view("<f2").astype(np.float32)
            elif qtype == GGMLQuantizationType.F64:
                arr = raw.view("<f8").astype(np.float32)
            else:
                block, size = GGML_QUANT_SIZES[qtype]
                rows = raw.reshape(-1, tensor.dims[0] // block * size)
                arr = np.asarray(quants.dequantize(rows, qtype), dtype=np.float32)
        except NotImplementedError:
            raise self.error(f"{self.path}: tensor {tensor.name} uses quantization type {qtype.name}, which the gguf "
                             "package cannot dequantize") from None
        except (ValueError, TypeError, IndexError, ArithmeticError) as e:
            raise self.error(f"{self.path}: tensor {tensor.name} ({qtype.name}) is corrupt: {type(e).__name__}: "
                             f"{e}") from None
        if arr.size != math.prod(tensor.dims):
            raise self.error(f"{self.path}: tensor {tensor.name} dequantized to {arr.size} values, expected shape "
                             f"{tensor.shape}")
        return arr.reshape(tensor.shape)


class GGUFShards(GGUFFile):
    """A split GGUF model as one file: the first shard's metadata and header fields, every shard's tensors (each
    read from its own file). Build it with `read_gguf_split`."""

    def __init__(self, shards: list[GGUFFile], owner: dict[str, GGUFFile]):
        first = shards[0]
        tensors = {name: shard.tensors[name] for name, shard in owner.items()}
        super().__init__(first.path, first.error, first.version, first._fields, tensors, first.alignment,
                         first.data_offset, first.file_size, first._buffer)
        self.shards = tuple(shards)
        self._owner = owner

    def raw_tensor(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as stored in its own shard (a read-only view of that file's map)."""
        return self._owner[tensor.name].raw_tensor(tensor)


def read_gguf_split(path: str, *, error: type = GGUFError) -> GGUFFile:
    """`read_gguf` of a model that may be split by llama.cpp's gguf-split. A file without `split.count` (or with
    count 1) is returned as `read_gguf` reads it. Given the first shard `<prefix>-00001-of-<N>.gguf`, the other
    N - 1 are read from the same directory and checked: each is a valid GGUF file whose split.no and split.count
    match its name, no tensor is in two shards, and the total is split.tensors.count. Given any other shard, the
    error names the first."""
    path = os.fspath(path)
    first = read_gguf(path, error=error)
    count = _split_int(first, "split.count", error)
    if count is None or count == 1:
        return first
    if not 1 <= count <= MAX_SPLITS:
        raise error(f"{path}: split.count {count} is outside [1, {MAX_SPLITS}]; the file is corrupt")
    directory, filename = os.path.split(path)
    match = SPLIT_NAME.match(filename)
    if match is None or int(match["count"]) != count:
        raise error(f"{path}: a shard of a model split into {count} files must be named <name>-NNNNN-of-"
                    f"{count:05d}.gguf (as llama.cpp's gguf-split writes them); rename the shards back")
    names = [os.path.join(directory, f"{match['prefix']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    no = _split_int(first, "split.no", error)
    if no != 0:
        raise error(f"{path} is shard {'?' if no is None else no + 1} of {count} of a split model; load the first "
                    f"shard, {names[0]}, which holds the metadata and finds the others")
    shards, owner = [first], dict.fromkeys(first.tensors, first)
    for k, shard_path in enumerate(names[1:], start=1):
        if not os.path.isfile(shard_path):
            raise error(f"{path}: shard {k + 1} of {count}, {shard_path}, is missing; a split model needs all its "
                        "files in one directory")
        shard = read_gguf(shard_path, error=error)
        if _split_int(shard, "split.no", error) != k or _split_int(shard, "split.count", error) != count:
            raise error(f"{shard_path}: its split.no / split.count ({shard.get('split.no')} / "
                        f"{shard.get('split.count')}) do not say shard {k + 1} of {count}; the shards are from "
                        "different splits")
        twice = sorted(set(shard.tensors) & set(owner))
        if twice:
            raise error(f"{shard_path}: tensor {twice[0]!r} is also in {owner[twice[0]].path}; the split is "
                        "inconsistent")
        owner.update(dict.fromkeys(shard.tensors, shard))
        shards.append(shard)
    total = _split_int(first, "split.tensors.count", error)
    if total is not None and total != len(owner):
        raise error(f"{path}: split.tensors.count says {total} tensors but the {count} shards hold {len(owner)}; a "
                    "shard is truncated or from another split")
    return GGUFShards(shards, owner)


def _split_int(reader: GGUFFile, key: str, error: type) -> int | None:
    """An integer split.* value, None if absent; another type is the file's error."""
    value = reader.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise error(f"{reader.path}: {key} must be an integer, got {type(value).__name__}; the file is corrupt")
    return value


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file; every overrun is the file's error."""

    def __init__(self, buf: Any, size: int, path: str, error: type):
        self.buf, self.size, self.path, self.error, self.pos = buf, size, path, error, 0

    def fail(self, what: str):
        raise self.error(f"{self.path}: {what} at byte {self.pos}; the GGUF file is truncated or corrupt")

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            self.fail(f"{what} needs {n} bytes but only {self.left()} remain")

    def scalar(self, fmt: str, size: int, what: str):
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str, limit: int) -> bytes:
        n = self.u64(f"length of {what}")
        if n > limit:
            self.fail(f"{what} declares {n} bytes (limit {limit})")
        self.need(n, what)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def text(self, what: str, limit: int) -> str:
        """`string` decoded as UTF-8; a name that is not UTF-8 fails naming `what` and its first bytes."""
        raw = self.string(what, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} {raw[:40]!r} is not UTF-8")


def _read_value(cur: _Cursor, vtype: int, key: str) -> _Value:
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        v = cur.scalar(fmt, size, f"value of {key!r}")
        if vtype == _BOOL:
            if v not in (0, 1):
                cur.fail(f"bool value {key!r} is {v}, not 0 or 1")
            v = bool(v)
        return _Value(vtype, v)
    if vtype == _STRING:
        return _Value(vtype, cur.string(f"string value of {key!r}", cur.left()))
    if vtype == _ARRAY:
        sub = cur.u32(f"element type of {key!r}")
        count = cur.u64(f"length of array {key!r}")
        if sub == _ARRAY:
            cur.fail(f"array {key!r} holds arrays, which GGUF readers do not support")
        if sub == _STRING:
            # Each string takes at least its 8-byte length: bounds the loop by the bytes left.
            if count > min(MAX_ARRAY_LEN, cur.left() // 8):
                cur.fail(f"array {key!r} declares {count} strings, more than the file can hold")
            return _Value(vtype, [cur.string(f"item of {key!r}", cur.left()) for _ in range(count)], sub)
        if sub not in _SCALARS:
            cur.fail(f"array {key!r} has unknown element type {sub}")
        size = _SCALARS[sub][1]
        if count > min(MAX_ARRAY_LEN, cur.left() // size):
            cur.fail(f"array {key!r} declares {count} elements of {size} bytes, more than the file holds")
        arr = np.frombuffer(cur.buf, dtype=_NP_SCALARS[sub], count=count, offset=cur.pos).copy()
        if sub == _BOOL and arr.size and arr.max() > 1:
            cur.fail(f"bool array {key!r} holds values other than 0 and 1")
        cur.pos += count * size
        return _Value(vtype, arr, sub)
    cur.fail(f"metadata {key!r} has unknown value type {vtype}")


def read_gguf(path: str, *, error: type = GGUFError, tensors: bool = True) -> GGUFFile:
    """Parse and validate a GGUF file's header; raise `error` (naming `path`) on anything malformed.

    tensors=False stops after the metadata (enough for the tokenizer) and checks no tensor info. With
    tensors=True every tensor is checked: 1-4 dimensions of at least 1, a known type whose block size divides
    the row, a unique name, an offset aligned to `general.alignment`, bytes inside the file, no two tensors
    overlapping, and no unused bytes between them beyond alignment padding (which a wrong type or shape leaves).
    The file is memory-mapped; nothing is read into memory beyond the metadata.
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        if size < 24:
            raise error(f"{path}: {size} bytes is too short for a GGUF file; it is truncated or corrupt")
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    size = len(buf)
    if buf[:4] != MAGIC:
        hint = " (it looks like a pickle: specjax never loads those)" if looks_like_pickle(buf[:9], buf[-1:]) else ""
        raise error(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF'){hint}")
    cur = _Cursor(buf, size, path, error)
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and version:
            raise error(f"{path}: a big-endian GGUF file; specjax reads little-endian GGUF only")
        raise error(f"{path}: GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS}); the file is "
                    "corrupt or from an unsupported writer")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    # The smallest metadata entry is 13 bytes (empty key, type, one-byte value); the smallest tensor info 32.
    if n_kv > cur.left() // 13:
        cur.fail(f"metadata count {n_kv} is more than the file can hold")
    if n_tensors > cur.left() // 32:
        cur.fail(f"tensor count {n_tensors} is more than the file can hold")
    fields: dict[str, _Value] = {}
    for _ in range(n_kv):
        key = cur.text("metadata key", MAX_KEY_BYTES)
        vtype = cur.u32(f"type of {key!r}")
        value = _read_value(cur, vtype, key)
        if key in fields:
            cur.fail(f"metadata key {key!r} appears twice")
        fields[key] = value
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        a = fields["general.alignment"]
        if a.vtype != _UINT32 or a.value == 0 or a.value & (a.value - 1):
            raise error(f"{path}: general.alignment must be a UINT32 power of two, got {TYPE_NAMES[a.vtype]} "
                        f"{a.value!r}; the file is corrupt")
        alignment = a.value
    if not tensors:
        return GGUFFile(path, error, version, fields, {}, alignment, 0, size, buf)
    infos = []
    for _ in range(n_tensors):
        name = cur.text("tensor name", MAX_TENSOR_NAME_BYTES)
        n_dims = cur.u32(f"dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = tuple(cur.u64(f"dimension of {name!r}") for _ in range(n_dims))
        qtype = cur.u32(f"type of {name!r}")
        offset = cur.u64(f"offset of {name!r}")
        infos.append((name, dims, qtype, offset))
    data_offset = -(-cur.pos // alignment) * alignment
    out = _check_tensors(infos, path, error, alignment, data_offset, size)
    return GGUFFile(path, error, version, fields, out, alignment, data_offset, size, buf)


def _check_tensors(infos: list, path: str, error: type, alignment: int, data_offset: int,
                   size: int) -> dict[str, GGUFTensor]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    known = {int(q): q for q in GGMLQuantizationType}
    out: dict[str, GGUFTensor] = {}
    for name, dims, qtype, offset in infos:
        if name in out:
            raise error(f"{path}: tensor {name!r} appears twice in the GGUF file; it is corrupt")
        if qtype not in known or known[qtype] not in GGML_QUANT_SIZES:
            raise error(f"{path}: tensor {name!r} has unknown ggml type {qtype}; the file is corrupt or newer than "
                        "this gguf package")
        if any(d < 1 for d in dims):
            raise error(f"{path}: tensor {name!r} has a zero dimension {dims}; the file is corrupt")
        block, type_size = GGML_QUANT_SIZES[known[qtype]]
        if dims[0] % block:
            raise error(f"{path}: tensor {name!r} rows of {dims[0]} values are not whole {known[qtype].name} blocks "
                        f"of {block}; the file is corrupt")
        # Python integers: no product or sum below can wrap around.
        nbytes = math.prod(dims) // block * type_size
        start = data_offset + offset
        if offset % alignment:
            raise error(f"{path}: tensor {name!r} offset {offset} is not a multiple of the alignment {alignment}; the "
                        "file is corrupt")
        if start + nbytes > size:
            raise error(f"{path}: tensor {name!r} ({nbytes} bytes at offset {offset}) runs past the end of the file "
                        f"({size} bytes); it is truncated or corrupt")
        out[name] = GGUFTensor(name, qtype, dims, start, nbytes)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in out.values())
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise error(f"{path}: tensors {n0!r} and {n1!r} overlap in the GGUF file; it is corrupt")
    # Writers lay tensors out back to back, each padded to the alignment. Unused bytes beyond that padding mean a
    # tensor's declared type or shape covers less data than was written for it (e.g. F32 data declared F16).
    ends = [data_offset] + [e for _, e, _ in spans]
    starts = [b for b, _, _ in spans] + [size]
    names = ["the start of the data"] + [n for _, _, n in spans]
    for end, start, name in zip(ends, starts, names):
        if start - end >= alignment:
            raise error(f"{path}: {start - end} unused bytes follow {name if name.startswith('the ') else repr(name)} "
                        "in the GGUF data; a tensor's type or shape disagrees with the data written for it")
    return out
