"""The kernel table (specjax.backends.ops / table): each op's selection on cpu (and on other platforms, by name),
the SPECJAX_KERNELS override, every registered implementation against its op's reference, adding an op; the named
attention registry and compile policies (specjax.backends.registry), on CPU."""
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


# ------------------------------------------------------------------------------------------------ the kernel table

from specjax.backends import ops  # noqa: E402
from specjax.kernels import cpu_attention, cpu_build, cpu_kv_write, cpu_matmul, cpu_quant_matmul  # noqa: E402

needs_kernels = pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler for the CPU kernels")
sds = jax.ShapeDtypeStruct
f32, bf16 = jnp.float32, jnp.bfloat16


def _attention_args(T=1, S=32, dtype=f32, window=None):
    B, Hq, Hkv, D = 2, 4, 2, 16
    return ((sds((B, T, Hq, D), dtype), sds((B, Hkv, S, D), dtype), sds((B, Hkv, S, D), dtype),
             sds((B, T, Hkv, D), dtype), sds((B, T, Hkv, D), dtype), sds((B,), jnp.int32), sds((B, T, T), bool)),
            dict(scale=0.25, positions=sds((B, T), jnp.int32), window=window))


def _quant_args(kind="int8", group=None, rows=3):
    n, k = 8, 64
    codes = sds((n, k if cpu_quant_matmul.BITS[kind] == 8 else k // 2), jnp.int8 if kind == "int8" else jnp.uint8)
    group = group or (k if kind == "int8" else 32)
    scale = sds((n, k // group), f32)
    minimum = scale if kind in ("int4", "q4_1") else None
    return (sds((rows, k), f32), codes, scale, minimum), dict(kind=kind, group=group)


def _chosen(op, args, kwargs=None, platform=None):
    return ops.select(op, *args, platform=platform, **(kwargs or {})).name


@pytest.fixture
def no_overrides(monkeypatch):
    monkeypatch.delenv(ops.ENV, raising=False)


@pytest.mark.usefixtures("no_overrides")
class TestSelection:
    def test_every_op_has_an_xla_implementation_on_every_platform(self):
        for op in ("matmul", "quant_matmul", "attention", "kv_write"):
            for platform in PLATFORMS:
                assert ops.implementations(op, platform)[-1].name == "xla"
        assert ops.implementations("tree_attention", "neuron")[-1].name == "reference"

    @needs_kernels
    def test_matmul_on_cpu(self):
        one, seventeen, w = sds((1, 1, 64), f32), sds((1, 17, 64), f32), sds((32, 64), f32)
        assert _chosen("matmul", (one, w)) == "kernel"
        assert _chosen("matmul", (seventeen, w)) == "xla"  # above the float32 row limit
        assert _chosen("matmul", (sds((64, 64), f32), sds((32, 64), bf16))) == "kernel"
        assert _chosen("matmul", (one, sds((32, 64), jnp.float16))) == "xla"  # a dtype the kernel does not take
        with cpu_build.row_invariant():  # decode and verify steps: any number of rows
            assert _chosen("matmul", (seventeen, w)) == "kernel"

    @needs_kernels
    def test_quant_matmul_on_cpu(self):
        for kind in ("int8", "int4", "q8_0", "q4_0", "q4_1"):
            args, kw = _quant_args(kind, rows=300)  # any number of rows
            assert _chosen("quant_matmul", args, kw) == "kernel", kind
        args, kw = _quant_args("int4", group=16)
        assert _chosen("quant_matmul", args, kw) == "xla"  # groups are multiples of 32 for the kernel

    @needs_kernels
    def test_attention_on_cpu(self):
        assert _chosen("attention", *_attention_args(T=1)) == "kernel"
        assert _chosen("attention", *_attention_args(T=13, dtype=bf16)) == "kernel"
        assert _chosen("attention", *_attention_args(T=200)) == "xla"  # a prefill chunk
        assert _chosen("attention", *_attention_args(T=1, window=8)) == "xla"  # the kernel applies no window
        assert _chosen("attention", *_attention_args(T=1, dtype=jnp.float16)) == "xla"
        with cpu_build.row_invariant():
            assert _chosen("attention", *_attention_args(T=200)) == "kernel"

    @needs_kernels
    def test_kv_write_on_cpu(self):
        def args(dtype):
            return sds((2, 2, 16, 8), dtype), sds((2, 3, 2, 8), dtype), sds((2,), jnp.int32)
        assert _chosen("kv_write", args(bf16)) == "kernel" and _chosen("kv_write", args(jnp.float16)) == "kernel"
        assert _chosen("kv_write", args(f32)) == "xla"  # XLA writes float32 in place itself

    @needs_kernels
    def test_no_custom_call_under_a_mesh(self):
        mesh = jax.make_mesh((1,), ("data",))
        with jax.set_mesh(mesh), cpu_build.row_invariant():
            assert _chosen("matmul", (sds((1, 64), f32), sds((32, 64), f32))) == "xla"
            assert _chosen("attention", *_attention_args()) == "xla"
            assert _chosen("quant_matmul", *_quant_args()) == "xla"
            assert _chosen("kv_write", (sds((2, 2, 16, 8), bf16), sds((2, 3, 2, 8), bf16),
                                        sds((2,), jnp.int32))) == "xla"

    @pytest.mark.parametrize("platform", ["gpu", "tpu", "neuron"])
    def test_other_platforms_run_xla(self, platform):
        assert _chosen("matmul", (sds((1, 64), f32), sds((32, 64), f32)), platform=platform) == "xla"
        assert _chosen("attention", *_attention_args(), platform=platform) == "xla"
        assert _chosen("quant_matmul", *_quant_args(), platform=platform) == "xla"

    def test_unbuilt_kernels_fall_back_with_one_warning(self, kernels_unbuildable):
        with pytest.warns(RuntimeWarning, match="CPU matmul kernel unavailable, using XLA's dot instead"):
            assert _chosen("matmul", (sds((1, 64), f32), sds((32, 64), f32))) == "xla"


class TestOverride:
    def test_syntax(self):
        assert ops.parse_overrides("") == {}
        assert ops.parse_overrides(" matmul = xla ,attention=kernel,") == {"matmul": "xla", "attention": "kernel"}
        assert ops.parse_overrides("kv_write=auto,tree_attention=lse_merge") == {
            "kv_write": "auto", "tree_attention": "lse_merge"}

    @pytest.mark.parametrize("text,message", [
        ("matmull=xla", "unknown op 'matmull' in SPECJAX_KERNELS; did you mean 'matmul'\\?"),
        ("attention=kernal", "unknown implementation 'kernal' of op 'attention' in SPECJAX_KERNELS; did you mean "
                             "'kernel'\\? choices: auto, kernel, xla"),
        ("quant_matmul", "'quant_matmul' is not op=implementation"),
        ("=xla", "is not op=implementation"),
    ])
    def test_errors_name_the_closest_valid_name(self, text, message):
        with pytest.raises(ops.KernelSelectionError, match=message):
            ops.parse_overrides(text)

    def test_an_error_is_a_specjax_error_at_trace_time(self, monkeypatch):
        from specjax.errors import SpecjaxError

        monkeypatch.setenv(ops.ENV, "matmul=fastest")
        with pytest.raises(SpecjaxError, match="unknown implementation 'fastest'"):
            jax.jit(lambda x, w: ops.call("matmul", x, w))(jnp.ones((1, 8)), jnp.ones((4, 8)))

    @needs_kernels
    def test_kernel_drops_the_auto_conditions_only(self, monkeypatch):
        monkeypatch.setenv(ops.ENV, "matmul=kernel,attention=kernel,kv_write=kernel")
        assert _chosen("matmul", (sds((300, 64), f32), sds((32, 64), f32))) == "kernel"
        assert _chosen("attention", *_attention_args(T=200)) == "kernel"
        assert _chosen("kv_write", (sds((2, 2, 16, 8), f32), sds((2, 3, 2, 8), f32), sds((2,), jnp.int32))) == "kernel"
        # What the kernel cannot take still runs XLA: a float16 weight, a sliding window.
        assert _chosen("matmul", (sds((3, 64), f32), sds((32, 64), jnp.float16))) == "xla"
        assert _chosen("attention", *_attention_args(window=4)) == "xla"

    @needs_kernels
    def test_xla_never_takes_the_kernel(self, monkeypatch):
        monkeypatch.setenv(ops.ENV, "matmul=xla,quant_matmul=xla,attention=xla,kv_write=xla")
        with cpu_build.row_invariant():
            assert _chosen("matmul", (sds((1, 64), f32), sds((32, 64), f32))) == "xla"
            assert _chosen("quant_matmul", *_quant_args()) == "xla"
            assert _chosen("attention", *_attention_args()) == "xla"
            assert _chosen("kv_write", (sds((2, 2, 16, 8), bf16), sds((2, 3, 2, 8), bf16),
                                        sds((2,), jnp.int32))) == "xla"

    def test_tree_attention_auto_follows_the_override(self, monkeypatch):
        monkeypatch.setenv(ops.ENV, "tree_attention=lse_merge")
        args = _inputs(seed=7)
        fn = get_attention()
        assert fn.select(*args).name == "lse_merge"
        np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(tree_attention_reference(*args)), atol=1e-5)


# Every op's reference and small inputs: an op registered without an entry here fails the test below.
def _matmul_case(rng):
    x = jnp.asarray(rng.standard_normal((3, 64)), f32)
    w = jnp.asarray(rng.standard_normal((24, 64)), bf16)
    return (x, w), dict(out_dtype=f32), cpu_matmul.small_matmul_reference(x, w), 1e-4


def _quant_case(rng, kind):
    from specjax.models import quant

    w = rng.standard_normal((24, 64)).astype(np.float32)
    q = {"int8": quant.quantize_int8(w), "int4": quant.quantize_int4(w, 32)}[kind]
    x = jnp.asarray(rng.standard_normal((5, 64)), f32)
    args = (x, q.codes, q.scale, q.minimum)
    kw = dict(kind=q.kind, group=q.group)
    return args, dict(kw, out_dtype=f32), cpu_quant_matmul.quant_matmul_reference(*args, **kw), 1e-4


def _gguf_case(rng):
    from gguf import GGMLQuantizationType, quants

    from specjax.kernels import gguf_matmul

    w = rng.standard_normal((24, 256)).astype(np.float32)
    blocks = jnp.asarray(quants.quantize(w, GGMLQuantizationType.Q8_0).reshape(24, -1))
    x = jnp.asarray(rng.standard_normal((3, 256)), f32)
    # The int8-activation implementation rounds x first: its own reference (a dict: implementation -> reference,
    # None for the others).
    want = {None: gguf_matmul.gguf_matmul_reference(x, blocks, "Q8_0"),
            "kernel_q8": gguf_matmul.gguf_matmul_q8_reference(x, blocks, "Q8_0")}
    return ((x, blocks), dict(type_name="Q8_0", out_dtype=f32), want, 1e-4)


def _attention_case(rng):
    B, T, Hq, Hkv, S, D = 2, 3, 4, 2, 16, 8
    q, kc, vc, kn, vn = (jnp.asarray(rng.standard_normal(s), f32) for s in
                         ((B, T, Hq, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, T, Hkv, D), (B, T, Hkv, D)))
    lengths = jnp.asarray([5, 11], jnp.int32)
    tm = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    args = (q, kc, vc, kn, vn, lengths, tm)
    return args, dict(scale=0.3), cpu_attention.prefix_attention_reference(*args, scale=0.3), 1e-5


def _kv_write_case(rng):
    cache = jnp.asarray(rng.standard_normal((2, 2, 16, 8)), bf16)
    new = jnp.asarray(rng.standard_normal((2, 3, 2, 8)), bf16)
    lengths = jnp.asarray([0, 14], jnp.int32)  # the second row runs past the capacity: dropped
    return (cache, new, lengths), {}, cpu_kv_write.kv_write_reference(cache, new, lengths), 0.0


def _tree_attention_case(rng):
    args = tuple(jnp.asarray(a) for a in _inputs(seed=int(rng.integers(100))))
    return args, dict(scale=0.25), tree_attention_reference(*args, scale=0.25), 1e-5


CASES = {"matmul": [_matmul_case], "quant_matmul": [lambda r: _quant_case(r, "int8"), lambda r: _quant_case(r, "int4")],
         "gguf_matmul": [_gguf_case], "attention": [_attention_case], "kv_write": [_kv_write_case], "tree_attention": [_tree_attention_case]}


@pytest.mark.parametrize("op", sorted(ops.TABLE))
def test_every_implementation_equals_the_reference(op):
    assert op in CASES, f"op {op!r} has no reference case in tests/backends/test_registry.py: add one"
    for case in CASES[op]:
        args, kwargs, want, tol = case(np.random.default_rng(0))
        tested = []
        for impl in ops.implementations(op):
            if impl.needs_build and not cpu_build.available():
                continue
            fn = impl.fn
            if impl.interpretable:  # a Pallas kernel: in the interpreter on CPU
                fn = get_attention(impl.name, interpret=True)
            elif not impl.runs_on("cpu"):
                continue
            assert impl.is_supported(*args, **kwargs), (op, impl.name)
            got = jax.jit(lambda *a, fn=fn: fn(*a, **kwargs))(*args)
            ref = want.get(impl.name, want[None]) if isinstance(want, dict) else want
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol,
                                       err_msg=f"{op}/{impl.name}")
            tested.append(impl.name)
        assert "xla" in tested or "reference" in tested


@pytest.fixture
def scratch_op():
    yield "scaled_add"
    ops.TABLE.pop("scaled_add", None)
    ops.OPS.pop("scaled_add", None)


def test_adding_an_op_is_registering_implementations(scratch_op, monkeypatch):
    monkeypatch.delenv(ops.ENV, raising=False)
    ops.define_op(scratch_op, "scaled_add(x, y, *, alpha) -> x + alpha * y")
    ops.register(scratch_op, "xla", lambda x, y, *, alpha: x + alpha * y)
    ops.register(scratch_op, "fused", lambda x, y, *, alpha: jnp.add(x, alpha * y), ("cpu",),
                 lambda x, y, *, alpha: x.shape == y.shape, priority=100, prefers=lambda x, y, *, alpha: x.size < 64)
    small, big = jnp.ones((4,)), jnp.ones((128,))
    assert ops.select(scratch_op, small, small, alpha=2.0).name == "fused"
    assert ops.select(scratch_op, big, big, alpha=2.0).name == "xla"  # not preferred
    assert ops.select(scratch_op, small, jnp.ones(()), alpha=2.0).name == "xla"  # not supported
    assert ops.select(scratch_op, small, small, alpha=2.0, platform="gpu").name == "xla"  # not registered there
    monkeypatch.setenv(ops.ENV, f"{scratch_op}=fused")
    assert ops.select(scratch_op, big, big, alpha=2.0).name == "fused"
    np.testing.assert_array_equal(np.asarray(ops.call(scratch_op, small, small, alpha=2.0)), np.full(4, 3.0))
    with pytest.raises(ops.KernelSelectionError, match="reserved"):
        ops.register(scratch_op, "auto", lambda x, y, *, alpha: x)
    with pytest.raises(ops.KernelSelectionError, match="unknown op 'scaled_ad'.*did you mean 'scaled_add'"):
        ops.register("scaled_ad", "xla", lambda x, y, *, alpha: x)


def test_a_retired_variable_names_the_new_spelling(monkeypatch):
    monkeypatch.setenv("SPECJAX_CPU_MATMUL", "xla")
    with pytest.raises(ops.KernelSelectionError, match="SPECJAX_CPU_MATMUL is no longer read: set "
                                                       "SPECJAX_KERNELS='matmul=xla' instead"):
        ops.overrides()


def test_policy_line_for_run_records(monkeypatch):
    monkeypatch.setenv(ops.ENV, "matmul=xla,attention=kernel")
    built = "built" if cpu_build.available() else "unavailable"
    assert ops.policy("matmul") == "xla"  # nothing to build
    assert ops.policy("attention").startswith(f"kernel (kernels {built}")
    assert ops.policy("kv_write").startswith(f"auto (kernels {built}")
    assert ops.policy("tree_attention") == "auto"
