"""Independent parsers and writers of the raw file formats the fuzzer mutates: GGUF, safetensors, JSON.

Written against the format specifications, not against specjax's readers, so a mutation can be expressed on the
structure (a tensor's offset, a metadata value's type, a header entry's dtype) and written back byte-exactly,
and so the byte position of every count, length and offset is known for raw patches (huge declared sizes).
These parsers trust their input: they only ever read the corpus's valid files.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
from typing import Any

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B", U64: "<Q",
        I64: "<q", F64: "<d"}


@dataclasses.dataclass
class KV:
    key: bytes
    vtype: int
    value: Any  # number | bytes | list (of numbers or bytes)
    subtype: int | None = None
    pos: dict = dataclasses.field(default_factory=dict)  # byte offsets of the key length, type, lengths


@dataclasses.dataclass
class TensorInfo:
    name: bytes
    dims: list
    ttype: int
    offset: int
    pos: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GGUF:
    version: int
    kvs: list
    tensors: list
    data: bytes  # everything from the (aligned) data section on
    alignment: int = 32
    counts_pos: int = 8  # offset of the u64 tensor count (the kv count follows)


def _scalar(buf: bytes, pos: int, vtype: int) -> tuple[Any, int]:
    fmt = _FMT[vtype]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def _string(buf: bytes, pos: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8:pos + 8 + n]), pos + 8 + n


def parse_gguf(buf: bytes) -> GGUF:
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos = 24
    kvs = []
    for _ in range(n_kv):
        kpos = pos
        key, pos = _string(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        tpos = pos
        pos += 4
        kv = KV(key, vtype, None, pos={"key": kpos, "type": tpos, "value": pos})
        if vtype == STRING:
            kv.value, pos = _string(buf, pos)
        elif vtype == ARRAY:
            sub, count = struct.unpack_from("<IQ", buf, pos)
            kv.subtype, kv.pos["count"] = sub, pos + 4
            pos += 12
            items = []
            for _ in range(count):
                if sub == STRING:
                    item, pos = _string(buf, pos)
                else:
                    item, pos = _scalar(buf, pos, sub)
                items.append(item)
            kv.value = items
        else:
            kv.value, pos = _scalar(buf, pos, vtype)
        kvs.append(kv)
    tensors = []
    for _ in range(n_tensors):
        npos = pos
        name, pos = _string(buf, pos)
        (nd,) = struct.unpack_from("<I", buf, pos)
        ndpos = pos
        pos += 4
        dims = list(struct.unpack_from(f"<{nd}Q", buf, pos))
        dpos = pos
        pos += 8 * nd
        ttype, offset = struct.unpack_from("<IQ", buf, pos)
        tensors.append(TensorInfo(name, dims, ttype, offset,
                                  pos={"name": npos, "ndims": ndpos, "dims": dpos, "type": pos, "offset": pos + 4}))
        pos += 12
    align = next((kv.value for kv in kvs if kv.key == b"general.alignment"), 32)
    start = -(-pos // align) * align
    return GGUF(version, kvs, tensors, bytes(buf[start:]), align)


def _pack(vtype: int, value: Any) -> bytes:
    """Pack a value, wrapping integers to the type's width and overflowing floats to infinity, so that any
    hostile value a mutation picks is representable."""
    fmt = _FMT[vtype]
    if vtype in (F32, F64):
        v = float(value) if isinstance(value, (int, float)) and abs(value) < 1e308 or isinstance(value, float) else 0.0
        if vtype == F32 and math.isfinite(v) and abs(v) > 3.4e38:
            v = math.copysign(math.inf, v)
        return struct.pack(fmt, v)
    size = struct.calcsize(fmt)
    v = int(value) if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)) else 0
    return struct.pack({1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[size], v & ((1 << (8 * size)) - 1))


def _pack_value(vtype: int, value: Any, subtype: int | None) -> bytes:
    if vtype == STRING:
        value = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(value)) + value
    if vtype == ARRAY:
        items = value if isinstance(value, list) else [value]
        sub = U32 if subtype is None else subtype
        return struct.pack("<IQ", sub & 0xFFFFFFFF, len(items)) + b"".join(_pack_value(sub, v, U32) for v in items)
    if vtype in _FMT:
        return _pack(vtype, value)
    return b""  # an unknown type id: the value bytes are whatever follows


def write_gguf(g: GGUF) -> bytes:
    out = bytearray(b"GGUF" + struct.pack("<IQQ", g.version, len(g.tensors), len(g.kvs)))
    for kv in g.kvs:
        out += struct.pack("<Q", len(kv.key)) + kv.key + struct.pack("<I", kv.vtype)
        out += _pack_value(kv.vtype, kv.value, kv.subtype)
    for t in g.tensors:
        out += struct.pack("<Q", len(t.name)) + t.name + struct.pack("<I", len(t.dims))
        out += b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in t.dims)
        out += struct.pack("<IQ", t.ttype & 0xFFFFFFFF, t.offset & (2**64 - 1))
    align = g.alignment if isinstance(g.alignment, int) and g.alignment > 0 else 32
    out += b"\0" * (-len(out) % align)
    return bytes(out) + g.data


# ------------------------------------------------------------------------------------------------ safetensors
def parse_safetensors(buf: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<Q", buf, 0)
    return json.loads(buf[8:8 + n]), bytes(buf[8 + n:])


def write_safetensors(header: dict | str | bytes, data: bytes) -> bytes:
    """header: a dict (JSON-encoded here), or the header's JSON text as is (for duplicate keys and the like)."""
    raw = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode(
        "utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data
