"""The specjax draft-model checkpoint format: a small Llama decoder sharing its target's embedding.

The draft is a Llama decoder of a few layers with the target's width. It owns no embedding and no LM head:
its input embedding is the target's `embed` [V, H] (it reads target token ids) and its output head is
`target_embed[d2t].T` [H, Vd], a reduced vocabulary of the Vd target tokens that matter most in the training
data (like EAGLE-3's draft vocabulary). A draft step then reads ~Vd*H instead of V*H head weights, and the
shipped file holds only the layers, the final norm and `d2t`.

Format (a directory):
    config.json        HF Llama config (num_hidden_layers small, tie_word_embeddings false) plus
                       "specjax_draft": {"target", "shares_target_embeddings": true, "draft_vocab_size": Vd}
    model.safetensors  model.layers.{i}.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
                       input_layernorm, post_attention_layernorm}.weight ([out, in], bf16/f16),
                       model.norm.weight, and d2t int32 [Vd] (target id of each draft-vocabulary entry,
                       ascending). No embedding or lm_head tensors.
Draft logits are over the Vd entries; the full-vocabulary distribution puts them at target ids d2t and
zero elsewhere. Inference (the drafter builder) reads drafts with `load_draft`; training
(`specjax.train.draft_model`) writes them with `save_draft`.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError
from specjax.models.llama import LlamaConfig
from specjax.models.safe_files import cfg_int, is_pickle_name, pickle_refusal, read_json_file

DRAFT_KEY = "specjax_draft"
LAYER_NAMES = {  # specjax layer param -> HF tensor suffix; matrices are stored transposed ([out, in])
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
}
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


class DraftError(SpecjaxError, ValueError):
    """A draft model cannot be saved, loaded or trained as asked; the message says how to fix it."""


def draft_config(target: LlamaConfig, num_layers: int, intermediate_size: int | None = None) -> LlamaConfig:
    """The draft architecture for `target`: same width, heads, RoPE and norm, `num_layers` layers, untied."""
    if num_layers < 1:
        raise DraftError(f"a draft needs at least one layer, got num_layers={num_layers}")
    if target.attention_bias:
        raise DraftError("drafts for targets with attention biases (Qwen2) are not supported yet")
    return dataclasses.replace(target, num_layers=num_layers,
                               intermediate_size=intermediate_size or target.intermediate_size,
                               tie_word_embeddings=False, architecture="LlamaForCausalLM")


def hf_config(config: LlamaConfig, target: str, draft_vocab_size: int) -> dict:
    """config.json contents for a draft (an HF Llama config plus the `specjax_draft` key)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.vocab_size,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
        DRAFT_KEY: {"target": target, "shares_target_embeddings": True, "draft_vocab_size": int(draft_vocab_size)},
    }
    if config.rope_scaling:
        cfg["rope_scaling"] = dict(config.rope_scaling)
    return cfg


def _check_d2t(d2t: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
    d2t = np.asarray(d2t)
    if d2t.ndim != 1 or d2t.size == 0 or d2t.dtype.kind not in "iu":
        raise DraftError(f"{where}: d2t must be a non-empty 1-D integer array, got {d2t.dtype} {d2t.shape}")
    if d2t.min() < 0 or d2t.max() >= vocab_size:
        raise DraftError(f"{where}: d2t holds ids outside the target vocabulary [0, {vocab_size})")
    if np.unique(d2t).size != d2t.size:
        raise DraftError(f"{where}: d2t lists a target id twice; each draft entry must map to a distinct token")
    return d2t.astype(np.int32)


def save_draft(path: str, config: LlamaConfig, layer_params: dict, d2t, meta: dict, dtype: str = "bfloat16") -> None:
    """Write a draft directory (config.json + model.safetensors).

    layer_params: {"layers": L x {attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down}, "final_norm" [H]}
    in the specjax layout ([in, out] matrices); "embed"/"lm_head" keys, if present, are not written (they
    come from the target at load time). d2t [Vd] target ids. meta: must hold "target" (the target's model
    spec); every entry is also stored, JSON-encoded, in the safetensors metadata. dtype: bfloat16 | float16.
    """
    from safetensors.flax import save_file

    if dtype not in ("bfloat16", "float16"):
        raise DraftError(f"draft weights are stored as bfloat16 or float16, not {dtype!r}")
    if "target" not in meta:
        raise DraftError("save_draft: meta must name the target model, e.g. {'target': 'smollm2-135m'}")
    layers = layer_params.get("layers")
    if not isinstance(layers, (list, tuple)) or len(layers) != config.num_layers or "final_norm" not in layer_params:
        raise DraftError(f"save_draft: layer_params needs 'layers' (a list of {config.num_layers} layer dicts) "
                         "and 'final_norm'")
    d2t = _check_d2t(d2t, config.vocab_size, "save_draft")
    jdtype = jnp.dtype(dtype)
    tensors = {}
    for i, lp in enumerate(layers):
        for key, suffix in LAYER_NAMES.items():
            if key not in lp:
                raise DraftError(f"save_draft: layer {i} has no {key!r}")
            w = jnp.asarray(lp[key])
            tensors[f"model.layers.{i}.{suffix}"] = (w.T if key in MATRICES else w).astype(jdtype)
    tensors["model.norm.weight"] = jnp.asarray(layer_params["final_norm"]).astype(jdtype)
    tensors["d2t"] = jnp.asarray(d2t, jnp.int32)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(config, meta["target"], d2t.size), f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(path, "model.safetensors"),
              metadata={str(k): json.dumps(v) for k, v in meta.items()})


def read_draft(path: str, vocab_size: int, hidden_size: int) -> tuple[LlamaConfig, list[dict], np.ndarray, np.ndarray]:
    """Everything `load_draft` does on the host, for a target of `vocab_size` x `hidden_size`: read and check the
    draft's config and weights. Returns (config, layers as NumPy [in, out] dicts, final_norm [H], d2t int32 [Vd]);
    no device is touched. Every rejection is a DraftError naming the file."""
    from specjax.models.loading import ModelLoadError, config_from_hf, params_from_hf_tensors, read_safetensors

    cfg_path = os.path.join(path, "config.json")
    st_path = os.path.join(path, "model.safetensors")
    if not os.path.isfile(st_path) and os.path.isdir(path):
        pickled = sorted(fn for fn in os.listdir(path) if is_pickle_name(fn))
        if pickled:
            raise DraftError(pickle_refusal(os.path.join(path, pickled[0]), st_path))
    for p in (cfg_path, st_path):
        if not os.path.isfile(p):
            raise DraftError(f"draft directory {path!r} has no {os.path.basename(p)}; "
                             "train and save one with `python -m specjax.train.draft_model`")
    raw = read_json_file(cfg_path, DraftError)
    info = raw.get(DRAFT_KEY)
    if not isinstance(info, dict) or info.get("shares_target_embeddings") is not True:
        raise DraftError(f"{cfg_path}: no '{DRAFT_KEY}' entry with shares_target_embeddings=true; this is not a "
                         "specjax draft (a standalone HF model loads with specjax.models.loading instead)")
    try:
        config = config_from_hf(raw, cfg_path)
        tensors = read_safetensors([st_path])
    except ModelLoadError as e:
        raise DraftError(str(e)) from None
    V, H = vocab_size, hidden_size
    if config.vocab_size != V or config.hidden_size != H:
        raise DraftError(f"{cfg_path}: draft expects a target with vocab {config.vocab_size} and hidden "
                         f"{config.hidden_size}, but the target embedding is [{V}, {H}]; use the draft's own target")
    stray = [n for n in tensors if n in ("model.embed_tokens.weight", "lm_head.weight")]
    if stray:
        raise DraftError(f"{st_path}: holds {stray}; a specjax draft shares the target's embedding and must not")
    if "d2t" not in tensors:
        raise DraftError(f"{st_path}: tensor 'd2t' (draft vocabulary -> target ids) is missing")
    d2t = _check_d2t(tensors.pop("d2t"), V, st_path)
    if cfg_int(info, "draft_vocab_size", cfg_path, DraftError, d2t.size) != d2t.size:
        raise DraftError(f"{cfg_path}: draft_vocab_size {info.get('draft_vocab_size')} != len(d2t) {d2t.size}")
    # The HF mapper wants the untied head and embedding it would load; give it placeholders, then drop them.
    tensors["model.embed_tokens.weight"] = np.zeros((0, H), np.float32)
    tensors["lm_head.weight"] = np.zeros((0, H), np.float32)
    try:
        hf = params_from_hf_tensors(tensors, config, path)
    except ModelLoadError as e:
        raise DraftError(str(e)) from None
    for i, lp in enumerate(hf["layers"]):
        for k, shape in _layer_shapes(config).items():
            if tuple(lp[k].shape) != shape:
                raise DraftError(f"{st_path}: layer {i} {k} has shape {tuple(lp[k].shape)}, expected {shape}")
    if tuple(hf["final_norm"].shape) != (H,):
        raise DraftError(f"{st_path}: model.norm.weight has shape {tuple(hf['final_norm'].shape)}, expected ({H},)")
    return dataclasses.replace(config, tie_word_embeddings=False), hf["layers"], hf["final_norm"], d2t


def load_draft(path: str, target_params: dict, dtype=None) -> tuple[LlamaConfig, dict, jax.Array]:
    """Read a draft directory and attach the target's embedding.

    target_params: the target's params (its "embed" [V, H] is shared). dtype: of the returned draft layers
    (default: the target embedding's dtype).
    Returns (config, params, d2t): config.tie_word_embeddings is False and vocab_size is the target's V;
    params = {"embed": target embed [V, H], "layers": [...], "final_norm": [H], "lm_head": embed[d2t].T
    [H, Vd]}, so `forward` gives logits over the Vd draft entries; d2t int32 [Vd].
    """
    if "embed" not in target_params:
        raise DraftError("load_draft: target_params has no 'embed'; pass the target's full params")
    embed = target_params["embed"]
    V, H = embed.shape
    config, layers, final_norm, d2t = read_draft(path, V, H)
    dt = dtype or embed.dtype
    d2t_j = jnp.asarray(d2t, jnp.int32)
    params = {"embed": embed, "layers": [{k: jnp.asarray(v, dt) for k, v in lp.items()} for lp in layers],
              "final_norm": jnp.asarray(final_norm, dt), "lm_head": jnp.take(embed, d2t_j, axis=0).T}
    return config, params, d2t_j


def _layer_shapes(c: LlamaConfig) -> dict:
    H, F, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"attn_norm": (H,), "wq": (H, q), "wk": (H, kv), "wv": (H, kv), "wo": (q, H), "mlp_norm": (H,),
            "w_gate": (H, F), "w_up": (H, F), "w_down": (F, H)}
