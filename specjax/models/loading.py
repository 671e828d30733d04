"""Load Llama-family weights from local paths only: a Hugging Face directory or a GGUF file.

Nothing here fetches from a hub and nothing unpickles: `.bin`/`.pt`/`.pth`/`.ckpt` checkpoints are refused with
the command that converts them. Model files are treated as untrusted: config values are checked for type and
range, safetensors and GGUF layouts are checked against the file before anything is read
(`specjax.models.safe_files`, `specjax.models.gguf_file`), and the layers, tensor shapes and tokenizer must agree
with the config. Every failure is a `ModelLoadError` whose one-line message names the file and the problem.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from specjax import compile_cache
from specjax.models.gguf_file import GGUFFile, read_gguf_split
from specjax.models import quant
from specjax.models.llama import LlamaConfig, fuse_projections, param_shapes
from specjax.models.safe_files import (INT32_MAX, cfg_bool, cfg_float, cfg_int, cfg_str, check_rope_scaling,
                                       is_pickle_name, layer_indices, map_safetensors, pickle_refusal,
                                       read_json_file)
from specjax.models.resolve import ModelFiles, ModelLoadError, resolve

DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
# The dtypes params load in; "auto" (or None) = the checkpoint's own (`checkpoint_dtype`).
DTYPES = ("float32", "bfloat16")

# Ranges accepted for config values: generous for any real Llama-family model, small enough that nothing derived
# from them overflows an int32 or asks for absurd memory before the tensors are checked against them.
MAX_HIDDEN = 1 << 20
MAX_INTERMEDIATE = 1 << 22
MAX_LAYERS = 1024
MAX_HEADS = 1 << 14
MAX_HEAD_DIM = 4096


def resolve_model(spec: str) -> ModelFiles:
    """Turn a model spec into local files: a packaged alias ('smollm2-135m', 'qwen2.5-coder-1.5b', ...), a local
    directory or .gguf path, or a Hugging Face Hub id (`specjax.models.resolve`, the one resolver)."""
    return resolve(spec)


def _llama_config(where: str, *, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
                  num_heads: int, num_kv_heads: int, head_dim: int | None, **rest) -> LlamaConfig:
    """A LlamaConfig from values already checked one by one, after the checks that relate them."""
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"{where}: {num_heads} attention heads are not a multiple of {num_kv_heads} key/value "
                             "heads")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ModelLoadError(f"{where}: hidden size {hidden_size} is not divisible by {num_heads} attention heads "
                                 "(and no head_dim is given)")
        head_dim = hidden_size // num_heads
    if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
        raise ModelLoadError(f"{where}: head dimension {head_dim} must be even and in [2, {MAX_HEAD_DIM}] for RoPE")
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       **rest)


# --------------------------------------------------------------------------------------------- HF directory
def config_from_hf(cfg: dict, where: str = "config.json") -> LlamaConfig:
    """A LlamaConfig from a Hugging Face config.json dict, every value checked (ModelLoadError naming `where`)."""
    E = ModelLoadError
    if not isinstance(cfg, dict):
        raise E(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise E(f"{where}: architectures must be a list of names, got {str(archs)[:40]!r}")
    arch = archs[0] if archs else cfg_str(cfg, "model_type", where, E, "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise E(f"{where}: unsupported architecture {arch[:60]!r}; specjax supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg_bool(cfg, "mlp_bias", where, E):
        raise E(f"{where}: mlp_bias=true is not supported")
    max_pos = cfg_int(cfg, "max_position_embeddings", where, E, 2048)
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or not all(isinstance(t, str) for t in layer_types)):
        raise E(f"{where}: layer_types must be a list of names, got {str(layer_types)[:40]!r}")
    sliding = None
    if arch == "MistralForCausalLM":
        # Mistral windows every layer; a window as long as the context changes nothing, so it is dropped.
        sw = cfg_int(cfg, "sliding_window", where, E, None)
        sliding = sw if sw is not None and sw < max_pos else None
    elif cfg_bool(cfg, "use_sliding_window", where, E) or any(t != "full_attention" for t in layer_types or ()):
        raise E(f"{where}: sliding-window attention on some layers (use_sliding_window / layer_types) is not "
                f"supported for {arch}; specjax applies a window only as Mistral does, on every layer")
    hidden = cfg_int(cfg, "hidden_size", where, E, hi=MAX_HIDDEN)
    heads = cfg_int(cfg, "num_attention_heads", where, E, hi=MAX_HEADS)
    # transformers >= 5 writes rope_theta and the scaling only inside `rope_parameters`.
    rp = cfg.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise E(f"{where}: rope_parameters must be an object")
    theta_src = cfg if cfg.get("rope_theta") is not None else rp
    rope_scaling = cfg.get("rope_scaling") or ({k: v for k, v in rp.items() if k != "rope_theta"} or None)
    return _llama_config(
        where,
        vocab_size=cfg_int(cfg, "vocab_size", where, E),
        hidden_size=hidden,
        intermediate_size=cfg_int(cfg, "intermediate_size", where, E, hi=MAX_INTERMEDIATE),
        num_layers=cfg_int(cfg, "num_hidden_layers", where, E, hi=MAX_LAYERS),
        num_heads=heads,
        num_kv_heads=cfg_int(cfg, "num_key_value_heads", where, E, heads, hi=heads),
        head_dim=cfg_int(cfg, "head_dim", where, E, None, hi=MAX_HEAD_DIM),
        rms_norm_eps=cfg_float(cfg, "rms_norm_eps", where, E, 1e-6, gt=0.0, lt=1.0),
        rope_theta=cfg_float(theta_src, "rope_theta", where, E, 10000.0, gt=1.0),
        rope_scaling=check_rope_scaling(rope_scaling, where, E),
        max_position_embeddings=max_pos,
        tie_word_embeddings=cfg_bool(cfg, "tie_word_embeddings", where, E),
        attention_bias=arch == "Qwen2ForCausalLM" or cfg_bool(cfg, "attention_bias", where, E),
        architecture=arch,
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=sliding,
    )


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json_file(index, ModelLoadError).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: not a valid safetensors index (no 'weight_map' object)")
        files = sorted(set(weight_map.values()) if all(isinstance(v, str) for v in weight_map.values()) else [None])
        for fn in files:
            # Shard names come from the file: plain names only, so an index cannot point outside the model.
            if not isinstance(fn, str) or os.path.basename(fn) != fn or fn in ("", ".", "..") \
                    or not fn.endswith(".safetensors"):
                raise ModelLoadError(f"{index}: shard {str(fn)[:80]!r} is not a .safetensors file name in the "
                                     "model directory")
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {missing[:4]}")
        return [os.path.join(path, fn) for fn in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    pickled = sorted(fn for fn in os.listdir(path) if is_pickle_name(fn))
    if pickled:
        raise ModelLoadError(pickle_refusal(os.path.join(path, pickled[0]), single))
    raise ModelLoadError(f"{path!r} has no model.safetensors or model.safetensors.index.json")


def np_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of 'float32' / 'bfloat16' (ml_dtypes' bfloat16, which jax takes without a cast)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def is_floating(a: np.ndarray) -> bool:
    """A floating NumPy array, bfloat16 included (whose dtype kind is 'V', not 'f')."""
    return a.dtype.kind == "f" or a.dtype == np_dtype("bfloat16")


# safetensors dtype -> NumPy dtype of the floating types a checkpoint's weights come in.
def read_safetensors_file_as(path: str, dtype: str = "float32") -> dict[str, np.ndarray]:
    """One safetensors file's tensors as NumPy arrays, every floating one read from the file's map and cast once
    to `dtype` (no float32 staging: a bf16 tensor loaded as bf16 is copied, never converted); integer and bool
    tensors keep their type. A malformed file -> ModelLoadError naming it."""
    target = np_dtype(dtype)
    return {name: a.astype(target) if is_floating(a) else a.astype(a.dtype.newbyteorder("="))
            for name, a in map_safetensors(path, ModelLoadError).items()}


def read_safetensors(files: list[str], dtype: str = "float32") -> dict[str, np.ndarray]:
    """All tensors of the files as NumPy arrays, floating ones cast once to `dtype` ('float32' | 'bfloat16'); a
    malformed file, or a tensor name in two shards -> ModelLoadError naming the file."""
    out: dict[str, np.ndarray] = {}
    bar = progress_bar("reading safetensors", len(files), "file") if len(files) > 1 else _NoBar()
    for fn in files:
        tensors = read_safetensors_file_as(fn, dtype)
        twice = sorted(set(tensors) & set(out))
        if twice:
            raise ModelLoadError(f"{fn}: tensor {twice[0]!r} is also in another shard; the checkpoint is inconsistent")
        out.update(tensors)
        bar.update(1)
    bar.close()
    return out


# One layer's tensor names in each file layout, by specjax parameter name. Matrices are stored [out, in] in both
# and transposed to specjax's [in, out]; norms and biases are vectors.
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
}
_BIASES = ("bq", "bk", "bv")
_QK_NORMS = ("q_norm", "k_norm")


def _layer_params(get, prefix: str, names: dict[str, str], bias: bool, fixes: dict | None = None,
                  qk_norm: bool = False) -> dict:
    """One layer's params: get(name) -> [out, in] array (or a vector), `fixes` applied to the named matrices
    before the transpose (GGUF's Q/K row order); the q/k biases when `bias`, the q/k norms when `qk_norm`."""
    fixes = fixes or {}
    lp = {}
    for key, name in names.items():
        if (key in _BIASES and not bias) or (key in _QK_NORMS and not qk_norm):
            continue
        a = fixes.get(key, lambda x: x)(get(prefix + name))
        lp[key] = a.T if key.startswith("w") else a
    return lp


def check_layer_count(names, prefix: str, num_layers: int, where: str) -> None:
    """The file's layer tensors `{prefix}{i}.*` must be exactly layers 0..num_layers-1: a config that names fewer
    layers than the file holds would silently drop some, and one that names more would index missing ones."""
    found = layer_indices(names, prefix, where, ModelLoadError)
    if found != set(range(num_layers)):
        extra = sorted(found - set(range(num_layers)))
        missing = sorted(set(range(num_layers)) - found)
        detail = f"tensors for layer {extra[0]} beyond them" if extra else f"no tensors for layer {missing[0]}"
        raise ModelLoadError(f"{where}: the config says {num_layers} layers but the file has {detail} (it holds "
                             f"{len(found)} layers); the config and the weights disagree")


def params_from_hf_tensors(tensors: dict[str, np.ndarray], config: LlamaConfig, where: str) -> dict:
    """Map HF names ([out, in] Linear weights) to the specjax params tree ([in, out])."""
    def get(name):
        if name not in tensors:
            raise ModelLoadError(f"{where}: tensor {name!r} is missing")
        a = tensors[name]
        if not is_floating(a) and a.size:
            raise ModelLoadError(f"{where}: tensor {name!r} has dtype {a.dtype}; model weights must be floating point")
        return a

    check_layer_count(tensors, "model.layers.", config.num_layers, where)
    layer = lambda i: _layer_params(get, f"model.layers.{i}.", HF_LAYER_NAMES, config.attention_bias,
                                    qk_norm=config.qk_norm)

    params = {"embed": get("model.embed_tokens.weight"), "layers": [layer(i) for i in range(config.num_layers)],
              "final_norm": get("model.norm.weight")}
    if not config.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    return params


def load_hf(path: str, dtype: str = "float32") -> tuple[LlamaConfig, dict]:
    """Config and params (NumPy, floating leaves in `dtype`) of a Hugging Face directory."""
    cfg_path = os.path.join(path, "config.json")
    config = config_from_hf(read_json_file(cfg_path, ModelLoadError), cfg_path)
    params = params_from_hf_tensors(read_safetensors(_safetensors_files(path), dtype), config, path)
    return config, params


# --------------------------------------------------------------------------------------------- GGUF
def _gguf_reader(path: str) -> GGUFFile:
    """The GGUF file at `path`, or all shards of a split model given its first (`gguf_file.read_gguf_split`)."""
    return read_gguf_split(path, error=ModelLoadError)


GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def config_from_gguf(reader: GGUFFile, path: str) -> LlamaConfig:
    """A LlamaConfig from GGUF metadata, every value checked (ModelLoadError naming `path`)."""
    E = ModelLoadError
    arch = reader.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise E(f"{path}: unsupported GGUF architecture {str(arch)[:60]!r}; specjax supports "
                f"{', '.join(GGUF_ARCHITECTURES)}")
    where = f"{path}: GGUF metadata"

    def integer(key, default=None, **kw):
        full = f"{arch}.{key}"
        if isinstance(reader.get(full), list):
            raise E(f"{path}: {full} holds per-layer values, which specjax does not support")
        return cfg_int(reader, full, where, E, *(() if default is None else (default,)), **kw)

    def number(key, default=None, **kw):
        return cfg_float(reader, f"{arch}.{key}", where, E, *(() if default is None else (default,)), **kw)

    heads = integer("attention.head_count", hi=MAX_HEADS)
    hidden = integer("embedding_length", hi=MAX_HIDDEN)
    scaling = None
    kind = reader.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise E(f"{path}: GGUF RoPE scaling type {str(kind)[:40]!r} ({arch}.rope.scaling.type) is not supported "
                "(supported: none, linear); specjax would compute wrong positions with it")
    if kind == "linear":
        scaling = (("factor", number("rope.scaling.factor", gt=0.0)), ("rope_type", "linear"))
    vocab = reader.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = reader.length("tokenizer.ggml.tokens")
        if not vocab:
            raise E(f"{path}: GGUF metadata has neither {arch}.vocab_size nor a tokenizer.ggml.tokens list")
    vocab = cfg_int({"vocab_size": vocab}, "vocab_size", where, E)
    names = reader.tensors
    # An explicit head size (Qwen3's head_dim is not hidden / heads) is the key length; llama files give the
    # rotary dimension instead.
    key_length = integer("attention.key_length", 0, lo=0, hi=MAX_HEAD_DIM)
    if key_length and key_length != integer("attention.value_length", key_length, hi=MAX_HEAD_DIM):
        raise E(f"{path}: {arch}.attention.key_length and value_length differ, which specjax does not support")
    config = _llama_config(
        where,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=integer("feed_forward_length", hi=MAX_INTERMEDIATE),
        num_layers=integer("block_count", hi=MAX_LAYERS),
        num_heads=heads,
        num_kv_heads=integer("attention.head_count_kv", heads, hi=heads),
        head_dim=key_length or integer("rope.dimension_count", 0, lo=0, hi=MAX_HEAD_DIM) or None,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", gt=0.0, lt=1.0),
        rope_theta=number("rope.freq_base", 10000.0, gt=1.0),
        rope_scaling=scaling,
        max_position_embeddings=integer("context_length", 2048, hi=INT32_MAX),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        architecture=GGUF_ARCHITECTURES[arch],
        qk_norm=arch == "qwen3",
    )
    return _with_rope_freqs(reader, config, path)


def _with_rope_freqs(reader: GGUFFile, config: LlamaConfig, path: str) -> LlamaConfig:
    """The config with the file's `rope_freqs.weight` as per-frequency factors, if it has one. llama.cpp's
    converter stores Llama-3.1/3.2's llama3 RoPE scaling this way (theta_i = pos * inv_freq_i / factor_i) instead
    of as metadata; without it, positions past the original context would rotate at the wrong frequencies."""
    t = reader.tensors.get("rope_freqs.weight")
    if t is None:
        return config
    if t.shape != (config.head_dim // 2,):
        raise ModelLoadError(f"{path}: tensor rope_freqs.weight has shape {t.shape}, expected "
                             f"({config.head_dim // 2},): one factor per rotary frequency of head_dim "
                             f"{config.head_dim}")
    factors = reader.tensor_float32(t).astype(np.float64)
    if not np.all(np.isfinite(factors)) or not np.all(factors > 0):
        raise ModelLoadError(f"{path}: rope_freqs.weight holds non-positive or non-finite factors; the file is "
                             "corrupt")
    return dataclasses.replace(config, rope_freq_factors=tuple(float(f) for f in factors))


def _gguf_shapes(config: LlamaConfig) -> dict[str, tuple]:
    """Expected shape (PyTorch order, [out, in]) of every GGUF tensor the config implies."""
    H, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
    if not config.tie_word_embeddings:
        out["output.weight"] = (V, H)
    layer = {"attn_norm.weight": (H,), "attn_q.weight": (q, H), "attn_k.weight": (kv, H), "attn_v.weight": (kv, H),
             "attn_output.weight": (H, q), "ffn_norm.weight": (H,), "ffn_gate.weight": (F, H),
             "ffn_up.weight": (F, H), "ffn_down.weight": (H, F)}
    if config.attention_bias:
        layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if config.qk_norm:
        layer.update({"attn_q_norm.weight": (config.head_dim,), "attn_k_norm.weight": (config.head_dim,)})
    for i in range(config.num_layers):
        out.update({f"blk.{i}.{k}": s for k, s in layer.items()})
    return out


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave: [out, in] with out = n_heads * head_dim -> rotate-half layout."""
    out, inp = w.shape
    hd = out // n_heads
    return w.reshape(n_heads, hd // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def load_gguf(path: str, dtype: str = "float32") -> tuple[LlamaConfig, dict, GGUFFile]:
    """Config, params (NumPy, each tensor dequantized and cast to `dtype` as it is read) and the reader of a GGUF
    file (or of a split model, given its first shard). A large file's params come from the weight cache when an
    earlier process stored them (`weight_cache`), and are stored there after a read."""
    from specjax.models import weight_cache

    target = np_dtype(dtype)
    reader = _gguf_reader(path)
    config = config_from_gguf(reader, path)
    cached = weight_cache.load(path, dtype)
    if cached is not None:
        try:
            check_shapes(cached, config, path)
            return config, cached, reader
        except ModelLoadError:  # an entry that does not fit this config: read the file again
            weight_cache.drop(path, dtype)
    tensors = reader.tensors
    check_layer_count(tensors, "blk.", config.num_layers, path)
    expected = _gguf_shapes(config)
    bar = progress_bar(f"reading {os.path.basename(path)}", len(expected), "tensor")

    def get(name):
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing from the GGUF file")
        t = tensors[name]
        # Checked before dequantizing: a shape that disagrees with the config allocates nothing.
        if t.shape != expected[name]:
            raise ModelLoadError(f"{path}: tensor {name} has shape {t.shape}, expected {expected[name]} from the "
                                 "config metadata")
        out = reader.tensor_float32(t).astype(target, copy=False)
        bar.update(1)
        return out

    # The converter interleaves Q/K rows for llama.cpp's rotary layout only for llama; qwen2/3 keep HF order.
    permute = config.architecture == "LlamaForCausalLM"
    fix_q = (lambda a: unpermute_rope_rows(a, config.num_heads)) if permute else (lambda a: a)
    fix_k = (lambda a: unpermute_rope_rows(a, config.num_kv_heads)) if permute else (lambda a: a)
    fixes = {"wq": fix_q, "wk": fix_k}
    layer = lambda i: _layer_params(get, f"blk.{i}.", GGUF_LAYER_NAMES, config.attention_bias, fixes,
                                    qk_norm=config.qk_norm)

    params = {"embed": get("token_embd.weight"), "layers": [layer(i) for i in range(config.num_layers)],
              "final_norm": get("output_norm.weight")}
    if not config.tie_word_embeddings:
        params["lm_head"] = get("output.weight").T
    bar.close()
    weight_cache.store(path, dtype, params)
    return config, params, reader


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(desc: str, total: int, unit: str):
    """A tqdm bar on stderr while a model loads, where progress is shown (`compile_time.progress_enabled`: a
    terminal, or SPECJAX_PROGRESS=1); otherwise, or without tqdm, an object that does nothing."""
    from specjax.compile_time import progress_enabled

    if not progress_enabled():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)


def load_gguf_native(path: str, lm_head: bool | None = None) -> tuple[LlamaConfig, dict, GGUFFile]:
    """A GGUF model with its quantized projection weights kept as stored, for quantization='gguf': Q8_0 / Q4_0 /
    Q4_1 as `quant.QuantWeight` (float16 scales, packed codes), Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K as
    `quant.BlockWeight` (the file's bytes), parts of one fused matrix in different types as a `quant.RowStack`.
    Returns params already in the inference layout
    (`llama.fuse_projections`: wqkv_t, wo_t, w_gu_t, w_down_t, stored [out, in]), float leaves as NumPy float32.
    Other tensor types, the embedding and the norms are dequantized as `load_gguf` does. A fused matrix whose parts
    are not all of one native type is dequantized whole (`quant.dequantize` of the native parts), so its values
    are the same either way.

    lm_head: the LM head (the tied embedding, or output.weight) also as stored, as 'lm_head_q' [V, H], which
    `llama.lm_head` reads: None does so when its type is native, True requires it, False keeps it float only.
    The float embedding stays for the token lookup and the drafters that share it."""
    reader = _gguf_reader(path)
    config = config_from_gguf(reader, path)
    tensors = reader.tensors
    check_layer_count(tensors, "blk.", config.num_layers, path)
    expected = _gguf_shapes(config)

    def get(name, native: bool = False):
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing from the GGUF file")
        t = tensors[name]
        if t.shape != expected[name]:
            raise ModelLoadError(f"{path}: tensor {name} has shape {t.shape}, expected {expected[name]} from the "
                                 "config metadata")
        if native and t.type_name in quant.GGUF_NATIVE and t.shape[1] % quant.BLOCK == 0:
            return quant.from_gguf_blocks(reader.raw_tensor(t), t.type_name, t.shape, f"{path}: {name}")
        if t.type_name in quant.GGUF_BLOCKS:
            w = quant.from_gguf_raw(reader.raw_tensor(t), t.type_name, t.shape, f"{path}: {name}")
            # Decoded by XLA when wanted as float (the embedding): the same bits as the gguf package's NumPy
            # dequantization, several times faster on a 151,936-row table.
            return w if native else np.asarray(quant.dequantize(w))
        return reader.tensor_float32(t)

    permute = config.architecture == "LlamaForCausalLM"

    def rope_rows(w, heads: int):
        if not permute:
            return w
        if quant.is_quantized(w):
            # Blocks run along the input axis, so the Q/K row interleave moves whole rows of codes and scales.
            order = unpermute_rope_rows(np.arange(w.shape[0])[:, None], heads)[:, 0]
            return quant.take_rows(w, order)
        return unpermute_rope_rows(w, heads)

    def fuse(parts):
        if all(quant.is_quantized(p) for p in parts):
            # One weight when the parts share a format, else a RowStack multiplied part by part.
            return quant.concat_rows(parts) if len(parts) > 1 else parts[0]
        dense = [np.asarray(quant.dequantize(p)) if quant.is_quantized(p) else p for p in parts]
        return np.concatenate(dense, axis=0)

    layers = []
    for i in range(config.num_layers):
        pre = f"blk.{i}."
        lp = {"attn_norm": get(pre + "attn_norm.weight"), "mlp_norm": get(pre + "ffn_norm.weight")}
        lp["wqkv_t"] = fuse([rope_rows(get(pre + "attn_q.weight", True), config.num_heads),
                             rope_rows(get(pre + "attn_k.weight", True), config.num_kv_heads),
                             get(pre + "attn_v.weight", True)])
        if config.attention_bias:
            lp["bqkv"] = np.concatenate([get(pre + "attn_q.bias"), get(pre + "attn_k.bias"), get(pre + "attn_v.bias")])
        lp["wo_t"] = fuse([get(pre + "attn_output.weight", True)])
        lp["w_gu_t"] = fuse([get(pre + "ffn_gate.weight", True), get(pre + "ffn_up.weight", True)])
        lp["w_down_t"] = fuse([get(pre + "ffn_down.weight", True)])
        layers.append(lp)
    params = {"embed": get("token_embd.weight"), "layers": layers, "final_norm": get("output_norm.weight")}
    head_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    head_type = tensors[head_name].type_name if head_name in tensors else None
    if lm_head and head_type not in quant.GGUF_KEPT:
        raise quant.QuantizationError(
            f"{path}: quantize_lm_head=True keeps the LM head ({head_name}) as stored, but it is {head_type}; "
            f"the types kept as stored are {', '.join(quant.GGUF_KEPT)}: use quantize_lm_head=None or False")
    native_head = lm_head is not False and head_type in quant.GGUF_KEPT
    if native_head:
        params["lm_head_q"] = get(head_name, True)
    if not config.tie_word_embeddings:
        params["lm_head"] = get("output.weight").T
    return config, params, reader


def cast_float_leaves(tree, dtype):
    """Every float leaf (NumPy or jax) as a jax array of `dtype`; quantized weights (`quant.QuantWeight`) as they
    are, their codes and scales moved to the device."""
    import jax
    import jax.numpy as jnp

    def cast(a):
        if quant.is_quantized(a):
            return jax.tree_util.tree_map(jnp.asarray, a)
        return jnp.asarray(a, dtype)

    return jax.tree_util.tree_map(cast, tree, is_leaf=quant.is_quantized)


def jax_tree_asarray(tree, dtype):
    """Every NumPy leaf as a jax array of `dtype` (the device copy happens here, once)."""
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), tree)


def check_shapes(params: dict, config: LlamaConfig, where: str) -> None:
    import jax

    expected = param_shapes(config)
    got = jax.tree_util.tree_map(lambda a: tuple(a.shape), params)
    flat_e = dict((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(
        expected, is_leaf=lambda s: isinstance(s, tuple))[0])
    flat_g = dict((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(
        got, is_leaf=lambda s: isinstance(s, tuple))[0])
    for name, shape in flat_e.items():
        if flat_g.get(name) != shape:
            raise ModelLoadError(f"{where}: parameter {name} has shape {flat_g.get(name)}, expected {shape} from the config")


def check_tokenizer(tokenizer, config: LlamaConfig, where: str) -> None:
    """The tokenizer must not produce ids the model has no embedding row for: every id it can emit from text,
    and every special or stop id, lies below the model's vocabulary size."""
    V = config.vocab_size
    if tokenizer.vocab_size > V:
        raise ModelLoadError(f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has "
                             f"only {V} rows; text could produce ids past {V - 1}, so tokenizer and weights disagree")
    specials = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
                "unk": tokenizer.unk_token_id}
    specials.update({f"stop[{i}]": t for i, t in enumerate(tokenizer.stop_token_ids)})
    for name, token in specials.items():
        if token is not None and not 0 <= token < V:
            raise ModelLoadError(f"{where}: the tokenizer's {name} token id {token} is outside the model's vocabulary "
                                 f"[0, {V})")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: LlamaConfig
    params: dict  # jax arrays in the requested dtype
    tokenizer: Any  # specjax.models.tokenizer.Tokenizer
    source: ModelFiles


def checkpoint_dtype(files: ModelFiles) -> str:
    """The dtype a checkpoint loads in when the user names none ('auto'): a Hugging Face directory's config.json
    `dtype` (transformers >= 5) or `torch_dtype`, where bfloat16 stays bfloat16 and float32, float16 (which specjax
    does not run; float32 holds it exactly) or no entry give float32; a GGUF file float32 (its blocks dequantize
    to float32)."""
    if files.kind != "hf":
        return "float32"
    cfg_path = os.path.join(files.path, "config.json")
    cfg = read_json_file(cfg_path, ModelLoadError)
    stored = cfg.get("dtype", cfg.get("torch_dtype")) if isinstance(cfg, dict) else None
    return "bfloat16" if stored == "bfloat16" else "float32"


def resolve_dtype(spec: str, dtype: str | None) -> str:
    """'float32' / 'bfloat16' as given; 'auto' or None -> the checkpoint's (`checkpoint_dtype`). Another value
    -> ModelLoadError listing the choices."""
    if dtype is None or dtype == "auto":
        return checkpoint_dtype(resolve_model(spec))
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use 'auto' (the checkpoint's own), 'float32' or "
                             "'bfloat16'")
    return dtype


def read_model(spec: str = DEFAULT_MODEL, with_tokenizer: bool = True, dtype: str = "float32"
               ) -> tuple[LlamaConfig, dict, Any, ModelFiles]:
    """Everything `load_model` does on the host: resolve, read and check config, params (NumPy arrays, floating
    ones in `dtype`: 'float32' | 'bfloat16', each tensor cast once as it is read) and tokenizer; no device is
    touched. Returns (config, params, tokenizer or None, files)."""
    files = resolve_model(spec)
    tokenizer = None
    if files.kind == "gguf":
        config, params, reader = load_gguf(files.path, dtype)
        if with_tokenizer:
            from specjax.models.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(reader)
    else:
        config, params = load_hf(files.path, dtype)
        if with_tokenizer:
            from specjax.models.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_hf_dir(files.path)
    check_shapes(params, config, files.path)
    if tokenizer is not None:
        check_tokenizer(tokenizer, config, files.path)
    return config, params, tokenizer, files


def load_model(spec: str = DEFAULT_MODEL, dtype: str | None = "float32", with_tokenizer: bool = True,
               quantization: str | None = None, group_size: int = quant.DEFAULT_GROUP_SIZE,
               quantize_lm_head: bool | None = None) -> LoadedModel:
    """Resolve a model spec and load config, params (as jax arrays of `dtype`) and tokenizer.

    dtype: 'float32' | 'bfloat16', or 'auto' / None for the checkpoint's own (`checkpoint_dtype`: a bf16 HF
    checkpoint loads as bf16, a GGUF file as float32); the loaded dtype is `params["embed"].dtype`.

    quantization: None keeps float weights (the canonical layout); 'int8' / 'int4' (group_size inputs per scale)
    quantize the layer projections from the float32 weights; 'gguf' keeps a GGUF file's Q8_0 / Q4_0 / Q4_1
    projections as stored (`load_gguf_native`). Quantized params come in the inference layout
    (`llama.fuse_projections`), with `quant.QuantWeight` projections; everything else is in `dtype`.

    quantize_lm_head: whether the LM head is quantized too, as 'lm_head_q' (`quant.check_lm_head`): None does so
    with 'gguf' when the file stores it in a native type, and not otherwise."""
    compile_cache.enable()  # before anything compiles: programs from earlier processes load from disk
    dtype = resolve_dtype(spec, dtype)
    quant.check_quantization(quantization)
    quant.check_lm_head(quantization, quantize_lm_head)
    if quantization == "gguf":
        files = resolve_model(spec)
        if files.kind != "gguf":
            raise ModelLoadError(f"{files.path}: quantization='gguf' keeps a GGUF file's own blocks, but this model is "
                                 "a Hugging Face directory; use quantization='int8' or 'int4', or a .gguf file")
        config, params, reader = load_gguf_native(files.path, quantize_lm_head)
        tokenizer = None
        if with_tokenizer:
            from specjax.models.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(reader)
            check_tokenizer(tokenizer, config, files.path)
        return LoadedModel(config, cast_float_leaves(params, dtype), tokenizer, files)
    # Quantization starts from float32 weights; otherwise each tensor is cast to `dtype` as it is read.
    config, params, tokenizer, files = read_model(spec, with_tokenizer, dtype if quantization is None else "float32")
    if quantization is None:
        return LoadedModel(config, jax_tree_asarray(params, dtype), tokenizer, files)
    fused = fuse_projections(jax_tree_asarray(params, "float32"))
    params = quant.quantize_params(fused, quantization, group_size=group_size, lm_head=bool(quantize_lm_head))
    return LoadedModel(config, cast_float_leaves(params, dtype), tokenizer, files)
