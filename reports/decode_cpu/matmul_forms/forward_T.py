# Evidence (reports/README.md): ran at commit 4283a0b, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=4283a0b p=reports/decode_cpu/matmul_forms/forward_T.py
import time, sys, numpy as np, jax, jax.numpy as jnp
from specjax.api import LLM
from specjax.models.llama import forward
from specjax.kv_cache import init_cache
llm=LLM("smollm2-135m"); c=llm.config; p=llm.params
def step(p, tok, pos, cache):
    out=forward(p,c,tok,pos,cache)
    return out.logits, out.cache
f=jax.jit(step, donate_argnums=3)
res={}
for B,T in ((1,1),(1,2),(1,5),(1,13),(8,1)):
    cache=init_cache(c.num_layers,B,512,c.num_kv_heads,c.head_dim)
    cache=cache._replace(lengths=jnp.full((B,),256,jnp.int32))
    tok=jnp.zeros((B,T),jnp.int32); pos=jnp.broadcast_to(256+jnp.arange(T),(B,T)).astype(jnp.int32)
    ts=[]
    for _ in range(25):
        t=time.perf_counter(); lg,cache=f(p,tok,pos,cache); lg.block_until_ready(); ts.append(time.perf_counter()-t)
    res[(B,T)]=round(float(np.min(ts[3:]))*1e3,1)
print(res)
