"""XLA implementations of the ops in `specjax.backends.ops` that have no reference elsewhere: the projection
(`matmul_t`) and the decode/verify attention over the committed KV cache (`prefix_tree_attention`). They run on
every platform and are what the op table falls back to where no kernel is registered or supported.
(The other ops' XLA implementations sit with their kernels: `cpu_kv_write.kv_write_reference`,
`cpu_quant_matmul.xla_quant_matmul`.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_t(x: jax.Array, w: jax.Array, *, out_dtype=None, weight_first: bool = False) -> jax.Array:
    """x [..., K] . w [N, K]^T -> [..., N] through XLA's dot_general, in `out_dtype` (default: the dtype XLA's dot
    gives). weight_first=True puts the weight first in the product ([N, rows], then a transpose): for a large
    weight such as a tied LM head XLA:CPU then runs one weight-streaming kernel where x-first took a small-M
    matrix-product path that cost about twice as much for 5-13 token verify blocks."""
    if out_dtype is None:
        out_dtype = jnp.result_type(x.dtype, w.dtype)
    if weight_first:
        lead = x.shape[:-1]
        out = jax.lax.dot_general(w, x.reshape(-1, x.shape[-1]), (((1,), (1,)), ((), ())),
                                  preferred_element_type=out_dtype)  # [N, rows]
        return out.T.reshape(*lead, out.shape[0])
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def prefix_tree_attention(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale, positions=None,
                          window=None):
    """Attention of T new tokens over the committed cache and over themselves, before they are written.

    q [B, T, Hq, D]; k_cache/v_cache [B, Hkv, S, D], of which slots s < lengths[b] are visible to every new
    token; k_new/v_new [B, T, Hkv, D]; tree_mask [B, T, T] bool (which new tokens each new token sees)
    -> [B, T, Hq, D]. The same result as writing the new K/V at [lengths, lengths + T) and calling
    `specjax.models.llama.reference_attention` with `llama.dense_mask`, but the cache is only read, as the left
    operand of both products: XLA:CPU then streams it once instead of materialising a transposed or updated copy
    of it (the write, after the layer's attention, is an in-place update nothing else reads). One softmax over
    both parts.
    window: a sliding window W (with positions [B, T], the new tokens' RoPE positions): a new token at position p
    sees only keys at positions > p - W, where committed slot s holds position s (prompts are right-padded, so
    slot and position agree) and new token j position positions[b, j]. None = no window.
    """
    B, T, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    f32 = jnp.float32
    # Rows n = g * T + t: every query of one KV head, so the cache is contracted once per head.
    qn = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    sp = jax.lax.dot_general(k_cache, qn.astype(k_cache.dtype), (((3,), (3,)), ((0, 1), (0, 1))),
                             preferred_element_type=f32)  # [B, Hkv, S, N]
    # Scores are small (S x N per head); with S minor the softmax below vectorises over the slots.
    sp = sp.swapaxes(2, 3) * scale  # [B, Hkv, N, S]
    # Behind a barrier: a fresh cache's lengths are a constant zero inside a jitted prefill, and XLA would then
    # constant-fold the masked scores' reductions over [B, Hkv, N, S] at compile time (seconds per bucket).
    visible = jnp.arange(S)[None, :] < jax.lax.optimization_barrier(lengths)[:, None]  # [B, S]
    if window is None:
        sp = jnp.where(visible[:, None, None, :], sp, -jnp.inf)
    else:
        low = positions - window  # [B, T]: the newest position each query no longer sees
        seen = visible[:, None, :] & (jnp.arange(S)[None, None, :] > low[:, :, None])  # [B, T, S]
        seen = jnp.broadcast_to(seen[:, None], (B, G, T, S)).reshape(B, 1, G * T, S)
        sp = jnp.where(seen, sp, -jnp.inf)
        tree_mask = tree_mask & (positions[:, None, :] > low[:, :, None])
    st = jnp.einsum("bknd,btkd->bknt", qn, k_new, preferred_element_type=f32) * scale  # [B, Hkv, N, T]
    tm = jnp.broadcast_to(tree_mask[:, None], (B, G, T, T)).reshape(B, 1, G * T, T)
    st = jnp.where(tm, st, -jnp.inf)
    m = jnp.maximum(sp.max(axis=3), st.max(axis=3))  # [B, Hkv, N]
    # A row with no visible key (padding queries) has m = -inf; it gets zero weights and a zero output.
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    ep = jnp.exp(sp - m[..., None])
    et = jnp.exp(st - m[..., None])
    den = ep.sum(axis=3) + et.sum(axis=3)  # [B, Hkv, N]
    o = jax.lax.dot_general(ep.astype(v_cache.dtype), v_cache, (((3,), (2,)), ((0, 1), (0, 1))),
                            preferred_element_type=f32)  # [B, Hkv, N, D]
    o = o + jnp.einsum("bknt,btkd->bknd", et.astype(v_new.dtype), v_new, preferred_element_type=f32)
    o = jnp.where(den[..., None] > 0, o / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return o.reshape(B, Hkv, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)


__all__ = ["matmul_t", "prefix_tree_attention"]
