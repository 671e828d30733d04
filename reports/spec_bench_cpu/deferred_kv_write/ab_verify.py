# Evidence (reports/README.md): ran at commit 0bc1e90, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=0bc1e90 p=reports/spec_bench_cpu/deferred_kv_write/ab_verify.py
# Longest RAG/summarization prompt of spec_bench_lookup9.jsonl, 96 new tokens, back-off off (every step verifies).
# Run from the repository root: python reports/spec_bench_cpu/deferred_kv_write/ab_verify.py draft_model
import json, sys, time
from specjax.api import LLM
from specjax.config import SamplingParams, SpeculativeConfig
rows = [json.loads(l) for l in open("reports/tune_cpu/spec_bench_lookup9.jsonl")]
rag = max((r for r in rows if r["category"] in ("rag", "summarization")), key=lambda r: len(r["turns"][0]))
llm = LLM("smollm2-135m")
spec = SpeculativeConfig(method=sys.argv[1], num_speculative_tokens=4, adaptive=False,
                         **({"model": "specjax/assets/smollm2-135m-draft"} if sys.argv[1] != "ngram" else {}))
sp = SamplingParams(max_new_tokens=96, ignore_eos=True)
n = len(llm.encode_prompt(rag["turns"][0], chat=True))
best = 1e9
for r in range(3):
    t = time.perf_counter(); out = llm.generate([rag["turns"][0]], sp, speculative_config=spec); dt = time.perf_counter() - t
    if r: best = min(best, dt)
print(f"prompt {n} tokens, {sys.argv[1]} adaptive off: best {best:.2f} s for 96 tokens ({96/best:.1f} tok/s)")
