"""A Llama-family decoder as pure functions over a params pytree.

Covers Llama 1/2/3 (incl. Llama-3 `rope_scaling`, also as llama.cpp's per-frequency factors), SmolLM, Mistral
(with its sliding window), Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm per head). One `forward` serves prefill,
one-token decode and chain/tree verification: it writes the K/V of the T new tokens into the cache at slots
[lengths[b], lengths[b] + T) and attends with either a tree mask
(ancestor-or-self among the new tokens, everything below `lengths` visible) or an arbitrary dense mask.
It never changes `cache.lengths`: only the caller knows how many of the T tokens are kept.

Params pytree. Layers are a list of per-layer dicts and the layer loop is unrolled in Python: on XLA:CPU a
`lax.scan` over stacked weights copies every layer's weights out of the stack on each step, and decode is bound
by exactly those weight reads (reports/decode_cpu/README.md).
    embed       [V, H]
    layers      L x {attn_norm [H], wq [H, Hq*D], wk/wv [H, Hkv*D], (bq [Hq*D], bk/bv [Hkv*D]),
                     (q_norm/k_norm [D], Qwen3), wo [Hq*D, H], mlp_norm [H], w_gate/w_up [H, F], w_down [F, H]}
    final_norm  [H]
    lm_head     [H, V]   (absent when the embeddings are tied)
`param_axes(config)` gives the same tree with logical axis names for sharding.

`fuse_projections` turns this canonical layout into the inference layout `LLM` runs, with fewer, wider products
stored [out, in]: per layer wqkv_t [(Hq+2Hkv)*D, H] (and bqkv [(Hq+2Hkv)*D]) in place of wq/wk/wv, wo_t [H, Hq*D],
w_gu_t [2F, H] in place of w_gate/w_up, and w_down_t [H, F]. `forward` accepts either (the pytree's keys are
static under jit). Why, measured on XLA:CPU with SmolLM2-135M: a one-token product runs on one core unless it is
large enough to be split across threads, and the fused ones are; and products of several tokens contract the
weights' minor axis faster in the [out, in] layout (figures: reports/decode_cpu/README.md, decode_fused.json).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from specjax.backends import ops
from specjax.backends.ops import under_mesh
from specjax.models import quant
from specjax.kv_cache import KVCache, as_stored, dequantize, with_layers, write_kv


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family model. Frozen and hashable: it is a static argument of every jit."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 scaling as a sorted tuple of (key, value) so the config stays hashable; None = plain RoPE.
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "llama"
    # Qwen3: an RMSNorm over each head's query and key (weights q_norm / k_norm [D]) before RoPE.
    qk_norm: bool = False
    # Mistral: a query at position p attends only to keys at positions > p - sliding_window; None = no window.
    sliding_window: int | None = None
    # llama.cpp's `rope_freqs.weight` (Llama-3.1/3.2 GGUF files store the llama3 scaling this way): the inverse
    # frequencies [D/2] are divided by these factors. A tuple so the config stays hashable; None = none.
    rope_freq_factors: tuple | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be >= 1, or None for full attention")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} values; head_dim "
                             f"{self.head_dim} needs {self.head_dim // 2}")

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [B, K, V] float32 (K = T, or the number of logit_positions)
    hidden: jax.Array  # [B, T, H] final hidden state after the last norm (what the LM head reads)
    layer_hidden: jax.Array | None  # [len(hidden_layers), B, T, H] residual stream after the requested layers
    cache: KVCache  # with the T new entries written at [lengths, lengths + T), unless forward(write_cache=False)
    # the T new entries of every layer: (k, v), each a tuple of [B, T, Hkv, D], for callers that write them later
    # (in the model's dtype: `kv_cache.write_path` quantizes them for an int8 cache)
    new_kv: tuple | None = None


def param_axes(config: LlamaConfig) -> dict:
    """Logical axis names of every parameter (same tree structure as the params)."""
    layer = {
        "attn_norm": ("embed",),
        "wq": ("embed", "heads"),
        "wk": ("embed", "kv_heads"),
        "wv": ("embed", "kv_heads"),
        "wo": ("heads", "embed"),
        "mlp_norm": ("embed",),
        "w_gate": ("embed", "mlp"),
        "w_up": ("embed", "mlp"),
        "w_down": ("mlp", "embed"),
    }
    if config.attention_bias:
        layer.update(bq=("heads",), bk=("kv_heads",), bv=("kv_heads",))
    if config.qk_norm:
        layer.update(q_norm=("head_dim",), k_norm=("head_dim",))
    axes = {"embed": ("vocab", "embed"), "layers": [dict(layer) for _ in range(config.num_layers)],
            "final_norm": ("embed",)}
    if not config.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def fuse_projections(params: dict) -> dict:
    """The inference layout of canonical params (see the module docstring): a new tree, the input untouched.
    Layers already in the inference layout pass through."""
    def fuse(lp: dict) -> dict:
        if "wqkv_t" in lp:
            return dict(lp)
        out = {k: v for k, v in lp.items() if k in ("attn_norm", "mlp_norm", "q_norm", "k_norm")}
        out["wqkv_t"] = jnp.concatenate([lp["wq"], lp["wk"], lp["wv"]], axis=1).T
        if "bq" in lp:
            out["bqkv"] = jnp.concatenate([lp["bq"], lp["bk"], lp["bv"]])
        out["wo_t"] = lp["wo"].T
        out["w_gu_t"] = jnp.concatenate([lp["w_gate"], lp["w_up"]], axis=1).T
        out["w_down_t"] = lp["w_down"].T
        return out

    return {**params, "layers": [fuse(lp) for lp in params["layers"]]}


def shard_hint(x: jax.Array, *axes: str | None) -> jax.Array:
    """x with a sharding constraint naming one mesh axis ('data', 'model') or None per dimension, under a mesh;
    a dimension the axis does not divide stays replicated. x itself outside a mesh. Pins the batch to the data
    axis and the KV heads to the model axis, where propagation alone could pick otherwise."""
    if not under_mesh():
        return x
    mesh = jax.sharding.get_abstract_mesh()
    spec = tuple(a if a in mesh.axis_names and mesh.shape[a] > 1 and n % mesh.shape[a] == 0 else None
                 for a, n in zip(axes, x.shape))
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*spec))


def param_shapes(config: LlamaConfig) -> dict:
    """Expected shape of every parameter (same tree structure as the params)."""
    c = config
    L, H, F = c.num_layers, c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = {
        "attn_norm": (H,), "wq": (H, q), "wk": (H, kv), "wv": (H, kv), "wo": (q, H),
        "mlp_norm": (H,), "w_gate": (H, F), "w_up": (H, F), "w_down": (F, H),
    }
    if c.attention_bias:
        layer.update(bq=(q,), bk=(kv,), bv=(kv,))
    if c.qk_norm:
        layer.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
    shapes = {"embed": (c.vocab_size, H), "layers": [dict(layer) for _ in range(L)], "final_norm": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (H, c.vocab_size)
    return shapes


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random params (for tests and for training a draft model from scratch)."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    # Norm weights start at one (identity), everything else small and random.
    out = [jnp.ones(shape, dtype) if "norm" in path else (scale * jax.random.normal(k, shape)).astype(dtype)
           for k, shape, path in zip(keys, leaves, paths)]
    return jax.tree_util.tree_unflatten(treedef, out)


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum(spec, a, b) with float32 products and sums, whatever the operands' dtype.

    XLA:CPU fuses a half-precision dot that returns float32 with the reduction after it (a log-softmax, an
    attention softmax) into one fused call whose dot then fails at run time ("Unsupported element type for
    DotThunk::Execute: BF16 x BF16 = F32", the EAGLE-3 head at batch 4). On CPU the operands are widened first:
    a bfloat16 or float16 product is exact in float32, so only the path changes, not the value of a product."""
    if jax.default_backend() == "cpu":
        a = a.astype(jnp.float32) if a.dtype in (jnp.bfloat16, jnp.float16) else a
        b = b.astype(jnp.float32) if b.dtype in (jnp.bfloat16, jnp.float16) else b
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def fixed_order_sum(y: jax.Array, lanes: int = 16) -> jax.Array:
    """y [..., D] -> [..., 1]: the sum over the last axis in one order whatever the leading shape.

    XLA:CPU picks a reduction's summation order from the whole operand's shape, so the same row summed inside a
    [4, 1, D] block and inside a [4, 5, D] block can differ in the last bit: a plain step and a verify block then
    normalise one token differently, which bfloat16 rounding and an int8 KV cache turn into different tokens.
    Elementwise adds are never reordered, so the sum is a pairwise fold of D/lanes slices of `lanes` values
    (zero-padded to a power of two), then of the lanes: log2 steps, a fixed tree."""
    D = y.shape[-1]
    n = max(1, -(-D // lanes))
    n2 = 1 << (n - 1).bit_length()
    y = jnp.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, n2 * lanes - D)]).reshape(*y.shape[:-1], n2, lanes)
    while y.shape[-2] > 1:
        h = y.shape[-2] // 2
        y = y[..., :h, :] + y[..., h:, :]
    y = y[..., 0, :]
    while y.shape[-1] > 1:
        h = y.shape[-1] // 2
        y = y[..., :h] + y[..., h:]
    return y


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32 (bf16 variance loses too much), result in x's dtype. The mean of squares is summed in a
    fixed order (`fixed_order_sum`), so a token is normalised bit for bit alike in any block shape."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(fixed_order_sum(xf * xf) / xf.shape[-1] + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> jax.Array:
    """[D/2] inverse frequencies, with Llama-3 frequency-dependent scaling when configured."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if config.rope_freq_factors is not None:
        inv = inv / jnp.asarray(config.rope_freq_factors, jnp.float32)
    sc = config.rope_scaling_dict
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / sc["factor"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}: supported are 'llama3' and 'linear'")
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = jnp.where(wavelen > old / lo, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
    return jnp.where(is_mid, mid, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [B, T, N, D], positions [B, T] -> [B, T, N, D]."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def dense_mask(lengths: jax.Array, tree_mask: jax.Array, capacity: int) -> jax.Array:
    """[B, T, S] bool: slot s is visible to new token t iff s < lengths[b], or s = lengths[b] + j with tree_mask[b, t, j]."""
    T = tree_mask.shape[-1]
    s = jnp.arange(capacity)
    rel = s[None, :] - lengths[:, None]  # [B, S]: index among the new tokens, or negative for the prefix
    prefix = rel < 0
    in_tree = (rel >= 0) & (rel < T)
    tree_part = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, T - 1)[:, None, :], tree_mask.shape[:2] + (capacity,)), axis=2
    )
    return prefix[:, None, :] | (in_tree[:, None, :] & tree_part)


def reference_attention(q, k, v, mask, scale):
    """q [B, T, Hq, D], k/v [B, Hkv, S, D] (the cache layout), mask [B, T, S] bool -> [B, T, Hq, D].

    GQA without repeating K/V. Attends to whatever the mask allows, so the new tokens' K/V must already be in
    k/v; the dense-mask override and the EAGLE head use it.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    s = einsum_f32("btkgd,bksd->bkgts", qg, k) * scale
    s = jnp.where(mask[:, None, None, :, :], s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    # A row with no visible key (padding queries) gives NaN from softmax; zero it so it never spreads.
    w = jnp.where(jnp.isnan(w), 0.0, w).astype(v.dtype)
    o = einsum_f32("bkgts,bksd->btkgd", w, v)
    return o.reshape(B, T, Hq, D).astype(q.dtype)


AttentionFn = Callable[..., jax.Array]  # (q, k, v, lengths, tree_mask, *, scale) -> out, see specjax.kernels


def forward(
    params: dict,
    config: LlamaConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    tree_mask: jax.Array | None = None,
    *,
    mask: jax.Array | None = None,
    hidden_layers: tuple[int, ...] = (),
    logit_positions: jax.Array | None = None,
    attention_fn: AttentionFn | None = None,
    compute_logits: bool = True,
    write_cache: bool = True,
) -> ForwardOutput:
    """Run the decoder on T new tokens per sequence.

    tokens [B, T] int32, positions [B, T] int32 (RoPE positions: for trees, prefix length + node depth).
    cache: a float or an int8 KVCache (`kv_cache.init_cache(kv_dtype=...)`); attention reads an int8 one back in the
    params' dtype (`kv_cache.dequantize`), whichever attention path runs.
    tree_mask [B, T, T] bool: which new tokens each new token sees (causal for prefill and chains, the
    ancestor-or-self mask for trees). Defaults to causal. `mask` [B, T, S] bool overrides it with an arbitrary
    mask over all cache slots (reference attention only), taken as given: it must carry any sliding window itself.
    A sliding-window model (config.sliding_window) runs only with the default attention (attention_fn=None, the
    XLA path, which applies the window to prefill, decode and tree verification alike); an attention_fn is refused.
    hidden_layers: indices (negative allowed) of layers whose output (residual stream) is returned in `layer_hidden`.
    logit_positions [B, K] int32: compute logits only at these of the T positions (prefill needs one).
    attention_fn: a named verify-attention implementation (q, k, v, lengths, tree_mask, scale=) from the backend
    registry; None = the kernel table's op `attention` (see `attention`). Not jitted here: callers jit their entry
    points.
    write_cache: False leaves the cache as it is (the default attention path reads only its committed slots and
    takes the new tokens apart) and the caller writes `new_kv` where it wants them; see `spec_engine.spec_step`,
    where writing inside a `lax.cond` branch made XLA copy the whole cache.
    """
    B, T = tokens.shape
    c = config
    if tree_mask is None:
        tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    _check_attention_args(c, mask, attention_fn, write_cache)
    inv_freq = rope_inv_freq(c)
    x = shard_hint(jnp.take(params["embed"], tokens, axis=0), "data", None, None)  # [B, T, H]
    wanted = {h % c.num_layers for h in hidden_layers}
    layers, kept, block_k, block_v = [], {}, [], []
    for i, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["attn_norm"], c.rms_norm_eps)
        q, k, v = qkv_projection(lp, c, h)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        layer = write_kv(cache.k[i], cache.v[i], k, v, cache.lengths, cache.scales(i)) if write_cache else (
            (cache.k[i], cache.v[i]) + ((cache.scales(i),) if cache.quantized else ()))
        layer = tuple(shard_hint(a, "data", "model", None, None) for a in layer[:2]) + layer[2:]
        a = attention(q, k, v, layer, cache.lengths, tree_mask, positions, c, mask=mask, attention_fn=attention_fn,
                      dtype=params["embed"].dtype)
        x = x + output_projection(lp, a.reshape(B, T, -1))
        x = x + mlp_block(lp, c, rms_norm(x, lp["mlp_norm"], c.rms_norm_eps))
        layers.append(layer)
        block_k.append(k)
        block_v.append(v)
        if i in wanted:
            kept[i] = x
    layer_hidden = jnp.stack([kept[h % c.num_layers] for h in hidden_layers]) if hidden_layers else None
    x = rms_norm(x, params["final_norm"], c.rms_norm_eps)
    logits = None
    if compute_logits:
        xs = x if logit_positions is None else jnp.take_along_axis(x, logit_positions[..., None], axis=1)
        logits = lm_head(params, xs)
    return ForwardOutput(logits, x, layer_hidden, with_layers(cache, layers), (tuple(block_k), tuple(block_v)))


def _check_attention_args(c: LlamaConfig, mask, attention_fn, write_cache: bool) -> None:
    if mask is not None and attention_fn is not None:
        raise ValueError("a dense `mask` works only with the reference attention (attention_fn=None)")
    if not write_cache and (mask is not None or attention_fn is not None):
        raise ValueError("write_cache=False works only with the default attention (no `mask`, no attention_fn): "
                         "the others read the new tokens from the cache")
    if c.sliding_window is not None and attention_fn is not None:
        raise ValueError(f"this model uses sliding-window attention (sliding_window={c.sliding_window}), which only "
                         "specjax's built-in XLA attention applies; attention "
                         f"{getattr(attention_fn, 'name', attention_fn)!r} would attend past the window: use "
                         "attention_impl='reference' (attention_fn=None)")


def qkv_projection(lp: dict, c: LlamaConfig, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [B, T, H] -> q [B, T, Hq, D], k and v [B, T, Hkv, D] (biases and Qwen3's q/k norms applied, no RoPE)."""
    B, T = h.shape[:2]
    if "wqkv_t" in lp:
        qkv = quant.linear(h, lp["wqkv_t"])
        if c.attention_bias:
            qkv = qkv + lp["bqkv"]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
    else:
        q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
        if c.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k = q.reshape(B, T, c.num_heads, c.head_dim), k.reshape(B, T, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], c.rms_norm_eps), rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    return q, k, v.reshape(B, T, c.num_kv_heads, c.head_dim)


def attention(q, k, v, layer: tuple, lengths, tree_mask, positions, c: LlamaConfig, *, mask=None,
              attention_fn=None, dtype=None) -> jax.Array:
    """One layer's attention of the T new tokens (q [B, T, Hq, D], k/v [B, T, Hkv, D] after RoPE) over the
    layer's cache entries `layer` ((k, v) or an int8 cache's (k, v, (k_scale, v_scale)), as `write_kv` returns
    them) -> [B, T, Hq, D].

    The one place the attention path is chosen: a dense `mask` runs `reference_attention` over the written cache,
    an `attention_fn` (a named `tree_attention` from the backend registry) reads the written cache as it is, and
    otherwise the kernel table's op `attention` takes the new tokens apart from the committed slots (the C++ kernel
    on cpu for decode and verify blocks; XLA's `prefix_tree_attention` under a mesh, for a sliding window and for
    prefill). Those read only the committed slots below `lengths`, which the write leaves alone; they read them
    after the write because an operation that read the old buffer while the write updated it in place made XLA
    copy the cache layer.
    An int8 cache is read back in the model's dtype `dtype`, and the new tokens are attended to as the cache will
    hold them (`as_stored`): every path then sees what it sees for a float cache, and a token sees an earlier one
    the same whether that one is in the cache or in the same block, so plain decoding and verification agree."""
    cache_k, cache_v = layer[:2]
    quantized = len(layer) > 2
    if quantized:
        k_scale, v_scale = layer[2]
        cache_k, cache_v = dequantize(cache_k, k_scale, dtype), dequantize(cache_v, v_scale, dtype)
    scale = 1.0 / math.sqrt(c.head_dim)
    if mask is not None:
        return reference_attention(q, cache_k, cache_v, mask, scale)
    if attention_fn is not None:
        # The kernels take the head-major cache as it is (see specjax.backends.registry).
        return attention_fn(q, cache_k, cache_v, lengths, tree_mask, scale=scale)
    k_in, v_in = as_stored(k, quantized), as_stored(v, quantized)
    return ops.call("attention", q, cache_k, cache_v, k_in, v_in, lengths, tree_mask, scale=scale,
                    positions=positions, window=c.sliding_window)


def output_projection(lp: dict, a: jax.Array) -> jax.Array:
    """The attention output [B, T, Hq*D] -> [B, T, H]."""
    return quant.linear(a, lp["wo_t"]) if "wo_t" in lp else a @ lp["wo"]


def mlp_block(lp: dict, c: LlamaConfig, h: jax.Array) -> jax.Array:
    """SwiGLU: h [B, T, H] (normed) -> [B, T, H]."""
    if "w_gu_t" in lp:
        gu = quant.linear(h, lp["w_gu_t"])
        m = jax.nn.silu(gu[..., :c.intermediate_size]) * gu[..., c.intermediate_size:]
        return quant.linear(m, lp["w_down_t"])
    return (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]


def lm_head(params: dict, x: jax.Array) -> jax.Array:
    """x [..., H] -> logits [..., V] float32 (tied embeddings when there is no `lm_head`)."""
    if "lm_head_q" in params:  # a quantized LM head [V, H] (specjax.models.quant.quantize_params(lm_head=True))
        return quant.linear(x, params["lm_head_q"], out_dtype=jnp.float32)
    if "lm_head" in params:
        return einsum_f32("...h,hv->...v", x, params["lm_head"])
    # The embedding [V, H] goes first in XLA's product (weight_first; see specjax.kernels.xla.matmul_t).
    return ops.call("matmul", x, params["embed"], out_dtype=jnp.float32, weight_first=True)


def cast_params(params: dict, dtype) -> dict:
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
