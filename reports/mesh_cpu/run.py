"""Tokens/s of SmolLM2-135M over simulated CPU devices, one figure per mesh shape: a check of the overheads of
the sharded programs (collectives, lost CPU kernels), not of speed -- 8 simulated devices share this machine's
cores, so no mesh can be faster than one device here.

    python reports/mesh_cpu/run.py [--meshes single,1x1,1x8,2x4,8x1] [--batch 8] [--tokens 64] [--repeats 3]

Runs itself in a subprocess per mesh with XLA_FLAGS=--xla_force_host_platform_device_count=8. Each subprocess
loads the model (placed on its mesh), warms up (compiles), then times `repeats` greedy generations of `batch`
chat prompts, `tokens` new tokens each, plain and n-gram; the figure is the median. Order: single first and last
(a drift check). Writes reports/mesh_cpu/results.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is in two sentences.",
           "List three uses of copper.", "What is the capital of Australia? Answer briefly.",
           "Summarise the plot of Hamlet in one paragraph.", "Give me a haiku about autumn.",
           "How do vaccines work? Keep it short.", "Translate 'good morning' into French, Spanish and German."]


def one(mesh: str, batch: int, tokens: int, repeats: int, methods: str = "plain,ngram") -> dict:
    from specjax.api import LLM
    from specjax.config import SamplingParams

    t0 = time.perf_counter()
    llm = LLM() if mesh == "single" else LLM(mesh="data={},model={}".format(*mesh.split("x")))
    load = time.perf_counter() - t0
    sp = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = (PROMPTS * (batch // len(PROMPTS) + 1))[:batch]
    out = {"mesh": mesh, "load_s": round(load, 2)}
    if llm.mesh_plan is not None:
        from specjax.mesh import describe

        out["plan"] = describe(llm.mesh_plan, llm.params)
    for method, spec in (("plain", {"method": None}),
                         ("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                    "prompt_lookup_max": 3, "adaptive": False})):
        if method not in methods.split(","):
            continue
        t0 = time.perf_counter()
        llm.generate(prompts, sp, speculative_config=spec, chat=True)
        out[method + "_first_call_s"] = round(time.perf_counter() - t0, 2)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = llm.generate(prompts, sp, speculative_config=spec, chat=True)
            dt = time.perf_counter() - t0
            rates.append(sum(len(r.outputs[0].token_ids) for r in res) / dt)
        out[method + "_tok_s"] = round(statistics.median(rates), 1)
        out[method + "_tok_s_all"] = [round(r, 1) for r in rates]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--meshes", default="single,1x1,1x8,2x4,8x1,single")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="plain,ngram")
    ap.add_argument("--one")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.batch, a.tokens, a.repeats, a.methods)))
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    rows = []
    for mesh in a.meshes.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", mesh, "--batch", str(a.batch), "--tokens",
                               str(a.tokens), "--repeats", str(a.repeats), "--methods", a.methods], env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    meta = {"command": " ".join([os.path.basename(__file__)] + sys.argv[1:]), "batch": a.batch, "tokens": a.tokens,
            "repeats": a.repeats, "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("| mesh (data x model) | plain tok/s | n-gram tok/s | first call s (plain) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['mesh']} | {r.get('plain_tok_s', '-')} | {r.get('ngram_tok_s', '-')} | "
              f"{r.get('plain_first_call_s', '-')} |")


if __name__ == "__main__":
    main()
