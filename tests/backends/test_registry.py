"""Attention registry and compile policies (specjax.backends.registry), on CPU."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.backends import (
    ATTENTION_NAMES,
    COMPILE_POLICIES,
    PLATFORMS,
    AttentionUnavailableError,
    CompilePolicy,
    available_attention,
    get_attention,
    get_compile_policy,
    normalize_platform,
    register_attention,
    registered_attention,
)
from specjax.backends import registry as registry_module
from specjax.kernels.pallas.tree_attention_gpu import TritonBlockSizes
from specjax.kernels.reference import tree_attention_reference
from specjax.kernels.validation import UnsupportedConfigError


def _inputs(head_dim=16, dtype=np.float32, num_q_heads=4, kv_heads=2, seed=0):
    rng = np.random.default_rng(seed)
    batch, num_tokens, seq_len = 2, 4, 40
    q = rng.standard_normal((batch, num_tokens, num_q_heads, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, seq_len, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, seq_len, head_dim)).astype(dtype)
    lengths = np.array([3, 29], np.int32)
    tree_mask = np.broadcast_to(np.tril(np.ones((num_tokens, num_tokens), bool)), (batch, num_tokens, num_tokens))
    return q, k, v, lengths, np.ascontiguousarray(tree_mask)


@pytest.fixture
def restore_registry():
    saved = dict(registry_module._REGISTRY)
    yield
    registry_module._REGISTRY.clear()
    registry_module._REGISTRY.update(saved)


class TestAvailability:
    def test_names(self):
        assert set(ATTENTION_NAMES) - {"auto", "pallas"} <= set(registered_attention())

    @pytest.mark.parametrize(
        "platform,expected",
        [
            ("cpu", ("auto", "reference", "lse_merge")),
            ("gpu", ("auto", "pallas", "pallas_triton", "reference", "lse_merge")),
            ("tpu", ("auto", "pallas", "pallas_tpu", "reference", "lse_merge")),
            ("neuron", ("auto", "reference")),
        ],
    )
    def test_available_per_platform(self, platform, expected):
        assert available_attention(platform) == expected

    def test_interpret_makes_pallas_available_on_cpu(self):
        names = available_attention("cpu", interpret=True)
        assert {"pallas", "pallas_triton", "pallas_tpu"} <= set(names)

    def test_platform_names(self):
        assert normalize_platform("cuda") == "gpu" and normalize_platform("ROCM") == "gpu"
        assert normalize_platform(None) == jax.default_backend() == "cpu"
        with pytest.raises(AttentionUnavailableError, match="unknown platform"):
            normalize_platform("metal")


class TestAuto:
    def test_cpu_auto_is_reference(self):
        fn = get_attention()
        args = _inputs()
        assert fn.platform == "cpu" and fn.select(*args).name == "reference"
        np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(tree_attention_reference(*args)))

    @pytest.mark.parametrize("platform,kernel", [("gpu", "pallas_triton"), ("tpu", "pallas_tpu")])
    def test_accelerator_auto_prefers_pallas(self, platform, kernel):
        assert get_attention("auto", platform).select(*_inputs()).name == kernel

    def test_auto_falls_back_when_kernel_unsupported(self):
        # head_dim 24 is not a power of two: no Triton tiling, so "auto" on gpu must fall back to the reference.
        assert get_attention("auto", "gpu").select(*_inputs(head_dim=24)).name == "reference"
        # float16 is not supported by the TPU kernel.
        assert get_attention("auto", "tpu").select(*_inputs(dtype=np.float16)).name == "reference"

    def test_neuron_auto_is_reference(self):
        assert get_attention("auto", "neuron").select(*_inputs()).name == "reference"

    def test_auto_with_interpret_runs_the_kernel_on_cpu(self):
        fn = get_attention("auto", "gpu", interpret=True)
        args = _inputs(seed=1)
        assert fn.select(*args).name == "pallas_triton"
        np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(tree_attention_reference(*args)), atol=1e-5)

    def test_auto_takes_no_options(self):
        with pytest.raises(AttentionUnavailableError, match="named implementation"):
            get_attention("auto", block_sizes=TritonBlockSizes())

    def test_auto_is_hashable_and_works_under_jit(self):
        fn = get_attention()
        hash(fn)
        args = _inputs(seed=2)
        out = jax.jit(fn)(*args)
        np.testing.assert_allclose(np.asarray(out), np.asarray(tree_attention_reference(*args)), atol=1e-6)


class TestNamed:
    @pytest.mark.parametrize("name", ["reference", "lse_merge"])
    def test_portable_names_on_cpu(self, name):
        args = _inputs(seed=3)
        out = get_attention(name)(*args, scale=0.2)
        np.testing.assert_allclose(
            np.asarray(out), np.asarray(tree_attention_reference(*args, scale=0.2)), atol=1e-5
        )

    @pytest.mark.parametrize("name", ["pallas_triton", "pallas_tpu", "pallas"])
    def test_pallas_unavailable_on_cpu_lists_alternatives(self, name):
        with pytest.raises(AttentionUnavailableError, match="available there: auto, reference, lse_merge"):
            get_attention(name)

    def test_wrong_accelerator(self):
        with pytest.raises(AttentionUnavailableError, match="'pallas_tpu' is not available on 'gpu'") as info:
            get_attention("pallas_tpu", "gpu")
        assert "pallas_triton" in str(info.value)

    def test_unknown_name(self):
        with pytest.raises(AttentionUnavailableError, match="unknown attention 'flash9'"):
            get_attention("flash9")

    @pytest.mark.parametrize(
        "name,resolved", [("pallas_triton", "pallas_triton"), ("pallas_tpu", "pallas_tpu"), ("pallas", "pallas_triton")]
    )
    def test_interpret_on_cpu(self, name, resolved):
        fn = get_attention(name, interpret=True)
        args = _inputs(seed=4)
        assert fn.select(*args).name == resolved
        np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(tree_attention_reference(*args)), atol=1e-5)

    def test_options_are_bound(self):
        fn = get_attention("pallas_triton", interpret=True, block_sizes=TritonBlockSizes(block_q=16, block_k=16))
        assert dict(fn.options) == {"block_sizes": TritonBlockSizes(16, 16)}
        args = _inputs(seed=5)
        np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(tree_attention_reference(*args)), atol=1e-5)

    def test_lse_merge_with_pallas_prefix_in_interpreter(self):
        fn = get_attention("lse_merge", interpret=True, prefix_impl="pallas_tpu")
        args = _inputs(head_dim=32, seed=6)
        np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(tree_attention_reference(*args)), atol=1e-5)

    def test_named_kernel_reports_unsupported_shapes(self):
        with pytest.raises(UnsupportedConfigError, match="power of two"):
            get_attention("pallas_triton", interpret=True)(*_inputs(head_dim=24))


class TestRegister:
    def test_custom_impl_wins_auto_when_supported(self, restore_registry):
        calls = []

        def doubled(q, k, v, lengths, tree_mask, *, scale=None):
            calls.append(q.shape)
            return 2 * tree_attention_reference(q, k, v, lengths, tree_mask, scale=scale)

        register_attention("doubled", doubled, ["cpu"], lambda q, *rest: q.shape[-1] == 16, priority=50)
        args = _inputs()
        fn = get_attention()
        assert fn.select(*args).name == "doubled"
        np.testing.assert_allclose(np.asarray(fn(*args)), 2 * np.asarray(tree_attention_reference(*args)), atol=1e-6)
        assert fn.select(*_inputs(head_dim=32)).name == "reference" and len(calls) == 1
        assert available_attention("cpu")[:2] == ("auto", "doubled")

    def test_reserved_names(self, restore_registry):
        for name in ("auto", "pallas"):
            with pytest.raises(AttentionUnavailableError, match="reserved"):
                register_attention(name, tree_attention_reference, ["cpu"])

    def test_unknown_platform_rejected(self, restore_registry):
        with pytest.raises(AttentionUnavailableError, match="unknown platform"):
            register_attention("x", tree_attention_reference, ["quantum"])

    def test_no_candidate_supports(self, restore_registry):
        registry_module._REGISTRY.clear()
        register_attention("picky", tree_attention_reference, ["cpu"], lambda *a: False)
        register_attention("pickier", tree_attention_reference, ["cpu"], lambda *a: False)
        with pytest.raises(AttentionUnavailableError, match="no attention implementation on cpu supports"):
            get_attention()(*_inputs())


class TestCompilePolicy:
    def test_every_platform_has_a_policy(self):
        assert set(COMPILE_POLICIES) == set(PLATFORMS)
        for name, policy in COMPILE_POLICIES.items():
            assert policy.platform == name

    def test_frozen(self):
        with pytest.raises(dataclasses.FrozenInstanceError):
            get_compile_policy("cpu").allows_cond = False

    def test_neuron_limits(self):
        policy = get_compile_policy("neuron")
        assert policy == CompilePolicy("neuron", False, False, False, "rbg", True)

    def test_accelerators_allow_everything(self):
        for name in ("cpu", "gpu", "tpu"):
            policy = get_compile_policy(name)
            assert policy.allows_cond and policy.allows_dynamic_while and policy.allows_callbacks
            assert not policy.prefer_sort_free

    def test_default_platform_and_alias(self):
        assert get_compile_policy() is COMPILE_POLICIES["cpu"]
        assert get_compile_policy("cuda") is COMPILE_POLICIES["gpu"]

    def test_rng_impls_are_real_jax_prng_names(self):
        for policy in COMPILE_POLICIES.values():
            key = jax.random.key(0, impl=policy.rng_impl)
            assert jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
