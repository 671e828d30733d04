"""Verify (tree) attention as one Pallas Mosaic kernel for TPU.

Grid (B, Hkv, row blocks, KV steps); the last axis is the reduction ("arbitrary") and walks
  1. `num_prefix_steps` blocks of `block_k` cache slots from slot 0. Steps past lengths[b] do no work, and their
     index_map repeats the last needed block so the pipeline issues no DMA for them (lengths arrive by scalar
     prefetch, so index maps can read them);
  2. ceil(T / block_tree) blocks of the tree's own K/V (slots [lengths[b], lengths[b] + T) of the cache, gathered
     into a small [B, Hkv, Tp, D] array by XLA because those slots do not start on a block boundary), with the
     ancestor mask,
all inside one online softmax whose running max/sum/accumulator live in VMEM scratch (float32).

Layout: GQA query heads are packed into rows (see `packing.py`). The cache is head-major, [B, Hkv, S, D] (the
layout of `specjax.kv_cache`), so a K/V block is [block_k, D] of one head, contiguous in memory, read in place.
Every block's last two dims are multiples of (8, 128) or the full array dims (D is the full last dim), which is
what Mosaic requires. With D = 64 a [block_k, D] tile fills half of the 128 lanes in VMEM.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.kernels.pallas.packing import pack_queries, pack_tree_mask, round_up, unpack_row_stat, unpack_rows
from specjax.kernels.reference import tree_attention_reference as reference
from specjax.kernels.validation import (
    UnsupportedConfigError,
    clip_lengths,
    resolve_scale,
    validate_tree_attention_inputs,
)

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LANES = 128
_STAT_LANES = 128  # running max/sum are kept lane-replicated so their VMEM tiles are dense


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Tiling of the Mosaic kernel.

    Attributes:
      block_q: packed query rows per program, a multiple of 16 (capped at the padded row count).
      block_k: prefix cache slots per grid step, a multiple of 128 (the lane width of the score tile); caches
        shorter than block_k use the largest multiple of 128 that fits, or the whole cache below 128 slots.
      block_tree: tree slots per grid step, a multiple of 128 (the lane width of the mask tile).
    """

    block_q: int = 128
    block_k: int = 512
    block_tree: int = 128

    def __post_init__(self):
        if self.block_q < 16 or self.block_q % 16:
            raise UnsupportedConfigError(f"TpuBlockSizes.block_q={self.block_q} must be a positive multiple of 16.")
        if self.block_k < _LANES or self.block_k % _LANES:
            raise UnsupportedConfigError(f"TpuBlockSizes.block_k={self.block_k} must be a multiple of 128.")
        if self.block_tree < _LANES or self.block_tree % _LANES:
            raise UnsupportedConfigError(f"TpuBlockSizes.block_tree={self.block_tree} must be a multiple of 128.")


DEFAULT_BLOCK_SIZES = TpuBlockSizes()
# Tilings shipped for the registry; the cross-lowering test lowers each for decode- and prefill-sized inputs.
SHIPPED_CONFIGS = (DEFAULT_BLOCK_SIZES, TpuBlockSizes(block_q=256, block_k=1024, block_tree=256))


def unsupported_reason(q, k, v, lengths, tree_mask) -> str | None:
    """Why this kernel cannot run these (already valid) shapes, or None when it can."""
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"dtype {q.dtype} (the TPU kernel supports float32 and bfloat16)"
    return None


def is_supported(q, k, v, lengths, tree_mask) -> bool:
    return unsupported_reason(q, k, v, lengths, tree_mask) is None


def _tree_attention_kernel(
    lengths_ref,  # SMEM [B] int32 (scalar prefetch)
    q_ref,  # [block_q, D]
    k_ref,  # [block_k, D] prefix cache block of one KV head
    v_ref,  # [block_k, D]
    *refs,  # (kt_ref, vt_ref [block_tree, D], mask_ref [block_q, block_tree] if tree) o_ref, lse_ref, scratch
    scale: float,
    block_k: int,
    num_prefix_steps: int,
    include_tree: bool,
    precision,
):
    if include_tree:
        kt_ref, vt_ref, mask_ref, o_ref, lse_ref, m_scratch, l_scratch, acc_scratch = refs
    else:
        o_ref, lse_ref, m_scratch, l_scratch, acc_scratch = refs
    b = pl.program_id(0)
    step = pl.program_id(3)
    length = lengths_ref[b]

    @pl.when(step == 0)
    def _init():
        m_scratch[...] = jnp.full(m_scratch.shape, _MASK_VALUE, jnp.float32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    def update(k, v, visible):
        # Invisible scores are replaced, not added to, and p is zeroed there: NaN in a masked K row cannot leak.
        # V rows that may hold garbage are zeroed by the caller (0 * NaN would).
        q = q_ref[...]
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        ) * scale  # [block_q, n]
        s = jnp.where(visible, s, _MASK_VALUE)
        m_prev = m_scratch[:, 0:1]
        l_prev = l_scratch[:, 0:1]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(visible, jnp.exp(s - m_next), 0.0)
        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        acc_scratch[...] = alpha * acc_scratch[...] + pv
        m_scratch[...] = jnp.broadcast_to(m_next, m_scratch.shape)
        l_scratch[...] = jnp.broadcast_to(l_next, l_scratch.shape)

    block_start = step * block_k

    @pl.when(jnp.logical_and(step < num_prefix_steps, block_start < length))
    def _prefix():
        block_q = q_ref.shape[0]
        width = k_ref.shape[1]
        cols = block_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        rows = block_start + lax.broadcasted_iota(jnp.int32, (block_k, width), 0)
        v = v_ref[...]
        # Rows >= length are tree slots, unused slots or the padding of a ragged edge block: never read them.
        update(k_ref[...], jnp.where(rows < length, v, jnp.zeros_like(v)), cols < length)

    if include_tree:

        @pl.when(step >= num_prefix_steps)
        def _tree():
            # kt/vt rows beyond T are zero padding and their mask columns are 0.
            update(kt_ref[...], vt_ref[...], mask_ref[...] != 0)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        l = l_scratch[:, 0:1]
        empty = l == 0.0  # padding rows, or prefix-only mode with lengths[b] == 0
        safe_l = jnp.where(empty, 1.0, l)
        o_ref[...] = (acc_scratch[...] / safe_l).astype(o_ref.dtype)
        lse = jnp.where(empty, -jnp.inf, m_scratch[:, 0:1] + jnp.log(safe_l))
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _prefix_block(block_k: int, seq_len: int) -> int:
    """Slots per prefix step: block_k, shrunk to a multiple of 128 <= S for short caches, or all of S below 128."""
    if seq_len >= block_k:
        return block_k
    if seq_len >= _LANES:
        return seq_len // _LANES * _LANES
    return seq_len  # the whole axis: legal whatever its size


def _gather_tree_rows(cache, lengths, num_tokens: int, rows_padded: int):
    """[B, Hkv, S, D] cache -> [B, Hkv, rows_padded, D]: slots [lengths[b], lengths[b] + T), zero padding."""
    rows = jax.vmap(lambda c, start: lax.dynamic_slice_in_dim(c, start, num_tokens, axis=1))(cache, lengths)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, rows_padded - num_tokens), (0, 0)))


@functools.partial(
    jax.jit, static_argnames=("scale", "block_sizes", "include_tree", "interpret", "debug")
)
def _tree_attention_tpu_jit(
    q, k, v, lengths, tree_mask, *, scale: float, block_sizes: TpuBlockSizes | None, include_tree: bool,
    interpret, debug: bool = False,
):
    batch, num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, seq_len, _ = k.shape
    group = num_q_heads // num_kv_heads
    num_rows = num_tokens * group
    blocks = block_sizes or DEFAULT_BLOCK_SIZES
    sublanes = 16 if jnp.dtype(q.dtype).itemsize == 2 else 8
    block_q = min(blocks.block_q, round_up(num_rows, sublanes))
    rows_padded = round_up(num_rows, block_q)
    block_k = _prefix_block(blocks.block_k, seq_len)
    # Prefix blocks can reach slot S - T at most; keep >= 1 step so the grid is never empty.
    num_prefix_steps = max(1, -(-(seq_len - num_tokens) // block_k))
    block_tree = blocks.block_tree
    num_tree_steps = -(-num_tokens // block_tree) if include_tree else 0

    lens = clip_lengths(lengths, seq_len, num_tokens)
    q_packed = pack_queries(q, num_kv_heads, rows_padded)  # [B, Hkv, Rp, D]

    def q_map(b, h, i, j, lengths_ref):
        return b, h, i, 0

    def kv_map(b, h, i, j, lengths_ref):
        last_needed = jnp.maximum(lax.div(lengths_ref[b] + block_k - 1, block_k) - 1, 0)
        return b, h, jnp.minimum(j, last_needed), 0

    def tree_kv_map(b, h, i, j, lengths_ref):
        return b, h, jnp.maximum(j - num_prefix_steps, 0), 0

    def mask_map(b, h, i, j, lengths_ref):
        return b, i, jnp.maximum(j - num_prefix_steps, 0)

    in_specs = [
        pl.BlockSpec((None, None, block_q, head_dim), q_map),
        pl.BlockSpec((None, None, block_k, head_dim), kv_map),
        pl.BlockSpec((None, None, block_k, head_dim), kv_map),
    ]
    args = [q_packed, k, v]
    if include_tree:
        tree_rows = num_tree_steps * block_tree
        in_specs += [
            pl.BlockSpec((None, None, block_tree, head_dim), tree_kv_map),
            pl.BlockSpec((None, None, block_tree, head_dim), tree_kv_map),
            pl.BlockSpec((None, block_q, block_tree), mask_map),
        ]
        args += [
            _gather_tree_rows(k, lens, num_tokens, tree_rows),
            _gather_tree_rows(v, lens, num_tokens, tree_rows),
            pack_tree_mask(tree_mask, group, rows_padded, tree_rows),
        ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, num_kv_heads, rows_padded // block_q, num_prefix_steps + num_tree_steps),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_q, head_dim), q_map),
            pl.BlockSpec((None, None, block_q, _STAT_LANES), q_map),
        ],
        scratch_shapes=[
            pltpu.VMEM((block_q, _STAT_LANES), jnp.float32),
            pltpu.VMEM((block_q, _STAT_LANES), jnp.float32),
            pltpu.VMEM((block_q, head_dim), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _tree_attention_kernel,
        scale=scale,
        block_k=block_k,
        num_prefix_steps=num_prefix_steps,
        include_tree=include_tree,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, rows_padded, head_dim), q.dtype),
            jax.ShapeDtypeStruct((batch, num_kv_heads, rows_padded, _STAT_LANES), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        debug=debug,
        name="specjax_tree_attention_tpu",
    )(lens, *args)
    out = unpack_rows(out, num_tokens, num_q_heads)
    return out, unpack_row_stat(lse[..., 0], num_tokens, num_q_heads)


def _check_supported(q, k, v, lengths, tree_mask):
    reason = unsupported_reason(q, k, v, lengths, tree_mask)
    if reason is not None:
        raise UnsupportedConfigError(
            f"pallas_tpu tree attention: {reason}; use get_attention('auto') or 'reference' instead."
        )


def tree_attention_tpu(
    q, k, v, lengths, tree_mask, *, scale=None, block_sizes: TpuBlockSizes | None = None, interpret=False,
    return_lse: bool = False,
):
    """Tree attention with the Pallas Mosaic TPU kernel.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D] (float32 or bfloat16, one dtype); lengths: [B] int;
        tree_mask: [B, T, T] bool with True diagonal; scale: float or None (1/sqrt(D)).
      block_sizes: tiling; None -> DEFAULT_BLOCK_SIZES.
      interpret: True or `pltpu.InterpretParams()` runs the kernel in a Pallas interpreter, e.g. on CPU.
      return_lse: also return the LSE.
    Returns:
      out [B, T, Hq, D] in q.dtype, or (out, lse [B, T, Hq] float32) when return_lse.
    """
    validate_tree_attention_inputs(q, k, v, lengths, tree_mask, scale=scale)
    _check_supported(q, k, v, lengths, tree_mask)
    out, lse = _tree_attention_tpu_jit(
        q, k, v, lengths, tree_mask, scale=resolve_scale(scale, q.shape[-1]), block_sizes=block_sizes,
        include_tree=True, interpret=interpret,
    )
    return (out, lse) if return_lse else out


def prefix_attention_tpu_lse(
    q, k, v, lengths, *, scale=None, block_sizes: TpuBlockSizes | None = None, interpret=False
):
    """Attention of the new tokens to the committed prefix only (slots < lengths[b]), with LSE (TPU kernel).

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; lengths: [B] int; scale: float or None.
    Returns:
      out [B, T, Hq, D] in q.dtype (zero where lengths[b] == 0), lse [B, T, Hq] float32 (-inf there).
    """
    batch, num_tokens = q.shape[:2]
    mask_shape = jax.ShapeDtypeStruct((batch, num_tokens, num_tokens), jnp.bool_)  # the validator needs one
    validate_tree_attention_inputs(q, k, v, lengths, mask_shape, scale=scale)
    _check_supported(q, k, v, lengths, mask_shape)
    return _tree_attention_tpu_jit(
        q, k, v, lengths, None, scale=resolve_scale(scale, q.shape[-1]), block_sizes=block_sizes,
        include_tree=False, interpret=interpret,
    )


__all__ = [
    "TpuBlockSizes",
    "DEFAULT_BLOCK_SIZES",
    "SHIPPED_CONFIGS",
    "is_supported",
    "unsupported_reason",
    "tree_attention_tpu",
    "prefix_attention_tpu_lse",
    "reference",
    "validate_tree_attention_inputs",
]
