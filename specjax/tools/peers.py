"""Peer engines run on the same prompts by `specjax bench --peers ...`, each optional.

- Hugging Face transformers on the same weights (the GGUF dequantized by transformers itself, float32 on CPU):
  plain greedy `generate`, `prompt_lookup_num_tokens` (n-gram prompt lookup), and assisted generation with a
  draft model given as an HF directory.
- llama.cpp through llama-cpp-python on the same GGUF file: plain and its prompt-lookup decoding. llama.cpp runs
  the QUANTIZED weights natively (Q4_1 for the default model), so its speed is not a same-precision comparison.

Each run returns the bench record format (see `specjax.tools.bench.run_requests`) plus whether the greedy output of a
speculative peer equals that peer's own plain greedy output.

`run_isolated` runs one peer in a child Python process (`python -m specjax.tools.peers ...`, prompts and records as JSON
files). A peer is native code we do not control: a llama.cpp build that uses AMX tiles on a virtual machine which
advertises but does not enable them dies with SIGILL. In the bench's own process that would end the run and lose
every result measured so far; in a child it becomes a `PeerFailed` the bench reports before going on.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from specjax.errors import SpecjaxError


class PeerUnavailable(SpecjaxError, RuntimeError):
    """The peer's package is not installed; the message says which extra to install."""


class PeerFailed(SpecjaxError, RuntimeError):
    """A peer's child process died or returned no records; the message says how, and the end of its stderr."""


EXIT_UNAVAILABLE = 3  # the child's exit status for PeerUnavailable (its message is the last stderr line)


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


_SIGNAL_HINTS = {
    "SIGILL": "the peer's native library ran an instruction this CPU does not execute (a build for other CPU "
              "features, e.g. llama.cpp with AMX or AVX-512 on a virtual machine that advertises but does not enable "
              "them); rebuild it for this machine, e.g. CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF "
              "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" pip install --no-cache-dir --force-reinstall llama-cpp-python",
    "SIGKILL": "the child was killed, most often by the kernel when memory ran out",
}


def _child_command(name: str, model_spec: str, prompts_path: str, out_path: str, max_new_tokens: int,
                   num_tokens: int, assistant_dir: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "specjax.tools.peers", "--name", name, "--model", model_spec, "--prompts", prompts_path,
           "--out", out_path, "--max-new-tokens", str(max_new_tokens), "--num-tokens", str(num_tokens)]
    return cmd + (["--peer-draft", assistant_dir] if assistant_dir else [])


def _tail(text: str, lines: int = 6) -> str:
    kept = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()][-lines:]
    return "\n".join("    " + ln for ln in kept)


def run_isolated(name: str, model_spec: str, prompts: Sequence, max_new_tokens: int, num_tokens: int = 4,
                 assistant_dir: str | None = None) -> list[dict]:
    """Run peer `name` on `prompts` (BenchPrompt-like: id, category, turns) in a child process -> its records.

    Raises PeerUnavailable when the child reports a missing package or an unusable model, PeerFailed when it dies
    (by a signal or an error) or writes no records.
    """
    with tempfile.TemporaryDirectory(prefix="specjax-peer-") as tmp:
        prompts_path, out_path = os.path.join(tmp, "prompts.json"), os.path.join(tmp, "records.json")
        with open(prompts_path, "w", encoding="utf-8") as f:
            json.dump([{"id": p.id, "category": p.category, "turns": list(p.turns)} for p in prompts], f)
        cmd = _child_command(name, model_spec, prompts_path, out_path, max_new_tokens, num_tokens, assistant_dir)
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
        if proc.returncode == EXIT_UNAVAILABLE:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            raise PeerUnavailable(lines[-1] if lines else f"peer {name} is unavailable")
        if proc.returncode < 0:
            sig = signal.Signals(-proc.returncode).name
            hint = _SIGNAL_HINTS.get(sig, "a crash in the peer's native code")
            raise PeerFailed(f"peer {name} crashed with {sig}: {hint}. End of its output:\n{_tail(proc.stderr)}")
        if proc.returncode != 0:
            raise PeerFailed(f"peer {name} failed (exit status {proc.returncode}). End of its output:\n"
                             f"{_tail(proc.stderr)}")
        try:
            with open(out_path, encoding="utf-8") as f:
                records = json.load(f)
        except (OSError, ValueError) as e:
            raise PeerFailed(f"peer {name} exited without writing its records ({e})") from None
    if not isinstance(records, list) or len(records) != len(prompts):
        raise PeerFailed(f"peer {name} wrote {len(records) if isinstance(records, list) else 'no'} records for "
                         f"{len(prompts)} prompts")
    return records


def _main(argv: Sequence[str] | None = None) -> int:
    """The child side of `run_isolated`."""
    from specjax.tools.bench import BenchPrompt

    ap = argparse.ArgumentParser(prog="python -m specjax.tools.peers", description="Run one peer engine (used by "
                                 "`specjax bench --peers`, which starts it in its own process).")
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of {id, category, turns}")
    ap.add_argument("--out", required=True, help="where the JSON list of records goes")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--peer-draft", default=None)
    args = ap.parse_args(argv)
    with open(args.prompts, encoding="utf-8") as f:
        prompts = [BenchPrompt(str(r["id"]), str(r["category"]), tuple(r["turns"])) for r in json.load(f)]
    try:
        runner = make_runner(args.name, args.model, args.num_tokens, args.peer_draft)
    except (PeerUnavailable, ValueError) as e:
        print(f"{e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    records = runner(prompts, args.max_new_tokens)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(records, f)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
