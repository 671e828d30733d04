"""Target features for the heads: the target's hidden states at every position of the distillation data.

EAGLE heads read the final hidden state (EAGLE-1/2) or three layer outputs (EAGLE-3), Medusa heads the final
hidden state at the response positions. All of them come from ONE prefill-style causal forward per batch of
sequences (`specjax.models.llama.forward` with `hidden_layers`, no logits). The feature cache file (float16
{"final" [N, L, H], "layers" [N, L, 3H]} plus a key naming what it was made from) is shared by the trainers and
written directly by `specjax.train.data --features-out`, which records the same features while generating.
"""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine import feature_layers
from specjax.engine import target_features as concat_features
from specjax.kv_cache import init_cache
from specjax.models.llama import LlamaConfig, forward
from specjax.sampling import top_k as two_stage_top_k
from specjax.train.common import TrainError, progress_bar


class FeatureError(TrainError):
    """Target features cannot be computed or cached as asked; the message says how to fix it."""


@functools.partial(jax.jit, static_argnames=("config", "layers", "dtype"))
def target_features(params: dict, config: LlamaConfig, tokens: jax.Array, layers: tuple = (), dtype=jnp.float32):
    """tokens [B, T] -> (final hidden state after the last norm [B, T, H], outputs of `layers` concatenated
    [B, T, len(layers) * H]; None without layers), in `dtype`, from one causal forward (`teacher_forced`)."""
    feats, _ = _teacher_forced(params, config, tokens, ("final",) + tuple(layers), dtype=dtype)
    H = config.hidden_size
    return feats[..., :H], (feats[..., H:] if layers else None)


def _teacher_forced(params: dict, config: LlamaConfig, tokens: jax.Array, features: tuple = (),
                    logit_positions: jax.Array | None = None, top_k: int = 0, dtype=jnp.float32):
    """One causal forward over finished sequences tokens [B, T] (prompt then response, zero-padded): what the
    distillation corpora keep of the target besides its tokens.

    features: the target features to return at every position, concatenated in this order (entries "final" or
    layer indices, as a drafter asks for them: `engine.target_features`), [B, T, F] in `dtype`; () -> None.
    logit_positions [B, R] int32 with top_k > 0: the top_k log-probabilities of the target's own distribution
    (temperature 1, log-softmax over the full vocabulary) at those positions, best first, as (log-probs [B, R, K]
    float32, ids [B, R, K] int32); None -> None. Returns (features, top-k)."""
    B, T = tokens.shape
    cache = init_cache(config.num_layers, B, T, config.num_kv_heads, config.head_dim, params["embed"].dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    scored = logit_positions is not None and top_k > 0
    out = forward(params, config, tokens, pos, cache, hidden_layers=feature_layers(features),
                  logit_positions=logit_positions if scored else None, compute_logits=scored)
    feats = concat_features(out, features).astype(dtype) if features else None
    top = None
    if scored:
        top = two_stage_top_k(jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1), top_k)
    return feats, top


# `teacher_forced`: the jitted entry point (jax.jit keeps the docstring); `target_features` traces the body inline.
teacher_forced = jax.jit(_teacher_forced, static_argnames=("config", "features", "top_k", "dtype"))


def final_hidden(params: dict, config: LlamaConfig, tokens: jax.Array) -> jax.Array:
    """The target's final hidden state (after the last norm) at every position: tokens [B, T] -> [B, T, H]."""
    return target_features(params, config, tokens)[0]


def response_rows(final: np.ndarray, arrays: dict) -> np.ndarray:
    """Per-position features [N, L, H] -> the response rows [N, R, H]: row (n, i) is position prompt_len[n] - 1 + i,
    the one predicting response token i; zero past each response."""
    plen, length = arrays["prompt_len"], arrays["length"]
    N, R = arrays["topk_ids"].shape[:2]
    rows = np.zeros((N, R, final.shape[-1]), final.dtype)
    for n in range(N):
        k = int(length[n] - plen[n])
        rows[n, :k] = final[n, plen[n] - 1:plen[n] - 1 + k]
    return rows

def compute_features(params: dict, config: LlamaConfig, tokens: np.ndarray, length: np.ndarray, layers: tuple,
                     batch: int = 8, bucket: int = 64, progress: bool = True) -> dict[str, np.ndarray]:
    """Target features of every sequence: {"final" [N, L, H], "layers" [N, L, 3H]} float16 (zero past length).

    Sequences are grouped by length rounded up to `bucket`, so each group is one compiled shape."""
    N, L = tokens.shape
    H = config.hidden_size
    final = np.zeros((N, L, H), np.float16)
    lay = np.zeros((N, L, len(layers) * H), np.float16)
    padded = np.minimum(-(-length // bucket) * bucket, L)
    groups = [(size, np.flatnonzero(padded == size)) for size in np.unique(padded)]
    todo = [(size, rows[s:s + batch]) for size, rows in groups for s in range(0, rows.size, batch)]
    for size, rows in progress_bar(todo, progress, desc="features", unit="batch"):
        idx = np.resize(rows, batch)  # fixed batch shape; repeated rows are dropped below
        f, h = jax.device_get(target_features(params, config, jnp.asarray(tokens[idx, :size]), layers, jnp.float16))
        if not (np.isfinite(f).all() and np.isfinite(h).all()):
            raise FeatureError("target features overflow float16; this target's activations are too large for "
                               "the feature cache")
        final[rows, :size] = f[:rows.size]
        lay[rows, :size] = h[:rows.size]
    for n in range(N):  # positions past the end hold padding features: zero them for a clean cache
        final[n, length[n]:] = 0
        lay[n, length[n]:] = 0
    return {"final": final, "layers": lay}


def load_or_compute_features(path: str, data_path: str, target_spec: str, params: dict, config: LlamaConfig,
                             arrays: dict, layers: tuple, progress: bool, max_len: int = 0) -> dict[str, np.ndarray]:
    """The feature cache at `path` if it was made from the same data, target, layers and truncation; else
    compute and save it."""
    key = feature_cache_key(data_path, target_spec, layers, max_len)
    if os.path.isfile(path):
        with np.load(path, allow_pickle=False) as f:
            if str(f["key"]) == key:
                return {"final": f["final"], "layers": f["layers"]}
    feats = compute_features(params, config, arrays["tokens"], arrays["length"], layers, progress=progress)
    save_feature_cache(path, key, feats)
    return feats


def feature_cache_key(data_path: str, target_spec: str, layers: tuple, max_len: int = 0) -> str:
    """What a feature cache was made from: the data file (path and size), the target, the layers, the cut."""
    return json.dumps({"data": os.path.abspath(data_path), "data_bytes": os.path.getsize(data_path),
                       "target": target_spec, "layers": list(layers), "max_len": max_len}, sort_keys=True)


def save_feature_cache(path: str, key: str, feats: dict[str, np.ndarray]) -> None:
    """Write {"final" [N, L, H], "layers" [N, L, 3H]} float16 under `key` (atomically: a crash leaves no half file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, key=np.asarray(key), final=feats["final"], layers=feats["layers"])
    os.replace(tmp, path)
