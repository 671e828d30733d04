"""Draft-head files in and out: EAGLE-1/2, EAGLE-3 (as released by its authors) and the speculators layout.

Only safetensors are read (a `.bin`/`.pt` checkpoint needs pickle: refused, with the command that converts it).
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
from specjax.errors import SpecjaxError

SPECJAX_KEY = "specjax_head"
_PICKLE_HINT = ("{path}: pickled PyTorch checkpoints are not loaded (unpickling runs arbitrary code); convert it once "
                "with: python -c \"import torch; from safetensors.torch import save_file; "
                "save_file({{k: v.contiguous() for k, v in torch.load('{path}', map_location='cpu', "
                "weights_only=True).items()}}, '{dir}/model.safetensors')\"")

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

    path: a head directory, or one of its .safetensors files. Pickled checkpoints are refused."""
    from safetensors import safe_open

    if os.path.isfile(path):
        if path.endswith((".bin", ".pt", ".pth")):
            raise HeadFormatError(_PICKLE_HINT.format(path=path, dir=os.path.dirname(path) or "."))
        if not path.endswith(".safetensors"):
            raise HeadFormatError(f"{path}: a head is a directory with config.json and safetensors weights")
        files, path = [path], os.path.dirname(path) or "."
    elif os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            pickled = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
            if pickled:
                raise HeadFormatError(_PICKLE_HINT.format(path=os.path.join(path, pickled[0]), dir=path))
            raise HeadFormatError(f"{path}: no .safetensors weights in this directory")
    else:
        raise HeadFormatError(f"head path {path!r} does not exist")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise HeadFormatError(f"{path}: config.json is missing (it holds the head's architecture)")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise HeadFormatError(f"{cfg_path}: invalid JSON ({e})") from None
    tensors: dict[str, np.ndarray] = {}
    for fn in files:
        try:
            with safe_open(fn, framework="numpy") as f:
                for name in f.keys():
                    a = f.get_tensor(name)
                    tensors[name] = a.astype(np.float32) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a
        except Exception as e:  # safetensors raises its own types for truncated or malformed headers
            raise HeadFormatError(f"{fn}: cannot read safetensors ({type(e).__name__}: {e}); the file is corrupt") \
                from None
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
def _need(tensors: dict, name: str, where: str) -> np.ndarray:
    if name not in tensors:
        raise HeadFormatError(f"{where}: tensor {name!r} is missing")
    return tensors[name]


def _cfg_int(config: dict, key: str, where: str, default=None) -> int:
    v = config.get(key, default)
    if v is None:
        raise HeadFormatError(f"{where}: config.json has no {key!r}")
    return int(v)


def _head_geometry(config: dict, where: str) -> dict:
    """HeadConfig fields shared by all EAGLE layouts, from a (Llama-like) config dict."""
    H = _cfg_int(config, "hidden_size", where)
    heads = _cfg_int(config, "num_attention_heads", where)
    rope = config.get("rope_scaling")
    if rope and rope.get("rope_type", rope.get("type")) == "default":
        rope = None
    return dict(hidden_size=H, intermediate_size=_cfg_int(config, "intermediate_size", where), num_heads=heads,
                num_kv_heads=_cfg_int(config, "num_key_value_heads", where, heads),
                head_dim=int(config.get("head_dim") or H // heads),
                vocab_size=_cfg_int(config, "vocab_size", where),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(config.get("rope_theta", 10000.0)),
                rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, (list, dict))))
                if rope else None)


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
    entry = config.get(SPECJAX_KEY) or {}
    if entry.get("feature_layers"):
        return tuple(int(i) for i in entry["feature_layers"])
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        if len(aux) != 3 or min(aux) < 1:
            raise HeadFormatError(f"{where}: eagle_aux_hidden_state_layer_ids {aux} must name three layers >= 1")
        return tuple(int(i) - 1 for i in aux)
    return ()


# ============================================================================================ EAGLE-1/2
def _detect_eagle(config: dict, names: set) -> bool:
    return "fc.weight" in names and any(n.startswith("layers.0.") for n in names) and "d2t" not in names \
        and "speculators_config" not in config and not any(n.startswith("midlayer.") for n in names)


def load_eagle(config: dict, tensors: dict, where: str) -> tuple[HeadConfig, dict]:
    """EAGLE-1/2 tensors -> (HeadConfig, params)."""
    geo = _head_geometry(config, where)
    n = _cfg_int(config, "num_hidden_layers", where, 1)
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
        params["fc_bias"] = tensors["fc.bias"]
    for i in range(n):
        lp = _read_layer(tensors, f"layers.{i}.", where, {})
        norm = tensors.get(f"layers.{i}.input_layernorm.weight")
        if i and norm is None:
            raise HeadFormatError(f"{where}: tensor 'layers.{i}.input_layernorm.weight' is missing")
        if norm is not None:
            lp["attn_norm"] = norm
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
        t2d = np.asarray(t2d).astype(bool)
        if t2d.shape != (V,) or int(t2d.sum()) != vd or not t2d[ids].all():
            raise HeadFormatError(f"{where}: t2d [{t2d.shape}] disagrees with d2t (t2d must mark exactly the "
                                  "target ids of the draft vocabulary)")
    return ids.astype(np.int32)


def _load_eagle3_common(config: dict, layer_cfg: dict, tensors: dict, prefix: str, where: str,
                        norm_before_residual: bool) -> tuple[HeadConfig, dict]:
    geo = _head_geometry(layer_cfg, where)
    vd = _cfg_int(config, "draft_vocab_size", where, layer_cfg.get("draft_vocab_size", geo["vocab_size"]))
    th = int(config.get("target_hidden_size") or layer_cfg.get("target_hidden_size") or geo["hidden_size"])
    n = int(layer_cfg.get("num_hidden_layers", 1))
    if n != 1:
        raise HeadFormatError(f"{where}: EAGLE-3 heads have one decoder layer, config says {n}")
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
        params["fc_bias"] = tensors["fc.bias"]
    _check_embed(tensors, hcfg, where)
    _check_shapes(hcfg, params, where)
    return hcfg, params


def load_eagle3(config: dict, tensors: dict, where: str) -> tuple[HeadConfig, dict]:
    """EAGLE-3 tensors as released by its authors -> (HeadConfig, params). Feature layers not recorded in the
    file are left empty here and set to the reference default for the target by `load_head`."""
    return _load_eagle3_common(config, config, tensors, "midlayer.", where, bool(config.get("norm_before_residual")))


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
    kind = config.get("speculators_model_type") or (config.get("speculators_config") or {}).get("algorithm")
    if kind != "eagle3":
        raise HeadFormatError(f"{where}: speculators model type {kind!r} is not supported (only 'eagle3')")
    layer_cfg = config.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise HeadFormatError(f"{where}: speculators config has no transformer_layer_config")
    return _load_eagle3_common(config, layer_cfg, tensors, "layers.0.", where,
                               bool(config.get("norm_before_residual", False)))


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
