"""Peer engines run on the same prompts by `specjax bench --peers ...`, each optional.

- Hugging Face transformers on the same weights (the GGUF dequantized by transformers itself, float32 on CPU):
  plain greedy `generate`, `prompt_lookup_num_tokens` (n-gram prompt lookup), and assisted generation with a
  draft model given as an HF directory.
- llama.cpp through llama-cpp-python on the same GGUF file: plain and its prompt-lookup decoding. llama.cpp runs
  the QUANTIZED weights natively (Q4_1 for the default model), so its speed is not a same-precision comparison.

Each run returns the bench record format (see `specjax.bench.run_requests`) plus whether the greedy output of a
speculative peer equals that peer's own plain greedy output.
"""
from __future__ import annotations

import os
import time
from typing import Sequence


class PeerUnavailable(RuntimeError):
    """The peer's package is not installed; the message says which extra to install."""


def _record(p, new_tokens: int, seconds: float, ttft: float | None, ids: list[int]) -> dict:
    return {"id": p.id, "category": p.category, "new_tokens": new_tokens, "time": seconds, "ttft": ttft or 0.0,
            "drafted": 0, "accepted": 0, "verify_steps": 0, "target_forwards": 0, "token_ids": [ids]}


def transformers_runner(model_files, mode: str = "plain", num_tokens: int = 4, assistant_dir: str | None = None):
    """A function(prompts, max_new_tokens) -> records for transformers in the given mode."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise PeerUnavailable(f"transformers peer needs the parity extra: pip install -e '.[parity]' ({e})") from None
    kw = {"gguf_file": os.path.basename(model_files.path)} if model_files.kind == "gguf" else {}
    root = os.path.dirname(model_files.path) if model_files.kind == "gguf" else model_files.path
    tok = AutoTokenizer.from_pretrained(root, **kw)
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32, **kw).eval()
    assistant = None
    if mode == "assisted":
        if not assistant_dir:
            raise PeerUnavailable("assisted generation needs a draft model directory (--peer-draft)")
        assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()

    def run(prompts: Sequence, max_new_tokens: int) -> list[dict]:
        records = []
        for i, p in enumerate(prompts):
            text = tok.apply_chat_template([{"role": "user", "content": p.turns[0]}], tokenize=False,
                                           add_generation_prompt=True)
            enc = tok(text, return_tensors="pt", add_special_tokens=False)
            extra = {}
            if mode == "prompt_lookup":
                extra["prompt_lookup_num_tokens"] = num_tokens
            elif mode == "assisted":
                extra["assistant_model"] = assistant
            with torch.no_grad():
                if i == 0:  # warm-up, like specjax's compile exclusion
                    model.generate(**enc, max_new_tokens=4, do_sample=False, **extra)
                t = time.perf_counter()
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, **extra)
                dt = time.perf_counter() - t
            ids = out[0, enc["input_ids"].shape[1]:].tolist()
            records.append(_record(p, len(ids), dt, None, ids))
        return records

    return run


def llamacpp_runner(gguf_path: str, mode: str = "plain", num_tokens: int = 4, threads: int | None = None):
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        raise PeerUnavailable(f"llama.cpp peer needs llama-cpp-python: pip install llama-cpp-python ({e})") from None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=num_tokens) if mode == "prompt_lookup" else None
    llm = Llama(model_path=gguf_path, n_ctx=4096, n_threads=threads or os.cpu_count(), verbose=False,
                draft_model=draft, logits_all=draft is not None)

    def run(prompts: Sequence, max_new_tokens: int) -> list[dict]:
        records = []
        for i, p in enumerate(prompts):
            msgs = [{"role": "user", "content": p.turns[0]}]
            if i == 0:
                llm.create_chat_completion(msgs, max_tokens=4, temperature=0.0)
            t = time.perf_counter()
            first = None
            ids: list[int] = []
            text = ""
            for chunk in llm.create_chat_completion(msgs, max_tokens=max_new_tokens, temperature=0.0, top_k=1,
                                                    stream=True):
                delta = chunk["choices"][0]["delta"].get("content")
                if delta:
                    if first is None:
                        first = time.perf_counter() - t
                    text += delta
            dt = time.perf_counter() - t
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
            records.append(_record(p, len(ids), dt, first, ids))
        return records

    return run


PEERS = {
    "transformers": ("plain",), "transformers-prompt-lookup": ("prompt_lookup",),
    "transformers-assisted": ("assisted",), "llama.cpp": ("plain",), "llama.cpp-prompt-lookup": ("prompt_lookup",),
}


def make_runner(name: str, model_spec: str, num_tokens: int = 4, assistant_dir: str | None = None):
    from specjax.models.loading import resolve_model

    if name not in PEERS:
        raise PeerUnavailable(f"unknown peer {name!r}; available: {', '.join(PEERS)}")
    files = resolve_model(model_spec)
    mode = PEERS[name][0]
    if name.startswith("transformers"):
        return transformers_runner(files, mode, num_tokens, assistant_dir)
    if files.kind != "gguf":
        raise PeerUnavailable("the llama.cpp peer needs a .gguf model")
    return llamacpp_runner(files.path, mode, num_tokens)
