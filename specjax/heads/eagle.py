"""EAGLE draft heads as pure functions over param pytrees: EAGLE-1/2 ("eagle") and EAGLE-3 ("eagle3").

Both heads run at the granularity of *pairs*: the pair at position t is (embedding of token t+1 ; feature at
position t), and the head's output at that position stands for the feature at position t+1, from which the
distribution of token t+2 is read. The feature is the target's own at committed positions and the head's
prediction inside a draft (so the head can run ahead of the target).

EAGLE-1/2: x = fc([embed(token) ; feature]) (fc 2H -> H, optional bias), then `num_layers` Llama decoder layers
(the first without an input norm, as in the reference implementation). The output is the predicted final
feature (after the target's last norm), so the token distribution is the target's LM head applied to it
directly, with no further norm. Embedding and LM head are the target's.

EAGLE-3: the feature is the concatenation of three target layers' residual outputs (low, mid, high), fused by
fc (3H -> H) at committed positions; inside a draft the head's own previous output (H) is fed back instead,
without fc. One decoder layer whose attention reads [input_norm(embed) ; hidden_norm(fused)] (2H); its
pre-norm output is the next step's feature. Token distribution: norm -> lm_head over a reduced draft vocabulary
of Vd tokens, draft index i standing for target id draft_ids[i].

Params (specjax layout, matrices [in, out]):
    eagle  {"fc" [2H, H], ("fc_bias" [H]), "layers": L x {("attn_norm" [H]), wq [H, Hq*D], wk/wv [H, Hkv*D],
            wo [Hq*D, H], mlp_norm [H], w_gate/w_up [H, F], w_down [F, H]}}
    eagle3 {"fc" [3Ht, H], ("fc_bias" [H]), "layers": 1 x {input_norm [H], hidden_norm [H], wq [2H, Hq*D],
            wk/wv [2H, Hkv*D], wo, mlp_norm, w_gate, w_up, w_down}, "norm" [H], "lm_head" [H, Vd],
            "draft_ids" int32 [Vd]}
Optional keys are decided by the pytree's structure (static under jit), not by flags.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.kv_cache import KVCache, init_cache, write_kv
from specjax.models.llama import (LlamaConfig, apply_rope, einsum_f32, lm_head, reference_attention, rms_norm,
                                  rope_inv_freq)
from specjax.errors import SpecjaxError

KINDS = ("eagle", "eagle3")


class HeadConfigError(SpecjaxError, ValueError):
    """A head configuration is inconsistent (unknown kind, wrong layer count, bad feature layers)."""


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Static architecture of an EAGLE head (hashable: a static jit argument, like LlamaConfig)."""

    kind: str  # "eagle" (EAGLE-1/2) | "eagle3"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    draft_vocab_size: int = 0  # eagle3: Vd; eagle: 0 (the target's LM head)
    target_hidden_size: int = 0  # eagle3: width of each fused target feature (0 = hidden_size)
    feature_layers: tuple = ()  # eagle3: target layers (residual OUTPUT of layer i) fused as low/mid/high
    norm_before_residual: bool = False  # eagle3 speculators variant: the residual is the normed hidden

    def __post_init__(self):
        if self.kind not in KINDS:
            raise HeadConfigError(f"unknown head kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "eagle3":
            if self.num_layers != 1:
                raise HeadConfigError(f"an EAGLE-3 head has exactly one decoder layer, got {self.num_layers}")
            # () = not known yet (a file that does not record them): `load_head` binds the target's default.
            if len(self.feature_layers) not in (0, 3):
                raise HeadConfigError(f"an EAGLE-3 head fuses three target layers, got {self.feature_layers}")
            if self.draft_vocab_size < 1:
                raise HeadConfigError("an EAGLE-3 head needs draft_vocab_size >= 1")
        elif self.num_layers < 1:
            raise HeadConfigError(f"an EAGLE head needs at least one decoder layer, got {self.num_layers}")
        if self.num_heads % self.num_kv_heads:
            raise HeadConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                                  f"({self.num_kv_heads})")

    @property
    def features(self) -> tuple:
        """The target features the engine must hand this head (see engine.target_features)."""
        if self.kind == "eagle":
            return ("final",)
        if not self.feature_layers:
            raise HeadConfigError("this EAGLE-3 head's feature layers are not set; load it with "
                                  "specjax.heads.eagle_io.load_head, which binds them to the target")
        return tuple(self.feature_layers)

    @property
    def feature_size(self) -> int:
        """Width F of the target features: H (eagle) or 3 * target_hidden_size (eagle3)."""
        if self.kind == "eagle":
            return self.hidden_size
        return 3 * (self.target_hidden_size or self.hidden_size)

    @property
    def out_vocab(self) -> int:
        """Width of the head's logits: the target vocabulary (eagle) or the draft vocabulary (eagle3)."""
        return self.vocab_size if self.kind == "eagle" else self.draft_vocab_size

    def llama(self) -> LlamaConfig:
        """A LlamaConfig with this head's attention geometry (for RoPE and KV cache helpers)."""
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling)


def default_eagle3_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The reference EAGLE-3 choice (inputs of layers 2, L//2 and L-3) as specjax layer OUTPUT indices."""
    L = num_target_layers
    return (1, L // 2 - 1, L - 4)


def head_config(target: LlamaConfig, kind: str, *, num_layers: int = 1, draft_vocab_size: int = 0,
                feature_layers: tuple | None = None) -> HeadConfig:
    """The head architecture matching `target` (same width, heads, RoPE and norm epsilon)."""
    if kind == "eagle3":
        feature_layers = tuple(feature_layers or default_eagle3_layers(target.num_layers))
        bad = [i for i in feature_layers if not 0 <= i < target.num_layers]
        if bad:
            raise HeadConfigError(f"feature layers {bad} are outside the target's {target.num_layers} layers")
    else:
        feature_layers = ()
    return HeadConfig(kind=kind, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                      num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                      vocab_size=target.vocab_size, num_layers=num_layers, rms_norm_eps=target.rms_norm_eps,
                      rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
                      draft_vocab_size=draft_vocab_size if kind == "eagle3" else 0,
                      target_hidden_size=target.hidden_size if kind == "eagle3" else 0,
                      feature_layers=feature_layers)


def param_shapes(cfg: HeadConfig, fc_bias: bool = False) -> dict:
    """Expected shape of every head parameter (same tree structure as the params; `draft_ids` included)."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn_in = H if cfg.kind == "eagle" else 2 * H
    layer = {"wq": (attn_in, q), "wk": (attn_in, kv), "wv": (attn_in, kv), "wo": (q, H), "mlp_norm": (H,),
             "w_gate": (H, F), "w_up": (H, F), "w_down": (F, H)}
    if cfg.kind == "eagle":
        layers = [dict(layer) for _ in range(cfg.num_layers)]
        for lp in layers[1:]:
            lp["attn_norm"] = (H,)
        shapes = {"fc": (2 * H, H), "layers": layers}
    else:
        layer.update(input_norm=(H,), hidden_norm=(H,))
        shapes = {"fc": (cfg.feature_size, H), "layers": [layer], "norm": (H,),
                  "lm_head": (H, cfg.draft_vocab_size), "draft_ids": (cfg.draft_vocab_size,)}
    if fc_bias:
        shapes["fc_bias"] = (H,)
    return shapes


# ============================================================================================ initialisation
def init_from_target(cfg: HeadConfig, target_params: dict, layer: int = -1, draft_ids=None,
                     dtype=jnp.float32) -> dict:
    """Head params that start as a well-behaved pass-through: the decoder layer is a copy of target layer
    `layer` whose two residual branches end in zero (wo and w_down start at 0, so the layer starts as the identity
    but its attention and MLP already compute useful features to grow from), fc passes the (high) feature
    through, and the EAGLE-3 norm/LM head start as the target's final norm and its LM head rows for `draft_ids`
    [Vd] (required for eagle3). A plain copy of a late target layer is a poor start: it expects its own input
    norm and residual scale, and its outputs explode when the head is unrolled on them."""
    H = cfg.hidden_size
    src = target_params["layers"][layer]
    cp = lambda a: jnp.array(a, dtype)  # a copy: trainers donate head params, which must not alias the target's
    base = {k: cp(src[k]) for k in ("wq", "wk", "wv", "mlp_norm", "w_gate", "w_up")}
    base["wo"] = jnp.zeros(src["wo"].shape, dtype)
    base["w_down"] = jnp.zeros(src["w_down"].shape, dtype)
    eye = jnp.eye(H, dtype=dtype)
    if cfg.kind == "eagle":
        layers = []
        for i in range(cfg.num_layers):
            lp = {k: jnp.array(v) for k, v in base.items()}
            if i:
                lp["attn_norm"] = cp(src["attn_norm"])
            layers.append(lp)
        # fc([embed ; feature]) starts as the feature itself: the layer then refines the target's own feature.
        return {"fc": jnp.concatenate([jnp.zeros((H, H), dtype), eye]), "layers": layers}
    if draft_ids is None:
        raise HeadConfigError("init_from_target: an EAGLE-3 head needs draft_ids (its draft vocabulary)")
    draft_ids = jnp.asarray(draft_ids, jnp.int32)
    lp = dict(base)
    # The attention reads [embed ; hidden]: both halves start as the target's projection, scaled so that the
    # sum of two unit-variance halves keeps the target layer's scale.
    for k in ("wq", "wk", "wv"):
        lp[k] = jnp.concatenate([base[k], base[k]]) / math.sqrt(2.0)
    lp["input_norm"] = cp(src["attn_norm"])
    lp["hidden_norm"] = cp(src["attn_norm"])
    Ht = cfg.target_hidden_size or H
    fc = jnp.zeros((3 * Ht, H), dtype).at[2 * Ht:].set(jnp.eye(Ht, H, dtype=dtype))
    head = target_params["lm_head"][:, draft_ids] if "lm_head" in target_params else \
        jnp.take(target_params["embed"], draft_ids, axis=0).T
    return {"fc": fc, "layers": [lp], "norm": cp(target_params["final_norm"]), "lm_head": jnp.asarray(head, dtype),
            "draft_ids": draft_ids}


# ============================================================================================ layer pieces
def _split_inputs(params: dict, cfg: HeadConfig, embed: jax.Array, tokens: jax.Array, feats: jax.Array,
                  from_target: bool):
    """(x [B, T, H] residual stream entering layer 0, token embeddings [B, T, H] or None).

    eagle: x = fc([embed ; feature]) whatever the feature's origin. eagle3: x = fc(target features) at
    committed positions (from_target), else the head's own previous output passed through unchanged.
    """
    emb = jnp.take(embed, tokens, axis=0).astype(feats.dtype)
    if cfg.kind == "eagle":
        x = jnp.concatenate([emb, feats], axis=-1) @ params["fc"].astype(feats.dtype)
        if "fc_bias" in params:
            x = x + params["fc_bias"].astype(x.dtype)
        return x, None
    if from_target:
        x = feats @ params["fc"].astype(feats.dtype)
        if "fc_bias" in params:
            x = x + params["fc_bias"].astype(x.dtype)
    else:
        x = feats
    return x, emb


def _attn_input(lp: dict, cfg: HeadConfig, x: jax.Array, emb):
    """(attention input [B, T, H or 2H], residual [B, T, H]) of one layer."""
    eps = cfg.rms_norm_eps
    if cfg.kind == "eagle":
        return (rms_norm(x, lp["attn_norm"], eps) if "attn_norm" in lp else x), x
    h = rms_norm(x, lp["hidden_norm"], eps)
    residual = h if cfg.norm_before_residual else x
    return jnp.concatenate([rms_norm(emb, lp["input_norm"], eps), h], axis=-1), residual


def _qkv(lp: dict, cfg: HeadConfig, attn_in: jax.Array, positions: jax.Array, inv_freq: jax.Array):
    """q [B, T, Hq, D], k/v [B, T, Hkv, D] with RoPE at `positions` [B, T]."""
    B, T, _ = attn_in.shape
    q = apply_rope((attn_in @ lp["wq"]).reshape(B, T, cfg.num_heads, cfg.head_dim), positions, inv_freq)
    k = apply_rope((attn_in @ lp["wk"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
    v = (attn_in @ lp["wv"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    return q, k, v


def _finish_layer(lp: dict, cfg: HeadConfig, residual: jax.Array, attn: jax.Array) -> jax.Array:
    """Output projection, residual add and the MLP block. attn [B, T, Hq*D] -> [B, T, H]."""
    x = residual + attn @ lp["wo"]
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    return x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]


# ============================================================================================ forward
def init_head_cache(cfg: HeadConfig, batch: int, capacity: int, dtype) -> KVCache:
    return init_cache(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, dtype)


def head_hidden(params: dict, cfg: HeadConfig, embed: jax.Array, tokens: jax.Array, feats: jax.Array,
                positions: jax.Array, mask: jax.Array, cache: KVCache | None = None, write_at=None,
                from_target: bool = True):
    """Run the head on T new pairs.

    tokens [B, T] int32 (token t+1 of each pair), feats [B, T, F] (target features when from_target, else the
    head's own previous outputs [B, T, H]), positions [B, T] int32 (the feature's position).
    With a cache: the new K/V are written at slots [write_at[b], write_at[b] + T) and mask [B, T, S] says which
    cache slots each new pair sees. Without: attention over the T new pairs only, mask [B, T, T].
    Returns (hidden [B, T, H] = predicted next features, updated cache or None).
    """
    B, T = tokens.shape
    inv_freq = rope_inv_freq(cfg.llama())
    scale = 1.0 / math.sqrt(cfg.head_dim)
    x, emb = _split_inputs(params, cfg, embed, tokens, feats, from_target)
    new_k, new_v = [], []
    for i, lp in enumerate(params["layers"]):
        attn_in, residual = _attn_input(lp, cfg, x, emb)
        q, k, v = _qkv(lp, cfg, attn_in, positions, inv_freq)
        if cache is not None:
            k, v = write_kv(cache.k[i], cache.v[i], k, v, write_at)
            new_k.append(k)
            new_v.append(v)
        else:
            k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B, Hkv, T, D], the layout reference_attention takes
        a = reference_attention(q, k, v, mask, scale)
        x = _finish_layer(lp, cfg, residual, a.reshape(B, T, -1))
    if cache is not None:
        cache = cache._replace(k=tuple(new_k), v=tuple(new_v))
    return x, cache


def head_logits(params: dict, cfg: HeadConfig, target_head: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] -> logits [..., out_vocab] float32.

    eagle: the target's LM head ({"embed"} when tied, else {"lm_head"}), no norm (the predicted feature is
    already post-norm). eagle3: the head's own norm and draft-vocabulary LM head (target_head unused).
    """
    if cfg.kind == "eagle":
        return lm_head(target_head, hidden)
    h = rms_norm(hidden, params["norm"], cfg.rms_norm_eps)
    return einsum_f32("...h,hv->...v", h, params["lm_head"].astype(h.dtype))


def to_target_ids(params: dict, cfg: HeadConfig, idx: jax.Array) -> jax.Array:
    """Head vocabulary indices -> target token ids (identity for eagle)."""
    if cfg.kind == "eagle":
        return idx
    return jnp.take(params["draft_ids"], idx)


def unrolled_hidden(params: dict, cfg: HeadConfig, embed: jax.Array, tokens: jax.Array, feats: jax.Array,
                    steps: int) -> jax.Array:
    """Training-time test: the head unrolled `steps` times on its own outputs, every start position at once.

    tokens [B, T] the sequence x_0..x_{T-1}; feats [B, T, F] the target features f_0..f_{T-1}.
    Step 0 at row t reads (x_{t+1}, f_t) at position t, like the head over committed text. Step j > 0 at row
    t reads (x_{t+1+j}, its own step j-1 output at row t) at position t + j, and attends to the step-0 pairs of
    rows <= t plus its own steps 1..j at row t: exactly what a draft chain started after position t sees at
    inference (committed pairs, then its own ancestors). Tokens past the end are 0 (mask those rows' losses).
    Returns hidden [steps, B, T, H]: step j at row t predicts the feature at t+1+j (token t+2+j).
    """
    B, T = tokens.shape
    inv_freq = rope_inv_freq(cfg.llama())
    scale = 1.0 / math.sqrt(cfg.head_dim)
    pos0 = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    causal = jnp.tril(jnp.ones((T, T), bool))
    G = cfg.num_heads // cfg.num_kv_heads
    # Per layer, the K/V of step 0 (all rows) and of each later step (its own row only).
    k0 = [None] * cfg.num_layers
    v0 = [None] * cfg.num_layers
    kd = [[] for _ in range(cfg.num_layers)]
    vd = [[] for _ in range(cfg.num_layers)]
    outs = []
    h = feats
    for j in range(steps):
        toks = jnp.concatenate([tokens[:, 1 + j:], jnp.zeros((B, 1 + j), tokens.dtype)], axis=1)[:, :T]
        x, emb = _split_inputs(params, cfg, embed, toks, h, from_target=(j == 0))
        for i, lp in enumerate(params["layers"]):
            attn_in, residual = _attn_input(lp, cfg, x, emb)
            q, k, v = _qkv(lp, cfg, attn_in, pos0 + j, inv_freq)
            if j == 0:
                k0[i], v0[i] = k, v
            else:
                kd[i].append(k)
                vd[i].append(v)
            qg = q.reshape(B, T, cfg.num_kv_heads, G, cfg.head_dim)
            s0 = einsum_f32("btkgd,bskd->bkgts", qg, k0[i]) * scale
            s0 = jnp.where(causal[None, None, None], s0, -jnp.inf)
            parts = [s0]
            for kk in kd[i]:
                parts.append(einsum_f32("btkgd,btkd->bkgt", qg, kk)[..., None]
                             * scale)
            w = jax.nn.softmax(jnp.concatenate(parts, axis=-1), axis=-1)
            o = einsum_f32("bkgts,bskd->btkgd", w[..., :T].astype(v0[i].dtype), v0[i])
            for n, vv in enumerate(vd[i]):
                o = o + einsum_f32("bkgt,btkd->btkgd", w[..., T + n].astype(vv.dtype), vv)
            x = _finish_layer(lp, cfg, residual, o.reshape(B, T, -1).astype(x.dtype))
        outs.append(x)
        h = x
    return jnp.stack(outs)
