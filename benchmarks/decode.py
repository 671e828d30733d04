"""Plain-decoding throughput of specjax against this machine's memory-bandwidth roofline and HF transformers.

    python benchmarks/decode.py [--model smollm2-135m] [--new-tokens 128] [--batches 1 8] [--no-hf] [--json out.json]
                                 [--cpu-matmul auto xla] [--cpu-attention auto xla] [--rounds 3]

For each dtype and batch size: tokens/s of greedy decoding (the on-device while loop, prefill excluded), the
roofline (weight bytes read per decode step / measured copy bandwidth, i.e. the best tokens/s a memory-bound
decoder can reach) and the ratio to it. transformers' greedy `generate` on the same dequantized weights runs
side by side (float32, same prompts, same number of new tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.backends import ops
from specjax.kernels import cpu_build

PROMPTS = [
    "Explain how a rainbow forms.", "Write a short poem about autumn leaves.",
    "What are the benefits of regular exercise?", "Describe the water cycle in simple terms.",
    "Give three tips for learning a new language.", "Why is the sky blue?",
    "Summarize the plot of a detective story you invent.", "How do airplanes stay in the air?",
]


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes/s of a large memory copy, read + written bytes counted (the STREAM 'copy' convention): the best of
    NumPy's copy into a preallocated buffer and a donated (in-place) XLA elementwise pass. Preallocating
    matters: a fresh output buffer would time page faults, not memory."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    f = jax.jit(lambda a: a * 1.0000001, donate_argnums=0)
    y = f(jnp.ones((nbytes // 4,), jnp.float32))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
        t = time.perf_counter()
        y = f(y)
        y.block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def weight_bytes(params) -> int:
    """Bytes read per decode step: every weight once (the embedding gather reads one row, but a tied LM head
    reads the whole table)."""
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params)))


def bench_specjax(llm, batch: int, new_tokens: int, reps: int = 2) -> dict:
    from specjax import engine
    from specjax.buckets import make_buckets
    from specjax.requests import pad_prompts
    from specjax.config import SamplingParams

    prompts = [llm.encode_prompt(p, chat=True) for p in (PROMPTS * 4)[:batch]]
    sp = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)] * batch
    b = make_buckets(batch, max(map(len, prompts)), new_tokens)
    toks, lens, active = pad_prompts(prompts, b.batch, b.prompt_len)
    sampling = llm.sampling_arrays(sp, b.batch, b.num_stop)
    best = float("inf")
    for r in range(reps + 1):
        state = engine.prefill(llm.params, llm.config, b, toks, lens, active, sampling)
        jax.block_until_ready(state)
        t = time.perf_counter()
        state = engine.decode_loop(llm.params, llm.config, state, sampling, jnp.int32(2 ** 30))
        jax.block_until_ready(state)
        dt = time.perf_counter() - t
        if r:  # the first round compiles
            best = min(best, dt)
    steps = new_tokens - 1  # the first token comes from prefill
    return {"batch": batch, "tokens_per_s": batch * steps / best, "step_ms": 1000 * best / steps}


def bench_hf(model_spec: str, batch: int, new_tokens: int) -> dict | None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        print(f"transformers not available ({e}); skipping the HF column")
        return None
    from specjax.models.loading import resolve_model

    files = resolve_model(model_spec)
    kw = {"gguf_file": os.path.basename(files.path)} if files.kind == "gguf" else {}
    d = os.path.dirname(files.path) if files.kind == "gguf" else files.path
    tok = AutoTokenizer.from_pretrained(d, **kw)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in (PROMPTS * 4)[:batch]]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    best = float("inf")
    with torch.no_grad():
        for r in range(2):
            t = time.perf_counter()
            model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            best = min(best, time.perf_counter() - t)
    return {"batch": batch, "tokens_per_s": batch * new_tokens / best}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every measurement (bandwidth, specjax, transformers) this many times, in turn")
    ap.add_argument("--cpu-matmul", nargs="+", default=None, choices=("auto", "kernel", "xla"),
                    help="run specjax under each SPECJAX_KERNELS matmul= choice in turn (default: the current one)")
    ap.add_argument("--cpu-attention", nargs="+", default=None, choices=("auto", "kernel", "xla"),
                    help="and under each SPECJAX_KERNELS attention= choice (default: the current one)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    from specjax.api import LLM

    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__} on {jax.default_backend()}")
    rows, bws = [], []
    policies = [(m, a) for m in args.cpu_matmul or [ops.override("matmul")]
                for a in args.cpu_attention or [ops.override("attention")]]
    llms = {}
    for rnd in range(args.rounds):
        # Each round measures the bandwidth, every specjax configuration and transformers again: this machine's
        # speed drifts by 10-20% within minutes, so only figures of one round compare.
        bw = copy_bandwidth()
        bws.append(bw)
        print(f"round {rnd + 1}/{args.rounds}: measured copy bandwidth {bw / 1e9:.1f} GB/s")
        for mm, att in policies:
            # The table chooses when a function is traced: drop every traced function before switching.
            others = {k: v for k, v in ops.overrides().items() if k not in ("matmul", "attention")}
            os.environ[ops.ENV] = ",".join(f"{k}={v}" for k, v in {**others, "matmul": mm, "attention": att}.items())
            jax.clear_caches()
            policy = f"matmul {mm}, attention {att}"
            kernel = f" (kernels {'built' if cpu_build.available() else 'unavailable'})"
            print(f"{ops.ENV}={os.environ[ops.ENV]}{kernel}")
            for dtype in args.dtypes:
                llm = llms.get(dtype) or llms.setdefault(dtype, LLM(args.model, dtype=dtype))
                wb = weight_bytes(llm.params)
                roof = bw / wb
                for batch in args.batches:
                    r = bench_specjax(llm, batch, args.new_tokens)
                    # At batch B one step reads the weights once and yields B tokens.
                    r.update(engine="specjax", dtype=dtype, cpu_matmul=mm, cpu_attention=att, weight_mb=wb / 1e6,
                             roofline_tokens_per_s=roof * batch, roofline_ratio=r["tokens_per_s"] / (roof * batch),
                             round=rnd + 1)
                    rows.append(r)
                    print(f"specjax {dtype:8s} batch {batch:2d} [{policy}]: {r['tokens_per_s']:8.1f} tok/s  "
                          f"step {r['step_ms']:.1f} ms  roofline {roof * batch:8.1f} tok/s  "
                          f"ratio {r['roofline_ratio']:.2f}")
        if not args.no_hf:
            for batch in args.batches:
                h = bench_hf(args.model, batch, args.new_tokens)
                if h:
                    h.update(engine="transformers", dtype="float32", round=rnd + 1)
                    rows.append(h)
                    ours = [r for r in rows if r["engine"] == "specjax" and r["batch"] == batch
                            and r["dtype"] == "float32" and r["round"] == rnd + 1]
                    for r in ours:
                        r["vs_transformers"] = r["tokens_per_s"] / h["tokens_per_s"]
                    print(f"transformers float32 batch {batch:2d}: {h['tokens_per_s']:8.1f} tok/s  " + ", ".join(
                        f"specjax f32 [{r['cpu_matmul']}/{r['cpu_attention']}] {r['vs_transformers']:.2f}x"
                        for r in ours))
    if args.rounds > 1:
        print(f"median over {args.rounds} rounds:")
        for mm, att in policies:
            for dtype in args.dtypes:
                for batch in args.batches:
                    rs = [r for r in rows if r["engine"] == "specjax" and (r["cpu_matmul"], r["cpu_attention"],
                                                                          r["dtype"], r["batch"]) == (mm, att, dtype, batch)]
                    line = (f"  specjax {dtype:8s} batch {batch:2d} [matmul {mm}, attention {att}]: "
                            f"{np.median([r['tokens_per_s'] for r in rs]):8.1f} tok/s  roofline ratio "
                            f"{np.median([r['roofline_ratio'] for r in rs]):.2f}")
                    vs = [r["vs_transformers"] for r in rs if "vs_transformers" in r]
                    print(line + (f"  vs transformers {np.median(vs):.2f}x (rounds: "
                                  f"{', '.join(f'{v:.2f}' for v in vs)})" if vs else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_gbs": [b / 1e9 for b in bws], "rows": rows, "new_tokens": args.new_tokens,
                       "rounds": args.rounds}, f, indent=1)


if __name__ == "__main__":
    main()
