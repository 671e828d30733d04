"""Distil a small draft model from its target, and save/load it in the specjax draft format.

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
zero elsewhere.

Training (`python -m specjax.train.draft_model --data FILE --out DIR --steps N`): layers initialised from chosen
target layers, trained with AdamW (warmup + cosine) on the response tokens of self-distillation data
(`specjax.train.data`) against the target's top-k distribution restricted to the draft vocabulary, plus an
optional cross-entropy on the target's greedy token. Orbax checkpoints every N steps; rerunning the same
command resumes from the last one.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kv_cache import init_cache
from specjax.models.llama import LlamaConfig, forward
from specjax.train.common import checkpoint_manager as _checkpoint_manager, make_optimizer, pyplot_or_none, read_metrics as _read_metrics
from specjax.errors import SpecjaxError

DRAFT_KEY = "specjax_draft"
_LAYER_NAMES = {  # specjax layer param -> HF tensor suffix; matrices are stored transposed ([out, in])
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
}
_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


class DraftError(SpecjaxError, ValueError):
    """A draft model cannot be saved, loaded or trained as asked; the message says how to fix it."""


# ============================================================================================ format
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
        for key, suffix in _LAYER_NAMES.items():
            if key not in lp:
                raise DraftError(f"save_draft: layer {i} has no {key!r}")
            w = jnp.asarray(lp[key])
            tensors[f"model.layers.{i}.{suffix}"] = (w.T if key in _MATRICES else w).astype(jdtype)
    tensors["model.norm.weight"] = jnp.asarray(layer_params["final_norm"]).astype(jdtype)
    tensors["d2t"] = jnp.asarray(d2t, jnp.int32)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(config, meta["target"], d2t.size), f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(path, "model.safetensors"),
              metadata={str(k): json.dumps(v) for k, v in meta.items()})


def load_draft(path: str, target_params: dict, dtype=None) -> tuple[LlamaConfig, dict, jax.Array]:
    """Read a draft directory and attach the target's embedding.

    target_params: the target's params (its "embed" [V, H] is shared). dtype: of the returned draft layers
    (default: the target embedding's dtype).
    Returns (config, params, d2t): config.tie_word_embeddings is False and vocab_size is the target's V;
    params = {"embed": target embed [V, H], "layers": [...], "final_norm": [H], "lm_head": embed[d2t].T
    [H, Vd]}, so `forward` gives logits over the Vd draft entries; d2t int32 [Vd].
    """
    from specjax.models.loading import ModelLoadError, config_from_hf, params_from_hf_tensors, read_safetensors

    cfg_path = os.path.join(path, "config.json")
    st_path = os.path.join(path, "model.safetensors")
    for p in (cfg_path, st_path):
        if not os.path.isfile(p):
            raise DraftError(f"draft directory {path!r} has no {os.path.basename(p)}; "
                             "train and save one with `python -m specjax.train.draft_model`")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise DraftError(f"{cfg_path}: invalid JSON ({e})") from None
    info = raw.get(DRAFT_KEY)
    if not isinstance(info, dict) or not info.get("shares_target_embeddings"):
        raise DraftError(f"{cfg_path}: no '{DRAFT_KEY}' entry with shares_target_embeddings=true; this is not a "
                         "specjax draft (a standalone HF model loads with specjax.models.loading instead)")
    try:
        config = config_from_hf(raw, cfg_path)
        tensors = read_safetensors([st_path])
    except ModelLoadError as e:
        raise DraftError(str(e)) from None
    if "embed" not in target_params:
        raise DraftError("load_draft: target_params has no 'embed'; pass the target's full params")
    embed = target_params["embed"]
    V, H = embed.shape
    if config.vocab_size != V or config.hidden_size != H:
        raise DraftError(f"{cfg_path}: draft expects a target with vocab {config.vocab_size} and hidden "
                         f"{config.hidden_size}, but the target embedding is [{V}, {H}]; use the draft's own target")
    stray = [n for n in tensors if n in ("model.embed_tokens.weight", "lm_head.weight")]
    if stray:
        raise DraftError(f"{st_path}: holds {stray}; a specjax draft shares the target's embedding and must not")
    if "d2t" not in tensors:
        raise DraftError(f"{st_path}: tensor 'd2t' (draft vocabulary -> target ids) is missing")
    d2t = _check_d2t(tensors.pop("d2t"), V, st_path)
    if int(info.get("draft_vocab_size", d2t.size)) != d2t.size:
        raise DraftError(f"{cfg_path}: draft_vocab_size {info.get('draft_vocab_size')} != len(d2t) {d2t.size}")
    # The HF mapper wants the untied head and embedding it would load; give it placeholders, then replace them.
    tensors["model.embed_tokens.weight"] = np.zeros((0, H), np.float32)
    tensors["lm_head.weight"] = np.zeros((0, H), np.float32)
    try:
        hf = params_from_hf_tensors(tensors, config, path)
    except ModelLoadError as e:
        raise DraftError(str(e)) from None
    dt = dtype or embed.dtype
    layers = [{k: jnp.asarray(v, dt) for k, v in lp.items()} for lp in hf["layers"]]
    for i, lp in enumerate(layers):
        for k, shape in _layer_shapes(config).items():
            if tuple(lp[k].shape) != shape:
                raise DraftError(f"{st_path}: layer {i} {k} has shape {tuple(lp[k].shape)}, expected {shape}")
    d2t_j = jnp.asarray(d2t, jnp.int32)
    params = {"embed": embed, "layers": layers, "final_norm": jnp.asarray(hf["final_norm"], dt),
              "lm_head": jnp.take(embed, d2t_j, axis=0).T}
    return dataclasses.replace(config, tie_word_embeddings=False), params, d2t_j


def _layer_shapes(c: LlamaConfig) -> dict:
    H, F, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"attn_norm": (H,), "wq": (H, q), "wk": (H, kv), "wv": (H, kv), "wo": (q, H), "mlp_norm": (H,),
            "w_gate": (H, F), "w_up": (H, F), "w_down": (F, H)}


# ============================================================================================ vocabulary
def select_draft_vocab(arrays: dict, size: int, vocab_size: int, always=(0, 1, 2), rows=None) -> np.ndarray:
    """The `size` target ids the draft predicts, ascending.

    Ranked by how often each token is the target's output in the data: the emitted response tokens plus the
    probability mass of the target's top-k at every response step (rows: which sequences to count; default
    all). `always` (special and stop tokens) is kept whatever its count. When the data names fewer than
    `size` tokens, the rest are the lowest unused ids: byte-level BPE numbers merges in training order, so
    low ids are the generic, frequent pieces.
    """
    if not len(always) <= size <= vocab_size:
        raise DraftError(f"draft vocabulary size {size} must lie in [{len(always)}, {vocab_size}]")
    rows = np.arange(arrays["tokens"].shape[0]) if rows is None else np.asarray(rows)
    score = np.zeros(vocab_size, np.float64)
    R = arrays["topk_ids"].shape[1]
    for n in rows:
        p, k = int(arrays["prompt_len"][n]), int(arrays["length"][n] - arrays["prompt_len"][n])
        np.add.at(score, arrays["tokens"][n, p:p + k], 1.0)
        steps = np.arange(R) < k
        np.add.at(score, arrays["topk_ids"][n][steps].ravel(),
                  np.exp(arrays["topk_logp"][n][steps].astype(np.float64)).ravel())
    score[list(always)] = np.inf
    # Stable ranking: score descending, then id ascending (so unseen tokens come in id order).
    order = np.lexsort((np.arange(vocab_size), -score))
    return np.sort(order[:size]).astype(np.int32)


# ============================================================================================ training data
def build_targets(arrays: dict, d2t: np.ndarray, vocab_size: int, rows=None) -> dict[str, np.ndarray]:
    """Per-response-step training targets for the sequences `rows` (default all).

    Only response steps get a loss, so targets are laid out per step i (R = max response length), and
    `pos` says which input position predicts it (prompt_len - 1 + i): the head runs on those positions only.
    Returns tokens [N, L] int32, length [N] int32, pos [N, R] int32, mask [N, R] bool (step exists);
    soft_idx [N, R, K] int32 (draft index of each target top-k entry, 0 where absent), soft_p [N, R, K]
    float32 (its probability, renormalised over the entries inside the draft vocabulary, 0 elsewhere);
    greedy_idx [N, R] int32 (draft index of the target's greedy token, -1 outside the draft vocabulary
    or the response); greedy_id [N, R] int32 (that token's target id).
    """
    rows = np.arange(arrays["tokens"].shape[0]) if rows is None else np.asarray(rows)
    t2d = np.full(vocab_size, -1, np.int32)
    t2d[d2t] = np.arange(d2t.size, dtype=np.int32)
    plen = arrays["prompt_len"][rows].astype(np.int32)
    n_resp = (arrays["length"][rows] - plen).astype(np.int32)
    ids = arrays["topk_ids"][rows]  # [N, R, K]
    R = ids.shape[1]
    mask = np.arange(R)[None, :] < n_resp[:, None]
    d = t2d[ids]
    prob = np.exp(arrays["topk_logp"][rows].astype(np.float32)) * (d >= 0) * mask[..., None]
    prob /= np.maximum(prob.sum(-1, keepdims=True), 1e-30)
    greedy_id = np.where(mask, ids[..., 0], 0).astype(np.int32)
    return {
        "tokens": arrays["tokens"][rows].astype(np.int32),
        "length": arrays["length"][rows].astype(np.int32),
        "pos": np.where(mask, plen[:, None] - 1 + np.arange(R)[None, :], 0).astype(np.int32),
        "mask": mask, "soft_idx": np.maximum(d, 0).astype(np.int32), "soft_p": prob.astype(np.float32),
        "greedy_idx": np.where(mask, t2d[greedy_id], -1).astype(np.int32), "greedy_id": greedy_id,
    }


def make_batches(length: np.ndarray, batch: int, bucket: int, seed: int, epoch: int) -> list[tuple[np.ndarray, int]]:
    """One epoch of batches as (row indices [batch], padded length), a pure function of (seed, epoch).

    Rows are grouped by length rounded up to `bucket` so short sequences are not padded to the longest one
    (few distinct shapes, so few compiles); a bucket's last batch is filled up by wrapping around it.
    """
    rng = np.random.default_rng([seed, epoch])
    padded = -(-length // bucket) * bucket
    out = []
    for size in np.unique(padded):
        members = rng.permutation(np.flatnonzero(padded == size))
        for s in range(0, members.size, batch):
            idx = members[np.arange(s, s + batch) % members.size]
            out.append((idx, int(size)))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def device_batch(targets: dict, idx: np.ndarray, size: int) -> dict:
    """Rows `idx` of the targets with tokens cropped to `size`, as jax arrays (host-only fields dropped)."""
    b = {k: v[idx] for k, v in targets.items() if k not in ("greedy_id", "length")}
    b["tokens"] = b["tokens"][:, :size]
    return {k: jnp.asarray(v) for k, v in b.items()}


# ============================================================================================ model and loss
def init_from_target(target_params: dict, layers: tuple[int, ...]) -> dict:
    """Trainable draft params {"layers", "final_norm"} copied from the given target layers and final norm."""
    n = len(target_params["layers"])
    bad = [i for i in layers if not -n <= i < n]
    if bad or not layers:
        raise DraftError(f"--init-layers {list(layers)}: give one or more target layer indices in [-{n}, {n})")
    copy = lambda a: jnp.array(a, jnp.float32)
    return {"layers": [jax.tree_util.tree_map(copy, dict(target_params["layers"][i])) for i in layers],
            "final_norm": copy(target_params["final_norm"])}


def draft_logits(train: dict, frozen: dict, config: LlamaConfig, tokens: jax.Array, pos: jax.Array) -> jax.Array:
    """Teacher-forced draft logits [B, R, Vd] at input positions pos [B, R] of tokens [B, T].

    frozen = {"embed" [V, H], "head" [H, Vd]}. The layers run causally over all T tokens; the head only at
    `pos` (the response), which is where the loss is.
    """
    B, T = tokens.shape
    params = {"embed": frozen["embed"], "layers": train["layers"], "final_norm": train["final_norm"]}
    cache = init_cache(config.num_layers, B, T, config.num_kv_heads, config.head_dim, frozen["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden = forward(params, config, tokens, positions, cache, compute_logits=False).hidden
    hidden = jnp.take_along_axis(hidden, jnp.clip(pos, 0, T - 1)[..., None], axis=1)
    return jnp.matmul(hidden, frozen["head"], preferred_element_type=jnp.float32)


def position_losses(train: dict, frozen: dict, config: LlamaConfig, batch: dict, hard_weight: float):
    """Per-step loss [B, R] (soft cross-entropy to the target's top-k + hard_weight * CE on its greedy
    token; zero outside the mask) and match [B, R] (draft argmax == target greedy token, inside the mask)."""
    logits = draft_logits(train, frozen, config, batch["tokens"], batch["pos"])
    logq = jax.nn.log_softmax(logits, axis=-1)
    soft = -jnp.sum(batch["soft_p"] * jnp.take_along_axis(logq, batch["soft_idx"], axis=-1), axis=-1)
    g = batch["greedy_idx"]
    hard = -jnp.take_along_axis(logq, jnp.maximum(g, 0)[..., None], axis=-1)[..., 0] * (g >= 0)
    m = batch["mask"]
    return jnp.where(m, soft + hard_weight * hard, 0.0), (jnp.argmax(logits, axis=-1) == g) & m


def loss_and_metrics(train: dict, frozen: dict, config: LlamaConfig, batch: dict, hard_weight: float):
    """Masked mean loss. Returns (loss, {"loss", "agree"}): agree = fraction of masked positions where the
    draft's argmax is the target's greedy token."""
    loss, match = position_losses(train, frozen, config, batch, hard_weight)
    count = jnp.maximum(jnp.sum(batch["mask"]), 1).astype(jnp.float32)
    loss = jnp.sum(loss) / count
    return loss, {"loss": loss, "agree": jnp.sum(match) / count}


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "hard_weight"), donate_argnums=(0, 1))
def train_step(train: dict, opt_state, frozen: dict, batch: dict, *, config: LlamaConfig, optimizer,
               hard_weight: float):
    """One AdamW step; train params and optimizer state are donated (updated in place)."""
    import optax

    grads, metrics = jax.grad(loss_and_metrics, has_aux=True)(train, frozen, config, batch, hard_weight)
    updates, opt_state = optimizer.update(grads, opt_state, train)
    return optax.apply_updates(train, updates), opt_state, metrics


eval_step = jax.jit(position_losses, static_argnames=("config", "hard_weight"))


def chain_acceptance(match: np.ndarray, mask: np.ndarray, depth: int = 8) -> dict:
    """Greedy chain speculation statistics from teacher-forced matches on greedy target text.

    match/mask [N, L] bool. Drafting k tokens from position t, draft j (0-based) is accepted iff drafts
    0..j all equal the target's greedy tokens; on greedy target text the draft's context is exactly the
    accepted prefix, so teacher forcing gives the real chain outcome. Returns alpha[j] = P(draft j accepted |
    drafts before it accepted; None when no start reaches it) and tau[k] = expected tokens per verify step
    with k drafts (accepted + 1), each over the start positions whose k-th draft lies inside the response.
    """
    N, L = match.shape
    alpha, tau = [], {}
    run = np.ones((N, L), bool)  # run[t]: drafts 0..j-1 from start t all matched
    survive = []  # survive[j][t]: drafts 0..j matched
    for j in range(depth):
        ok = np.zeros((N, L), bool)
        ok[:, :L - j] = match[:, j:] & mask[:, j:]
        valid = np.zeros((N, L), bool)
        valid[:, :L - j] = mask[:, j:] & mask[:, :L - j]
        now = run & ok
        den = np.sum(run & valid)
        alpha.append(float(np.sum(now & valid) / den) if den else None)  # None: no such start (JSON-safe)
        survive.append(now)
        run = now
    for k in range(1, depth + 1):
        valid = np.zeros((N, L), bool)
        valid[:, :L - k + 1] = mask[:, k - 1:] & mask[:, :L - k + 1]
        tau[k] = float(1 + sum(np.sum(survive[j] & valid) for j in range(k)) / max(np.sum(valid), 1))
    return {"alpha": alpha, "tau": tau}


def evaluate(train: dict, frozen: dict, config: LlamaConfig, targets: dict, batch: int, hard_weight: float,
             depth: int = 8) -> dict:
    """Held-out loss, top-1 agreement with the target's greedy token, and greedy chain acceptance."""
    N = targets["tokens"].shape[0]
    losses, matches = [], []
    for s in range(0, N, batch):
        idx = np.arange(s, s + batch) % N  # wrap to keep one shape; the repeated rows are dropped below
        loss, match = eval_step(train, frozen, config, device_batch(targets, idx, targets["tokens"].shape[1]),
                                hard_weight)
        keep = min(batch, N - s)
        losses.append(np.asarray(loss)[:keep])
        matches.append(np.asarray(match)[:keep])
    count = float(np.sum(targets["mask"]))
    match = np.concatenate(matches)
    in_vocab = float(np.sum((targets["greedy_idx"] >= 0) & targets["mask"]) / max(count, 1))
    return {"loss": float(np.sum(np.concatenate(losses)) / max(count, 1)),
            "agree": float(np.sum(match) / max(count, 1)), "positions": int(count),
            "greedy_in_draft_vocab": in_vocab, **chain_acceptance(match, targets["mask"], depth)}


# ============================================================================================ loop
_RUN_KEYS = ("data", "init_layers", "draft_vocab", "batch", "bucket", "steps", "lr", "warmup", "weight_decay", "hard_weight",
             "seed", "target")


def train(args) -> dict:
    """The training run described by the parsed arguments (see `main`). Returns the final summary."""
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from specjax.models.loading import load_model
    from specjax.train.data import load_dataset

    os.makedirs(args.out, exist_ok=True)
    run = {k: getattr(args, k) for k in _RUN_KEYS}
    run["init_layers"] = list(run["init_layers"])
    run["data"] = os.path.abspath(run["data"])
    run_path = os.path.join(args.out, "run.json")
    if os.path.exists(run_path):
        with open(run_path) as f:
            old = json.load(f)
        diff = {k: (old.get(k), run[k]) for k in _RUN_KEYS if old.get(k) != run[k]}
        if diff:
            raise DraftError(f"{args.out} holds a run with other settings {diff} (old, new); resume with the same "
                             "arguments or pick a new --out")
    with open(run_path, "w") as f:
        json.dump(run, f, indent=2)

    arrays, meta = load_dataset(args.data)
    target = load_model(args.target, "float32", with_tokenizer=False)
    tcfg, tparams = target.config, target.params
    V = tcfg.vocab_size
    train_rows = np.flatnonzero(~arrays["heldout"])
    eval_rows = np.flatnonzero(arrays["heldout"])
    if train_rows.size == 0:
        raise DraftError(f"{args.data}: no training sequences (every row is held out)")
    d2t_path = os.path.join(args.out, "d2t.npy")
    if os.path.exists(d2t_path):
        d2t = np.load(d2t_path, allow_pickle=False)
    else:
        always = sorted({0, 1, 2, *meta.get("stop_token_ids", [])})
        d2t = select_draft_vocab(arrays, args.draft_vocab, V, always=always, rows=train_rows)
        np.save(d2t_path, d2t)
    config = draft_config(tcfg, len(args.init_layers))
    frozen = {"embed": tparams["embed"], "head": jnp.take(tparams["embed"], jnp.asarray(d2t), axis=0).T}
    train_t = build_targets(arrays, d2t, V, train_rows)
    eval_t = build_targets(arrays, d2t, V, eval_rows) if eval_rows.size else None

    optimizer, schedule = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    params = init_from_target(tparams, tuple(args.init_layers))
    opt_state = optimizer.init(params)
    del tparams, target
    mngr = _checkpoint_manager(args.out, args.checkpoint_every)
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": opt_state})
        restored = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
        params, opt_state = restored["params"], restored["opt"]
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    history = _read_metrics(metrics_path, start)

    def log(rec):
        history.append(rec)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    if start == 0 and eval_t is not None and not any(r.get("kind") == "eval" for r in history):
        ev = evaluate(params, frozen, config, eval_t, args.eval_batch, args.hard_weight)
        log({"kind": "eval", "step": 0, **ev})
    N = train_t["tokens"].shape[0]
    per_epoch = len(make_batches(train_t["length"], args.batch, args.bucket, args.seed, 0))
    bar = tqdm(total=args.steps, initial=start, desc="train", unit="step", disable=not args.progress)
    recent: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        # Batch order is a pure function of (seed, step), so a resumed run sees the same batches.
        epoch, k = divmod(step, per_epoch)
        idx, size = make_batches(train_t["length"], args.batch, args.bucket, args.seed, epoch)[k]
        batch = device_batch(train_t, idx, size)
        params, opt_state, m = train_step(params, opt_state, frozen, batch, config=config, optimizer=optimizer,
                                          hard_weight=args.hard_weight)
        loss, agree = float(m["loss"]), float(m["agree"])
        if not math.isfinite(loss):
            raise DraftError(f"loss became {loss} at step {step + 1}; lower --lr (now {args.lr})")
        done = step + 1
        log({"kind": "train", "step": done, "loss": loss, "agree": agree, "lr": float(schedule(step)),
             "seconds": round(time.perf_counter() - t0, 2)})
        bar.update(1)
        recent.append((loss, agree))
        del recent[:-20]  # the bar shows the mean of the last 20 steps
        bar.set_postfix(loss=f"{np.mean([r[0] for r in recent]):.3f}", agree=f"{np.mean([r[1] for r in recent]):.3f}")
        if eval_t is not None and (done % args.eval_every == 0 or done == args.steps):
            ev = evaluate(params, frozen, config, eval_t, args.eval_batch, args.hard_weight)
            log({"kind": "eval", "step": done, **ev})
            bar.write(f"step {done}: held-out loss {ev['loss']:.3f} agree {ev['agree']:.3f} "
                      f"alpha {[a if a is None else round(a, 3) for a in ev['alpha'][:5]]}")
        mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt": opt_state}),
                  force=done == args.steps)
    bar.close()
    mngr.wait_until_finished()

    final_eval = next((r for r in reversed(history) if r.get("kind") == "eval"), None)
    train_recs = [r for r in history if r.get("kind") == "train"]
    summary = {
        "steps": args.steps, "train_sequences": int(N), "heldout_sequences": int(eval_rows.size),
        "train_positions": int(train_t["mask"].sum()), "draft_vocab": int(d2t.size),
        "final_train_loss": float(np.mean([r["loss"] for r in train_recs[-50:]])) if train_recs else None,
        "final_train_agree": float(np.mean([r["agree"] for r in train_recs[-50:]])) if train_recs else None,
        "train_seconds_this_run": round(time.perf_counter() - t0, 1), "heldout": final_eval,
        "data_meta": meta,
    }
    export = args.export or os.path.join(args.out, "draft")
    save_draft(export, config, params, d2t,
               {"target": args.target, "steps": args.steps, "init_layers": list(args.init_layers),
                "heldout_top1_agreement": final_eval["agree"] if final_eval else None})
    plot_curve(history, os.path.join(export, "training_curve.png"))
    if eval_t is not None:
        # What ships is bf16: measure the exported weights themselves, as the drafter will load them.
        _, shipped, _ = load_draft(export, {"embed": frozen["embed"]})
        summary["heldout_exported"] = evaluate({"layers": shipped["layers"], "final_norm": shipped["final_norm"]},
                                               frozen, config, eval_t, args.eval_batch, args.hard_weight)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def plot_curve(history: list[dict], path: str) -> None:
    """Training loss and top-1 agreement (smoothed) with the held-out evaluations, to a PNG."""
    plt = pyplot_or_none(path)
    if plt is None:
        return

    tr = [r for r in history if r.get("kind") == "train"]
    ev = [r for r in history if r.get("kind") == "eval"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    if tr:
        steps = np.asarray([r["step"] for r in tr])
        w = max(1, len(tr) // 50)
        smooth = lambda x: np.convolve(x, np.ones(w) / w, mode="valid")
        a1.plot(steps[w - 1:], smooth(np.asarray([r["loss"] for r in tr])), label="train (smoothed)")
        a2.plot(steps[w - 1:], smooth(np.asarray([r["agree"] for r in tr])), label="train (smoothed)")
    if ev:
        a1.plot([r["step"] for r in ev], [r["loss"] for r in ev], "o-", label="held-out")
        a2.plot([r["step"] for r in ev], [r["agree"] for r in ev], "o-", label="held-out")
    a1.set(xlabel="step", ylabel="distillation loss (log scale)", title="loss", yscale="log")
    a2.set(xlabel="step", ylabel="top-1 agreement with target", title="top-1 agreement")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _layers_arg(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--init-layers wants comma-separated integers like 0,29, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (also read by `specjax train-head` to check YAML keys)."""
    ap = argparse.ArgumentParser(prog="python -m specjax.train.draft_model",
                                 description="Distil a small draft model from the target; rerun to resume.")
    ap.add_argument("--data", required=True, help=".npz from `python -m specjax.train.data`")
    ap.add_argument("--out", required=True, help="run directory (checkpoints, metrics, d2t, exported draft)")
    ap.add_argument("--export", default=None, help="where to write the draft directory (default OUT/draft)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=64, help="sequence lengths are padded to a multiple of this")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--hard-weight", type=float, default=0.0, help="weight of the CE on the target's greedy token")
    ap.add_argument("--init-layers", type=_layers_arg, default=(0, -1),
                    help="target layers copied into the draft (their count is the draft depth)")
    ap.add_argument("--draft-vocab", type=int, default=12288)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if min(args.steps, args.batch, args.bucket, args.checkpoint_every, args.eval_every) < 1:
        ap.error("--steps, --batch, --bucket, --checkpoint-every and --eval-every must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    summary = train(parse_args(argv))
    print(json.dumps({k: v for k, v in summary.items() if k != "data_meta"}, indent=1))
    return summary


if __name__ == "__main__":
    main()
