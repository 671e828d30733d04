"""Pure-jnp verify (tree) attention: the ground truth for every kernel and the XLA path on every platform.

Query t of sequence b sees cache slots s < lengths[b] (the committed prefix) and slot lengths[b] + j iff
tree_mask[b, t, j]. Everything is computed in float32 at HIGHEST matmul precision; the output is cast back to
q's dtype.

The dense [B, T, S] visibility mask is built without gather or scatter (one-hot matmul against iota
comparisons), so the same program suits backends where data-dependent gathers are unsafe (Neuron).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels.validation import clip_lengths, resolve_scale, validate_tree_attention_inputs

_HIGHEST = lax.Precision.HIGHEST


def visibility_mask(lengths, tree_mask, seq_len: int):
    """Dense [B, T, S] bool: which cache slots each new token attends to.

    Args:
      lengths: [B] int32, already in [0, S - T].
      tree_mask: [B, T, T] bool.
      seq_len: S.
    """
    num_tokens = tree_mask.shape[-1]
    slots = jnp.arange(seq_len, dtype=jnp.int32)
    prefix = slots[None, None, :] < lengths[:, None, None]  # [B, 1, S]
    # onehot[b, j, s] = (s == lengths[b] + j): places tree column j at cache slot lengths[b] + j.
    onehot = slots[None, None, :] == (lengths[:, None, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :, None])
    tree = jnp.einsum(
        "btj,bjs->bts",
        tree_mask.astype(jnp.float32),
        onehot.astype(jnp.float32),
        precision=_HIGHEST,
    )
    return prefix | (tree > 0.5)


def masked_attention(q, k, v, visible, kv_used, scale: float):
    """Softmax attention with an explicit mask, GQA without repeating K/V.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D].
      visible: [B, T, S] bool.
      kv_used: [B, S] bool, slots that may hold data (others are zeroed so NaN/inf there cannot leak).
      scale: softmax scale.
    Returns:
      out [B, T, Hq, D] float32 (zero for a row that sees nothing), lse [B, T, Hq] float32 (-inf for such a row).
    """
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(batch, num_tokens, num_kv_heads, group, head_dim)
    used = kv_used[:, None, :, None]
    kf = jnp.where(used, k.astype(jnp.float32), 0.0)
    vf = jnp.where(used, v.astype(jnp.float32), 0.0)
    logits = jnp.einsum("btkgd,bksd->bkgts", qg, kf, precision=_HIGHEST) * scale  # [B, Hkv, G, T, S]
    vis = visible[:, None, None, :, :]
    logits = jnp.where(vis, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # a row that sees nothing: avoid inf - inf
    p = jnp.where(vis, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bksd->btkgd", p, vf, precision=_HIGHEST)
    denom_t = jnp.moveaxis(denom[..., 0], 3, 1)[..., None]  # [B, T, Hkv, G, 1]
    out = out / jnp.where(denom_t == 0.0, 1.0, denom_t)
    lse = jnp.where(denom == 0.0, -jnp.inf, row_max + jnp.log(jnp.where(denom == 0.0, 1.0, denom)))[..., 0]
    lse = jnp.moveaxis(lse, 3, 1).reshape(batch, num_tokens, num_q_heads)
    return out.reshape(batch, num_tokens, num_q_heads, head_dim), lse


@functools.partial(jax.jit, static_argnames=("scale",))
def _reference_lse_jit(q, k, v, lengths, tree_mask, scale: float):
    seq_len = k.shape[2]
    num_tokens = q.shape[1]
    lens = clip_lengths(lengths, seq_len, num_tokens)
    visible = visibility_mask(lens, tree_mask, seq_len)
    kv_used = jnp.arange(seq_len, dtype=jnp.int32)[None, :] < (lens + num_tokens)[:, None]
    out, lse = masked_attention(q, k, v, visible, kv_used, scale)
    return out.astype(q.dtype), lse


def tree_attention_reference_lse(q, k, v, lengths, tree_mask, *, scale=None):
    """Reference tree attention that also returns the log-sum-exp of each query row.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; lengths: [B] int; tree_mask: [B, T, T] bool; scale: float or None
        (1/sqrt(D)).
    Returns:
      out [B, T, Hq, D] in q.dtype, lse [B, T, Hq] float32 (natural log).
    """
    validate_tree_attention_inputs(q, k, v, lengths, tree_mask, scale=scale)
    return _reference_lse_jit(q, k, v, lengths, tree_mask, scale=resolve_scale(scale, q.shape[-1]))


def tree_attention_reference(q, k, v, lengths, tree_mask, *, scale=None):
    """Reference tree attention.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; lengths: [B] int; tree_mask: [B, T, T] bool; scale: float or None
        (1/sqrt(D)).
    Returns:
      out [B, T, Hq, D] in q.dtype.
    """
    return tree_attention_reference_lse(q, k, v, lengths, tree_mask, scale=scale)[0]


@functools.partial(jax.jit, static_argnames=("scale",))
def _prefix_lse_jit(q, k, v, lengths, scale: float):
    seq_len = k.shape[2]
    num_tokens = q.shape[1]
    lens = clip_lengths(lengths, seq_len, num_tokens)
    kv_used = jnp.arange(seq_len, dtype=jnp.int32)[None, :] < lens[:, None]  # [B, S]
    visible = jnp.broadcast_to(kv_used[:, None, :], (q.shape[0], num_tokens, seq_len))
    return masked_attention(q, k, v, visible, kv_used, scale)


def prefix_attention_reference_lse(q, k, v, lengths, *, scale=None):
    """Attention of every new token to the committed prefix only (slots s < lengths[b]), with LSE.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; lengths: [B] int (clipped to [0, S - T]); scale: float or None.
    Returns:
      out [B, T, Hq, D] float32 (zero where lengths[b] == 0), lse [B, T, Hq] float32 (-inf there).
    """
    return _prefix_lse_jit(q, k, v, lengths, scale=resolve_scale(scale, q.shape[-1]))
