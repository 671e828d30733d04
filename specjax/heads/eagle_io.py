"""Draft-head files in and out: EAGLE-1/2, EAGLE-3 (as released by its authors) and the speculators layout.

Only safetensors are read (a `.bin`/`.pt`/`.pth`/`.ckpt` checkpoint needs pickle: refused, never opened, with the
command that converts it). Head files are untrusted: config values are checked for type and range, the safetensors
layout is checked before any tensor is read (`specjax.models.safe_files`), and the layers and shapes in the file
must match the config. Every rejection is a HeadFormatError naming the file.
Every format is an entry of the module-level registry `HEAD_FORMATS` (name -> HeadFormat), so other head
families add theirs next to these; `load_head` detects the format from config.json and the tensor names.

Formats (PyTorch Linear weights are [out, in]; specjax keeps [in, out]):
  eagle        config.json (a Llama config: hidden_size, num_hidden_layers, heads, vocab_size, ...),
               fc.weight [H, 2H] (+ fc.bias), layers.{i}.self_attn.{q,k,v,o}_proj.weight,
               layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.post_attention_layernorm.weight,
               layers.{i}.input_layernorm.weight for i > 0 (layer 0 has none in the reference code).
  eagle3       config.json (Llama-like, num_hidden_layers 1, draft_vocab_size, optional target_hidden_size),
               midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], midlayer.self_attn.o_proj.weight,
               midlayer.mlp.*, midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
               fc.weight [H, 3H] (+ fc.bias), norm.weight, lm_head.weight [Vd, H], d2t int64 [Vd]
               (target id = i + d2t[i]), t2d bool [V].
  speculators  EAGLE-3 saved by `speculators`: layers.0.* instead of midlayer.*, config with
               speculators_config {algorithm, proposal_methods, default_proposal_method, verifier},
               transformer_layer_config, draft_vocab_size, norm_before_residual, target_hidden_size,
               eagle_aux_hidden_state_layer_ids.
EAGLE-3 reads the residual stream entering target layers (2, L//2, L-3) by default; specjax names a feature by
the layer whose OUTPUT it is, so an aux id i here is specjax feature layer i - 1. Files written here record the
ids as `eagle_aux_hidden_state_layer_ids` (the convention vLLM reads) and in a `specjax_head` config entry.
Embeddings and the EAGLE-1/2 LM head are the target's: they are never written, and ignored when a file has them.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import numpy as np

from specjax.heads.eagle import HeadConfig, HeadConfigError, default_eagle3_layers, param_shapes
from specjax.models.llama import LlamaConfig
from specjax.models.safe_files import (INT32_MAX, cfg_bool, cfg_float, cfg_int, check_rope_scaling, is_pickle_name,
                                       layer_indices, pickle_refusal, read_json_file, read_safetensors_file)
from specjax.errors import SpecjaxError

SPECJAX_KEY = "specjax_head"
MAX_HEAD_LAYERS = 64

_LAYER = {  # specjax layer key -> HF suffix ([out, in] matrices are transposed)
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
}
_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_IGNORED = ("embed_tokens.weight",)  # the target's embedding, copied into some releases


class HeadFormatError(SpecjaxError, ValueError):
    """A head file is missing, unreadable, of an unknown format or internally inconsistent."""


class HeadMismatchError(HeadFormatError):
    """A head was built for another target (hidden size, vocabulary or layer count differ)."""


@dataclasses.dataclass(frozen=True)
class HeadFormat:
    """One on-disk head format. detect(config, tensor names) -> bool; load(config, tensors, where) ->
    (head config, params as NumPy arrays); save(path, head config, params, meta) writes it (None = read-only)."""

    name: str
    detect: Callable[[dict, set], bool]
    load: Callable[[dict, dict, str], tuple[Any, dict]]
    save: Callable[..., None] | None = None
    description: str = ""


HEAD_FORMATS: dict[str, HeadFormat] = {}


def register_format(fmt: HeadFormat) -> HeadFormat:
    """Add (or replace) a format in `HEAD_FORMATS`; returns it."""
    HEAD_FORMATS[fmt.name] = fmt
    return fmt


# ============================================================================================ reading
def read_head_dir(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json as a dict, every tensor as a NumPy array: floats as float32, integers/bools as stored).

    path: a head directory, or one of its .safetensors files. Pickled checkpoints are refused unopened."""
    if os.path.isfile(path):
        if is_pickle_name(path):
            raise HeadFormatError(pickle_refusal(path, os.path.join(os.path.dirname(path) or ".", "model.safetensors")))
        if not path.endswith(".safetensors"):
            raise HeadFormatError(f"{path}: a head is a directory with config.json and safetensors weights")
        files, path = [path], os.path.dirname(path) or "."
    elif os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            pickled = sorted(f for f in os.listdir(path) if is_pickle_name(f))
            if pickled:
                raise HeadFormatError(pickle_refusal(os.path.join(path, pickled[0]),
                                                     os.path.join(path, "model.safetensors")))
            raise HeadFormatError(f"{path}: no .safetensors weights in this directory")
    else:
        raise HeadFormatError(f"head path {path!r} does not exist")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise HeadFormatError(f"{path}: config.json is missing (it holds the head's architecture)")
    config = read_json_file(cfg_path, HeadFormatError)
    tensors: dict[str, np.ndarray] = {}
    for fn in files:
        got = read_safetensors_file(fn, HeadFormatError)
        twice = sorted(set(got) & set(tensors))
        if twice:
            raise HeadFormatError(f"{fn}: tensor {twice[0]!r} is also in another file of the head; it is inconsistent")
        tensors.update(got)
    return config, tensors


def detect_format(config: dict, names: set, where: str = "head") -> str:
    """The registered format that recognises this config and these tensor names."""
    hits = [n for n, fmt in HEAD_FORMATS.items() if fmt.detect(config, names)]
    if not hits:
        raise HeadFormatError(f"{where}: unrecognised head format (tensors such as {sorted(names)[:4]}); "
                              f"supported: {', '.join(HEAD_FORMATS)}")
    return hits[0]


def load_head(path: str, target: LlamaConfig, fmt: str | None = None) -> tuple[Any, dict]:
    """Read a head and check it against the target. Returns (head config, params as NumPy arrays).

    fmt: a name from HEAD_FORMATS, or None to detect it."""
    config, tensors = read_head_dir(path)
    name = fmt or detect_format(config, set(tensors), path)
    if name not in HEAD_FORMATS:
        raise HeadFormatError(f"unknown head format {name!r}; registered: {', '.join(HEAD_FORMATS)}")
    hcfg, params = HEAD_FORMATS[name].load(config, tensors, path)
    if isinstance(hcfg, HeadConfig):
        hcfg = _bind_target(hcfg, config, target, path)
        check_against_target(hcfg, params, target, path)
    return hcfg, params


def _bind_target(hcfg: HeadConfig, config: dict, target: LlamaConfig, where: str) -> HeadConfig:
    """Fill in what the file left to the target (EAGLE-3 feature layers when not recorded)."""
    if hcfg.kind == "eagle3" and not hcfg.feature_layers:
        try:
            return dataclasses.replace(hcfg, feature_layers=default_eagle3_layers(target.num_layers))
        except HeadConfigError as e:
            raise HeadMismatchError(f"{where}: {e}") from None
    return hcfg


def check_against_target(hcfg: HeadConfig, params: dict, target: LlamaConfig, where: str = "head") -> None:
    """Raise HeadMismatchError when the head cannot run on this target."""
    if hcfg.hidden_size != target.hidden_size:
        raise HeadMismatchError(f"{where}: head hidden size {hcfg.hidden_size} != target hidden size "
                                f"{target.hidden_size}; use a head trained for this target")
    if hcfg.kind == "eagle3" and (hcfg.target_hidden_size or hcfg.hidden_size) != target.hidden_size:
        raise HeadMismatchError(f"{where}: head fuses target features of width {hcfg.target_hidden_size}, the target's "
                                f"are {target.hidden_size}; use a head trained for this target")
    if hcfg.vocab_size != target.vocab_size:
        raise HeadMismatchError(f"{where}: head vocabulary {hcfg.vocab_size} != target vocabulary {target.vocab_size}; "
                                "a head must share its target's tokenizer")
    bad = [i for i in hcfg.feature_layers if not 0 <= i < target.num_layers]
    if bad:
        raise HeadMismatchError(f"{where}: head reads target layers {list(hcfg.feature_layers)} but the target has "
                                f"{target.num_layers} layers")
    ids = params.get("draft_ids")
    if ids is not None and (ids.min() < 0 or ids.max() >= target.vocab_size):
        raise HeadMismatchError(f"{where}: draft vocabulary maps to ids outside the target vocabulary "
                                f"[0, {target.vocab_size})")


# ============================================================================================ shared helpers
def _need(tensors: dict, name: str, where: str, kind: str = "f") -> np.ndarray:
    """tensors[name], which must exist and (kind "f") be floating point."""
    if name not in tensors:
        raise HeadFormatError(f"{where}: tensor {name!r} is missing")
    a = tensors[name]
    if kind == "f" and a.dtype.kind != "f":
        raise HeadFormatError(f"{where}: tensor {name!r} has dtype {a.dtype}; head weights must be floating point")
    return a


def _cfg_int(config: dict, key: str, where: str, default=None, **bounds) -> int:
    """config[key] as an int in range (see safe_files.cfg_int); `default` None means required."""
    return cfg_int(config, key, f"{where}/config.json", HeadFormatError,
                   *(() if default is None else (default,)), **bounds)


def _head_geometry(config: dict, where: str) -> dict:
    """HeadConfig fields shared by all EAGLE layouts, from a (Llama-like) config dict, every value checked."""
    cw = f"{where}/config.json"
    H = _cfg_int(config, "hidden_size", where, hi=1 << 20)
    heads = _cfg_int(config, "num_attention_heads", where, hi=1 << 14)
    kv = _cfg_int(config, "num_key_value_heads", where, heads, hi=heads)
    if heads % kv:
        raise HeadFormatError(f"{cw}: {heads} attention heads are not a multiple of {kv} key/value heads")
    head_dim = cfg_int(config, "head_dim", cw, HeadFormatError, None, hi=4096)
    if head_dim is None:
        if H % heads:
            raise HeadFormatError(f"{cw}: hidden size {H} is not divisible by {heads} attention heads (and no "
                                  "head_dim is given)")
        head_dim = H // heads
    if head_dim % 2:
        raise HeadFormatError(f"{cw}: head dimension {head_dim} must be even for RoPE")
    return dict(hidden_size=H, intermediate_size=_cfg_int(config, "intermediate_size", where, hi=1 << 22),
                num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                vocab_size=_cfg_int(config, "vocab_size", where),
                rms_norm_eps=cfg_float(config, "rms_norm_eps", cw, HeadFormatError, 1e-6, gt=0.0, lt=1.0),
                rope_theta=cfg_float(config, "rope_theta", cw, HeadFormatError, 10000.0, gt=1.0),
                rope_scaling=check_rope_scaling(config.get("rope_scaling"), cw, HeadFormatError))


def _check_layer_count(tensors: dict, prefix: str, n: int, where: str) -> None:
    """The file's `{prefix}{i}.*` layers must be exactly 0..n-1 (config.json and the weights agree)."""
    found = layer_indices(tensors, prefix, where, HeadFormatError)
    if found != set(range(n)):
        raise HeadFormatError(f"{where}: config.json says {n} decoder layers but the weights hold layers "
                              f"{sorted(found)[:8]}; the config and the weights disagree")


def _geometry_config(hcfg: HeadConfig) -> dict:
    cfg = {"hidden_size": hcfg.hidden_size, "intermediate_size": hcfg.intermediate_size,
           "num_attention_heads": hcfg.num_heads, "num_key_value_heads": hcfg.num_kv_heads,
           "head_dim": hcfg.head_dim, "vocab_size": hcfg.vocab_size, "rms_norm_eps": hcfg.rms_norm_eps,
           "rope_theta": hcfg.rope_theta, "hidden_act": "silu", "model_type": "llama", "attention_bias": False,
           "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if hcfg.rope_scaling:
        cfg["rope_scaling"] = dict(hcfg.rope_scaling)
    return cfg


def _read_layer(tensors: dict, prefix: str, where: str, extra: dict) -> dict:
    lp = {}
    for key, suffix in {**_LAYER, **extra}.items():
        a = _need(tensors, prefix + suffix, where)
        if a.ndim != (2 if key in _MATRICES else 1):
            raise HeadFormatError(f"{where}: tensor {prefix + suffix!r} has {a.ndim} dimensions, expected "
                                  f"{2 if key in _MATRICES else 1}")
        lp[key] = a.T if key in _MATRICES else a
    return lp


def _write_layer(lp: dict, prefix: str, extra: dict) -> dict:
    out = {}
    for key, suffix in {**_LAYER, **extra}.items():
        a = np.asarray(lp[key], np.float32)
        out[prefix + suffix] = a.T if key in _MATRICES else a
    return out


def _check_shapes(hcfg: HeadConfig, params: dict, where: str) -> None:
    expected = param_shapes(hcfg, fc_bias="fc_bias" in params)
    for key, shape in expected.items():
        if key == "layers":
            for i, (le, lg) in enumerate(zip(shape, params["layers"])):
                for k, s in le.items():
                    got = tuple(np.shape(lg.get(k))) if k in lg else None
                    if got != s:
                        raise HeadFormatError(f"{where}: layer {i} {k} has shape {got}, expected {s} from config.json")
        elif tuple(np.shape(params.get(key))) != shape:
            raise HeadFormatError(f"{where}: {key} has shape {tuple(np.shape(params.get(key)))}, expected {shape} "
                                  "from config.json")


def _save(path: str, config: dict, tensors: dict, meta: dict, dtype: str) -> None:
    """Write config.json and model.safetensors (floats as `dtype`, integer/bool tensors as given)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    if dtype not in ("bfloat16", "float16", "float32"):
        raise HeadFormatError(f"head weights are stored as bfloat16, float16 or float32, not {dtype!r}")
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    out = {k: np.ascontiguousarray(v.astype(npdt) if v.dtype.kind == "f" else v) for k, v in tensors.items()}
    os.makedirs(path, exist_ok=True)
    config = dict(config, torch_dtype=dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    save_file(out, os.path.join(path, "model.safetensors"),
              metadata={str(k): json.dumps(v) for k, v in (meta or {}).items()})


def _specjax_entry(hcfg: HeadConfig, meta: dict | None) -> dict:
    entry = {"kind": hcfg.kind, "feature_layers": list(hcfg.feature_layers)}
    entry.update({k: v for k, v in (meta or {}).items() if isinstance(v, (str, int, float, bool, list, dict))})
    return entry


def _feature_layers_from(config: dict, where: str) -> tuple:
    """EAGLE-3 feature layers recorded in a config (specjax entry, else vLLM aux ids), or () = target default."""
    def ints(value, key, lo):
        if not isinstance(value, list) or len(value) != 3 or not all(
                isinstance(i, int) and not isinstance(i, bool) and lo <= i <= 4096 for i in value):
            raise HeadFormatError(f"{where}/config.json: {key} {str(value)[:60]} must name three layers >= {lo}")
        return value

    entry = config.get(SPECJAX_KEY) or {}
    if not isinstance(entry, dict):
        raise HeadFormatError(f"{where}/config.json: {SPECJAX_KEY} must be an object")
    if entry.get("feature_layers"):
        return tuple(ints(entry["feature_layers"], f"{SPECJAX_KEY}.feature_layers", 0))
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        return tuple(i - 1 for i in ints(aux, "eagle_aux_hidden_state_layer_ids", 1))
    return ()


# ============================================================================================ EAGLE-1/2
def _detect_eagle(config: dict, names: set) -> bool:
    return "fc.weight" in names and any(n.startswith("layers.0.") for n in names) and "d2t" not in names \
        and "speculators_config" not in config and not any(n.startswith("midlayer.") for n in names)


def load_eagle(config: dict, tensors: dict, where: str) -> tuple[HeadConfig, dict]:
    """EAGLE-1/2 tensors -> (HeadConfig, params)."""
    geo = _head_geometry(config, where)
    n = _cfg_int(config, "num_hidden_layers", where, 1, hi=MAX_HEAD_LAYERS)
    _check_layer_count(tensors, "layers.", n, where)
    try:
        hcfg = HeadConfig(kind="eagle", num_layers=n, **geo)
    except HeadConfigError as e:
        raise HeadFormatError(f"{where}: {e}") from None
    fc = _need(tensors, "fc.weight", where)
    if fc.shape != (hcfg.hidden_size, 2 * hcfg.hidden_size):
        raise HeadMismatchError(f"{where}: fc.weight is {fc.shape}, an EAGLE-1/2 head of hidden size "
                                f"{hcfg.hidden_size} needs [{hcfg.hidden_size}, {2 * hcfg.hidden_size}]")
    params = {"fc": fc.T, "layers": []}
    if "fc.bias" in tensors:
        params["fc_bias"] = _need(tensors, "fc.bias", where)
    for i in range(n):
        lp = _read_layer(tensors, f"layers.{i}.", where, {})
        norm_name = f"layers.{i}.input_layernorm.weight"
        if i and norm_name not in tensors:
            raise HeadFormatError(f"{where}: tensor {norm_name!r} is missing")
        if norm_name in tensors:
            lp["attn_norm"] = _need(tensors, norm_name, where)
        params["layers"].append(lp)
    _check_embed(tensors, hcfg, where)
    _check_shapes_eagle(hcfg, params, where)
    return hcfg, params


def _check_shapes_eagle(hcfg, params, where):
    # Layer 0 may carry an input norm in some exports; the shape check expects it only where the file has it.
    if "attn_norm" in params["layers"][0]:
        trimmed = dict(params, layers=[{k: v for k, v in params["layers"][0].items() if k != "attn_norm"}]
                       + params["layers"][1:])
        _check_shapes(hcfg, trimmed, where)
    else:
        _check_shapes(hcfg, params, where)


def _check_embed(tensors: dict, hcfg: HeadConfig, where: str) -> None:
    e = tensors.get("embed_tokens.weight")
    if e is not None and e.shape != (hcfg.vocab_size, hcfg.hidden_size):
        raise HeadMismatchError(f"{where}: embed_tokens.weight is {e.shape}, config says [{hcfg.vocab_size}, "
                                f"{hcfg.hidden_size}]")


def save_eagle(path: str, hcfg: HeadConfig, params: dict, meta: dict | None = None, dtype: str = "bfloat16") -> None:
    """Write an EAGLE-1/2 head (config.json + model.safetensors) that EAGLE-1/2 loaders read."""
    if hcfg.kind != "eagle":
        raise HeadFormatError(f"save_eagle writes EAGLE-1/2 heads, got a {hcfg.kind!r} head")
    t = {"fc.weight": np.asarray(params["fc"], np.float32).T}
    if "fc_bias" in params:
        t["fc.bias"] = np.asarray(params["fc_bias"], np.float32)
    for i, lp in enumerate(params["layers"]):
        extra = {"attn_norm": "input_layernorm.weight"} if "attn_norm" in lp else {}
        t.update(_write_layer(lp, f"layers.{i}.", extra))
    cfg = dict(_geometry_config(hcfg), architectures=["LlamaForCausalLM"], num_hidden_layers=hcfg.num_layers,
               bias="fc_bias" in params)
    cfg[SPECJAX_KEY] = _specjax_entry(hcfg, meta)
    _save(path, cfg, t, meta, dtype)


# ============================================================================================ EAGLE-3
_E3_EXTRA = {"input_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight"}


def _detect_eagle3(config: dict, names: set) -> bool:
    return any(n.startswith("midlayer.") for n in names)


def _draft_ids(tensors: dict, vd: int, V: int, where: str) -> np.ndarray:
    """Absolute target ids [Vd] from the EAGLE-3 offsets d2t (target = i + d2t[i]), checked against t2d."""
    if vd > V:
        raise HeadFormatError(f"{where}: draft_vocab_size {vd} is larger than the vocabulary {V}")
    d2t = tensors.get("d2t")
    if d2t is None:
        if vd != V:
            raise HeadFormatError(f"{where}: tensor 'd2t' is missing (draft vocabulary {vd} != target {V})")
        return np.arange(V, dtype=np.int32)
    d2t = np.asarray(d2t)
    if d2t.shape != (vd,) or d2t.dtype.kind not in "iu":
        raise HeadFormatError(f"{where}: d2t must be an integer vector of draft_vocab_size {vd}, got {d2t.dtype} "
                              f"{d2t.shape}")
    ids = np.arange(vd, dtype=np.int64) + d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= V:
        raise HeadMismatchError(f"{where}: d2t maps draft tokens to ids outside the target vocabulary [0, {V})")
    if np.unique(ids).size != vd:
        raise HeadFormatError(f"{where}: d2t maps two draft tokens to the same target id")
    t2d = tensors.get("t2d")
    if t2d is not None:
        if t2d.dtype.kind not in "biu":
            raise HeadFormatError(f"{where}: t2d must be a bool or integer vector, got {t2d.dtype}")
        t2d = np.asarray(t2d).astype(bool)
        if t2d.shape != (V,) or int(t2d.sum()) != vd or not t2d[ids].all():
            raise HeadFormatError(f"{where}: t2d [{t2d.shape}] disagrees with d2t (t2d must mark exactly the "
                                  "target ids of the draft vocabulary)")
    return ids.astype(np.int32)


def _load_eagle3_common(config: dict, layer_cfg: dict, tensors: dict, prefix: str, where: str,
                        norm_before_residual: bool) -> tuple[HeadConfig, dict]:
    geo = _head_geometry(layer_cfg, where)
    vd = _cfg_int(config, "draft_vocab_size", where,
                  _cfg_int(layer_cfg, "draft_vocab_size", where, geo["vocab_size"], hi=INT32_MAX), hi=INT32_MAX)
    th = _cfg_int(config, "target_hidden_size", where,
                  _cfg_int(layer_cfg, "target_hidden_size", where, geo["hidden_size"], hi=1 << 20), hi=1 << 20)
    n = _cfg_int(layer_cfg, "num_hidden_layers", where, 1, hi=MAX_HEAD_LAYERS)
    if n != 1:
        raise HeadFormatError(f"{where}: EAGLE-3 heads have one decoder layer, config says {n}")
    _check_layer_count(tensors, "layers.", 1 if prefix == "layers.0." else 0, where)
    layers = _feature_layers_from(config, where)
    try:
        hcfg = HeadConfig(kind="eagle3", num_layers=1, draft_vocab_size=vd, target_hidden_size=th,
                          feature_layers=layers, norm_before_residual=norm_before_residual, **geo)
    except HeadConfigError as e:
        raise HeadFormatError(f"{where}: {e}") from None
    fc = _need(tensors, "fc.weight", where)
    if fc.shape != (hcfg.hidden_size, 3 * th):
        raise HeadMismatchError(f"{where}: fc.weight is {fc.shape}, an EAGLE-3 head fusing three target layers of "
                                f"width {th} needs [{hcfg.hidden_size}, {3 * th}]")
    params = {"fc": fc.T, "layers": [_read_layer(tensors, prefix, where, _E3_EXTRA)],
              "norm": _need(tensors, "norm.weight", where), "lm_head": _need(tensors, "lm_head.weight", where).T,
              "draft_ids": _draft_ids(tensors, vd, hcfg.vocab_size, where)}
    if "fc.bias" in tensors:
        params["fc_bias"] = _need(tensors, "fc.bias", where)
    _check_embed(tensors, hcfg, where)
    _check_shapes(hcfg, params, where)
    return hcfg, params


def load_eagle3(config: dict, tensors: dict, where: str) -> tuple[HeadConfig, dict]:
    """EAGLE-3 tensors as released by its authors -> (HeadConfig, params). Feature layers not recorded in the
    file are left empty here and set to the reference default for the target by `load_head`."""
    return _load_eagle3_common(config, config, tensors, "midlayer.", where,
                               cfg_bool(config, "norm_before_residual", f"{where}/config.json", HeadFormatError))


def _e3_tensors(hcfg: HeadConfig, params: dict, prefix: str) -> dict:
    if hcfg.kind != "eagle3":
        raise HeadFormatError(f"EAGLE-3 layouts hold EAGLE-3 heads, got a {hcfg.kind!r} head")
    ids = np.asarray(params["draft_ids"], np.int64)
    t2d = np.zeros(hcfg.vocab_size, bool)
    t2d[ids] = True
    t = {"fc.weight": np.asarray(params["fc"], np.float32).T, "norm.weight": np.asarray(params["norm"], np.float32),
         "lm_head.weight": np.asarray(params["lm_head"], np.float32).T,
         "d2t": ids - np.arange(ids.size, dtype=np.int64), "t2d": t2d}
    if "fc_bias" in params:
        t["fc.bias"] = np.asarray(params["fc_bias"], np.float32)
    t.update(_write_layer(params["layers"][0], prefix, _E3_EXTRA))
    return t


def _aux_ids(hcfg: HeadConfig) -> list[int]:
    return [int(i) + 1 for i in hcfg.feature_layers]


def save_eagle3(path: str, hcfg: HeadConfig, params: dict, meta: dict | None = None,
                dtype: str = "bfloat16") -> None:
    """Write an EAGLE-3 head in its authors' layout (midlayer.*, d2t offsets, t2d)."""
    t = _e3_tensors(hcfg, params, "midlayer.")
    cfg = dict(_geometry_config(hcfg), architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               draft_vocab_size=hcfg.draft_vocab_size, target_hidden_size=hcfg.target_hidden_size or hcfg.hidden_size,
               eagle_aux_hidden_state_layer_ids=_aux_ids(hcfg))
    if hcfg.norm_before_residual:
        cfg["norm_before_residual"] = True
    cfg[SPECJAX_KEY] = _specjax_entry(hcfg, meta)
    _save(path, cfg, t, meta, dtype)


# ============================================================================================ speculators
def _detect_speculators(config: dict, names: set) -> bool:
    return "speculators_config" in config or "speculators_model_type" in config


def load_speculators(config: dict, tensors: dict, where: str) -> tuple[HeadConfig, dict]:
    """An EAGLE-3 head saved in the speculators layout -> (HeadConfig, params)."""
    spec = config.get("speculators_config") or {}
    if not isinstance(spec, dict):
        raise HeadFormatError(f"{where}/config.json: speculators_config must be an object")
    kind = config.get("speculators_model_type") or spec.get("algorithm")
    if kind != "eagle3":
        raise HeadFormatError(f"{where}: speculators model type {str(kind)[:40]!r} is not supported (only 'eagle3')")
    layer_cfg = config.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise HeadFormatError(f"{where}: speculators config has no transformer_layer_config")
    return _load_eagle3_common(config, layer_cfg, tensors, "layers.0.", where,
                               cfg_bool(config, "norm_before_residual", f"{where}/config.json", HeadFormatError))


def save_speculators(path: str, hcfg: HeadConfig, params: dict, meta: dict | None = None,
                     dtype: str = "bfloat16") -> None:
    """Write an EAGLE-3 head in the speculators layout (layers.0.*, speculators_config)."""
    meta = meta or {}
    t = _e3_tensors(hcfg, params, "layers.0.")
    layer_cfg = dict(_geometry_config(hcfg), architectures=["LlamaForCausalLM"], num_hidden_layers=1)
    cfg = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_cfg, "draft_vocab_size": hcfg.draft_vocab_size,
        "norm_before_residual": hcfg.norm_before_residual,
        "target_hidden_size": hcfg.target_hidden_size or hcfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": _aux_ids(hcfg),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(meta.get("speculative_tokens", 5)),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": str(meta.get("target", "")), "architectures": ["LlamaForCausalLM"]},
        },
        SPECJAX_KEY: _specjax_entry(hcfg, meta),
    }
    _save(path, cfg, t, meta, dtype)


register_format(HeadFormat("eagle3", _detect_eagle3, load_eagle3, save_eagle3, "EAGLE-3 (authors' release)"))
register_format(HeadFormat("speculators", _detect_speculators, load_speculators, save_speculators,
                           "EAGLE-3, speculators layout"))
register_format(HeadFormat("eagle", _detect_eagle, load_eagle, save_eagle, "EAGLE-1/2"))


def save_head(path: str, hcfg: HeadConfig, params: dict, fmt: str | None = None, meta: dict | None = None,
              dtype: str = "bfloat16") -> None:
    """Write a head in `fmt` (default: 'eagle' for EAGLE-1/2 heads, 'eagle3' for EAGLE-3 heads)."""
    fmt = fmt or hcfg.kind
    entry = HEAD_FORMATS.get(fmt)
    if entry is None or entry.save is None:
        raise HeadFormatError(f"cannot write head format {fmt!r}; writable: "
                              f"{', '.join(n for n, f in HEAD_FORMATS.items() if f.save)}")
    entry.save(path, hcfg, params, meta, dtype)
