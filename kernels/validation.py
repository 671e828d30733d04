"""Input checks shared by every verify (tree) attention implementation.

All implementations take the same arguments:

    q         [B, T, Hq, D]   queries of the T new tokens
    k, v      [B, Hkv, S, D]  one layer's KV cache, head-major like `specjax.kv_cache` (tree K/V already written
                              at slots [lengths[b], lengths[b] + T))
    lengths   [B] int         committed prefix length per sequence
    tree_mask [B, T, T] bool  ancestor-or-self mask, diagonal True

Shape and dtype problems are always caught (they are static, even under `jax.jit`). Value problems (a False on the
diagonal of `tree_mask`, `lengths` outside [0, S - T]) are caught when the arrays are concrete, i.e. when the
function is called outside `jit`; under `jit` the kernels clip `lengths` into range so that no implementation ever
reads outside the cache.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class TreeAttentionInputError(SpecjaxError, ValueError):
    """Bad arguments to a tree attention implementation (shape, dtype or value)."""


class UnsupportedConfigError(SpecjaxError, ValueError):
    """Valid arguments that this particular implementation cannot handle (e.g. a head_dim it has no tiling for)."""


def _is_concrete(x) -> bool:
    """True when the value of `x` can be read on the host now (numpy array or a non-traced jax array)."""
    if isinstance(x, jax.core.Tracer):
        return False
    return isinstance(x, (np.ndarray, np.generic, jax.Array))


def _shape(x, name: str) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TreeAttentionInputError(f"{name} must be an array, got {type(x).__name__}; pass a jax or numpy array.")
    return tuple(shape)


def validate_tree_attention_inputs(q, k, v, lengths, tree_mask, *, scale=None) -> None:
    """Raise TreeAttentionInputError naming the first problem with the arguments; return None when they are valid.

    Args:
      q: [B, T, Hq, D] float32/bfloat16/float16.
      k, v: [B, Hkv, S, D], same dtype as q, Hq % Hkv == 0, T <= S.
      lengths: [B] integer; checked to lie in [0, S - T] when concrete.
      tree_mask: [B, T, T] bool; diagonal checked to be all True when concrete.
      scale: None or a positive finite Python number.
    """
    q_shape, k_shape, v_shape = _shape(q, "q"), _shape(k, "k"), _shape(v, "v")
    l_shape, m_shape = _shape(lengths, "lengths"), _shape(tree_mask, "tree_mask")
    if len(q_shape) != 4:
        raise TreeAttentionInputError(f"q must be [B, T, Hq, D], got shape {q_shape}; add the missing axes.")
    if len(k_shape) != 4:
        raise TreeAttentionInputError(f"k must be [B, Hkv, S, D], got shape {k_shape}; pass one layer's cache.")
    if v_shape != k_shape:
        raise TreeAttentionInputError(f"v shape {v_shape} differs from k shape {k_shape}; they must match.")
    batch, num_tokens, num_q_heads, head_dim = q_shape
    k_batch, num_kv_heads, seq_len, k_head_dim = k_shape
    if k_batch != batch:
        raise TreeAttentionInputError(f"batch mismatch: q has B={batch}, k/v have B={k_batch}.")
    if k_head_dim != head_dim:
        raise TreeAttentionInputError(f"head_dim mismatch: q has D={head_dim}, k/v have D={k_head_dim}.")
    if min(q_shape) < 1 or min(k_shape) < 1:
        raise TreeAttentionInputError(f"empty axis in q {q_shape} or k {k_shape}; every axis needs size >= 1.")
    if num_q_heads % num_kv_heads != 0:
        raise TreeAttentionInputError(
            f"GQA needs Hq % Hkv == 0, got Hq={num_q_heads}, Hkv={num_kv_heads}; check the head counts."
        )
    if num_tokens > seq_len:
        raise TreeAttentionInputError(
            f"T={num_tokens} new tokens do not fit in a cache of S={seq_len} slots; need T <= S."
        )
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k.dtype), jnp.dtype(v.dtype)}
    if len(dtypes) != 1:
        raise TreeAttentionInputError(
            f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one."
        )
    if jnp.dtype(q.dtype) not in _FLOAT_DTYPES:
        raise TreeAttentionInputError(f"q/k/v dtype {q.dtype} not supported; use float32, bfloat16 or float16.")
    if l_shape != (batch,):
        raise TreeAttentionInputError(f"lengths must be [B]=({batch},), got shape {l_shape}.")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TreeAttentionInputError(f"lengths must be an integer array, got dtype {lengths.dtype}.")
    if m_shape != (batch, num_tokens, num_tokens):
        raise TreeAttentionInputError(
            f"tree_mask must be [B, T, T]=({batch}, {num_tokens}, {num_tokens}), got shape {m_shape}."
        )
    if jnp.dtype(tree_mask.dtype) != jnp.dtype(jnp.bool_):
        raise TreeAttentionInputError(
            f"tree_mask must be bool, got dtype {tree_mask.dtype}; pass `mask.astype(bool)`."
        )
    if scale is not None:
        if isinstance(scale, jax.core.Tracer) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise TreeAttentionInputError(f"scale must be a Python number (static), got {type(scale).__name__}.")
        if not (math.isfinite(float(scale)) and float(scale) > 0):
            raise TreeAttentionInputError(f"scale must be positive and finite, got {scale}.")
    if _is_concrete(tree_mask):
        diag = np.diagonal(np.asarray(tree_mask), axis1=1, axis2=2)
        if not diag.all():
            b, t = np.argwhere(~diag)[0]
            raise TreeAttentionInputError(
                f"tree_mask[{b}, {t}, {t}] is False; every node must see itself (set the diagonal to True)."
            )
    if _is_concrete(lengths):
        lens = np.asarray(lengths)
        bad = np.flatnonzero((lens < 0) | (lens > seq_len - num_tokens))
        if bad.size:
            b = int(bad[0])
            raise TreeAttentionInputError(
                f"lengths[{b}]={int(lens[b])} out of range: need 0 <= lengths <= S - T = {seq_len - num_tokens} "
                f"so that the {num_tokens} tree slots fit in the cache."
            )


def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale: `scale` if given, else 1/sqrt(head_dim)."""
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def clip_lengths(lengths, seq_len: int, num_tokens: int):
    """lengths clipped to [0, S - T] as int32 [B]: an out-of-range value under jit never reads outside the cache."""
    return jnp.clip(lengths.astype(jnp.int32), 0, seq_len - num_tokens)
