"""Verify (tree) attention as one Pallas kernel for the Triton lowering (NVIDIA Ampere+/AMD via Triton).

One program handles a tile of `block_q` packed query rows (GQA: the G query heads of one KV head stacked with the
tokens, see `packing.py`) for one (sequence, KV head). It runs a flash-style online softmax over
  1. the committed prefix, cache slots [0, lengths[b]) in blocks of `block_k` (dynamic trip count; the ragged last
     block is masked on load, so slots at or beyond lengths[b] are never read), then
  2. the tree slots [lengths[b], lengths[b] + T) in blocks of `block_k`, masked by the ancestor mask,
in the same running (max, sum, accumulator), in float32.

Triton constraints honoured here: every loaded tensor is a power of two in each dimension (block_q, block_k and
head_dim), ragged edges use masked loads, and `compiler_params` is the Triton one (num_warps, num_stages).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.kernels.pallas.packing import (
    next_power_of_2,
    pack_queries,
    pack_tree_mask,
    round_up,
    unpack_row_stat,
    unpack_rows,
)
from specjax.kernels.reference import tree_attention_reference as reference
from specjax.kernels.validation import (
    UnsupportedConfigError,
    clip_lengths,
    resolve_scale,
    validate_tree_attention_inputs,
)

# Finite stand-in for -inf in the running max: exp(MASK - m) underflows to 0 without inf - inf = NaN.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_MIN_DOT_DIM = 16  # tl.dot needs every matrix dimension >= 16


@dataclasses.dataclass(frozen=True)
class TritonBlockSizes:
    """Tiling of the Triton kernel.

    Attributes:
      block_q: packed query rows per program, power of two >= 16 (capped at the padded row count).
      block_k: cache slots per inner step, power of two >= 16.
      num_warps: warps per program; None -> 4 for head_dim <= 64, else 8.
      num_stages: software pipelining depth of the inner loops.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value < _MIN_DOT_DIM or value & (value - 1):
                raise UnsupportedConfigError(f"TritonBlockSizes.{name}={value} must be a power of two >= 16.")


def default_block_sizes(num_rows: int, head_dim: int) -> TritonBlockSizes:
    """The tiling the wrapper uses when none is given: rows = T * G packed query rows."""
    block_q = min(64, max(_MIN_DOT_DIM, next_power_of_2(num_rows)))
    block_k = 128 if head_dim <= 64 else 64  # keeps the [block_k, D] K/V tiles at <= 16 KiB in 16-bit
    return TritonBlockSizes(block_q=block_q, block_k=block_k)


# Every tiling default_block_sizes can return, as (block_q, block_k, head_dim): the cross-lowering test covers them.
SHIPPED_CONFIGS = tuple((bq, 128 if d <= 64 else 64, d) for d in (64, 128) for bq in (16, 32, 64))


def unsupported_reason(q, k, v, lengths, tree_mask) -> str | None:
    """Why this kernel cannot run these (already valid) shapes, or None when it can."""
    head_dim = q.shape[-1]
    if head_dim < _MIN_DOT_DIM or head_dim & (head_dim - 1):
        return f"head_dim={head_dim} is not a power of two >= 16 (Triton tiles must be powers of two)"
    return None


def is_supported(q, k, v, lengths, tree_mask) -> bool:
    return unsupported_reason(q, k, v, lengths, tree_mask) is None


def _tree_attention_kernel(
    lengths_ref,  # [] int32, this sequence's prefix length
    q_ref,  # [block_q, D] packed query rows
    k_ref,  # [S, D] this KV head's keys
    v_ref,  # [S, D]
    *refs,  # (mask_ref [block_q, Cp] int32 if tree blocks) o_ref [block_q, D], lse_ref [block_q]
    scale: float,
    block_k: int,
    num_tree_blocks: int,
    num_tokens: int,
    precision,
):
    if num_tree_blocks:
        mask_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    length = lengths_ref[()]
    q = q_ref[...]
    block_q, head_dim = q.shape
    offsets = jnp.arange(block_k, dtype=jnp.int32)

    def update(carry, k, v, visible):
        # visible: [block_q, block_k] or [1, block_k]; invisible scores are replaced (not added to), so NaN/inf
        # in a masked K row cannot leak, and p is zeroed there before it meets V (whose masked rows are 0).
        acc, m_prev, l_prev = carry
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
        s = jnp.where(visible, s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_next, l_next

    def prefix_step(i, carry):
        start = i * block_k
        slot_ok = (start + offsets) < length  # [block_k]
        load_mask = jnp.broadcast_to(slot_ok[:, None], (block_k, head_dim))
        k = plgpu.load(k_ref.at[pl.ds(start, block_k), :], mask=load_mask, other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(start, block_k), :], mask=load_mask, other=0.0)
        return update(carry, k, v, slot_ok[None, :])

    def tree_step(j, carry):
        start = j * block_k
        node_ok = (start + offsets) < num_tokens  # tree column exists (columns >= T are padding)
        load_mask = jnp.broadcast_to(node_ok[:, None], (block_k, head_dim))
        k = plgpu.load(k_ref.at[pl.ds(length + start, block_k), :], mask=load_mask, other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(length + start, block_k), :], mask=load_mask, other=0.0)
        visible = mask_ref[:, pl.ds(start, block_k)] != 0  # padding columns hold 0
        return update(carry, k, v, visible)

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), _MASK_VALUE, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = lax.fori_loop(0, lax.div(length + block_k - 1, block_k), prefix_step, carry)
    if num_tree_blocks:
        carry = lax.fori_loop(0, num_tree_blocks, tree_step, carry)
    acc, m, l = carry
    empty = l == 0.0  # padding rows, or prefix-only mode with lengths[b] == 0
    safe_l = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(safe_l))


@functools.partial(
    jax.jit, static_argnames=("scale", "block_sizes", "include_tree", "interpret", "debug")
)
def _tree_attention_triton_jit(
    q, k, v, lengths, tree_mask, *, scale: float, block_sizes: TritonBlockSizes | None, include_tree: bool,
    interpret, debug: bool = False,
):
    batch, num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, seq_len, _ = k.shape
    group = num_q_heads // num_kv_heads
    num_rows = num_tokens * group
    blocks = block_sizes or default_block_sizes(num_rows, head_dim)
    block_q = min(blocks.block_q, max(_MIN_DOT_DIM, next_power_of_2(num_rows)))
    block_k = blocks.block_k
    rows_padded = round_up(num_rows, block_q)
    num_tree_blocks = -(-num_tokens // block_k) if include_tree else 0
    num_warps = blocks.num_warps or (4 if head_dim <= 64 else 8)

    lens = clip_lengths(lengths, seq_len, num_tokens)
    q_packed = pack_queries(q, num_kv_heads, rows_padded)  # [B, Hkv, Rp, D]
    grid = (batch, num_kv_heads, rows_padded // block_q)
    in_specs = [
        pl.BlockSpec((None,), lambda b, h, i: (b,)),
        pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i: (b, h, i, 0)),
        # The whole sequence of one KV head, contiguous in the head-major cache: the kernel walks it with masked
        # loads (only up to lengths[b] + T).
        pl.BlockSpec((None, None, seq_len, head_dim), lambda b, h, i: (b, h, 0, 0)),
        pl.BlockSpec((None, None, seq_len, head_dim), lambda b, h, i: (b, h, 0, 0)),
    ]
    args = [lens, q_packed, k, v]
    if include_tree:
        cols_padded = num_tree_blocks * block_k
        in_specs.append(pl.BlockSpec((None, block_q, cols_padded), lambda b, h, i: (b, i, 0)))
        args.append(pack_tree_mask(tree_mask, group, rows_padded, cols_padded))
    kernel = functools.partial(
        _tree_attention_kernel,
        scale=scale,
        block_k=block_k,
        num_tree_blocks=num_tree_blocks,
        num_tokens=num_tokens,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, rows_padded, head_dim), q.dtype),
            jax.ShapeDtypeStruct((batch, num_kv_heads, rows_padded), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        debug=debug,
        name="specjax_tree_attention_triton",
    )(*args)
    return unpack_rows(out, num_tokens, num_q_heads), unpack_row_stat(lse, num_tokens, num_q_heads)


def _check_supported(q, k, v, lengths, tree_mask):
    reason = unsupported_reason(q, k, v, lengths, tree_mask)
    if reason is not None:
        raise UnsupportedConfigError(
            f"pallas_triton tree attention: {reason}; use get_attention('auto') or 'reference' instead."
        )


def tree_attention_triton(
    q, k, v, lengths, tree_mask, *, scale=None, block_sizes: TritonBlockSizes | None = None, interpret=False,
    return_lse: bool = False,
):
    """Tree attention with the Pallas Triton kernel.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D] (same dtype, D a power of two >= 16); lengths: [B] int;
        tree_mask: [B, T, T] bool with True diagonal; scale: float or None (1/sqrt(D)).
      block_sizes: tiling; None picks `default_block_sizes`.
      interpret: True (or pallas interpret params) runs the kernel in the Pallas interpreter, e.g. on CPU.
      return_lse: also return the LSE.
    Returns:
      out [B, T, Hq, D] in q.dtype, or (out, lse [B, T, Hq] float32) when return_lse.
    """
    validate_tree_attention_inputs(q, k, v, lengths, tree_mask, scale=scale)
    _check_supported(q, k, v, lengths, tree_mask)
    out, lse = _tree_attention_triton_jit(
        q, k, v, lengths, tree_mask, scale=resolve_scale(scale, q.shape[-1]), block_sizes=block_sizes,
        include_tree=True, interpret=interpret,
    )
    return (out, lse) if return_lse else out


def prefix_attention_triton_lse(
    q, k, v, lengths, *, scale=None, block_sizes: TritonBlockSizes | None = None, interpret=False
):
    """Attention of the new tokens to the committed prefix only (slots < lengths[b]), with LSE (Triton kernel).

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; lengths: [B] int; scale: float or None.
    Returns:
      out [B, T, Hq, D] in q.dtype (zero where lengths[b] == 0), lse [B, T, Hq] float32 (-inf there).
    """
    batch, num_tokens = q.shape[:2]
    mask_shape = jax.ShapeDtypeStruct((batch, num_tokens, num_tokens), jnp.bool_)  # the validator needs one
    validate_tree_attention_inputs(q, k, v, lengths, mask_shape, scale=scale)
    _check_supported(q, k, v, lengths, mask_shape)
    return _tree_attention_triton_jit(
        q, k, v, lengths, None, scale=resolve_scale(scale, q.shape[-1]), block_sizes=block_sizes,
        include_tree=False, interpret=interpret,
    )


__all__ = [
    "TritonBlockSizes",
    "SHIPPED_CONFIGS",
    "default_block_sizes",
    "is_supported",
    "unsupported_reason",
    "tree_attention_triton",
    "prefix_attention_triton_lse",
    "reference",
    "validate_tree_attention_inputs",
]
