# Evidence (reports/README.md): ran at commit 2e4661f, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=2e4661f p=reports/spec_bench_cpu/lookup_tuning/trim_ab.py
"""A/B of suffix decoding with and without cutting proposals to 2/3/5-node verifies (`spec_engine.trim_proposal`),
interleaved per prompt, every generation a first request. Run from the repository root; output in trim_ab.txt."""
import json, time
from specjax import LLM, SamplingParams, spec_engine
from specjax.spec_api import restore_learned
rows = [json.loads(l) for l in open("reports/spec_bench_cpu/spec_bench_13.jsonl")]
llm=LLM('smollm2-135m')
sp=SamplingParams(max_tokens=128, temperature=0.0)
orig=spec_engine.verify_sizes
full=lambda tree: (tree.num_nodes,)
spec={"method":"suffix","num_speculative_tokens":4}
res={}
for rnd in range(3):
    for r in rows:
        msgs=[{"role":"user","content":r['turns'][0]}]
        for name,f in (("trim",orig),("full",full)):
            spec_engine.verify_sizes=f
            restore_learned(llm, {})
            t=time.perf_counter(); o=llm.generate([msgs], sp, spec)[0]; dt=time.perf_counter()-t
            m=o.metrics
            if rnd>0:
                k=(name,r['category']); res[k]=min(res.get(k,1e9), dt-m.time_to_first_token)
for c in sorted({k[1] for k in res}):
    print(c, 'trim %.2f full %.2f ratio %.3f'%(res['trim',c],res['full',c],res['full',c]/res['trim',c]))
print('total trim %.2f full %.2f'%(sum(v for k,v in res.items() if k[0]=='trim'), sum(v for k,v in res.items() if k[0]=='full')))
