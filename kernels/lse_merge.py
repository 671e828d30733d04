"""Portable verify attention by log-sum-exp merge.

  1. prefix attention over slots s < lengths[b] that also returns its LSE (jnp reference, or a Pallas kernel in
     prefix-only mode);
  2. a small dense [T, T] attention over the tree's own K/V (gathered from slots [lengths[b], lengths[b] + T)) with
     the ancestor mask;
  3. merge: lse = logaddexp(lse_p, lse_t), out = out_p * exp(lse_p - lse) + out_t * exp(lse_t - lse).

The merge is exact (both parts are normalised softmaxes over disjoint key sets). An empty prefix has lse_p = -inf
and weight 0; the tree part is never empty because the diagonal of tree_mask is True.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels.reference import masked_attention, prefix_attention_reference_lse
from specjax.kernels.reference import tree_attention_reference as reference
from specjax.kernels.validation import (
    TreeAttentionInputError,
    clip_lengths,
    resolve_scale,
    validate_tree_attention_inputs,
)

PREFIX_IMPLS = ("reference", "pallas_triton", "pallas_tpu")


def _prefix_fn(prefix_impl: str, interpret):
    """(q, k, v, lengths, *, scale) -> (out [B, T, Hq, D], lse [B, T, Hq] f32) for the named prefix attention."""
    if prefix_impl == "reference":
        return prefix_attention_reference_lse
    if prefix_impl == "pallas_triton":
        from specjax.kernels.pallas.tree_attention_gpu import prefix_attention_triton_lse

        return functools.partial(prefix_attention_triton_lse, interpret=interpret)
    if prefix_impl == "pallas_tpu":
        from specjax.kernels.pallas.tree_attention_tpu import prefix_attention_tpu_lse

        return functools.partial(prefix_attention_tpu_lse, interpret=interpret)
    raise TreeAttentionInputError(f"prefix_impl={prefix_impl!r} unknown; choose one of {PREFIX_IMPLS}.")


def tree_part_lse(q, k, v, lengths, tree_mask, *, scale: float):
    """Dense attention of the T new tokens to the T tree slots only.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; lengths: [B] int32 in [0, S - T]; tree_mask: [B, T, T] bool.
    Returns:
      out [B, T, Hq, D] float32, lse [B, T, Hq] float32.
    """
    num_tokens = q.shape[1]
    take = jax.vmap(lambda cache, start: lax.dynamic_slice_in_dim(cache, start, num_tokens, axis=1))
    k_tree, v_tree = take(k, lengths), take(v, lengths)  # [B, Hkv, T, D]
    kv_used = jnp.ones((k_tree.shape[0], num_tokens), jnp.bool_)
    return masked_attention(q, k_tree, v_tree, tree_mask, kv_used, scale)


def merge_by_lse(out_a, lse_a, out_b, lse_b):
    """Combine two softmax attentions over disjoint key sets.

    Args:
      out_a, out_b: [B, T, Hq, D]; lse_a, lse_b: [B, T, Hq] float32 (-inf for an empty part).
    Returns:
      out [B, T, Hq, D] float32, lse [B, T, Hq] float32.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)  # both parts empty: weights become exp(-inf) = 0
    w_a = jnp.exp(lse_a - safe)[..., None]
    w_b = jnp.exp(lse_b - safe)[..., None]
    out = w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)
    return out, lse


def tree_attention_lse_merge(
    q, k, v, lengths, tree_mask, *, scale=None, prefix_impl: str = "reference", interpret=False,
    return_lse: bool = False,
):
    """Tree attention as prefix attention + dense tree attention merged by LSE.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; lengths: [B] int; tree_mask: [B, T, T] bool; scale: float or None.
      prefix_impl: "reference" | "pallas_triton" | "pallas_tpu" for step 1.
      interpret: passed to a Pallas prefix kernel (run it in the interpreter, e.g. on CPU).
      return_lse: also return the merged LSE.
    Returns:
      out [B, T, Hq, D] in q.dtype, or (out, lse [B, T, Hq] float32) when return_lse.
    """
    validate_tree_attention_inputs(q, k, v, lengths, tree_mask, scale=scale)
    prefix = _prefix_fn(prefix_impl, interpret)
    scale_value = resolve_scale(scale, q.shape[-1])
    out_p, lse_p = prefix(q, k, v, lengths, scale=scale_value)
    out, lse = _tree_and_merge(q, k, v, lengths, tree_mask, out_p, lse_p, scale=scale_value)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("scale",))
def _tree_and_merge(q, k, v, lengths, tree_mask, out_p, lse_p, *, scale: float):
    lens = clip_lengths(lengths, k.shape[2], q.shape[1])
    out_t, lse_t = tree_part_lse(q, k, v, lens, tree_mask, scale=scale)
    out, lse = merge_by_lse(out_p, lse_p, out_t, lse_t)
    return out.astype(q.dtype), lse


__all__ = ["PREFIX_IMPLS", "merge_by_lse", "reference", "tree_attention_lse_merge", "tree_part_lse",
           "validate_tree_attention_inputs"]
