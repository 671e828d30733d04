# Evidence (reports/README.md): ran at commit 88676ec, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=88676ec p=reports/decode_cpu/attention/attention_layers.py
"""30 layers of SmolLM2's attention alone (9 query heads, 3 KV heads, D = 64), XLA's version against the C++ kernel:
python reports/decode_cpu/attention/attention_layers.py"""
import time, numpy as np, jax, jax.numpy as jnp
from specjax.kernels.xla import prefix_tree_attention
from specjax.kernels.cpu_attention import prefix_attention
def kern(q,kc,vc,kn,vn,lengths,tm,scale):
    return prefix_attention(q,kc,vc,kn,vn,lengths,tm,scale=scale)
rng=np.random.default_rng(0)
for B,T,Ln,S in ((1,1,256,512),(1,1,1500,2048),(1,5,256,512),(1,5,1500,2048),(8,1,256,512)):
    Hq,Hkv,D=9,3,64
    q=jnp.asarray(rng.standard_normal((30,B,T,Hq,D)),jnp.float32)
    kc=tuple(jnp.asarray(rng.standard_normal((B,Hkv,S,D)),jnp.float32) for i in range(30)); vc=tuple(x*0.5 for x in kc)
    kn=jnp.asarray(rng.standard_normal((B,T,Hkv,D)),jnp.float32); vn=kn
    L=jnp.full((B,),Ln,jnp.int32); tm=jnp.broadcast_to(jnp.tril(jnp.ones((T,T),bool)),(B,T,T))
    res={}
    for name,fn in (("xla",prefix_tree_attention),("kern",kern)):
        @jax.jit
        def f(q,kc,vc):
            acc=jnp.zeros(q.shape[1:],jnp.float32)
            for i in range(30):
                acc=acc+fn(q[i]+acc*1e-9,kc[i],vc[i],kn,vn,L,tm,0.125)
            return acc
        f(q,kc,vc).block_until_ready()
        t=[]
        for r in range(20):
            t0=time.perf_counter(); f(q,kc,vc).block_until_ready(); t.append(time.perf_counter()-t0)
        res[name]=np.median(t)*1e3
    print((B,T,Ln,S), " ".join(f"{k} {v:.2f} ms" for k,v in res.items()), flush=True)
