# Evidence (reports/README.md): ran at commit 4fe3bc1, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=4fe3bc1 p=reports/decode_cpu/matmul_forms/kernel_layers.py
import numpy as np, time, jax, jax.numpy as jnp
from specjax.kernels import cpu_matmul as cm
assert cm.available()
def kmm(x,w): return cm._kernel_2d(x,w)
def xmm(x,w): return jnp.einsum('ti,oi->to',x,w.astype(jnp.float32))
H=576;L=30
rng=np.random.default_rng(0)
shapes={'qkv':(960,H),'o':(H,960),'gu':(3072,H),'down':(H,1536)}
Wn=[{k:rng.standard_normal(s,dtype=np.float32)*0.02 for k,s in shapes.items()} for _ in range(L)]
E=rng.standard_normal((49152,H),dtype=np.float32)*0.02
def make(mm):
    def run(x,W):
        for w in W:
            q=mm(x,w['qkv']); x=x+mm(q,w['o'])
            g=mm(x,w['gu']); a=g[:, :1536]*g[:,1536:]; x=x+mm(a,w['down']); x=x*0.5
        return x
    return jax.jit(run)
fk,fx=make(kmm),make(xmm)
hk=jax.jit(kmm); hx=jax.jit(lambda x,e: jax.lax.dot_general(e,x,(((1,),(1,)),((),()))).T)
for dt in (jnp.float32, jnp.bfloat16):
  W=[{k:jnp.asarray(v,dt) for k,v in w.items()} for w in Wn]; Ed=jnp.asarray(E,dt)
  for T in (1,2,3,5,8,13):
    x=jnp.asarray(rng.standard_normal((T,H),dtype=np.float32))
    r={}
    for n,f,a in (('layers_kern',fk,W),('layers_xla',fx,W),('head_kern',hk,Ed),('head_xla',hx,Ed)):
        ts=[]
        for _ in range(10):
            t=time.perf_counter(); f(x,a).block_until_ready(); ts.append(time.perf_counter()-t)
        r[n]=round(min(ts)*1e3,1)
    print(dt.__name__,T,r,flush=True)
