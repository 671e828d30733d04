# Evidence (reports/README.md): ran at commit 88676ec, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=88676ec p=reports/decode_cpu/attention/forward_ab.py
"""Whole SmolLM2 forward, SPECJAX_CPU_ATTENTION=xla against kernel, compiled side by side and interleaved:
python reports/decode_cpu/attention/forward_ab.py float32 "((1,1,256,512),(1,5,256,512))" 8
(cases are (batch, new tokens, committed length, cache capacity))."""
import time, sys, os, numpy as np, jax, jax.numpy as jnp
from specjax.api import LLM
import specjax.models.llama as L
from specjax.kv_cache import init_cache
dt=sys.argv[1]; cases=eval(sys.argv[2]); reps=int(sys.argv[3]) if len(sys.argv)>3 else 10
llm=LLM("smollm2-135m", dtype=dt); c=llm.config; p=llm.params
def step(p, tok, pos, cache):
    out=L.forward(p,c,tok,pos,cache)
    return out.logits, out.cache
fs={}
for m in ("xla","kernel"):
    os.environ["SPECJAX_KERNELS"]=f"attention={m}"
    jax.clear_caches(); f=jax.jit(lambda *a: step(*a), donate_argnums=3)
    for B,T,Ln,S in cases:
        cache=init_cache(c.num_layers,B,S,c.num_kv_heads,c.head_dim, dtype=p["embed"].dtype)
        cache=cache._replace(lengths=jnp.full((B,),Ln,jnp.int32))
        tok=jnp.zeros((B,T),jnp.int32); pos=jnp.broadcast_to(Ln+jnp.arange(T),(B,T)).astype(jnp.int32)
        fs[(m,B,T,Ln,S)]=[f.lower(p,tok,pos,cache).compile(),tok,pos,cache]
ts={k:[] for k in fs}
for rep in range(reps):
    for k,v in fs.items():
        f,tok,pos,cache=v
        t=time.perf_counter(); lg,cache=f(p,tok,pos,cache); lg.block_until_ready(); ts[k].append(time.perf_counter()-t); v[3]=cache
for B,T,Ln,S in cases:
    print(dt,(B,T,Ln,S)," ".join(f"{m} {np.median(ts[(m,B,T,Ln,S)][2:])*1e3:.1f}" for m in ("xla","kernel")),flush=True)
