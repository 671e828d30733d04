"""Quantized targets (specjax.models.quant): quantize / dequantize bounds, GGUF block formats against the gguf
package's own dequantizer, the CPU kernel against the XLA path, one summation order for any number of rows, and
greedy speculation equal to plain greedy decoding of the same quantized target (ngram, draft model, EAGLE)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.backends import ops
from specjax.kernels import cpu_build, cpu_quant_matmul
from specjax.models import quant
from specjax.models.llama import forward, fuse_projections
from specjax.kv_cache import init_cache

from spec_helpers import make_sampling, outputs, run_plain, run_spec, tiny_buckets, tiny_config, tiny_params

V = 96
needs_kernel = pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler for the CPU kernels")


def _weights(n=48, k=128, seed=0):
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1


# ------------------------------------------------------------------------------------ quantize / dequantize


def test_int8_error_bound_per_row():
    w = _weights()
    q = quant.quantize_int8(w)
    assert q.codes.dtype == jnp.int8 and q.scale.shape == (48, 1) and q.shape == w.shape
    err = np.abs(np.asarray(quant.dequantize(q)) - w)
    bound = np.abs(w).max(axis=1, keepdims=True) / 254 * (1 + 1e-5)
    assert (err <= bound).all()
    assert err.max() > 0  # it did quantize


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_bound_per_group(group):
    w = _weights()
    q = quant.quantize_int4(w, group)
    assert q.codes.shape == (48, 64) and q.scale.shape == (48, 128 // group) and q.minimum is not None
    err = np.abs(np.asarray(quant.dequantize(q)) - w).reshape(48, -1, group)
    g = w.reshape(48, -1, group)
    bound = (g.max(axis=2) - g.min(axis=2))[..., None] / 30 * (1 + 1e-4) + 1e-7
    assert (err <= bound).all()


def test_nibble_packing_round_trip():
    nib = np.random.default_rng(1).integers(0, 16, (5, 64)).astype(np.uint8)
    packed = quant.pack_nibbles(nib)
    assert packed.shape == (5, 32)
    assert packed[0, 0] == nib[0, 0] | (nib[0, 16] << 4)  # GGUF order: value j and j + 16 share byte j
    np.testing.assert_array_equal(np.asarray(cpu_quant_matmul.unpack_nibbles(jnp.asarray(packed))), nib)


@pytest.mark.parametrize("group, match", [(48, "multiple of 32"), (96, "does not divide the input dimension 128"),
                                          (0, "multiple of 32"), (True, "multiple of 32")])
def test_int4_bad_group_size(group, match):
    with pytest.raises(quant.QuantizationError, match=match):
        quant.quantize_int4(_weights(), group)


def test_unknown_settings_name_the_supported_ones():
    with pytest.raises(quant.QuantizationError, match="'int8', 'int4', 'gguf'"):
        quant.check_quantization("fp8")
    with pytest.raises(quant.QuantizationError, match="Q8_0, Q4_0, Q4_1"):
        quant.from_gguf_blocks(np.zeros(10, np.uint8), "Q6_K", (1, 256))
    with pytest.raises(quant.QuantizationError, match="fuse_projections"):
        quant.quantize_params(tiny_params(tiny_config(V), 0), "int8")
    with pytest.raises(quant.QuantizationError, match="'gguf' keeps"):
        quant.quantize_params(fuse_projections(tiny_params(tiny_config(V), 0)), "gguf")


def test_quantize_lm_head_needs_a_quantization():
    with pytest.raises(quant.QuantizationError, match="quantization is None"):
        quant.check_lm_head(None, True)
    with pytest.raises(quant.QuantizationError, match="None, True or False"):
        quant.check_lm_head("int8", "yes")
    quant.check_lm_head(None, False)
    quant.check_lm_head("gguf", None)


# ------------------------------------------------------------------------------------ GGUF blocks


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_match_the_gguf_dequantizer(type_name):
    from gguf import GGMLQuantizationType, quants

    qt = GGMLQuantizationType[type_name]
    w = _weights(8, 96, seed=3)
    raw = quants.quantize(w, qt)  # [8, bytes per row]
    ref = np.asarray(quants.dequantize(raw, qt), np.float32)
    q = quant.from_gguf_blocks(raw.reshape(-1), type_name, (8, 96))
    assert q.kind == type_name.lower() and q.scale.dtype == jnp.float16
    assert q.nbytes == raw.size  # kept as stored: the same bytes, split into codes and scales
    np.testing.assert_allclose(np.asarray(quant.dequantize(q)), ref, rtol=1e-6, atol=1e-7)
    with pytest.raises(quant.QuantizationError, match="do not hold"):
        quant.from_gguf_blocks(raw.reshape(-1)[:-1], type_name, (8, 96))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_rows_permute_and_fuse(type_name):
    from gguf import GGMLQuantizationType, quants

    qt = GGMLQuantizationType[type_name]
    a, b = _weights(8, 64, seed=4), _weights(4, 64, seed=5)
    qa = quant.from_gguf_blocks(quants.quantize(a, qt).reshape(-1), type_name, (8, 64))
    qb = quant.from_gguf_blocks(quants.quantize(b, qt).reshape(-1), type_name, (4, 64))
    order = np.array([1, 0, 3, 2, 5, 4, 7, 6])
    fused = quant.concat_rows([quant.take_rows(qa, order), qb])
    want = np.concatenate([np.asarray(quant.dequantize(qa))[order], np.asarray(quant.dequantize(qb))])
    np.testing.assert_array_equal(np.asarray(quant.dequantize(fused)), want)


def _gguf_with_embedding(tmp_path, type_name: str | None):
    """A tiny tied llama GGUF whose token_embd is stored as `type_name` (None: F32); (config, params, path)."""
    from gguf import GGMLQuantizationType, quants
    from helpers import tiny_config as hf_tiny_config, tiny_params as hf_tiny_params, write_gguf

    cfg = hf_tiny_config(architecture="LlamaForCausalLM", tie_word_embeddings=True)
    params = hf_tiny_params(cfg, seed=3)
    qtypes = None
    if type_name is not None:
        qt = GGMLQuantizationType[type_name]
        qtypes = {"token_embd.weight": (quants.quantize(np.asarray(params["embed"], np.float32), qt), qt)}
    return cfg, params, write_gguf(tmp_path / f"{type_name}.gguf", cfg, params, qtypes=qtypes)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_gguf_keeps_its_lm_head_as_stored(tmp_path, type_name):
    from specjax.models.loading import load_model

    _, _, path = _gguf_with_embedding(tmp_path, type_name)
    native = load_model(path, with_tokenizer=False, quantization="gguf")
    head = native.params["lm_head_q"]
    assert head.kind == type_name.lower() and head.shape == native.params["embed"].shape
    # The quantized head is what a step reads; the float embedding is only gathered from.
    assert quant.step_weight_bytes(native.params) < quant.weight_bytes(native.params) - head.nbytes
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, head.shape[1])), jnp.float32)
    from specjax.models.llama import lm_head

    want = np.asarray(lm_head({"embed": native.params["embed"]}, x))
    np.testing.assert_allclose(np.asarray(lm_head(native.params, x)), want, rtol=1e-5, atol=1e-5)
    assert "lm_head_q" not in load_model(path, with_tokenizer=False, quantization="gguf",
                                         quantize_lm_head=False).params


def test_gguf_lm_head_of_another_type_stays_float_or_is_refused(tmp_path):
    from specjax.models.loading import load_model

    _, _, path = _gguf_with_embedding(tmp_path, None)
    assert "lm_head_q" not in load_model(path, with_tokenizer=False, quantization="gguf").params
    with pytest.raises(quant.QuantizationError, match="token_embd.weight.*F32.*Q8_0, Q4_0, Q4_1"):
        load_model(path, with_tokenizer=False, quantization="gguf", quantize_lm_head=True)


# ------------------------------------------------------------------------------------ the product


def _all_kinds():
    from gguf import GGMLQuantizationType, quants

    w = _weights(70, 192, seed=6)
    out = {"int8": quant.quantize_int8(w), "int4": quant.quantize_int4(w, 64)}
    for t in ("Q8_0", "Q4_0", "Q4_1"):
        raw = quants.quantize(w, GGMLQuantizationType[t])
        out[t.lower()] = quant.from_gguf_blocks(raw.reshape(-1), t, w.shape)
    return out


@needs_kernel
@pytest.mark.parametrize("kind", ["int8", "int4", "q8_0", "q4_0", "q4_1"])
def test_kernel_matches_dequantized_product_and_is_row_invariant(kind):
    w = _all_kinds()[kind]
    x = jnp.asarray(np.random.default_rng(7).standard_normal((13, 192)), jnp.float32)
    ref = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(w), np.float64).T
    kernel = lambda a: cpu_quant_matmul.quant_matmul(a, w.codes, w.scale, w.minimum, kind=w.kind,  # noqa: E731
                                                     group=w.group)
    y = kernel(x)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
    # One summation order whatever the number of rows: what keeps a verify block equal to plain steps.
    rows = jnp.concatenate([kernel(x[i:i + 1]) for i in range(13)])
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(y))
    # The XLA path computes the same function (other summation order).
    xla = jax.jit(lambda a, b: _xla_linear(a, b))(x, w)
    np.testing.assert_allclose(np.asarray(xla), ref, rtol=1e-4, atol=1e-4)


def _xla_linear(x, w: quant.QuantWeight):
    return cpu_quant_matmul.xla_quant_matmul(x, w.codes, w.scale, w.minimum, kind=w.kind, group=w.group)


@needs_kernel
def test_linear_runs_the_table_choice():
    """Float weights take the op matmul, quantized ones the op quant_matmul: on CPU with the kernels built, the C++
    kernels (bit for bit), and XLA's product when SPECJAX_KERNELS says so."""
    from specjax.kernels import cpu_matmul

    w = jnp.asarray(_weights(16, 64))
    x = jnp.asarray(np.random.default_rng(8).standard_normal((3, 64)), jnp.float32)
    assert ops.select("matmul", x, w).name == "kernel"
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.linear)(x, w)),
                                  np.asarray(jax.jit(cpu_matmul.kernel_matmul_t)(x, w)))
    q = _all_kinds()["q4_1"]
    xq = jnp.asarray(np.random.default_rng(8).standard_normal((3, 192)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.linear)(xq, q)),
                                  np.asarray(cpu_quant_matmul.quant_matmul(xq, q.codes, q.scale, q.minimum,
                                                                           kind=q.kind, group=q.group)))


def test_linear_under_an_xla_override(kernel_policy):
    kernel_policy("quant_matmul", "xla")
    q = _all_kinds()["int8"]
    x = jnp.asarray(np.random.default_rng(8).standard_normal((3, 192)), jnp.float32)
    assert ops.select("quant_matmul", x, q.codes, q.scale, q.minimum, kind=q.kind, group=q.group).name == "xla"
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.linear)(x, q)), np.asarray(jax.jit(_xla_linear)(x, q)))


def _w8a8_reference(x: np.ndarray, w: quant.QuantWeight) -> np.ndarray:
    """The W8A8 product rebuilt in NumPy from Qwix's int8 codes of x (one scale per row): integer dot with the
    weight's codes, then both scales."""
    import qwix

    qx = qwix.quantize(jnp.asarray(x), jnp.int8, channelwise_axes=[0])
    acc = np.asarray(qx.qvalue, np.int64) @ np.asarray(w.codes, np.int64).T
    return acc * np.asarray(qx.scale, np.float64) * np.asarray(w.scale, np.float64)[:, 0]


def test_w8a8_is_an_integer_product_of_per_row_int8_activations():
    w = quant.quantize_w8a8(_weights(48, 192))
    assert w.kind == "w8a8" and w.bits == 8 and w.shape == (48, 192)
    x = np.random.default_rng(9).standard_normal((13, 192)).astype(np.float32)
    y = np.asarray(jax.jit(quant.linear)(jnp.asarray(x), w))
    np.testing.assert_allclose(y, _w8a8_reference(x, w), rtol=1e-5, atol=1e-5)
    # Per-row scales and integer accumulation: a row alone gives the same bits as inside a block of rows.
    rows = np.concatenate([np.asarray(jax.jit(quant.linear)(jnp.asarray(x[i:i + 1]), w)) for i in range(13)])
    np.testing.assert_array_equal(rows, y)
    # Lossy against the weight-only int8 product of the same codes (activations rounded), within int8's error.
    weight_only = np.asarray(_xla_linear(jnp.asarray(x), quant.quantize_int8(_weights(48, 192))))
    err = np.abs(y - weight_only).max() / np.abs(weight_only).max()
    assert 0 < err < 0.02


def test_w8a8_without_qwix_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_qwix(name, *args, **kwargs):
        if name == "qwix" or name.startswith("qwix."):
            raise ImportError("no qwix")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_qwix)
    with pytest.raises(quant.QuantizationError, match=r"specjax\[quant\]"):
        quant.quantize_params(fuse_projections(tiny_params(tiny_config(V), seed=1)), "w8a8")


# ------------------------------------------------------------------------------------ the model


def _target(quantization: str, group: int = 32, lm_head: bool = False):
    cfg = tiny_config(V)
    params = fuse_projections(tiny_params(cfg, seed=1))
    return cfg, params, quant.quantize_params(params, quantization, group_size=group, lm_head=lm_head)


@pytest.mark.parametrize("quantization, lm_head", [("int8", False), ("int4", True), ("w8a8", False)])
def test_quantized_forward_close_to_float(quantization, lm_head):
    cfg, params, qparams = _target(quantization, lm_head=lm_head)
    assert ("lm_head_q" in qparams) == lm_head
    assert quant.weight_bytes(qparams) < quant.weight_bytes(params)
    toks = jnp.asarray([[3, 9, 27, 81, 50, 11]], jnp.int32)
    pos = jnp.arange(6)[None]
    cache = init_cache(cfg.num_layers, 1, 8, cfg.num_kv_heads, cfg.head_dim)
    f = jax.jit(lambda p: forward(p, cfg, toks, pos, cache).logits)
    ref, got = np.asarray(f(params)), np.asarray(f(qparams))
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    # int4 on these sharp N(0, 0.3^2) weights moves every product by about 20% of its size: a loose bound.
    assert 0 < rel < (0.6 if quantization == "int4" else 0.05)


def _drafter(name: str, cfg, float_params):
    from specjax.drafters.draft_model import DraftModelDrafter
    from specjax.drafters.ngram import NgramDrafter

    if name == "ngram":
        return NgramDrafter(3, 1, 2), {}
    if name == "draft_model":
        dcfg = tiny_config(V, num_layers=1)
        return DraftModelDrafter(dcfg, 3, V), {"params": fuse_projections(tiny_params(dcfg, seed=2))}
    from specjax.drafters.eagle import EagleDrafter
    from specjax.heads.eagle import head_config, init_from_target

    hc = head_config(cfg, "eagle")
    # From the canonical float target: heads stay float, whatever the target they serve is quantized to.
    head = init_from_target(hc, tiny_params(cfg, seed=1), -1)
    return EagleDrafter(hc, top_k=3, depth=2, total_tokens=6), {"head": head, "embed": float_params["embed"],
                                                                 "lm_head": float_params["lm_head"]}


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_greedy_speculation_equals_plain_of_the_same_quantized_target(quantization, method):
    cfg, params, qparams = _target(quantization)
    prompts = [[3, 9, 27, 81, 50, 11, 3, 9, 27], [7, 7, 8]]
    buckets = tiny_buckets(2, max_new=20)
    sampling = make_sampling(2, max_new=20)
    plain, _ = outputs(run_plain(qparams, cfg, buckets, prompts, sampling))
    float_plain, _ = outputs(run_plain(params, cfg, buckets, prompts, sampling))
    drafter, dparams = _drafter(method, cfg, params)
    state = run_spec(qparams, cfg, dparams, drafter, buckets, prompts, sampling)
    spec, _ = outputs(state.dec)
    assert spec == plain
    assert int(np.asarray(state.stats.verify_steps).sum()) > 0
    assert len(plain[0]) == 20 and float_plain != [[]]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_eagle_reads_the_targets_quantized_lm_head_and_stays_exact(quantization, monkeypatch):
    from specjax.drafters.eagle import load_eagle_drafter
    from specjax.heads import eagle_io
    from specjax.heads.eagle import head_config, init_from_target

    cfg, params, qparams = _target(quantization, lm_head=True)
    hc = head_config(cfg, "eagle")
    monkeypatch.setattr(eagle_io, "load_head", lambda path, target: (hc, init_from_target(hc, tiny_params(cfg, seed=1), -1)))
    drafter, dparams = load_eagle_drafter("unused", "eagle", cfg, qparams, top_k=3, depth=2, total_tokens=6)
    assert dparams["lm_head_q"] is qparams["lm_head_q"]
    prompts = [[3, 9, 27, 81, 50, 11, 3, 9, 27], [7, 7, 8]]
    buckets = tiny_buckets(2, max_new=20)
    sampling = make_sampling(2, max_new=20)
    plain, _ = outputs(run_plain(qparams, cfg, buckets, prompts, sampling))
    state = run_spec(qparams, cfg, dparams, drafter, buckets, prompts, sampling)
    assert outputs(state.dec)[0] == plain
    assert int(np.asarray(state.stats.accepted).sum()) > 0


# ------------------------------------------------------------------------------------ the real model


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_real_model_ngram_greedy_equals_plain(quantization):
    from specjax.api import LLM
    from specjax.config import SamplingParams

    llm = LLM(quantization=quantization)
    assert llm.quantization == quantization
    prompts = ["Write a short poem about the sea.", "List three uses of a paperclip.",
               "Explain what a hash table is, then explain it again in one sentence."]
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, chat=True)]
    spec = [o.outputs[0].token_ids for o in llm.generate(
        prompts, sp, {"method": "ngram", "num_speculative_tokens": 4}, chat=True)]
    assert plain == spec
    assert all(len(t) == 32 for t in plain)


@pytest.mark.slow
def test_real_model_gguf_native_matches_dequantized_float32():
    from specjax.models.loading import load_model

    ref = load_model(with_tokenizer=False)
    native = load_model(with_tokenizer=False, quantization="gguf")
    kinds = {lp["wqkv_t"].kind for lp in native.params["layers"]}
    assert kinds == {"q4_1"}
    assert native.params["lm_head_q"].kind == "q8_0"  # SmolLM2's token_embd, the tied LM head, as stored
    c = ref.config
    toks = jnp.asarray([[1, 504, 3458, 282, 4260, 314, 260, 1345]], jnp.int32)
    pos = jnp.arange(8)[None]
    cache = init_cache(c.num_layers, 1, 16, c.num_kv_heads, c.head_dim)
    f = jax.jit(lambda p: forward(p, c, toks, pos, cache).logits)
    a, b = np.asarray(f(fuse_projections(ref.params))), np.asarray(f(native.params))
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-3)


# ------------------------------------------------------------------------------ K-quants kept as stored


def _kquant_gguf(tmp_path, types: dict):
    """A tiny llama GGUF (hidden 256, so every projection holds whole 256-value blocks) whose projections are
    random blocks of the given types: `types` maps a tensor suffix (attn_q, attn_v, ffn_down, ...) to a GGUF type.
    Returns (config, path)."""
    from gguf import GGMLQuantizationType
    from helpers import random_gguf_blocks, tiny_config as hf_tiny_config, tiny_params as hf_tiny_params, write_gguf

    cfg = hf_tiny_config(architecture="LlamaForCausalLM", hidden_size=256, intermediate_size=512, num_heads=4,
                         num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
    params = hf_tiny_params(cfg, seed=5)
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    qtypes = {}
    for i in range(cfg.num_layers):
        for j, (name, type_name) in enumerate(types.items()):
            raw = random_gguf_blocks(type_name, *shapes[name], seed=100 * i + j)
            qtypes[f"blk.{i}.{name}.weight"] = (raw, GGMLQuantizationType[type_name])
    return cfg, write_gguf(tmp_path / "kquant.gguf", cfg, params, qtypes=qtypes)


KQUANT_MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
              "ffn_up": "Q4_K", "ffn_down": "Q6_K"}  # Q5_K: the int8 kernel does not take it, so both kernels run


@needs_kernel
def test_kquant_projections_are_kept_as_stored_and_equal_the_dequantized_float32_model(tmp_path, monkeypatch):
    from specjax.models.loading import load_model

    monkeypatch.setenv(ops.ENV, "gguf_matmul=kernel")  # float32 activations: the dequantized model's products
    _, path = _kquant_gguf(tmp_path, KQUANT_MIX)
    ref = load_model(path, with_tokenizer=False)
    native = load_model(path, with_tokenizer=False, quantization="gguf")
    lp = native.params["layers"][0]
    # q and k share Q4_K, v is Q6_K: one RowStack; gate and up fuse into one Q4_K weight.
    assert isinstance(lp["wqkv_t"], quant.RowStack)
    assert [p.type_name for p in lp["wqkv_t"].parts] == ["Q4_K", "Q6_K"]
    assert lp["wqkv_t"].shape == (512, 256)
    assert isinstance(lp["w_gu_t"], quant.BlockWeight) and lp["w_gu_t"].type_name == "Q4_K"
    assert lp["wo_t"].type_name == "Q5_K" and lp["w_down_t"].type_name == "Q6_K"
    # The file's bytes, not a decoded copy: 4.5 / 5.5 / 6.56 bits a weight.
    assert quant.weight_bytes(lp["w_gu_t"]) == 1024 * 144
    c = ref.config
    toks = jnp.asarray([[1, 50, 34, 28, 42, 31, 26, 13]], jnp.int32)
    pos = jnp.arange(8)[None]
    cache = init_cache(c.num_layers, 1, 16, c.num_kv_heads, c.head_dim)
    f = jax.jit(lambda p: forward(p, c, toks, pos, cache).logits)
    with cpu_build.row_invariant():  # both sides on the kernels, whatever the row count
        a, b = np.asarray(f(fuse_projections(ref.params))), np.asarray(f(native.params))
    np.testing.assert_array_equal(b, a)


@needs_kernel
@pytest.mark.parametrize("kernel", ["kernel", "kernel_q8"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_speculation_equals_plain_over_kquant_weights(tmp_path, method, kernel, monkeypatch):
    from specjax.models.loading import load_model

    monkeypatch.setenv(ops.ENV, f"gguf_matmul={kernel}")  # float32 or int8 activations
    cfg, path = _kquant_gguf(tmp_path, KQUANT_MIX)
    native = load_model(path, with_tokenizer=False, quantization="gguf")
    params = native.params
    prompts = [[3, 9, 27, 81, 50, 11, 3, 9, 27], [7, 7, 8]]
    buckets = tiny_buckets(2, max_new=16)
    sampling = make_sampling(2, max_new=16)
    plain, _ = outputs(run_plain(params, native.config, buckets, prompts, sampling))
    if method == "ngram":
        from specjax.drafters.ngram import NgramDrafter

        drafter, dparams = NgramDrafter(3, 1, 2), {}
    else:
        from specjax.drafters.draft_model import DraftModelDrafter

        # The target itself as its own drafter: every drafted token is accepted, so verify blocks run long.
        drafter, dparams = DraftModelDrafter(native.config, 3, native.config.vocab_size), {"params": params}
    state = run_spec(params, native.config, dparams, drafter, buckets, prompts, sampling)
    spec, _ = outputs(state.dec)
    assert spec == plain
    assert int(np.asarray(state.stats.verify_steps).sum()) > 0


def test_a_kquant_file_with_a_row_the_type_cannot_hold_is_refused(tmp_path):
    from specjax.models.loading import load_model

    with pytest.raises(quant.QuantizationError, match="whole number of 256-value blocks"):
        quant.from_gguf_raw(np.zeros(144, np.uint8), "Q4_K", (1, 200), "t")
    with pytest.raises(quant.QuantizationError, match="do not hold a Q6_K tensor"):
        quant.from_gguf_raw(np.zeros(100, np.uint8), "Q6_K", (1, 256), "t")
    with pytest.raises(quant.QuantizationError, match="not kept as stored"):
        quant.from_gguf_raw(np.zeros(100, np.uint8), "IQ2_XS", (1, 256), "t")
    del load_model, tmp_path
