# Evidence (reports/README.md): ran at commit 1ca987a, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=1ca987a p=reports/spec_bench_cpu/backoff_observe/ab.py
"""Interleaved plain decoding and a shipped method config (back-off on), per Spec-Bench prompt; prints the
per-category speed ratio (fastest of 2 reps each). Run from the repository root:
    python reports/spec_bench_cpu/backoff_observe/ab.py writing,coding,qa,rag,summarization eagle3
with PYTHONPATH=<a checkout of another commit> to measure that commit's code the same way."""
import json, sys, time
import yaml
import specjax
print("specjax from", specjax.__file__, flush=True)
from specjax.api import LLM
from specjax.config import SamplingParams
cats = sys.argv[1].split(",")
method = sys.argv[2]
prompts = {json.loads(l)["category"]: json.loads(l)["turns"][0] for l in open("reports/spec_bench_cpu/spec_bench_13.jsonl")}
llm = LLM("smollm2-135m")
sp = SamplingParams(max_new_tokens=128)
spec = yaml.safe_load(open(f"configs/methods/{method}.yaml"))["speculative"]
llm.generate([prompts[cats[0]]], sp, speculative_config=spec, chat=True)  # compile + calibrate
llm.generate([prompts[cats[0]]], sp, chat=True)
tot = {}
for rep in range(2):
    for c in cats:
        for name, s in (("plain", None), (method, spec)):
            t = time.perf_counter()
            out = llm.generate([prompts[c]], sp, speculative_config=s, chat=True)[0]
            tot.setdefault((c, name), []).append(time.perf_counter() - t)
for c in cats:
    p, e = min(tot[(c, "plain")]), min(tot[(c, method)])
    print(f"{c:14s} plain {p:.2f}s {method} {e:.2f}s speed {p/e:.2f}x", flush=True)
P = sum(min(tot[(c, "plain")]) for c in cats); E = sum(min(tot[(c, method)]) for c in cats)
print(f"overall {P/E:.2f}x", flush=True)
