"""Medusa heads on disk: the FasterDecoding layout, the vLLM layout, and specjax's own (vLLM names, no LM head).

FasterDecoding (`FasterDecoding/Medusa`, what most published Medusa heads use), a directory with
    medusa_lm_head.safetensors   `{h}.{l}.linear.weight` [H, H] ([out, in]), `{h}.{l}.linear.bias` [H] for the
                                 residual blocks l < L, then `{h}.{L}.weight` [vocab, H] (the head's LM head)
    config.json                  {"medusa_num_heads", "medusa_num_layers", "base_model_name_or_path", ...}
vLLM (`model_type: medusa`), a directory with
    model.safetensors            `blocks.{h}.layers.{l}.weight` [H, H] (+ `.bias` when medusa_fc_bias),
                                 `lm_heads.{h}.weight` [Vd, H] (only `lm_heads.0` when original_lm_head),
                                 optional `token_map` [Vd] (target ids of a truncated vocabulary)
    config.json                  {"num_heads", "num_hidden_layers", "hidden_size", "vocab_size",
                                  "truncated_vocab_size", "medusa_fc_bias", "original_lm_head", ...}
specjax: the vLLM layout plus a "specjax_medusa" entry in config.json ({"lm_head": "target" | "shared" |
    "per_head", "target", "tree_choices", ...}); with lm_head "target" the file holds no LM head at all (the heads
    use the target's), which keeps shipped heads small. `save_medusa(..., layout="vllm", target_params=...)`
    writes the target's rows as `lm_heads.0` + original_lm_head so vLLM can load the same heads.

Only safetensors are read: `.pt` / `.bin` / `.pth` / `.ckpt` files need pickle and are refused, unopened, with a
conversion command. Files are untrusted: config values are checked for type and range, the safetensors layout is
checked before anything is read (`specjax.models.safe_files`), shapes are compared before any array is stacked, and
every rejection is a MedusaFormatError naming the file.
"""
from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
import numpy as np

from specjax.heads.medusa import MedusaConfig, MedusaError, check_params, check_token_map, target_lm_rows
from specjax.models.safe_files import (INT32_MAX, cfg_bool, cfg_int, cfg_str, is_pickle_name, pickle_refusal,
                                       read_json_file, read_safetensors_file)

SPECJAX_KEY = "specjax_medusa"
MAX_HEADS = 256
MAX_LAYERS = 64
MAX_TREE_NODES = 4096
FD_WEIGHTS = "medusa_lm_head.safetensors"
VLLM_WEIGHTS = "model.safetensors"
LAYOUTS = ("specjax", "vllm", "fasterdecoding")


class MedusaFormatError(MedusaError):
    """A Medusa checkpoint cannot be read or written as asked; the message says why and how to fix it."""


# ------------------------------------------------------------------------------------------------ reading


def _read_json(path: str) -> dict:
    return read_json_file(path, MedusaFormatError)


def _read_tensors(path: str) -> dict:
    """Every tensor of a safetensors file as a NumPy array in its stored dtype (bf16 via ml_dtypes)."""
    return read_safetensors_file(path, MedusaFormatError, float32=False)


def _refuse_pickle(path: str) -> None:
    """Raise the conversion hint when a directory (or file) only has pickled weights; the pickle is never opened."""
    names = [path] if os.path.isfile(path) else [os.path.join(path, n) for n in sorted(os.listdir(path))]
    pickled = [n for n in names if is_pickle_name(n)]
    if pickled:
        src = pickled[0]
        raise MedusaFormatError(pickle_refusal(src, os.path.splitext(src)[0] + ".safetensors"))


def detect_layout(path: str) -> str:
    """'fasterdecoding', 'vllm' or 'specjax' for a Medusa directory; MedusaFormatError otherwise."""
    if not os.path.exists(path):
        raise MedusaFormatError(f"Medusa heads path {path!r} does not exist")
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            raise MedusaFormatError(f"{path}: pass the directory that holds it and its config.json")
        _refuse_pickle(path)
        raise MedusaFormatError(f"{path}: not a Medusa directory (config.json + safetensors weights)")
    cfg_path = os.path.join(path, "config.json")
    if os.path.isfile(os.path.join(path, FD_WEIGHTS)):
        return "fasterdecoding"
    if os.path.isfile(os.path.join(path, VLLM_WEIGHTS)) and os.path.isfile(cfg_path):
        return "specjax" if SPECJAX_KEY in _read_json(cfg_path) else "vllm"
    _refuse_pickle(path)
    raise MedusaFormatError(f"{path}: no {FD_WEIGHTS} (FasterDecoding) or config.json + {VLLM_WEIGHTS} "
                            "(vLLM / specjax) found; is this a Medusa checkpoint?")


def load_medusa(path: str, hidden_size: int | None = None, vocab_size: int | None = None,
                dtype=None) -> tuple[MedusaConfig, dict, dict]:
    """Read Medusa heads in any supported layout.

    hidden_size / vocab_size: the target's, checked against the heads (MedusaFormatError on mismatch).
    dtype: of the returned weights (default: as stored). Returns (config, params, meta) with params (jax arrays)
    in the layout of `specjax.heads.medusa` and meta = {"layout", "base_model", "tree_choices" (or None), ...}.
    """
    config, params, meta = read_medusa(path, hidden_size, vocab_size)
    out = {k: (v if k == "token_map" else _cast(v, dtype)) for k, v in params.items()}
    if "token_map" in params:
        out["token_map"] = check_token_map(params["token_map"], config)
    return config, out, meta


def read_medusa(path: str, hidden_size: int | None = None,
                vocab_size: int | None = None) -> tuple[MedusaConfig, dict, dict]:
    """Everything `load_medusa` does on the host: detect the layout, read and check config and weights.
    Returns (config, params as NumPy arrays in their stored dtype, meta); no device is touched."""
    layout = detect_layout(path)
    if layout == "fasterdecoding":
        config, params, meta = _load_fd(path)
    else:
        config, params, meta = _load_vllm(path, layout)
    where = os.path.join(path, FD_WEIGHTS if layout == "fasterdecoding" else VLLM_WEIGHTS)
    if hidden_size is not None and config.hidden_size != hidden_size:
        raise MedusaFormatError(f"{where}: heads have hidden size {config.hidden_size}, the target {hidden_size}; "
                                f"these heads were trained for another model ({meta.get('base_model')})")
    if vocab_size is not None and config.vocab_size != vocab_size:
        raise MedusaFormatError(f"{where}: heads predict a vocabulary of {config.vocab_size}, the target has "
                                f"{vocab_size}; these heads were trained for another model ({meta.get('base_model')})")
    try:
        check_params(config, params)
    except MedusaError as e:
        raise MedusaFormatError(f"{where}: {e}") from None
    meta["layout"] = layout
    return config, params, meta


def _cast(tree, dtype):
    """Every leaf as a jax array (of `dtype`, or as stored when None)."""
    import jax

    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), tree)


def _load_fd(path: str):
    cfg_path = os.path.join(path, "config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    where = os.path.join(path, FD_WEIGHTS)
    t = _read_tensors(where)
    heads = sorted({int(m.group(1)) for k in t if (m := re.fullmatch(r"(\d{1,6})\.\d{1,6}\.(?:linear\.)?\w+", k))})
    if not heads or heads != list(range(len(heads))):
        raise MedusaFormatError(f"{where}: no tensors named '{{head}}.{{layer}}.linear.weight'; not a Medusa head file")
    K = cfg_int(cfg, "medusa_num_heads", cfg_path, MedusaFormatError, len(heads), hi=MAX_HEADS)
    if K != len(heads):
        raise MedusaFormatError(f"{cfg_path}: medusa_num_heads={K} but the weights hold {len(heads)} heads")
    L = cfg_int(cfg, "medusa_num_layers", cfg_path, MedusaFormatError,
                sum(1 for k in t if re.fullmatch(r"0\.\d{1,6}\.linear\.weight", k)), lo=0, hi=MAX_LAYERS)
    blocks, lm = [], []
    for h in range(K):
        layers = []
        for l in range(L):
            w = _get(t, f"{h}.{l}.linear.weight", where)
            b = _get(t, f"{h}.{l}.linear.bias", where)
            layers.append({"w": w.T, "b": b})
        blocks.append(layers)
        lm.append(_get(t, f"{h}.{L}.weight", where))
    known = {f"{h}.{l}.linear.{s}" for h in range(K) for l in range(L) for s in ("weight", "bias")}
    known |= {f"{h}.{L}.weight" for h in range(K)}
    _no_extra(t, known, where)
    if lm[0].ndim != 2 or 0 in lm[0].shape:
        raise MedusaFormatError(f"{where}: LM head '0.{L}.weight' has shape {tuple(lm[0].shape)}, expected [vocab, "
                                "hidden]")
    V, H = lm[0].shape
    if any(x.shape != (V, H) for x in lm):
        raise MedusaFormatError(f"{where}: the heads' LM heads differ in shape {[tuple(x.shape) for x in lm][:4]}")
    _check_blocks(blocks, H, where)
    config = MedusaConfig(num_heads=K, hidden_size=H, vocab_size=V, num_layers=L, bias=True, lm_head="per_head")
    meta = {"base_model": _base_model(cfg, cfg_path), "tree_choices": None}
    return config, {"blocks": blocks, "lm_head": np.stack(lm)}, meta


def _get(t: dict, name: str, where: str):
    """t[name], which must exist and be floating point."""
    if name not in t:
        raise MedusaFormatError(f"{where}: tensor {name!r} is missing")
    a = t[name]
    if np.dtype(a.dtype).kind not in "fV" and np.dtype(a.dtype).name != "bfloat16":
        raise MedusaFormatError(f"{where}: tensor {name!r} has dtype {a.dtype}; weights must be floating point")
    return a


def _check_blocks(blocks: list, H: int, where: str) -> None:
    """Every residual block [H, H] (and bias [H]) before anything is built from them."""
    for h, layers in enumerate(blocks):
        for l, blk in enumerate(layers):
            if tuple(blk["w"].shape) != (H, H) or ("b" in blk and tuple(blk["b"].shape) != (H,)):
                raise MedusaFormatError(f"{where}: head {h} block {l} has weight {tuple(blk['w'].shape)}"
                                        f"{' and bias ' + str(tuple(blk['b'].shape)) if 'b' in blk else ''}, expected "
                                        f"({H}, {H}) and ({H},)")


def _base_model(cfg: dict, where: str):
    return cfg_str(cfg, "base_model_name_or_path", where, MedusaFormatError)


def _tree_choices(value, where: str):
    """A tree given in a config: a list of at most MAX_TREE_NODES paths, each a short list of small ints."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_TREE_NODES or not all(
            isinstance(p, list) and len(p) <= 64 and all(isinstance(i, int) and not isinstance(i, bool)
                                                         and 0 <= i < 4096 for i in p) for p in value):
        raise MedusaFormatError(f"{where}: tree_choices must be a list of at most {MAX_TREE_NODES} paths (lists of "
                                "small non-negative integers)")
    return value


def _no_extra(t: dict, known: set, where: str) -> None:
    extra = sorted(set(t) - known)
    if extra:
        raise MedusaFormatError(f"{where}: unexpected tensors {extra[:4]}{' ...' if len(extra) > 4 else ''}; "
                                "the config and the weights disagree on the number of heads or layers")


def _load_vllm(path: str, layout: str):
    cfg_path = os.path.join(path, "config.json")
    cfg = _read_json(cfg_path)
    where = os.path.join(path, VLLM_WEIGHTS)
    # vLLM strips an optional "medusa_heads." prefix when loading; accept it too.
    t = {k[len("medusa_heads."):] if k.startswith("medusa_heads.") else k: v for k, v in _read_tensors(where).items()}
    for key in ("num_heads", "num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in cfg:
            raise MedusaFormatError(f"{cfg_path}: key {key!r} is missing (a vLLM Medusa config needs num_heads, "
                                    "num_hidden_layers, hidden_size, vocab_size)")
    E = MedusaFormatError
    K = cfg_int(cfg, "num_heads", cfg_path, E, hi=MAX_HEADS)
    L = cfg_int(cfg, "num_hidden_layers", cfg_path, E, lo=0, hi=MAX_LAYERS)
    H = cfg_int(cfg, "hidden_size", cfg_path, E, hi=1 << 20)
    V = cfg_int(cfg, "vocab_size", cfg_path, E)
    bias = cfg_bool(cfg, "medusa_fc_bias", cfg_path, E)
    info = cfg.get(SPECJAX_KEY, {}) if layout == "specjax" else {}
    if not isinstance(info, dict):
        raise MedusaFormatError(f"{cfg_path}: {SPECJAX_KEY} must be an object")
    if layout == "specjax":
        lm_head = cfg_str(info, "lm_head", cfg_path, E, "target")
    else:
        lm_head = "shared" if cfg_bool(cfg, "original_lm_head", cfg_path, E) else "per_head"
    token_map = t.get("token_map")
    Vt = cfg_int(cfg, "truncated_vocab_size", cfg_path, E, None, hi=INT32_MAX)
    if token_map is not None:
        if token_map.dtype.kind not in "iu" or token_map.ndim != 1:
            raise MedusaFormatError(f"{where}: token_map must be an integer vector, got {token_map.dtype} "
                                    f"{tuple(token_map.shape)}")
        token_map = np.asarray(token_map).astype(np.int64)
        if Vt is not None and int(Vt) != token_map.shape[0]:
            raise MedusaFormatError(f"{cfg_path}: truncated_vocab_size={Vt} but token_map has {token_map.shape[0]} "
                                    "entries")
    elif Vt is not None and int(Vt) != V:
        raise MedusaFormatError(f"{cfg_path}: truncated_vocab_size={Vt} < vocab_size={V} needs a 'token_map' tensor "
                                f"in {VLLM_WEIGHTS}")
    try:
        config = MedusaConfig(num_heads=K, hidden_size=H, vocab_size=V, num_layers=L, bias=bias, lm_head=lm_head,
                              draft_vocab_size=None if token_map is None else int(token_map.shape[0]))
    except MedusaError as e:
        raise MedusaFormatError(f"{cfg_path}: {e}") from None
    blocks, known = [], {"token_map"}
    for h in range(K):
        layers = []
        for l in range(L):
            name = f"blocks.{h}.layers.{l}"
            blk = {"w": _get(t, name + ".weight", where).T}
            known.add(name + ".weight")
            if bias:
                blk["b"] = _get(t, name + ".bias", where)
                known.add(name + ".bias")
            layers.append(blk)
        blocks.append(layers)
    _check_blocks(blocks, H, where)
    params = {"blocks": blocks}
    if lm_head == "shared":
        params["lm_head"] = _get(t, "lm_heads.0.weight", where)
        if params["lm_head"].ndim != 2 or params["lm_head"].shape[1] != H:
            raise MedusaFormatError(f"{where}: the shared LM head lm_heads.0.weight must be [vocab, hidden={H}], got "
                                    f"{tuple(params['lm_head'].shape)}")
        known.add("lm_heads.0.weight")
    elif lm_head == "per_head":
        lms = [_get(t, f"lm_heads.{h}.weight", where) for h in range(K)]
        if any(x.ndim != 2 or x.shape != lms[0].shape for x in lms):
            raise MedusaFormatError(f"{where}: the per-head LM heads must all be [vocab, hidden], got "
                                    f"{[tuple(x.shape) for x in lms][:4]}")
        params["lm_head"] = np.stack(lms)
        known |= {f"lm_heads.{h}.weight" for h in range(K)}
    if token_map is not None:
        params["token_map"] = _token_map(token_map, config, where)
        if "lm_head" in params and params["lm_head"].shape[-2] == V and config.out_vocab < V:
            # vLLM also accepts full-vocabulary LM heads with a token_map and keeps the mapped rows.
            params["lm_head"] = np.take(params["lm_head"], params["token_map"], axis=-2)
    _no_extra(t, known, where)
    meta = {"base_model": cfg_str(info, "target", cfg_path, E) or _base_model(cfg, cfg_path),
            "tree_choices": _tree_choices(info.get("tree_choices"), cfg_path),
            **{k: v for k, v in info.items() if k != "tree_choices"}}
    return config, params, meta


def _token_map(tm: np.ndarray, config: MedusaConfig, where: str) -> np.ndarray:
    """token_map checked on the host as `check_token_map` checks it (which `load_medusa` applies again when it
    makes the device copy): int32 [Vd], strictly ascending ids in [0, vocab_size)."""
    if tm.ndim != 1 or tm.shape[0] != config.out_vocab:
        raise MedusaFormatError(f"{where}: token_map must be [draft_vocab_size={config.out_vocab}], got shape "
                                f"{tm.shape}")
    if tm.size and (tm.min() < 0 or tm.max() >= config.vocab_size or np.any(np.diff(tm) <= 0)):
        raise MedusaFormatError(f"{where}: token_map must hold distinct ascending target ids in "
                                f"[0, {config.vocab_size})")
    return tm.astype(np.int32)


# ------------------------------------------------------------------------------------------------ writing


def save_medusa(path: str, config: MedusaConfig, params: dict, *, layout: str = "specjax",
                target_params: dict | None = None, base_model: str | None = None, dtype="bfloat16",
                info: dict | None = None) -> list[str]:
    """Write heads to directory `path` in `layout` (one of LAYOUTS). Returns the files written.

    target_params: needed to write heads that use the target's LM head (lm_head="target") in the vllm or
    fasterdecoding layouts, which must store an LM head. FasterDecoding has no truncated vocabulary: heads with a
    token_map cannot be written there (use layout="vllm"). base_model: the target's name, recorded in the config.
    info: extra JSON-able entries for the specjax config entry (tree_choices, training figures).
    dtype: of the stored floating-point weights (bfloat16, float16 or float32).
    """
    from safetensors.numpy import save_file

    if layout not in LAYOUTS:
        raise MedusaFormatError(f"layout {layout!r} must be one of {LAYOUTS}")
    check_params(config, params)
    np_dtype = _np_dtype(dtype)
    cast = lambda a: np.ascontiguousarray(np.asarray(jnp.asarray(a, jnp.float32)).astype(np_dtype))
    K, L, H, V = config.num_heads, config.num_layers, config.hidden_size, config.vocab_size
    lm = params.get("lm_head")
    if lm is None and layout != "specjax":
        if target_params is None:
            raise MedusaFormatError(f"these heads use the target's LM head; the {layout} layout stores one, so pass "
                                    "target_params")
        lm = target_lm_rows(target_params, params.get("token_map"))
        if lm.shape[-1] != H:
            raise MedusaFormatError(f"target hidden size {lm.shape[-1]} != heads' hidden size {H}")
    os.makedirs(path, exist_ok=True)
    if layout == "fasterdecoding":
        if "token_map" in params:
            raise MedusaFormatError("the FasterDecoding layout has no truncated vocabulary (token_map); save with "
                                    "layout='vllm', which keeps it")
        if not config.bias:
            raise MedusaFormatError("FasterDecoding heads always have block biases; these have none, use layout='vllm'")
        t = {}
        for h in range(K):
            for l, blk in enumerate(params["blocks"][h]):
                t[f"{h}.{l}.linear.weight"] = cast(jnp.asarray(blk["w"]).T)
                t[f"{h}.{l}.linear.bias"] = cast(blk["b"])
            t[f"{h}.{L}.weight"] = cast(lm if lm.ndim == 2 else lm[h])
        cfg = {"medusa_num_heads": K, "medusa_num_layers": L, "base_model_name_or_path": base_model,
               "hidden_size": H, "vocab_size": V}
        files = [FD_WEIGHTS, "config.json"]
        save_file(t, os.path.join(path, FD_WEIGHTS))
    else:
        t = {}
        for h in range(K):
            for l, blk in enumerate(params["blocks"][h]):
                t[f"blocks.{h}.layers.{l}.weight"] = cast(jnp.asarray(blk["w"]).T)
                if config.bias:
                    t[f"blocks.{h}.layers.{l}.bias"] = cast(blk["b"])
        shared = lm is not None and lm.ndim == 2
        if lm is not None:
            for h in range(1 if shared else K):
                t[f"lm_heads.{h}.weight"] = cast(lm if shared else lm[h])
        if "token_map" in params:
            t["token_map"] = np.asarray(params["token_map"], np.int64)
        cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H, "vocab_size": V,
               "num_heads": K, "num_hidden_layers": L, "truncated_vocab_size": config.out_vocab,
               "medusa_fc_bias": config.bias, "original_lm_head": shared, "base_model_name_or_path": base_model}
        if layout == "specjax":
            cfg[SPECJAX_KEY] = {"lm_head": config.lm_head, "target": base_model, **(info or {})}
        files = [VLLM_WEIGHTS, "config.json"]
        save_file(t, os.path.join(path, VLLM_WEIGHTS))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    return [os.path.join(path, n) for n in files]


def _np_dtype(dtype):
    import ml_dtypes

    name = jnp.dtype(dtype).name
    table = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
    if name not in table:
        raise MedusaFormatError(f"weights are stored as bfloat16, float16 or float32, not {name}")
    return table[name]
