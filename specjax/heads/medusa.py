"""Medusa-1 heads as pure functions over a params pytree.

K heads read the target's final hidden state h (after the last norm, what the LM head reads) at the last
accepted position t. Head k (k = 1..K) predicts the token k + 1 positions after t: the target's own LM head
already predicts the token right after t (the root of the next tree), so head k proposes depth k of the tree.
Each head is `num_layers` residual blocks x <- x + SiLU(x W + b) followed by an LM head.

The LM head of the heads is, by config:
    "target"    the target's (tied) LM head, not stored with the heads: the shipped file holds only the blocks
    "shared"    one own LM head for all heads (vLLM `original_lm_head`)
    "per_head"  an own LM head per head (FasterDecoding checkpoints: `{h}.{L}.weight` [vocab, H])
An optional `token_map` [Vd] int32 restricts the heads to a draft vocabulary of Vd target ids (vLLM
`truncated_vocab_size`): logits are computed over those rows only, which makes drafting and training cheaper,
and the chosen indices map back to target ids through it.

Params pytree (weights [in, out], so a block is `x @ w + b`):
    blocks     K x [L x {"w": [H, H], "b": [H] (absent when bias=False)}]
    lm_head    [K, Vd, H] ("per_head") or [Vd, H] ("shared"); absent for "target"
    token_map  [Vd] int32, ascending target ids; absent when the heads cover the full vocabulary
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.llama import einsum_f32, lm_head
from specjax.errors import SpecjaxError

LM_HEADS = ("target", "shared", "per_head")


class MedusaError(SpecjaxError, ValueError):
    """Medusa heads and their target (or their settings) do not fit together; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """Static description of a set of Medusa heads (hashable: part of the drafter, a static jit argument)."""

    num_heads: int  # K
    hidden_size: int  # H, the target's hidden size
    vocab_size: int  # the target's vocabulary
    num_layers: int = 1  # residual blocks per head
    bias: bool = True  # blocks have a bias (FasterDecoding always; vLLM per `medusa_fc_bias`)
    lm_head: str = "target"  # one of LM_HEADS
    draft_vocab_size: int | None = None  # Vd = len(token_map); None = the full vocabulary

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 0:
            raise MedusaError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {self.num_heads} heads and "
                              f"{self.num_layers} layers")
        if self.lm_head not in LM_HEADS:
            raise MedusaError(f"lm_head={self.lm_head!r} must be one of {LM_HEADS}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise MedusaError(f"draft_vocab_size {self.draft_vocab_size} must lie in [1, vocab_size="
                              f"{self.vocab_size}]")

    @property
    def out_vocab(self) -> int:
        """Vd: entries in each head's logits."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size


def init_heads(config: MedusaConfig, key: jax.Array | None = None, dtype=jnp.float32, *, token_map=None,
               target_params: dict | None = None, scale: float = 0.0) -> dict:
    """Fresh head params. Blocks start at zero (scale 0), so every head first reproduces the target's next-token
    prediction (x + SiLU(0) = x), the usual Medusa start; scale > 0 draws random blocks instead (tests).

    Own LM heads ("shared" / "per_head") are initialised from the target's LM head, so `target_params` is needed
    for them; token_map [Vd] is required iff config.draft_vocab_size is set.
    """
    H, K, L = config.hidden_size, config.num_heads, config.num_layers
    keys = jax.random.split(key if key is not None else jax.random.PRNGKey(0), max(K * L, 1) * 2)
    blocks = []
    for k in range(K):
        layers = []
        for l in range(L):
            kw, kb = keys[2 * (k * L + l)], keys[2 * (k * L + l) + 1]
            blk = {"w": (scale * jax.random.normal(kw, (H, H))).astype(dtype)}
            if config.bias:
                blk["b"] = (scale * jax.random.normal(kb, (H,))).astype(dtype)
            layers.append(blk)
        blocks.append(layers)
    params = {"blocks": blocks}
    if config.draft_vocab_size is not None:
        if token_map is None:
            raise MedusaError("config.draft_vocab_size is set: pass token_map, the [Vd] target ids of the draft "
                              "vocabulary")
        params["token_map"] = check_token_map(token_map, config)
    elif token_map is not None:
        raise MedusaError("a token_map was given but config.draft_vocab_size is None; set draft_vocab_size=len(map)")
    if config.lm_head != "target":
        if target_params is None:
            raise MedusaError(f"lm_head={config.lm_head!r} heads start from the target's LM head: pass target_params")
        rows = target_lm_rows(target_params, params.get("token_map")).astype(dtype)  # [Vd, H]
        params["lm_head"] = rows if config.lm_head == "shared" else jnp.broadcast_to(rows, (K,) + rows.shape) + 0
    return params


def check_token_map(token_map, config: MedusaConfig) -> jax.Array:
    """token_map as int32 [Vd], checked: strictly ascending target ids in [0, vocab_size)."""
    tm = np.asarray(token_map)
    if tm.ndim != 1 or tm.shape[0] != config.out_vocab:
        raise MedusaError(f"token_map must be [draft_vocab_size={config.out_vocab}], got shape {tm.shape}")
    if tm.size and (tm.min() < 0 or tm.max() >= config.vocab_size or np.any(np.diff(tm) <= 0)):
        raise MedusaError(f"token_map must hold distinct ascending target ids in [0, {config.vocab_size})")
    return jnp.asarray(tm, jnp.int32)


def target_lm_rows(target_params: dict, token_map=None) -> jax.Array:
    """The target's LM head as rows [V or Vd, H] (the tied embedding, or `lm_head` [H, V] transposed), restricted
    to token_map when given. Ties: SmolLM2 ties its head to the embedding, so no copy is made without a map."""
    w = target_params["embed"] if "lm_head" not in target_params else target_params["lm_head"].T
    return w if token_map is None else jnp.take(w, jnp.asarray(token_map), axis=0)


def draft_params(config: MedusaConfig, head_params: dict, target_params: dict) -> dict:
    """What the drafter needs at run time: {"blocks", "lm" [Vd, H] or [K, Vd, H], "token_map" (if any)}.

    "lm" is the heads' own LM head, or for lm_head="target" the target's LM head rows (the same array as the
    target's embedding when there is no token_map, so nothing is copied).
    """
    check_params(config, head_params)
    lm = head_params["lm_head"] if config.lm_head != "target" else target_lm_rows(target_params,
                                                                                    head_params.get("token_map"))
    if lm.shape[-1] != config.hidden_size:
        raise MedusaError(f"the LM head has hidden size {lm.shape[-1]}, the heads {config.hidden_size}")
    out = {"blocks": head_params["blocks"], "lm": lm}
    if "token_map" in head_params:
        out["token_map"] = head_params["token_map"]
    return out


def check_params(config: MedusaConfig, params: dict) -> None:
    """Shapes of a head params pytree against its config (one-line MedusaError on mismatch)."""
    H, K, L, Vd = config.hidden_size, config.num_heads, config.num_layers, config.out_vocab
    blocks = params.get("blocks")
    if not isinstance(blocks, (list, tuple)) or len(blocks) != K or any(len(b) != L for b in blocks):
        raise MedusaError(f"expected {K} heads of {L} residual blocks each")
    for k, head in enumerate(blocks):
        for l, blk in enumerate(head):
            if tuple(blk["w"].shape) != (H, H):
                raise MedusaError(f"head {k} block {l}: weight {tuple(blk['w'].shape)}, expected ({H}, {H})")
            if config.bias != ("b" in blk) or (config.bias and tuple(blk["b"].shape) != (H,)):
                raise MedusaError(f"head {k} block {l}: bias must be {'[%d]' % H if config.bias else 'absent'}")
    want = {"target": None, "shared": (Vd, H), "per_head": (K, Vd, H)}[config.lm_head]
    got = None if "lm_head" not in params else tuple(params["lm_head"].shape)
    if got != want:
        raise MedusaError(f"lm_head={config.lm_head!r} needs an LM head of shape {want}, got {got}")
    if (config.draft_vocab_size is None) != ("token_map" not in params):
        raise MedusaError("token_map must be present exactly when draft_vocab_size is set")


def residual_blocks(layers, x: jax.Array) -> jax.Array:
    """One head's blocks: x [..., H] -> [..., H], each x <- x + SiLU(x @ w + b)."""
    for blk in layers:
        y = einsum_f32("...h,hk->...k", x, blk["w"])
        if "b" in blk:
            y = y + blk["b"].astype(jnp.float32)
        x = (x.astype(jnp.float32) + jax.nn.silu(y)).astype(x.dtype)
    return x


def head_hidden(blocks, x: jax.Array, num: int | None = None) -> jax.Array:
    """Hidden states of the first `num` heads (default all): x [..., H] -> [..., num, H] in the blocks' dtype."""
    heads = blocks if num is None else blocks[:num]
    dtype = heads[0][0]["w"].dtype if heads and heads[0] else x.dtype
    x = x.astype(dtype)
    return jnp.stack([residual_blocks(layers, x) for layers in heads], axis=-2)


def head_logits(hidden: jax.Array, lm: jax.Array) -> jax.Array:
    """Logits float32 [..., k, Vd] from head hidden states [..., k, H] and an LM head [Vd, H] (shared by the
    heads) or [K, Vd, H] (one per head; the first k are used)."""
    hidden = hidden.astype(lm.dtype)
    if lm.ndim == 2:
        return lm_head({"embed": lm}, hidden)  # the [Vd, H]-first product (see llama.lm_head)
    k = hidden.shape[-2]
    return einsum_f32("...kh,kvh->...kv", hidden, lm[:k])


def top_candidates(logits: jax.Array, k: int, token_map: jax.Array | None = None) -> jax.Array:
    """The k best tokens of every head, best first: logits [..., K, Vd] -> target ids [..., K, k] int32.

    Deterministic in the logits (ties go to the lower index), which is what makes a Medusa tree a deterministic
    candidate set for the lossless acceptance rule."""
    _, idx = jax.lax.top_k(logits, k)
    if token_map is not None:
        idx = jnp.take(token_map, idx)
    return idx.astype(jnp.int32)


def apply(dparams: dict, x: jax.Array, num: int | None = None) -> jax.Array:
    """Logits [..., num, Vd] of the first `num` heads (default all) at features x [..., H]; dparams from
    `draft_params`."""
    return head_logits(head_hidden(dparams["blocks"], x, num), dparams["lm"])
