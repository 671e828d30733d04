"""Plain decoding of quantized targets: tokens/s, bytes per step against the read bandwidth, and quality against
float32 (issue 28).

    python benchmarks/quant_decode.py [--settings float32 bfloat16 int8 int4 gguf w8a8 int8+kv8] [--batches 1 8]
                                      [--new-tokens 64] [--quality-prompts 5] [--quality-tokens 32]
                                      [--group-size 32] [--llama-cpp] [--json out.json]

For each setting: resident weight bytes, bytes a one-token step reads from the weights, the copy bandwidth measured
in the same run (STREAM convention, `benchmarks/decode.py`) and the roofline it implies, plain greedy tokens/s at
each batch size (`benchmarks/decode.bench_specjax`: the on-device loop, prefill excluded, best of 2), KV cache
bytes per token (the model's dtype, and int8 entries with one float32 scale per token and head), and on the first
--quality-prompts Spec-Bench prompts (turns[0], chat template): greedy token agreement with float32 (the share of
positions before the first difference, and exact-match prompts) and the largest logit difference of one forward
over the prompt. Settings: float32, bfloat16 (float weights), int8, int4 (float32 activations), gguf (the file's
own Q8_0 / Q4_0 / Q4_1 blocks, its LM head too when the file stores it so), w8a8 (int8 weights and activations
through Qwix); "+lmq" / "+lmf" quantize the LM head too / keep it float (default: the setting's own, LLM's
quantize_lm_head=None), and "+kv8" adds the int8 KV cache. A setting named twice runs again as "<setting>#2"
(speed only): list float32 first and last to measure the drift; the bfloat16 / float32 ratio at batch 1 is then over
the float32 runs' mean. --llama-cpp: llama.cpp (llama-cpp-python, in a child process) decodes the same GGUF file on
the same prompts before the first setting and after the last (its drift), at batch 1: decode tokens/s is
(tokens - 1) over the time after the first token, the median over the prompts.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

SPEC_BENCH = "/work/shared/data/spec_bench/question.jsonl"
SETTINGS = ("float32", "bfloat16", "int8", "int4", "gguf", "w8a8")
KV8 = "+kv8"
LM_HEAD = {"+lmq": True, "+lmf": False}  # the LM head quantized like the layers, or kept float


def _decode_module():
    path = pathlib.Path(__file__).with_name("decode.py")
    spec = importlib.util.spec_from_file_location("specjax_bench_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_setting(setting: str) -> tuple[str, bool | None, bool]:
    """'int8+lmq+kv8' -> (base 'int8', quantize_lm_head True, int8 KV cache True)."""
    base, *flags = setting.split("+")
    unknown = [f for f in flags if "+" + f not in LM_HEAD and "+" + f != KV8]
    if base not in SETTINGS or unknown or len(flags) != len(set(flags)):
        raise argparse.ArgumentTypeError(
            f"unknown setting {setting!r}: one of {', '.join(SETTINGS)}, each optionally with {' or '.join(LM_HEAD)} "
            f"(the LM head quantized / float; default: the setting's own) and {KV8}")
    lm = [LM_HEAD["+" + f] for f in flags if "+" + f in LM_HEAD]
    if len(lm) > 1:
        raise argparse.ArgumentTypeError(f"setting {setting!r}: {' and '.join(LM_HEAD)} exclude each other")
    return base, (lm[0] if lm else None), KV8[1:] in flags


def make_llm(setting: str, model: str, group_size: int):
    from specjax.api import LLM

    base, lm_head, kv8 = parse_setting(setting)
    dtype = "bfloat16" if base == "bfloat16" else "float32"
    quantization = base if base in ("int8", "int4", "gguf", "w8a8") else None
    return LLM(model, dtype, quantization=quantization, quantization_group_size=group_size,
               quantize_lm_head=lm_head, kv_cache_dtype="int8" if kv8 else None)


def setting_name(value: str) -> str:
    parse_setting(value)
    return value


def llama_cpp_decode(model: str, prompts: list[str], new_tokens: int) -> dict:
    """llama.cpp on the same GGUF file, batch 1, greedy: the median decode tokens/s over the prompts."""
    from specjax.tools.bench import BenchPrompt
    from specjax.tools.peers import run_isolated

    records = run_isolated("llama.cpp", model, [BenchPrompt(str(i), "decode", (p,)) for i, p in enumerate(prompts)],
                           new_tokens)
    rates = [(r["new_tokens"] - 1) / (r["time"] - r["ttft"]) for r in records if r["new_tokens"] > 1]
    return {"tokens_per_s": float(np.median(rates)), "per_prompt": rates,
            "new_tokens": [r["new_tokens"] for r in records]}


def kv_bytes_per_token(config, itemsize: int) -> dict:
    """KV bytes per cached token in the model's dtype and as the int8 cache stores it (`memory.kv_token_bytes`)."""
    from specjax.memory import kv_token_bytes

    return {"model_dtype": kv_token_bytes(config, itemsize), "int8": kv_token_bytes(config, itemsize, "int8")}


def spec_bench_prompts(n: int) -> list[str]:
    out = []
    with open(SPEC_BENCH) as f:
        for line in f:
            out.append(json.loads(line)["turns"][0])
            if len(out) == n:
                break
    return out


def greedy_tokens(llm, prompts: list[str], new_tokens: int) -> list[list[int]]:
    from specjax.config import SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, chat=True)]


def prompt_logits(llm, prompts: list[str]) -> list[np.ndarray]:
    """Logits [P, V] of one forward over each prompt (chat template)."""
    from specjax.kv_cache import init_cache
    from specjax.models.llama import forward

    c = llm.config
    out = []
    for p in prompts:
        ids = llm.encode_prompt(p, chat=True)
        P = 1 << max(4, (len(ids) - 1).bit_length())
        toks = np.zeros((1, P), np.int32)
        toks[0, :len(ids)] = ids
        cache = init_cache(c.num_layers, 1, P, c.num_kv_heads, c.head_dim, llm.params["embed"].dtype)
        logits = jax.jit(lambda prm, t: forward(prm, c, t, jnp.arange(P)[None], cache).logits)(llm.params, toks)
        out.append(np.asarray(logits[0, :len(ids)], np.float32))
    return out


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, len(a)))
    return {"agree_prefix": float(np.mean(prefix)), "exact_prompts": int(sum(a == b for a, b in zip(ref, got)))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), type=setting_name)
    ap.add_argument("--llama-cpp", action="store_true", help="llama.cpp on the same GGUF, first and last")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quality-prompts", type=int, default=5)
    ap.add_argument("--quality-tokens", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from specjax.models import quant

    dec = _decode_module()
    bw = dec.copy_bandwidth()
    prompts = spec_bench_prompts(args.quality_prompts) if args.quality_prompts else []
    rows, ref_tokens, ref_logits = [], None, None
    dec_prompts = dec.PROMPTS[:4]
    peer = []
    if args.llama_cpp:
        peer.append(llama_cpp_decode(args.model, dec_prompts, args.new_tokens))
        print(f"llama.cpp batch 1 (first): {peer[0]['tokens_per_s']:.1f} tok/s", flush=True)
    seen: dict[str, int] = {}
    for setting in args.settings:
        seen[setting] = seen.get(setting, 0) + 1
        label = setting if seen[setting] == 1 else f"{setting}#{seen[setting]}"  # a repeat measures the drift
        t0 = time.perf_counter()
        llm = make_llm(setting, args.model, args.group_size)
        load_s = time.perf_counter() - t0
        resident = quant.weight_bytes(llm.params)
        step = quant.step_weight_bytes(llm.params)
        row = {"setting": label, "load_s": load_s, "resident_weight_bytes": resident, "step_weight_bytes": step,
               "roofline_tokens_per_s_batch1": bw / 2 / step,  # copy bandwidth counts read + write bytes
               "kv_bytes_per_token": kv_bytes_per_token(llm.config, np.dtype(llm.params["embed"].dtype).itemsize)}
        for b in args.batches:
            fig = dec.bench_specjax(llm, b, args.new_tokens)
            row[f"batch{b}"] = fig
            print(f"{label} batch {b}: {fig['tokens_per_s']:.1f} tok/s ({fig['step_ms']:.1f} ms/step)", flush=True)
        if prompts and seen[setting] == 1:
            toks = greedy_tokens(llm, prompts, args.quality_tokens)
            logits = prompt_logits(llm, prompts)
            if ref_tokens is None and setting == "float32":
                ref_tokens, ref_logits = toks, logits
            if ref_tokens is not None:
                row.update(agreement(ref_tokens, toks))
                row["max_logit_error"] = float(max(np.abs(a - b).max() for a, b in zip(ref_logits, logits)))
        rows.append(row)
        del llm
    if args.llama_cpp:
        peer.append(llama_cpp_decode(args.model, dec_prompts, args.new_tokens))
        print(f"llama.cpp batch 1 (last): {peer[1]['tokens_per_s']:.1f} tok/s", flush=True)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(), "cpus": os.cpu_count(),
           "load_average": os.getloadavg(), "copy_bandwidth_bytes_per_s": bw, "args": vars(args), "rows": rows,
           "llama_cpp": peer}
    print(f"\ncopy bandwidth {bw / 1e9:.1f} GB/s; load average {os.getloadavg()[0]:.1f}")
    print("| setting | weights MB | step reads MB | roofline tok/s (b=1) | "
          + " | ".join(f"tok/s b={b}" for b in args.batches)
          + " | KV B/token (dtype / int8) | greedy agree (prefix, exact) | max logit err |")
    print("|---" * (6 + len(args.batches)) + "|")
    for r in rows:
        kv = r["kv_bytes_per_token"]
        q = (f"{r['agree_prefix']:.2f}, {r['exact_prompts']}/{len(prompts)} | {r['max_logit_error']:.3f}"
             if "agree_prefix" in r else "- | -")
        print(f"| {r['setting']} | {r['resident_weight_bytes'] / 1e6:.0f} | {r['step_weight_bytes'] / 1e6:.0f} | "
              f"{r['roofline_tokens_per_s_batch1']:.0f} | "
              + " | ".join(f"{r[f'batch{b}']['tokens_per_s']:.1f}" for b in args.batches)
              + f" | {kv['model_dtype']} / {kv['int8']} | {q} |")
    f32 = [r for r in rows if r["setting"].split("#")[0] == "float32"]
    bf16 = [r for r in rows if r["setting"] == "bfloat16"]
    if f32 and bf16 and 1 in args.batches:
        base = [r["batch1"]["tokens_per_s"] for r in f32]
        ratio = bf16[0]["batch1"]["tokens_per_s"] / float(np.mean(base))
        doc["bfloat16_over_float32_batch1"] = {"ratio": ratio, "float32_runs": base}
        print(f"\nbfloat16 / float32 at batch 1: {ratio:.2f}x (float32 runs: "
              + " / ".join(f"{x:.1f}" for x in base) + " tok/s; the ratio is over their mean)")
    if peer:
        print(f"| llama.cpp (same GGUF, first / last) | | | | {peer[0]['tokens_per_s']:.1f} / {peer[-1]['tokens_per_s']:.1f}"
              " (b=1) | | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
