# Evidence (reports/README.md): ran at commit 4fe3bc1, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=4fe3bc1 p=reports/decode_cpu/matmul_forms/kernel_forward_ab.py
import time, sys, os, numpy as np, jax, jax.numpy as jnp
from specjax.api import LLM
from specjax.models.llama import forward
from specjax.kv_cache import init_cache
dt=sys.argv[1]
llm=LLM("smollm2-135m", dtype=dt); c=llm.config; p=llm.params
def make_step():
    def step(p, tok, pos, cache):
        out=forward(p,c,tok,pos,cache)
        return out.logits, out.cache
    return step
shapes=((1,1),(1,2),(1,3),(1,5),(1,8),(1,13),(8,1),(4,5))
fs={}
for m in ("xla","auto","kernel"):
    os.environ["SPECJAX_KERNELS"]=f"matmul={m}"
    f=jax.jit(make_step(), donate_argnums=3)
    for B,T in shapes:
        cache=init_cache(c.num_layers,B,512,c.num_kv_heads,c.head_dim, dtype=p["embed"].dtype)
        cache=cache._replace(lengths=jnp.full((B,),256,jnp.int32))
        tok=jnp.zeros((B,T),jnp.int32); pos=jnp.broadcast_to(256+jnp.arange(T),(B,T)).astype(jnp.int32)
        fs[(m,B,T)]=[f.lower(p,tok,pos,cache).compile(), tok, pos, cache]
ts={k:[] for k in fs}
for rep in range(12):
    for k,v in fs.items():
        f,tok,pos,cache=v
        t=time.perf_counter(); lg,cache=f(p,tok,pos,cache); lg.block_until_ready(); ts[k].append(time.perf_counter()-t); v[3]=cache
for B,T in shapes:
    print(dt,(B,T)," ".join(f"{m} {np.median(ts[(m,B,T)][2:])*1e3:.1f}" for m in ("xla","auto","kernel")),flush=True)
