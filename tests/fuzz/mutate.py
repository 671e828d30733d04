"""Hypothesis-driven mutations of model files: structural (on the parsed GGUF / safetensors / JSON, written back)
and raw (truncation, bit flips, byte splices, huge counts written over the located length fields).

`mutate(draw, fmt, raw)` applies one to three mutations to the bytes `raw` of a file of format `fmt` and returns
(new bytes, a short description of each mutation). `draw` is hypothesis's `data.draw`, so every choice is
recorded, replayable from the seed, and shrinkable in the pytest run.
"""
from __future__ import annotations

import json
import math
import re
import struct

import hypothesis.strategies as st

from . import parts
from .formats import (ARRAY, BOOL, F32, F64, I32, I64, KV, STRING, U32, U64, U8, TensorInfo, parse_gguf,
                      parse_safetensors, write_gguf, write_safetensors)

FORMATS = ("gguf", "safetensors", "json", "tokenizer_json", "tokenizer_config", *parts.FORMATS)

HOSTILE_INTS = [0, 1, -1, 2, 3, 255, 256, 2**15, 2**16 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1,
                2**63 - 1, 2**63, 2**64 - 1, 2**64 - 64, -(2**31), -(2**63), 10**12]
HOSTILE_FLOATS = [0.0, -0.0, 1e-45, -1.0, 1.0, 0.5, 1e38, 1e308, math.inf, -math.inf, math.nan]
HOSTILE_STRINGS = ["", "x", "yarn", "linear", "dynamic", "longrope", "llama", "qwen2", "gpt2", "smollm", "\ufffd",
                   "\udcff", "a" * 70_000, "<|im_end|>", "../../etc/passwd", "0" * 5000]
HOSTILE_JSON = [*HOSTILE_INTS, *HOSTILE_FLOATS, *HOSTILE_STRINGS, None, True, False, [], [1, 2], [[]], {},
                {"type": "yarn", "factor": 4.0}, {"rope_type": "llama3"}, 1.5, 10**30]
# Chat templates that try to escape the sandbox or exhaust time or memory (fuzzed in GGUF metadata and in
# tokenizer_config.json; the same attacks have one test each in tests/models/test_template_limits.py).
TEMPLATE_ATTACKS = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ range(10**9)|list }}",
    "{{ lipsum(n=10**7) }}",
    "{{ messages|tojson(indent=10**9) }}",
    "{{ 'x' * 10**9 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ lipsum.__globals__['os'].system('id') }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ ('%0' ~ 10**9 ~ 'd') % 1 }}",
    "{{ '{:>1000000000}'.format(1) }}",
    "{{ 'x'.center(10**9) }}",
    "{{ ('x' * 100000)|replace('x', 'y' * 1000) }}",
    "{{ 2 ** (10 ** 9) }}",
    "{{ range(100000)|join('x' * 1000) }}",
    "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
    "{{ (messages * 10**9)|length }}",
    "{{ raise_exception('refused') }}",
    "{% for %}",
    "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",  # a harmless one, rendered for real
]


def _pick(draw, items, label: str):
    return draw(st.sampled_from(items), label=label) if items else None


def _hostile_int(draw, current=None) -> int:
    near = [current + d for d in (-1, 1, 2)] + [current * 2] if isinstance(current, int) else []
    return draw(st.one_of(st.sampled_from(HOSTILE_INTS + near), st.integers(-(2**64), 2**64)))


# ------------------------------------------------------------------------------------------------ raw
def raw_mutation(draw, raw: bytes) -> tuple[bytes, str]:
    n = len(raw)
    op = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "delete", "splice"]), label="raw op")
    # Mutations cluster at the start (headers, lengths, JSON structure) but reach the whole file.
    pos = draw(st.one_of(st.integers(0, min(n, 512)), st.integers(0, max(0, n - 1))), label="pos") if n else 0
    if op == "truncate":
        return raw[:pos], f"truncate@{pos}"
    if op == "flip":
        out = bytearray(raw)
        flips = draw(st.lists(st.tuples(st.integers(0, max(0, n - 1)), st.integers(0, 7)), min_size=1, max_size=8))
        for p, bit in flips:
            if p < n:
                out[p] ^= 1 << bit
        return bytes(out), f"flip{len(flips)}"
    if op == "overwrite":
        chunk = draw(st.binary(min_size=1, max_size=16))
        return raw[:pos] + chunk + raw[pos + len(chunk):], f"overwrite@{pos}"
    if op == "insert":
        return raw[:pos] + draw(st.binary(min_size=1, max_size=64)) + raw[pos:], f"insert@{pos}"
    if op == "delete":
        k = draw(st.integers(1, 256))
        return raw[:pos] + raw[pos + k:], f"delete{k}@{pos}"
    src = draw(st.integers(0, max(0, n - 1)))
    k = draw(st.integers(1, 512))
    return raw[:pos] + raw[src:src + k] + raw[pos:], f"splice{k}@{pos}"


# ------------------------------------------------------------------------------------------------ GGUF
_CONFIG_SUFFIXES = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                    "attention.head_count_kv", "rope.dimension_count", "attention.layer_norm_rms_epsilon",
                    "rope.freq_base", "context_length", "vocab_size")
_TOKENIZER_KEYS = (b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.eos_token_id", b"tokenizer.ggml.model",
                   b"tokenizer.ggml.pre", b"tokenizer.ggml.add_bos_token", b"tokenizer.ggml.padding_token_id")
GGML_TYPES = [0, 1, 2, 3, 6, 8, 9, 10, 12, 14, 24, 26, 27, 28, 30, 4, 5, 39, 99, 2**31]


def _gguf_value_of(draw, vtype: int, current):
    if vtype in (F32, F64):
        return draw(st.one_of(st.sampled_from(HOSTILE_FLOATS), st.floats()))
    if vtype == STRING:
        s = draw(st.sampled_from(HOSTILE_STRINGS + [b"\xff\xfe", b"\xc3", b"ok\x00"]))
        return s if isinstance(s, bytes) else s.encode("utf-8", "surrogatepass")
    if vtype == BOOL:
        return draw(st.sampled_from([0, 1, 2, 255]))
    return _hostile_int(draw, current if isinstance(current, int) else None)


def gguf_mutation(draw, raw: bytes) -> tuple[bytes, str]:
    try:
        g = parse_gguf(raw)
    except Exception:  # an earlier mutation broke the structure: fall back to raw bytes
        return raw_mutation(draw, raw)
    ops = ["patch", "kv_value", "kv_type", "kv_remove", "kv_duplicate", "kv_add", "tensor_dims", "tensor_type",
           "tensor_offset", "tensor_name", "string_item"]
    op = draw(st.sampled_from(ops), label="gguf op")
    arch = next((kv.value for kv in g.kvs if kv.key == b"general.architecture"), b"llama").decode("utf-8", "replace")
    config_keys = [kv for kv in g.kvs if kv.key.decode("utf-8", "replace").split(".", 1)[-1] in _CONFIG_SUFFIXES
                   or kv.key in _TOKENIZER_KEYS]
    if op == "patch":
        # A huge or wrapped count, length, dimension, type or offset written over the field itself.
        fields = [("u64", g.counts_pos, "tensor_count"), ("u64", g.counts_pos + 8, "kv_count")]
        for kv in g.kvs:
            fields.append(("u64", kv.pos["key"], f"keylen:{kv.key[:30]!r}"))
            fields.append(("u32", kv.pos["type"], f"type:{kv.key[:30]!r}"))
            if kv.vtype == STRING:
                fields.append(("u64", kv.pos["value"], f"strlen:{kv.key[:30]!r}"))
            if kv.vtype == ARRAY:
                fields.append(("u64", kv.pos["count"], f"arraylen:{kv.key[:30]!r}"))
                fields.append(("u32", kv.pos["count"] - 4, f"arraytype:{kv.key[:30]!r}"))
        for t in g.tensors:
            fields += [("u64", t.pos["name"], f"namelen:{t.name[:30]!r}"), ("u32", t.pos["ndims"], "ndims"),
                       ("u64", t.pos["dims"], f"dim0:{t.name[:30]!r}"), ("u32", t.pos["type"], "ttype"),
                       ("u64", t.pos["offset"], f"offset:{t.name[:30]!r}")]
        width, pos, what = draw(st.sampled_from(fields), label="field")
        value = _hostile_int(draw, struct.unpack_from("<Q" if width == "u64" else "<I", raw, pos)[0])
        packed = struct.pack("<Q", value & (2**64 - 1)) if width == "u64" else struct.pack("<I", value & 0xFFFFFFFF)
        return raw[:pos] + packed + raw[pos + len(packed):], f"patch {what}={value}"
    if op in ("kv_value", "kv_type", "kv_remove", "kv_duplicate") and g.kvs:
        kv = _pick(draw, config_keys, "config kv") if config_keys and draw(st.booleans()) else _pick(draw, g.kvs, "kv")
        name = kv.key.decode("utf-8", "replace")[:40]
        if op == "kv_value":
            if kv.vtype == ARRAY:
                kv.value = [_gguf_value_of(draw, kv.subtype, None) for _ in range(draw(st.integers(0, 3)))]
            else:
                kv.value = _gguf_value_of(draw, kv.vtype, kv.value)
            desc = f"value {name}"
        elif op == "kv_type":
            kv.vtype = draw(st.sampled_from([U8, I32, U32, F32, BOOL, STRING, U64, I64, F64, ARRAY, 13, 2**31]))
            kv.subtype = draw(st.sampled_from([U32, STRING, ARRAY, F32, 99])) if kv.vtype == ARRAY else None
            kv.value = _gguf_value_of(draw, kv.vtype if kv.vtype != ARRAY else kv.subtype, None)
            desc = f"type {name}={kv.vtype}"
        elif op == "kv_remove":
            g.kvs.remove(kv)
            desc = f"remove {name}"
        else:
            g.kvs.insert(draw(st.integers(0, len(g.kvs))), KV(kv.key, kv.vtype, kv.value, kv.subtype))
            desc = f"duplicate {name}"
        return write_gguf(g), desc
    if op == "kv_add":
        choices = [
            KV(f"{arch}.rope.scaling.type".encode(), STRING, draw(st.sampled_from([b"yarn", b"linear", b"none",
                                                                                  b"longrope"]))),
            KV(f"{arch}.rope.scaling.factor".encode(), F32, draw(st.sampled_from(HOSTILE_FLOATS))),
            KV(b"general.alignment", U32, draw(st.sampled_from([0, 1, 3, 16, 64, 4096, 2**31, 2**32 - 1]))),
            KV(b"general.alignment", U64, 64),
            KV(f"{arch}.attention.head_count".encode(), ARRAY, [4, 4], U32),
            KV(b"tokenizer.chat_template", STRING, draw(st.sampled_from(TEMPLATE_ATTACKS)).encode()),
            KV(b"tokenizer.ggml.eot_token_id", U32, _hostile_int(draw)),
            KV(b"nested", ARRAY, [[1]], ARRAY),
        ]
        kv = draw(st.sampled_from(choices), label="added kv")
        # Replace an existing key of the same name (a second copy is the duplicate mutation's job).
        g.kvs = [k for k in g.kvs if k.key != kv.key] + [kv]
        return write_gguf(g), f"add {kv.key[:40]!r}"
    if op == "string_item":
        arrays = [kv for kv in g.kvs if kv.vtype == ARRAY and kv.subtype == STRING and kv.value]
        kv = _pick(draw, arrays, "string array")
        if kv is None:
            return raw_mutation(draw, raw)
        i = draw(st.integers(0, len(kv.value) - 1))
        choice = draw(st.sampled_from(["bytes", "empty", "dup", "merge", "space", "drop"]))
        if choice == "bytes":
            kv.value[i] = draw(st.binary(max_size=8))
        elif choice == "empty":
            kv.value[i] = b""
        elif choice == "dup":
            kv.value[i] = kv.value[draw(st.integers(0, len(kv.value) - 1))]
        elif choice == "merge":
            kv.value[i] = b"zz qq"
        elif choice == "space":
            kv.value[i] = b"a b c"
        else:
            del kv.value[i]
        return write_gguf(g), f"item {kv.key[:30]!r}[{i}] {choice}"
    if not g.tensors:
        return raw_mutation(draw, raw)
    t: TensorInfo = _pick(draw, g.tensors, "tensor")
    name = t.name.decode("utf-8", "replace")[:40]
    if op == "tensor_dims":
        how = draw(st.sampled_from(["swap", "plus", "double", "zero", "huge", "drop", "add"]))
        if how == "swap" and len(t.dims) > 1:
            t.dims = t.dims[::-1]
        elif how == "plus":
            t.dims[-1] += 1
        elif how == "double":
            t.dims[0] *= 2
        elif how == "zero":
            t.dims[0] = 0
        elif how == "huge":
            t.dims[draw(st.integers(0, len(t.dims) - 1))] = _hostile_int(draw)
        elif how == "drop" and len(t.dims) > 1:
            t.dims = [t.dims[0] * t.dims[1]] + t.dims[2:]
        else:
            t.dims = t.dims + [draw(st.sampled_from([1, 2, 2**32]))]
        return write_gguf(g), f"dims {name} {how}"
    if op == "tensor_type":
        t.ttype = draw(st.sampled_from(GGML_TYPES))
        return write_gguf(g), f"ttype {name}={t.ttype}"
    if op == "tensor_offset":
        other = _pick(draw, g.tensors, "other tensor")
        t.offset = draw(st.sampled_from([t.offset + 1, t.offset + g.alignment // 2, other.offset, other.offset + 32,
                                         len(g.data), len(g.data) + 32, 2**64 - 64, 2**63, 2**32, 0]))
        return write_gguf(g), f"offset {name}={t.offset}"
    how = draw(st.sampled_from(["duplicate", "extra_layer", "garbage", "delete", "rename"]))
    if how == "duplicate":
        t.name = _pick(draw, g.tensors, "name source").name
    elif how == "extra_layer":
        t.name = re.sub(rb"blk\.\d+", b"blk.7", t.name) if t.name.startswith(b"blk.") else b"blk.2.attn_q.weight"
    elif how == "garbage":
        t.name = draw(st.binary(max_size=12))
    elif how == "rename":
        t.name = re.sub(rb"blk\.(\d+)", lambda m: b"blk.0" + m.group(1), t.name)
    else:
        g.tensors.remove(t)
    return write_gguf(g), f"tensor {name} {how}"


# ------------------------------------------------------------------------------------------------ safetensors
ST_DTYPES = ["F32", "F16", "BF16", "F64", "I32", "I64", "I8", "U8", "BOOL", "F8_E4M3", "XX", 7, None]


def safetensors_mutation(draw, raw: bytes) -> tuple[bytes, str]:
    try:
        header, data = parse_safetensors(raw)
    except Exception:
        return raw_mutation(draw, raw)
    names = [n for n in header if n != "__metadata__"]
    op = draw(st.sampled_from(["header_len", "dtype", "shape", "offsets", "duplicate", "rename", "remove", "alias",
                               "metadata", "entry"]), label="safetensors op")
    if op == "header_len" or not names:
        value = _hostile_int(draw, struct.unpack_from("<Q", raw)[0])
        return struct.pack("<Q", value & (2**64 - 1)) + raw[8:], f"header_len={value}"
    name = draw(st.sampled_from(names), label="tensor")
    entry = header[name]
    if op == "dtype":
        entry["dtype"] = draw(st.sampled_from(ST_DTYPES))
    elif op == "shape":
        shape = list(entry["shape"])
        how = draw(st.sampled_from(["transpose", "flatten", "plus", "empty", "negative", "huge", "string", "nested"]))
        entry["shape"] = {
            "transpose": shape[::-1], "flatten": [math.prod(shape)], "plus": shape[:-1] + [shape[-1] + 1] if shape
            else [1], "empty": [], "negative": [-1] + shape[1:], "huge": [2**40] + shape[1:], "string": ["a"],
            "nested": [shape]}[how]
        op = f"shape:{how}"
    elif op == "offsets":
        b, e = entry["data_offsets"]
        other = header[draw(st.sampled_from(names))]["data_offsets"]
        entry["data_offsets"] = draw(st.sampled_from([[e, b], [-1, e], [b, 2**64], [b + 1, e + 1], list(other),
                                                      [b, len(data) + 8], [2**63, 2**63 + e - b], [b, e + 4],
                                                      [float(b), e], [b]]))
    elif op == "duplicate":
        text = json.dumps(header)
        dup = json.dumps({name: header[draw(st.sampled_from(names))]})[1:-1]
        return write_safetensors("{" + dup + ", " + text[1:], data), f"duplicate {name}"
    elif op == "rename":
        header[re.sub(r"\.(\d+)\.", ".7.", name, count=1) if re.search(r"\.\d+\.", name) else name + "x"] = \
            header.pop(name)
    elif op == "remove":
        del header[name]
    elif op == "alias":
        header[name + ".alias"] = dict(entry)
    elif op == "metadata":
        header["__metadata__"] = draw(st.sampled_from([{"a": 1}, [], "x", {"a": {"b": "c"}}, None]))
    else:
        header[name] = draw(st.sampled_from([[], 1, "x", None, {"dtype": "F32"}, dict(entry, extra=1)]))
    return write_safetensors(header, data), f"{op} {name[:40]}"


# ------------------------------------------------------------------------------------------------ JSON
def _paths(obj, prefix=(), depth=0, out=None):
    """(path, value) of the nodes of a JSON tree, at most a few thousand (large vocabularies are sampled)."""
    out = [] if out is None else out
    if depth > 6 or len(out) > 3000:
        return out
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:400]:
            out.append((prefix + (k,), v))
            _paths(v, prefix + (k,), depth + 1, out)
    elif isinstance(obj, list):
        for i, v in list(enumerate(obj))[:400]:
            out.append((prefix + (i,), v))
            _paths(v, prefix + (i,), depth + 1, out)
    return out


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


_DELETE = object()
_CONFIG_ADDS = {"rope_scaling": [{"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 0},
                                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                  "high_freq_factor": 1.0, "original_max_position_embeddings": 64}, "x"],
                "head_dim": [0, 3, 15, 2**31], "num_key_value_heads": [0, 3, 5, -2], "sliding_window": [1, "x"],
                "rope_parameters": [{"rope_theta": math.nan}, []], "eos_token_id": [2**31, -1],
                "chat_template": TEMPLATE_ATTACKS, "added_tokens_decoder": [{"x": {}}, {"99": {"content": 5}},
                                                                           {"1" * 30: {"content": "a"}}],
                "truncation": [{"max_length": 0, "strategy": "LongestFirst", "stride": 0, "direction": "Right"}],
                "padding": [{"strategy": {"Fixed": 10**9}, "direction": "Right", "pad_to_multiple_of": 0,
                             "pad_id": 0, "pad_type_id": 0, "pad_token": "x"}],
                "architectures": [["GPT2"], "LlamaForCausalLM", [1]], "torch_dtype": [1]}


def json_mutation(draw, raw: bytes, fmt: str) -> tuple[bytes, str]:
    ops = ["value", "value", "remove", "add", "duplicate_key", "nesting", "non_utf8", "literal"]
    op = draw(st.sampled_from(ops + (["template"] if fmt == "tokenizer_config" else [])), label="json op")
    if op in ("nesting", "non_utf8", "literal", "duplicate_key"):
        text = raw.decode("utf-8", "replace")
        if op == "nesting":
            depth = draw(st.sampled_from([100, 1000, 100_000]))
            return ("[" * depth + "]" * depth).encode() if draw(st.booleans()) else \
                raw.replace(b":", b":" + b"[" * depth, 1), f"nesting{depth}"
        if op == "non_utf8":
            pos = draw(st.integers(0, len(raw)))
            return raw[:pos] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + raw[pos:], \
                f"non-utf8@{pos}"
        if op == "literal":
            lit = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "9" * 5000, "-0", "1.0e-400"]))
            m = list(re.finditer(r"(?<=: )-?\d+(\.\d+)?", text))
            if not m:
                return raw_mutation(draw, raw)
            hit = m[draw(st.integers(0, len(m) - 1))]
            return (text[:hit.start()] + lit + text[hit.end():]).encode(), f"literal {lit[:12]}"
        m = list(re.finditer(r'"([^"\\]{1,40})": ', text))
        if not m:
            return raw_mutation(draw, raw)
        hit = m[draw(st.integers(0, len(m) - 1))]
        return (text[:hit.start()] + f'"{hit.group(1)}": 0, ' + text[hit.start():]).encode(), f"dupkey {hit.group(1)}"
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return raw_mutation(draw, raw)
    if op == "template":
        if not isinstance(obj, dict):
            return raw_mutation(draw, raw)
        obj["chat_template"] = draw(st.sampled_from(TEMPLATE_ATTACKS))
        desc = "template"
    elif op == "add":
        if not isinstance(obj, dict):
            return raw_mutation(draw, raw)
        key = draw(st.sampled_from(sorted(_CONFIG_ADDS)))
        obj[key] = draw(st.sampled_from(_CONFIG_ADDS[key]))
        desc = f"add {key}"
    else:
        paths = _paths(obj)
        if not paths:
            return raw_mutation(draw, raw)
        path, _ = draw(st.sampled_from(paths), label="json path")
        _set(obj, path, _DELETE if op == "remove" else draw(st.sampled_from(HOSTILE_JSON)))
        desc = f"{op} {'/'.join(map(str, path))[:60]}"
    return json.dumps(obj).encode("utf-8", "surrogatepass"), desc


# ------------------------------------------------------------------------------------------------ entry point
def mutate(draw, fmt: str, raw: bytes) -> tuple[bytes, list[str]]:
    """One to three mutations: structural ones first (they need a parseable file), then at most one raw one."""
    if fmt in parts.FORMATS:
        return parts.mutate(draw, fmt, raw)
    structural = {"gguf": gguf_mutation, "safetensors": safetensors_mutation}.get(
        fmt, lambda d, r: json_mutation(d, r, fmt))
    # Half the inputs get structural mutations only: raw ones mostly stop a file at its first bytes, and the
    # deeper checks (types, ranges, shapes against the config) need a file that still parses.
    n_struct = draw(st.sampled_from([0, 1, 1, 1, 2]), label="structural mutations")
    n_raw = 1 if n_struct == 0 else draw(st.sampled_from([0, 0, 1]), label="raw mutations")
    desc = []
    for _ in range(n_struct):
        try:
            raw, d = structural(draw, raw)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, struct.error):
            # An earlier mutation left a structure this one cannot edit (a header entry that is a list, a shape
            # of strings): mutate the bytes instead.
            raw, d = raw_mutation(draw, raw)
        desc.append(d)
    for _ in range(n_raw):
        raw, d = raw_mutation(draw, raw)
        desc.append(d)
    return raw, desc
