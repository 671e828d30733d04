"""Verify (tree) attention kernels against the jnp reference, on CPU.

The Pallas kernels run in interpret mode; their legality for the real compilers is checked by cross-lowering
(`lower(lowering_platforms=("cuda",))` for Triton, `("tpu",)` for Mosaic), which runs the Pallas -> Triton/Mosaic
lowering and its block-shape checks without hardware. The reference itself is checked against a float64 NumPy
brute force that loops over queries, so a bug shared by reference and kernels cannot hide.

Error measure: rel = max|out - truth| / max|truth| over the whole output, truth = reference in float32 on the same
(dtype-rounded) inputs. Bounds: float32 < 1e-5, bfloat16 < 1e-2. A NaN anywhere fails.
"""
from __future__ import annotations

import dataclasses
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax.kernels.lse_merge import tree_attention_lse_merge
from specjax.kernels.pallas import tree_attention_gpu as gpu
from specjax.kernels.pallas import tree_attention_tpu as tpu
from specjax.kernels.reference import (
    prefix_attention_reference_lse,
    tree_attention_reference,
    tree_attention_reference_lse,
)
from specjax.kernels.validation import TreeAttentionInputError, UnsupportedConfigError

F32_TOL = 1e-5
BF16_TOL = 1e-2
MAX_DEPTH = 8

# Small blocks so the short prefixes of the fast tests still span several blocks with a ragged last one.
TRITON_SMALL = gpu.TritonBlockSizes(block_q=16, block_k=32)
TPU_SMALL = tpu.TpuBlockSizes(block_q=16, block_k=128, block_tree=128)



pytestmark = pytest.mark.usefixtures("fast_xla_compiles")


HYP = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------------------------ helpers


def random_parents(rng: np.random.Generator, num_nodes: int, max_depth: int = MAX_DEPTH) -> np.ndarray:
    """parent[i] < i (parent[0] = -1), every node at depth <= max_depth (root depth 1).

    Half the time a node extends the previous node (when that is allowed), so deep chains are common, not only
    the shallow bushy trees that uniform parent choice gives.
    """
    parents = np.full(num_nodes, -1, np.int64)
    depth = np.ones(num_nodes, np.int64)
    for i in range(1, num_nodes):
        if depth[i - 1] < max_depth and rng.random() < 0.5:
            parents[i] = i - 1
        else:
            parents[i] = rng.choice(np.flatnonzero(depth[:i] < max_depth))
        depth[i] = depth[parents[i]] + 1
    return parents


def tree_depth(parents: np.ndarray) -> int:
    return int(ancestor_mask(parents).sum(axis=1).max())


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[T, T] bool: mask[i, j] iff j is i or an ancestor of i."""
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def permute_tree(mask: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """The same tree with nodes stored in order perm (so the mask is no longer lower triangular)."""
    return mask[np.ix_(perm, perm)]


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    group: int
    kv_heads: int
    head_dim: int
    nodes: int
    lengths: tuple[int, ...]
    spare: int
    dtype: str
    nan_fill: bool
    shuffle: bool
    seed: int


def make_inputs(case: Case):
    """q, k, v, lengths, tree_mask as NumPy arrays (q/k/v in case.dtype; k/v head-major [B, Hkv, S, D])."""
    rng = np.random.default_rng(case.seed)
    num_q_heads = case.group * case.kv_heads
    seq_len = max(case.lengths) + case.nodes + case.spare
    q = rng.standard_normal((case.batch, case.nodes, num_q_heads, case.head_dim), np.float32)
    k = rng.standard_normal((case.batch, case.kv_heads, seq_len, case.head_dim), np.float32)
    v = rng.standard_normal((case.batch, case.kv_heads, seq_len, case.head_dim), np.float32)
    lengths = np.asarray(case.lengths, np.int32)
    if case.nan_fill:  # slots beyond lengths + T are unused: poison them, nothing may leak
        for b, length in enumerate(lengths):
            k[b, :, length + case.nodes :] = np.nan
            v[b, :, length + case.nodes :] = np.nan
    masks = []
    for _ in range(case.batch):
        mask = ancestor_mask(random_parents(rng, case.nodes))
        if case.shuffle:
            mask = permute_tree(mask, rng.permutation(case.nodes))
        masks.append(mask)
    dtype = jnp.dtype(case.dtype)
    cast = lambda x: np.asarray(jnp.asarray(x, dtype))
    return cast(q), cast(k), cast(v), lengths, np.stack(masks)


def truth(q, k, v, lengths, tree_mask, scale=None):
    """Reference on float32 copies of the inputs: (out, lse), both float32."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    out, lse = tree_attention_reference_lse(f32(q), f32(k), f32(v), lengths, tree_mask, scale=scale)
    return np.asarray(out), np.asarray(lse)


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.isfinite(ref).all(), "reference produced non-finite values"
    assert np.isfinite(out).all(), "output has NaN/inf"
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-6))


def tol(dtype) -> float:
    return F32_TOL if jnp.dtype(dtype) == jnp.float32 else BF16_TOL


def brute_force(q, k, v, lengths, tree_mask, scale=None) -> np.ndarray:
    """float64 loop over (b, t, h): softmax over the explicit list of visible slots."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        for t in range(num_tokens):
            slots = list(range(lengths[b])) + [lengths[b] + j for j in range(num_tokens) if tree_mask[b, t, j]]
            for h in range(num_q_heads):
                keys = k[b, h // group, slots].astype(np.float64)
                vals = v[b, h // group, slots].astype(np.float64)
                logits = keys @ q[b, t, h].astype(np.float64) * scale
                p = np.exp(logits - logits.max())
                out[b, t, h] = (p / p.sum()) @ vals
    return out


@st.composite
def cases(draw, *, max_prefix: int, head_dims, dtypes, max_nodes: int = 64, max_batch: int = 4):
    batch = draw(st.integers(1, max_batch))
    return Case(
        batch=batch,
        group=draw(st.sampled_from([1, 3, 8])),
        kv_heads=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from(head_dims)),
        nodes=draw(st.integers(1, max_nodes)),
        lengths=tuple(draw(st.lists(st.integers(0, max_prefix), min_size=batch, max_size=batch))),
        spare=draw(st.integers(0, 9)),
        dtype=draw(st.sampled_from(dtypes)),
        nan_fill=draw(st.booleans()),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def run_triton(q, k, v, lengths, tree_mask, blocks=TRITON_SMALL, **kw):
    return gpu.tree_attention_triton(q, k, v, lengths, tree_mask, block_sizes=blocks, interpret=True, **kw)


def run_tpu(q, k, v, lengths, tree_mask, blocks=TPU_SMALL, **kw):
    return tpu.tree_attention_tpu(q, k, v, lengths, tree_mask, block_sizes=blocks, interpret=True, **kw)


# ------------------------------------------------------------------------------------------- the reference


def test_tree_generator():
    rng = np.random.default_rng(0)
    depths = []
    for n in (1, 2, 9, 64):
        for _ in range(20):
            parents = random_parents(rng, n)
            mask = ancestor_mask(parents)
            assert (parents[1:] < np.arange(1, n)).all() and parents[0] == -1
            assert mask.diagonal().all() and mask[:, 0].all()  # node 0 is the root of every path
            depths.append(tree_depth(parents))
    assert max(depths) == MAX_DEPTH and min(depths) == 1


class TestReference:
    @settings(max_examples=12, **HYP)
    @given(cases(max_prefix=40, head_dims=[8, 16], dtypes=["float32"], max_nodes=12))
    def test_matches_bruteforce(self, case):
        q, k, v, lengths, tree_mask = make_inputs(case)
        out = tree_attention_reference(q, k, v, lengths, tree_mask)
        expect = brute_force(q, k, v, lengths, tree_mask)
        assert rel_err(out, expect) < F32_TOL

    def test_custom_scale_matches_bruteforce(self):
        case = Case(2, 3, 2, 16, 7, (5, 0), 3, "float32", True, True, 1)
        q, k, v, lengths, tree_mask = make_inputs(case)
        out = tree_attention_reference(q, k, v, lengths, tree_mask, scale=0.3)
        assert rel_err(out, brute_force(q, k, v, lengths, tree_mask, scale=0.3)) < F32_TOL

    def test_tree_mask_is_used(self):
        # Chain vs star over the same K/V: the last node sees different keys, so outputs must differ.
        case = Case(1, 1, 1, 16, 4, (3,), 0, "float32", False, False, 2)
        q, k, v, lengths, _ = make_inputs(case)
        chain = ancestor_mask(np.array([-1, 0, 1, 2]))[None]
        star = ancestor_mask(np.array([-1, 0, 0, 0]))[None]
        out_chain = np.asarray(tree_attention_reference(q, k, v, lengths, chain))
        out_star = np.asarray(tree_attention_reference(q, k, v, lengths, star))
        assert np.abs(out_chain[0, 3] - out_star[0, 3]).max() > 1e-3
        np.testing.assert_allclose(out_chain[0, :2], out_star[0, :2], rtol=1e-6)

    def test_lse_matches_bruteforce(self):
        case = Case(2, 2, 1, 8, 5, (4, 9), 2, "float32", False, False, 3)
        q, k, v, lengths, tree_mask = make_inputs(case)
        _, lse = tree_attention_reference_lse(q, k, v, lengths, tree_mask)
        b, t, h = 1, 4, 1
        slots = list(range(lengths[b])) + [lengths[b] + j for j in range(5) if tree_mask[b, t, j]]
        logits = k[b, 0, slots].astype(np.float64) @ q[b, t, h].astype(np.float64) / np.sqrt(8)
        expect = np.log(np.exp(logits - logits.max()).sum()) + logits.max()
        assert abs(float(lse[b, t, h]) - expect) < 1e-5

    def test_prefix_only_empty_prefix_is_zero_with_neg_inf_lse(self):
        case = Case(2, 1, 1, 8, 3, (0, 6), 0, "float32", True, False, 4)
        q, k, v, lengths, _ = make_inputs(case)
        out, lse = prefix_attention_reference_lse(q, k, v, lengths)
        assert np.all(np.asarray(out)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))
        assert np.isfinite(np.asarray(out)[1]).all() and np.isfinite(np.asarray(lse)[1]).all()


# ------------------------------------------------------------------------------------------------- kernels


KERNELS = {"triton": run_triton, "tpu": run_tpu}


class TestTritonKernel:
    @settings(max_examples=10, **HYP)
    @given(cases(max_prefix=150, head_dims=[16, 32], dtypes=["float32", "bfloat16"]))
    def test_matches_reference(self, case):
        q, k, v, lengths, tree_mask = make_inputs(case)
        out = run_triton(q, k, v, lengths, tree_mask)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert rel_err(out, truth(q, k, v, lengths, tree_mask)[0]) < tol(case.dtype)

    def test_lse_and_default_blocks(self):
        case = Case(2, 3, 2, 32, 9, (70, 0), 4, "float32", True, True, 5)
        q, k, v, lengths, tree_mask = make_inputs(case)
        out, lse = gpu.tree_attention_triton(q, k, v, lengths, tree_mask, interpret=True, return_lse=True)
        ref_out, ref_lse = truth(q, k, v, lengths, tree_mask)
        assert rel_err(out, ref_out) < F32_TOL
        np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)

    def test_prefix_only_mode(self):
        case = Case(3, 8, 1, 16, 4, (0, 33, 64), 1, "float32", True, False, 6)
        q, k, v, lengths, _ = make_inputs(case)
        out, lse = gpu.prefix_attention_triton_lse(q, k, v, lengths, block_sizes=TRITON_SMALL, interpret=True)
        ref_out, ref_lse = prefix_attention_reference_lse(q, k, v, lengths)
        assert rel_err(out, ref_out) < F32_TOL
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], rtol=1e-5, atol=1e-5)


class TestTpuKernel:
    @settings(max_examples=10, **HYP)
    @given(cases(max_prefix=300, head_dims=[32, 64, 128], dtypes=["float32", "bfloat16"]))
    def test_matches_reference(self, case):
        q, k, v, lengths, tree_mask = make_inputs(case)
        out = run_tpu(q, k, v, lengths, tree_mask)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert rel_err(out, truth(q, k, v, lengths, tree_mask)[0]) < tol(case.dtype)

    @pytest.mark.parametrize("kv_heads,head_dim", [(2, 128), (2, 64), (4, 32), (3, 64), (1, 16)])
    def test_head_dims(self, kv_heads, head_dim):
        # A [block_k, D] block of one head: D a multiple of 128, or narrower than the 128 lanes.
        case = Case(1, 2, kv_heads, head_dim, 5, (131,), 3, "float32", True, True, 7)
        q, k, v, lengths, tree_mask = make_inputs(case)
        out, lse = run_tpu(q, k, v, lengths, tree_mask, return_lse=True)
        ref_out, ref_lse = truth(q, k, v, lengths, tree_mask)
        assert rel_err(out, ref_out) < F32_TOL
        np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)

    def test_prefix_only_mode(self):
        case = Case(3, 3, 2, 64, 4, (0, 129, 256), 1, "bfloat16", True, False, 8)
        q, k, v, lengths, _ = make_inputs(case)
        out, lse = tpu.prefix_attention_tpu_lse(q, k, v, lengths, block_sizes=TPU_SMALL, interpret=True)
        f32 = lambda x: jnp.asarray(x, jnp.float32)
        ref_out, ref_lse = prefix_attention_reference_lse(f32(q), f32(k), f32(v), lengths)
        assert rel_err(out, ref_out) < BF16_TOL
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
class TestKernelEdgeCases:
    @pytest.mark.parametrize(
        "name,lengths,nodes,spare",
        [
            ("empty_prefix", (0, 0), 6, 5),
            ("decode_one_token", (37, 128), 1, 0),
            ("prefix_multiple_of_block", (128, 256), 3, 2),
            ("full_cache", (250, 90), 6, 0),  # lengths[0] == S - T
        ],
    )
    def test_edges(self, kernel, name, lengths, nodes, spare):
        case = Case(2, 3, 2, 32, nodes, lengths, spare, "float32", True, False, 9)
        q, k, v, lens, tree_mask = make_inputs(case)
        out = KERNELS[kernel](q, k, v, lens, tree_mask)
        assert rel_err(out, truth(q, k, v, lens, tree_mask)[0]) < F32_TOL

    def test_causal_chunk_prefill(self, kernel):
        # Chunked prefill: T new tokens with a causal (lower-triangular) mask, many rows per program.
        num_tokens = 40
        case = Case(1, 3, 1, 32, num_tokens, (77,), 0, "float32", False, False, 10)
        q, k, v, lens, _ = make_inputs(case)
        causal = np.tril(np.ones((num_tokens, num_tokens), bool))[None]
        out = KERNELS[kernel](q, k, v, lens, causal)
        assert rel_err(out, truth(q, k, v, lens, causal)[0]) < F32_TOL

    def test_nan_beyond_tree_does_not_leak_under_jit(self, kernel):
        case = Case(2, 1, 1, 32, 3, (5, 40), 20, "float32", True, False, 11)
        q, k, v, lens, tree_mask = make_inputs(case)
        fn = jax.jit(functools.partial(KERNELS[kernel]))
        out = np.asarray(fn(q, k, v, lens, tree_mask))
        assert np.isfinite(out).all()
        assert rel_err(out, truth(q, k, v, lens, tree_mask)[0]) < F32_TOL

    def test_lengths_clipped_under_jit(self, kernel):
        # Out-of-range lengths cannot be seen under jit; every implementation clips them to [0, S - T] alike.
        case = Case(2, 1, 1, 32, 3, (0, 0), 30, "float32", False, False, 12)
        q, k, v, _, tree_mask = make_inputs(case)
        seq_len = k.shape[2]
        bad = np.array([-4, seq_len + 7], np.int32)
        clipped = np.array([0, seq_len - 3], np.int32)
        out = jax.jit(KERNELS[kernel])(q, k, v, bad, tree_mask)
        assert rel_err(out, truth(q, k, v, clipped, tree_mask)[0]) < F32_TOL


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prefix(kernel, dtype):
    """Prefixes up to 1500 slots, not multiples of any block, with the shipped default tilings."""
    case = Case(3, 8, 1, 64, 33, (1499, 1037, 0), 7, dtype, True, True, 13)
    q, k, v, lengths, tree_mask = make_inputs(case)
    run = {
        "triton": functools.partial(gpu.tree_attention_triton, interpret=True),
        "tpu": functools.partial(tpu.tree_attention_tpu, interpret=True),
    }[kernel]
    out = run(q, k, v, lengths, tree_mask)
    assert rel_err(out, truth(q, k, v, lengths, tree_mask)[0]) < tol(dtype)


@pytest.mark.slow
@settings(max_examples=6, **HYP)
@given(cases(max_prefix=1500, head_dims=[32, 64], dtypes=["float32", "bfloat16"], max_batch=2))
def test_long_prefix_random(case):
    q, k, v, lengths, tree_mask = make_inputs(case)
    ref = truth(q, k, v, lengths, tree_mask)[0]
    assert rel_err(run_triton(q, k, v, lengths, tree_mask, blocks=gpu.TritonBlockSizes(32, 64)), ref) < tol(case.dtype)
    assert rel_err(run_tpu(q, k, v, lengths, tree_mask, blocks=tpu.DEFAULT_BLOCK_SIZES), ref) < tol(case.dtype)


# ---------------------------------------------------------------------------------------------- lse merge


class TestLseMerge:
    @settings(max_examples=10, **HYP)
    @given(cases(max_prefix=200, head_dims=[16, 32], dtypes=["float32", "bfloat16"]))
    def test_matches_reference(self, case):
        q, k, v, lengths, tree_mask = make_inputs(case)
        out, lse = tree_attention_lse_merge(q, k, v, lengths, tree_mask, return_lse=True)
        ref_out, ref_lse = truth(q, k, v, lengths, tree_mask)
        assert out.dtype == q.dtype
        assert rel_err(out, ref_out) < tol(case.dtype)
        np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("prefix_impl", ["pallas_triton", "pallas_tpu"])
    def test_pallas_prefix(self, prefix_impl):
        case = Case(2, 3, 2, 32, 6, (0, 150), 3, "float32", True, True, 14)
        q, k, v, lengths, tree_mask = make_inputs(case)
        out = tree_attention_lse_merge(q, k, v, lengths, tree_mask, prefix_impl=prefix_impl, interpret=True)
        assert rel_err(out, truth(q, k, v, lengths, tree_mask)[0]) < F32_TOL

    def test_unknown_prefix_impl(self):
        q, k, v, lengths, tree_mask = make_inputs(Case(1, 1, 1, 16, 2, (3,), 0, "float32", False, False, 0))
        with pytest.raises(TreeAttentionInputError, match="prefix_impl"):
            tree_attention_lse_merge(q, k, v, lengths, tree_mask, prefix_impl="magic")


# ------------------------------------------------------------------------------------------ cross-lowering


def _abstract_args(batch, num_tokens, num_q_heads, kv_heads, head_dim, seq_len, dtype):
    sds = jax.ShapeDtypeStruct
    return (
        sds((batch, num_tokens, num_q_heads, head_dim), dtype),
        sds((batch, kv_heads, seq_len, head_dim), dtype),
        sds((batch, kv_heads, seq_len, head_dim), dtype),
        sds((batch,), jnp.int32),
        sds((batch, num_tokens, num_tokens), jnp.bool_),
    )


def _lower(fn, args, platform):
    """Lower for `platform` on this (CPU) host. For cuda the target GPU is named by an abstract mesh: jax 0.11's
    Triton lowering reads the GPU's generation from it when no GPU is attached (0.10 did not need it)."""
    ctx = contextlib.nullcontext()
    if platform == "cuda":
        gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
        ctx = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu))
    with ctx:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


class TestCrossLowering:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("block_q,block_k,head_dim", gpu.SHIPPED_CONFIGS)
    def test_triton_shipped_configs(self, block_q, block_k, head_dim, dtype):
        # Rows T * G = 4 * 8 = 32 (capped by block_q), cache 1000 slots (not a multiple of block_k).
        args = _abstract_args(2, 4, 16, 2, head_dim, 1000, dtype)
        blocks = gpu.TritonBlockSizes(block_q=block_q, block_k=block_k)
        assert gpu.default_block_sizes(block_q, head_dim) == blocks  # the configs are what the wrapper picks
        for include_tree in (True, False):
            fn = functools.partial(
                gpu._tree_attention_triton_jit, scale=0.125, block_sizes=blocks, include_tree=include_tree,
                interpret=False,
            )
            text = _lower(fn, args, "cuda")
            assert "__gpu$xla.gpu.triton" in text

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("blocks", tpu.SHIPPED_CONFIGS, ids=lambda b: f"q{b.block_q}k{b.block_k}t{b.block_tree}")
    @pytest.mark.parametrize(
        "shape",
        [
            (2, 1, 32, 8, 128, 4096),  # decode, D = 128
            (1, 64, 24, 8, 128, 3000),  # tree / chunk, GQA 3, cache not a multiple of block_k
            (2, 16, 8, 2, 64, 1000),  # D = 64: half of the 128 lanes
            (1, 5, 9, 3, 64, 700),  # SmolLM2's heads
            (1, 7, 4, 1, 64, 100),  # cache shorter than 128 slots
        ],
        ids=["decode_d128", "tree_d128", "d64", "smollm2", "tiny_cache"],
    )
    def test_tpu_shipped_configs(self, blocks, shape, dtype):
        args = _abstract_args(*shape, dtype)
        for include_tree in (True, False):
            fn = functools.partial(
                tpu._tree_attention_tpu_jit, scale=0.125, block_sizes=blocks, include_tree=include_tree,
                interpret=False,
            )
            assert "tpu_custom_call" in _lower(fn, args, "tpu")

    def test_tpu_lowering_rejects_illegal_block(self):
        # The cross-lowering check has teeth: a block of 12 slots (not a multiple of 8) must be refused.
        bad = tpu.TpuBlockSizes()
        object.__setattr__(bad, "block_k", 12)
        fn = functools.partial(
            tpu._tree_attention_tpu_jit, scale=0.125, block_sizes=bad, include_tree=True, interpret=False
        )
        with pytest.raises(ValueError, match="divisible by 8 and 128"):
            _lower(fn, _abstract_args(1, 3, 4, 2, 128, 600, jnp.bfloat16), "tpu")

    def test_triton_lowering_rejects_non_power_of_two(self):
        bad = gpu.TritonBlockSizes()
        object.__setattr__(bad, "block_k", 48)
        fn = functools.partial(
            gpu._tree_attention_triton_jit, scale=0.125, block_sizes=bad, include_tree=True, interpret=False
        )
        with pytest.raises(Exception, match="power of 2"):
            _lower(fn, _abstract_args(1, 3, 4, 2, 64, 600, jnp.bfloat16), "cuda")


# -------------------------------------------------------------------------------------------- validation


def _good(batch=2, num_tokens=3, num_q_heads=4, kv_heads=2, head_dim=16, seq_len=20):
    case = Case(batch, num_q_heads // kv_heads, kv_heads, head_dim, num_tokens, (2,) * batch,
                seq_len - 2 - num_tokens, "float32", False, False, 0)
    return make_inputs(case)


def _bad_inputs():
    q, k, v, lengths, mask = _good()
    off_diag = mask.copy()
    off_diag[1, 2, 2] = False
    return {
        "q_rank": ((q[0], k, v, lengths, mask), {}, "q must be"),
        "k_rank": ((q, k[0], v, lengths, mask), {}, "k must be"),
        "v_shape": ((q, k, v[:, :-1], lengths, mask), {}, "v shape"),
        "batch": ((q[:1], k, v, lengths, mask), {}, "batch mismatch"),
        "head_dim": ((q[..., :8], k, v, lengths, mask), {}, "head_dim mismatch"),
        "gqa": ((q[:, :, :3], k, v, lengths, mask), {}, "Hq % Hkv"),
        "too_many_tokens": ((np.zeros((2, 21, 4, 16), np.float32), k, v, lengths,
                             np.ones((2, 21, 21), bool)), {}, "do not fit"),
        "dtype_mismatch": ((q.astype(jnp.bfloat16), k, v, lengths, mask), {}, "share one dtype"),
        "int_dtype": ((q.astype(np.int32), k.astype(np.int32), v.astype(np.int32), lengths, mask), {}, "not supported"),
        "lengths_shape": ((q, k, v, lengths[:1], mask), {}, "lengths must be"),
        "lengths_dtype": ((q, k, v, lengths.astype(np.float32), mask), {}, "integer"),
        "mask_shape": ((q, k, v, lengths, mask[:, :2]), {}, "tree_mask must be"),
        "mask_dtype": ((q, k, v, lengths, mask.astype(np.int32)), {}, "must be bool"),
        "diag_false": ((q, k, v, lengths, off_diag), {}, r"tree_mask\[1, 2, 2\] is False"),
        "negative_length": ((q, k, v, np.array([2, -1], np.int32), mask), {}, r"lengths\[1\]=-1"),
        "length_too_big": ((q, k, v, np.array([18, 2], np.int32), mask), {}, r"S - T = 17"),
        "scale_negative": ((q, k, v, lengths, mask), {"scale": -1.0}, "positive"),
        "scale_nan": ((q, k, v, lengths, mask), {"scale": float("nan")}, "positive"),
        "not_array": ((q.tolist(), k, v, lengths, mask), {}, "must be an array"),
    }


IMPLS = {
    "reference": tree_attention_reference,
    "lse_merge": tree_attention_lse_merge,
    "triton": functools.partial(gpu.tree_attention_triton, interpret=True),
    "tpu": functools.partial(tpu.tree_attention_tpu, interpret=True),
}


class TestValidation:
    @pytest.mark.parametrize("impl", sorted(IMPLS))
    @pytest.mark.parametrize("bad", sorted(_bad_inputs()))
    def test_bad_input_raises_clear_error(self, impl, bad):
        args, kwargs, message = _bad_inputs()[bad]
        with pytest.raises(TreeAttentionInputError, match=message):
            IMPLS[impl](*args, **kwargs)

    def test_error_is_value_error_and_one_line(self):
        args, kwargs, _ = _bad_inputs()["gqa"]
        with pytest.raises(ValueError) as info:
            tree_attention_reference(*args, **kwargs)
        assert "\n" not in str(info.value)

    def test_value_checks_skipped_under_jit_but_shapes_checked(self):
        q, k, v, lengths, mask = _good()
        off_diag = mask.copy()
        off_diag[0, 0, 0] = False
        jax.jit(tree_attention_reference)(q, k, v, lengths, off_diag)  # values unknown at trace time: no error
        with pytest.raises(TreeAttentionInputError, match="Hq % Hkv"):
            jax.jit(tree_attention_reference)(q[:, :, :3], k, v, lengths, mask)

    def test_triton_rejects_head_dim(self):
        q, k, v, lengths, mask = _good(head_dim=24)
        with pytest.raises(UnsupportedConfigError, match="power of two"):
            gpu.tree_attention_triton(q, k, v, lengths, mask, interpret=True)

    def test_tpu_rejects_float16(self):
        q, k, v, lengths, mask = _good()
        f16 = lambda x: x.astype(np.float16)
        with pytest.raises(UnsupportedConfigError, match="float32 and bfloat16"):
            tpu.tree_attention_tpu(f16(q), f16(k), f16(v), lengths, mask, interpret=True)

    @pytest.mark.parametrize(
        "make",
        [
            lambda: gpu.TritonBlockSizes(block_q=24),
            lambda: gpu.TritonBlockSizes(block_k=8),
            lambda: tpu.TpuBlockSizes(block_q=24),
            lambda: tpu.TpuBlockSizes(block_k=200),
            lambda: tpu.TpuBlockSizes(block_tree=64),
        ],
    )
    def test_bad_block_sizes(self, make):
        with pytest.raises(UnsupportedConfigError):
            make()
