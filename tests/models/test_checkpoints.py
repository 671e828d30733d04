"""Checkpoints users bring (issue 25, item 6), each against Hugging Face transformers where the maths is involved.

- BOS as the tokenizer says: raw text gets what the tokenizer.json post-processor or tokenizer_config.json's
  add_bos_token asks for, chat-template text gets none on top of what the template writes (transformers'
  tokenizer and apply_chat_template are the reference).
- Llama-3.1/3.2 GGUF files: `rope_freqs.weight` (llama.cpp's per-frequency form of the llama3 RoPE scaling)
  gives transformers' llama3 logits; a planted wrong factor, or the tensor ignored, fails.
- Split GGUF (gguf-split shards): the first shard loads the whole model, bit-identical to the single file.
- Qwen3 (q/k RMSNorm per head, explicit head_dim) from an HF directory and from a qwen3 GGUF, and Mistral with a
  sliding window shorter than the prompt: prefill logits and greedy decoding through `LLM` match transformers;
  speculative verification honours the window (tree nodes' logits equal the causal forward of their own path,
  n-gram speculation equals plain greedy); attention backends without a window are refused by name.
- `{% generation %}` blocks and chat_template_kwargs render as transformers renders them.
- Loading straight into the target dtype: a bf16 checkpoint loads as bf16 bit for bit under dtype 'auto' (its
  config's dtype), with no float32 copy on the host (measured with tracemalloc); GGUF stays float32.

Tests that need torch / transformers are marked `parity` and skip cleanly without them.
"""
from __future__ import annotations

import json
import math
import os
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (LLAMA3_SCALING, full_logits, hf_tensors, jit_forward, llama_cpp_permute, tiny_config,
                     tiny_params, write_byte_tokenizer)
from specjax.models.loading import ModelLoadError, load_model, read_safetensors, resolve_dtype
from specjax.models.tokenizer import Tokenizer

TOL = 1e-4
VOCAB = 264
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def require_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        pytest.skip(f"parity tests need torch and transformers (pip install -e .[parity]): {e}")


def require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        pytest.skip(f"needs transformers (pip install -e .[parity]): {e}")


def _randomize_(model, seed: int, scale: float = 0.15):
    """Weights under which a wrong norm, rotary frequency or mask moves the logits far past the tolerance
    (transformers' own init gives near-constant logits and unit norms)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_((1.0 + 0.2 * noise if "norm" in name else scale * noise).to(p.dtype))
    return model.eval()


def _torch_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens)[None], dtype=torch.long)).logits[0].float().numpy()


def _tiny_hf(kind: str, seed: int, **overrides):
    import transformers

    kw = dict(COMMON, **overrides)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{"head_dim": 32, **kw}))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**{"sliding_window": 8, **kw}))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    return _randomize_(model, seed)


def _save(model, path) -> str:
    """save_pretrained plus the byte tokenizer, padded with special tokens to the model's 264 ids so LLM(path)
    loads it and decodes whatever the random model emits."""
    from tokenizers import AddedToken, Tokenizer as Backend

    model.save_pretrained(path)
    write_byte_tokenizer(path)
    tj = os.path.join(path, "tokenizer.json")
    backend = Backend.from_file(tj)
    backend.add_special_tokens([AddedToken(f"<|extra_{i}|>", special=True, normalized=False)
                                for i in range(VOCAB - backend.get_vocab_size())])
    backend.save(tj)
    return str(path)


# ------------------------------------------------------------------------------------------------ GGUF writer
def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for a llama3 rope_scaling: one divisor per frequency
    (1 for short wavelengths, `factor` for long ones, interpolated between)."""
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf_model(path, hf: dict, *, arch: str, layers: int, heads: int, kv_heads: int, head_dim: int,
                     hidden: int, ffn: int, theta: float, eps: float, extra: dict | None = None,
                     split_max_tensors: int = 0) -> str:
    """A GGUF file (or gguf-split shards) of HF-named float32 tensors `hf`, laid out as llama.cpp's converter
    does: Q/K rows interleaved for llama, HF order for qwen3 (with its q/k norms and explicit key length)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(VOCAB)
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"],
               "output.weight": hf["lm_head.weight"], **(extra or {})}
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    if arch == "qwen3":
        names.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
    for i in range(layers):
        for ours, theirs in names.items():
            t = hf[f"model.layers.{i}.{theirs}.weight"]
            if arch == "llama" and ours in ("attn_q", "attn_k"):
                t = llama_cpp_permute(t, heads if ours == "attn_q" else kv_heads)
            tensors[f"blk.{i}.{ours}.weight"] = t
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _torch_tensors(model) -> dict:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ 1. BOS
def _bos_tokenizer_dir(path, *, post_bos: bool, config_flags: dict | None = None, template: str | None = None):
    """The byte tokenizer with '<|endoftext|>' (id 256) as BOS: its tokenizer.json post-processor adds the BOS
    when `post_bos`; `config_flags` (add_bos_token / add_eos_token) go into tokenizer_config.json."""
    from tokenizers import Tokenizer as Backend, processors

    write_byte_tokenizer(path)
    tj = os.path.join(path, "tokenizer.json")
    backend = Backend.from_file(tj)
    if post_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B:1",
            special_tokens=[("<|endoftext|>", 256)])
    backend.save(tj)
    cfg = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast",
           "chat_template": template or ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                         "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
           **(config_flags or {})}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


BOS_CASES = {
    # name: (post-processor adds BOS, tokenizer_config flags, raw prompts get the BOS)
    "post_processor": (True, {}, True),
    "config_add_bos": (False, {"add_bos_token": True}, True),
    "config_overrides_post_processor": (True, {"add_bos_token": False}, False),
    "neither": (False, {}, False),
}


@pytest.mark.parametrize("case", sorted(BOS_CASES))
def test_raw_prompt_bos_follows_the_tokenizer(tmp_path, case):
    from specjax.requests import encode_prompt

    post_bos, flags, expect_bos = BOS_CASES[case]
    tok = Tokenizer.from_hf_dir(_bos_tokenizer_dir(tmp_path, post_bos=post_bos, config_flags=flags))
    text = "Hello world"
    raw = encode_prompt(tok, VOCAB, text, False)
    assert tok.add_bos is expect_bos
    assert raw == ([256] if expect_bos else []) + list(text.encode())
    # A chat template that writes the BOS itself: exactly one BOS, whatever the post-processor says.
    chat = encode_prompt(tok, VOCAB, text, True)
    assert chat[0] == 256 and chat.count(256) == 1


# Only the cases where transformers' answer does not depend on its version: 4.x's Llama tokenizers rebuild the
# post-processor from tokenizer_config.json's add_bos_token (what specjax follows), while 5.x's TokenizersBackend
# ignores that flag for a byte-level tokenizer.json (measured with 5.24).
@pytest.mark.parity
@pytest.mark.parametrize("case", ["neither", "post_processor"])
def test_bos_parity_with_transformers(tmp_path, case):
    require_transformers()
    from transformers import AutoTokenizer

    from specjax.requests import encode_prompt

    post_bos, flags, _ = BOS_CASES[case]
    path = _bos_tokenizer_dir(tmp_path, post_bos=post_bos, config_flags=flags)
    hf = AutoTokenizer.from_pretrained(path)
    tok = Tokenizer.from_hf_dir(path)
    messages = [{"role": "user", "content": "Hi there"}]
    for text in ("Hello world", "  two  spaces", "<|im_start|>markup"):
        assert encode_prompt(tok, VOCAB, text, False) == hf(text).input_ids, text
    theirs = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert encode_prompt(tok, VOCAB, messages, True) == list(theirs)


def test_gguf_add_bos_token_reaches_raw_prompts(tmp_path):
    """A GGUF whose tokenizer.ggml.add_bos_token is true: raw prompts start with its BOS, chat prompts do not get
    a second one."""
    import gguf

    from specjax.requests import encode_prompt

    src = Tokenizer.from_hf_dir(_bos_tokenizer_dir(tmp_path / "hf", post_bos=False))
    vocab = json.loads(src.to_json())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + ["<|endoftext|>", "<|im_start|>",
                                                                           "<|im_end|>"]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens + ["ab"])
    w.add_token_merges(["a b"])
    w.add_token_types([1] * 256 + [3, 3, 3, 1])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_add_bos_token(True)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(str(tmp_path / "t.gguf"))
    assert tok.add_bos
    assert encode_prompt(tok, VOCAB, "ab", False) == [256, 259]
    assert encode_prompt(tok, VOCAB, "ab", True) == [256, 259]


# ------------------------------------------------------------------------------------------------ 2. rope_freqs
def _llama3_gguf(tmp_path, model, factors, name="l3.gguf") -> str:
    cfg = model.config
    return write_gguf_model(tmp_path / name, _torch_tensors(model), arch="llama", layers=2, heads=4, kv_heads=2,
                            head_dim=16, hidden=64, ffn=128, theta=10000.0, eps=cfg.rms_norm_eps,
                            extra=None if factors is None else {"rope_freqs.weight": factors})


@pytest.mark.parity
def test_gguf_rope_freqs_parity_with_llama3_scaling(tmp_path):
    require_torch()
    model = _tiny_hf("llama", seed=3, rope_scaling=dict(LLAMA3_SCALING), rope_theta=10000.0)
    factors = llama3_rope_factors(16, 10000.0, LLAMA3_SCALING)
    assert {1.0, 8.0} <= set(factors.tolist()) and len(set(factors.tolist())) > 2  # all three bands present
    tokens = np.random.default_rng(3).integers(0, VOCAB, 48)
    ref = _torch_logits(model, tokens)
    assert ref.std() > 0.5

    def err(gguf_path):
        loaded = load_model(gguf_path, with_tokenizer=False)
        return loaded, float(np.abs(full_logits(loaded.params, loaded.config, tokens) - ref).max())

    loaded, good = err(_llama3_gguf(tmp_path, model, factors))
    print(f"\n[parity] tiny Llama-3.1 GGUF with rope_freqs: max abs logit error {good:.2e}")
    assert loaded.config.rope_freq_factors is not None and loaded.config.rope_scaling is None
    assert good < TOL
    # A planted wrong frequency (one mid-band factor doubled) and the tensor ignored must both fail.
    planted = factors.copy()
    planted[2] *= 2.0
    _, bad = err(_llama3_gguf(tmp_path, model, planted, "planted.gguf"))
    _, none = err(_llama3_gguf(tmp_path, model, None, "none.gguf"))
    print(f"[parity] planted factor: {bad:.2e}; rope_freqs ignored: {none:.2e}")
    assert bad > 100 * TOL and none > 100 * TOL


def test_gguf_rope_freqs_wrong_length_refused(tmp_path):
    cfg = tiny_config(architecture="LlamaForCausalLM")
    hf = hf_tensors(tiny_params(cfg, seed=0), cfg)
    path = write_gguf_model(tmp_path / "bad.gguf", hf, arch="llama", layers=2, heads=4, kv_heads=2, head_dim=16,
                            hidden=64, ffn=128, theta=10000.0, eps=1e-5,
                            extra={"rope_freqs.weight": np.ones(5, np.float32)})
    with pytest.raises(ModelLoadError, match="rope_freqs.weight has shape"):
        load_model(path, with_tokenizer=False)


# ------------------------------------------------------------------------------------------------ 3. split GGUF
def _split_files(tmp_path, max_tensors=4):
    cfg = tiny_config(architecture="LlamaForCausalLM")
    params = tiny_params(cfg, seed=5)
    hf = hf_tensors(params, cfg)
    kw = dict(arch="llama", layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64, ffn=128, theta=10000.0, eps=1e-5)
    single = write_gguf_model(tmp_path / "one.gguf", hf, **kw)
    write_gguf_model(tmp_path / "model.gguf", hf, split_max_tensors=max_tensors, **kw)
    shards = sorted(str(p) for p in tmp_path.glob("model-*-of-*.gguf"))
    return single, shards


def test_split_gguf_loads_all_shards_from_the_first(tmp_path):
    single, shards = _split_files(tmp_path)
    assert len(shards) >= 3 and shards[0].endswith("-00001-of-%05d.gguf" % len(shards))
    whole = load_model(single, with_tokenizer=False)
    split = load_model(shards[0], with_tokenizer=False)
    assert split.config == whole.config
    diffs = jax.tree_util.tree_map(lambda a, b: float(jnp.abs(a - b).max()), split.params, whole.params)
    assert max(jax.tree_util.tree_leaves(diffs)) == 0.0


def test_split_gguf_errors_name_the_fix(tmp_path):
    _, shards = _split_files(tmp_path)
    with pytest.raises(ModelLoadError, match=r"load the first shard, .*-00001-of-"):
        load_model(shards[1], with_tokenizer=False)
    os.remove(shards[-1])
    with pytest.raises(ModelLoadError, match=r"shard %d of %d, .* is missing" % (len(shards), len(shards))):
        load_model(shards[0], with_tokenizer=False)


# ------------------------------------------------------------------------------------------------ 4. Qwen3, Mistral
def _greedy_hf(model, prompt, n: int) -> list[int]:
    import torch

    model.generation_config.eos_token_id = None  # eos is just another token, as with ignore_eos
    with torch.no_grad():
        out = model.generate(torch.tensor(np.asarray([prompt])), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _greedy_ours(path, prompt, n: int, **llm_kw) -> list[int]:
    from specjax.api import LLM
    from specjax.config import SamplingParams

    llm = LLM(path, **llm_kw)
    return llm.generate([list(map(int, prompt))], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids


@pytest.mark.parity
def test_qwen3_parity(tmp_path):
    require_torch()
    model = _tiny_hf("qwen3", seed=7)
    path = _save(model, tmp_path)
    loaded = load_model(path, with_tokenizer=False)
    assert loaded.config.qk_norm and loaded.config.head_dim == 32 and loaded.config.architecture == "Qwen3ForCausalLM"
    tokens = np.random.default_rng(7).integers(0, VOCAB, 40)
    ref = _torch_logits(model, tokens)
    err = float(np.abs(full_logits(loaded.params, loaded.config, tokens) - ref).max())
    from dataclasses import replace

    no_norm = replace(loaded.config, qk_norm=False)
    guard = float(np.abs(full_logits(loaded.params, no_norm, tokens) - ref).max())
    print(f"\n[parity] tiny Qwen3: max abs logit error {err:.2e} (q/k norms skipped: {guard:.2e})")
    assert ref.std() > 0.5 and err < TOL and guard > 100 * TOL
    prompt = tokens[:12]
    assert _greedy_ours(path, prompt, 8) == _greedy_hf(model, prompt, 8)


@pytest.mark.parity
def test_qwen3_gguf_parity(tmp_path):
    require_torch()
    model = _tiny_hf("qwen3", seed=8)
    cfg = model.config
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    path = write_gguf_model(tmp_path / "q3.gguf", _torch_tensors(model), arch="qwen3", layers=2, heads=4,
                            kv_heads=2, head_dim=32, hidden=64, ffn=128, theta=theta, eps=1e-5)
    loaded = load_model(path, with_tokenizer=False)
    tokens = np.random.default_rng(8).integers(0, VOCAB, 32)
    err = float(np.abs(full_logits(loaded.params, loaded.config, tokens) - _torch_logits(model, tokens)).max())
    print(f"\n[parity] tiny Qwen3 GGUF: max abs logit error {err:.2e}")
    assert loaded.config.qk_norm and loaded.config.head_dim == 32 and err < TOL


@pytest.mark.parity
def test_mistral_sliding_window_parity(tmp_path):
    require_torch()
    model = _tiny_hf("mistral", seed=9, sliding_window=8)
    path = _save(model, tmp_path)
    loaded = load_model(path, with_tokenizer=False)
    assert loaded.config.sliding_window == 8
    tokens = np.random.default_rng(9).integers(0, VOCAB, 20)
    ref = _torch_logits(model, tokens)
    ours = full_logits(loaded.params, loaded.config, tokens)
    err = float(np.abs(ours - ref).max())
    from dataclasses import replace

    full = full_logits(loaded.params, replace(loaded.config, sliding_window=None), tokens)
    guard = float(np.abs(full[8:] - ref[8:]).max())
    print(f"\n[parity] tiny Mistral, window 8, 20 tokens: max abs logit error {err:.2e} (no window: {guard:.2e})")
    assert err < TOL and guard > 100 * TOL
    assert float(np.abs(full[:8] - ref[:8]).max()) < TOL  # inside the window the two agree
    # Greedy decoding past the window, through the engine's prefill and decode steps.
    assert _greedy_ours(path, tokens, 8) == _greedy_hf(model, tokens, 8)


def _ancestor_mask(parents) -> np.ndarray:
    n = len(parents)
    m = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def test_sliding_window_tree_verify_matches_each_path():
    """Verifying a tree over a cached prefix with a window: every node's logits equal the causal forward of
    prefix + its own path (where the window, not the tree, hides the oldest tokens)."""
    from dataclasses import replace

    from helpers import fresh_cache

    cfg = replace(tiny_config(architecture="MistralForCausalLM"), sliding_window=4)
    params = tiny_params(cfg, seed=11)
    rng = np.random.default_rng(11)
    L, parents = 10, [-1, 0, 0, 1, 3, 2]
    prefix = rng.integers(0, VOCAB, L)
    nodes = rng.integers(0, VOCAB, len(parents))
    depth = _ancestor_mask(parents).sum(1) - 1
    cache = fresh_cache(cfg, 1, 32)
    pre = jit_forward(params, cfg, jnp.asarray(prefix[None], jnp.int32), jnp.arange(L, dtype=jnp.int32)[None], cache)
    cache = pre.cache._replace(lengths=jnp.asarray([L], jnp.int32))
    out = jit_forward(params, cfg, jnp.asarray(nodes[None], jnp.int32), jnp.asarray((L + depth)[None], jnp.int32),
                      cache, jnp.asarray(_ancestor_mask(parents)[None]))
    no_window = replace(cfg, sliding_window=None)
    out_full = jit_forward(params, no_window, jnp.asarray(nodes[None], jnp.int32),
                           jnp.asarray((L + depth)[None], jnp.int32), cache, jnp.asarray(_ancestor_mask(parents)[None]))
    worst, moved = 0.0, 0.0
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(nodes[j])
            j = parents[j]
        seq = np.concatenate([prefix, path[::-1]])
        ref = full_logits(params, cfg, seq)[-1]
        worst = max(worst, float(np.abs(np.asarray(out.logits[0, i]) - ref).max()))
        moved = max(moved, float(np.abs(np.asarray(out_full.logits[0, i]) - ref).max()))
    assert worst < TOL and moved > 100 * TOL


def test_sliding_window_refuses_attention_without_it():
    from dataclasses import replace

    from helpers import fresh_cache
    from specjax.backends.registry import get_attention

    cfg = replace(tiny_config(architecture="MistralForCausalLM"), sliding_window=4)
    params = tiny_params(cfg, seed=0)
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"sliding_window=4.*attention_impl='reference'"):
        jit_forward(params, cfg, tokens, jnp.arange(3, dtype=jnp.int32)[None], fresh_cache(cfg, 1, 8),
                    attention_fn=get_attention("reference", "cpu"))


@pytest.mark.slow
@pytest.mark.parity
def test_mistral_window_speculative_equals_plain(tmp_path):
    """n-gram speculation past the window: the verify pass applies the window, so greedy speculation equals plain
    greedy decoding and transformers. The prompt X + G + X (G = X's greedy continuation, X longer than the two
    layers' 15-token receptive field) makes the model repeat G, which the n-gram drafter finds and gets accepted."""
    require_torch()
    model = _tiny_hf("mistral", seed=12, sliding_window=8)
    path = _save(model, tmp_path)
    from specjax.api import LLM
    from specjax.config import SamplingParams

    x = np.random.default_rng(12).integers(0, VOCAB, 20).tolist()
    llm = LLM(path)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = x + llm.generate([x], sp)[0].token_ids + x
    plain = llm.generate([prompt], sp)[0]
    spec = llm.generate([prompt], sp, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "adaptive": False})[0]
    assert spec.token_ids == plain.token_ids == _greedy_hf(model, prompt, 12)
    assert (spec.metrics.accepted or 0) > 0


# ------------------------------------------------------------------------------------------------ 5. chat templates
GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.mark.parity
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_generation_blocks_and_template_kwargs_parity(tmp_path, kwargs):
    require_transformers()
    from transformers import AutoTokenizer

    from specjax.requests import encode_prompt

    path = _bos_tokenizer_dir(tmp_path, post_bos=False, template=GENERATION_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(path)
    tok = Tokenizer.from_hf_dir(path)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Again"}]
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == theirs
    assert ("<think>" in theirs) == bool(kwargs)
    ids = encode_prompt(tok, VOCAB, messages, True, chat_template_kwargs=kwargs)
    assert ids == hf(theirs, add_special_tokens=False).input_ids


def test_generation_block_renders_as_if_absent():
    from specjax.models import chat_template

    with_tags = "{% for m in messages %}[{% generation %}{{ m.content }}{% endgeneration %}]{% endfor %}"
    without = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    msgs = {"messages": [{"content": "a"}, {"content": "b"}]}
    assert chat_template.render(with_tags, msgs) == chat_template.render(without, msgs) == "[a][b]"


# ------------------------------------------------------------------------------------------------ 6. dtypes
def _bf16_checkpoint(path, n: int = 1 << 21, config_dtype: str | None = "bfloat16") -> tuple[str, np.ndarray]:
    """A one-tensor bf16 safetensors file (n values) next to a config.json naming `config_dtype`."""
    import ml_dtypes
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    values = np.random.default_rng(0).standard_normal(n).astype(ml_dtypes.bfloat16)
    fn = os.path.join(path, "model.safetensors")
    save_file({"w": values}, fn)
    cfg = {} if config_dtype is None else {"dtype": config_dtype}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return fn, values


@pytest.mark.parametrize("dtype, itemsize", [("bfloat16", 2), ("float32", 4)])
def test_safetensors_cast_once_without_float32_staging(tmp_path, dtype, itemsize):
    """Reading a bf16 file allocates the result and nothing of its size besides: bf16 -> bf16 is one bf16 copy
    (float32 staging would allocate twice as much again), bf16 -> float32 one float32 array (no bf16 copy
    first)."""
    fn, values = _bf16_checkpoint(tmp_path / "m")
    tracemalloc.start()
    try:
        out = read_safetensors([fn], dtype)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = values.size * itemsize
    assert str(out["w"].dtype) == dtype
    assert np.array_equal(out["w"].astype(np.float32), values.astype(np.float32))
    assert peak < 1.25 * size, f"peak {peak} bytes for a {size}-byte result: an extra copy was staged"


def test_checkpoint_dtype_is_the_default(tmp_path):
    from specjax.models.loading import DEFAULT_MODEL

    _bf16_checkpoint(tmp_path / "bf16", n=8)
    _bf16_checkpoint(tmp_path / "f16", n=8, config_dtype="float16")
    _bf16_checkpoint(tmp_path / "none", n=8, config_dtype=None)
    assert resolve_dtype(str(tmp_path / "bf16"), "auto") == "bfloat16"
    assert resolve_dtype(str(tmp_path / "bf16"), None) == "bfloat16"
    assert resolve_dtype(str(tmp_path / "bf16"), "float32") == "float32"  # an explicit choice wins
    assert resolve_dtype(str(tmp_path / "f16"), "auto") == "float32"
    assert resolve_dtype(str(tmp_path / "none"), "auto") == "float32"
    with pytest.raises(ModelLoadError, match="'auto'"):
        resolve_dtype(str(tmp_path / "bf16"), "float16")
    try:
        assert resolve_dtype(DEFAULT_MODEL, "auto") == "float32"  # the default GGUF model stays float32
    except ModelLoadError:
        pytest.skip("default GGUF model not installed")


@pytest.mark.parity
def test_bf16_checkpoint_loads_bit_exact_as_bf16(tmp_path):
    require_torch()
    import torch

    model = _tiny_hf("qwen3", seed=13).to(torch.bfloat16)
    path = _save(model, tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    loaded = load_model(path, dtype="auto", with_tokenizer=False)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree_util.tree_leaves(loaded.params))
    ref = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    assert np.array_equal(np.asarray(loaded.params["embed"], np.float32), ref["model.embed_tokens.weight"])
    assert np.array_equal(np.asarray(loaded.params["layers"][1]["wq"], np.float32).T,
                          ref["model.layers.1.self_attn.q_proj.weight"])
    assert np.array_equal(np.asarray(loaded.params["layers"][0]["q_norm"], np.float32),
                          ref["model.layers.0.self_attn.q_norm.weight"])


@pytest.mark.parametrize("shown", ["1", "0"])
def test_reading_a_gguf_file_shows_progress_where_progress_is_shown(tmp_path, capsys, monkeypatch, shown):
    from helpers import write_gguf
    from specjax.models import loading

    monkeypatch.setenv("SPECJAX_PROGRESS", shown)
    monkeypatch.setenv("SPECJAX_WEIGHT_CACHE", "0")
    cfg = tiny_config()
    loading.load_gguf(write_gguf(tmp_path / "m.gguf", cfg, tiny_params(cfg, seed=1)))
    err = capsys.readouterr().err
    assert ("reading m.gguf" in err) == (shown == "1")
