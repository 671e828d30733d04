# Evidence (reports/README.md): ran at commit 4283a0b, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=4283a0b p=reports/decode_cpu/matmul_forms/xla_forms.py
import time, numpy as np, jax, jax.numpy as jnp
from jax import lax
H=576; L=30
rng=np.random.default_rng(0)
shapes={'qkv':(960,H),'o':(H,960),'gu':(3072,H),'down':(H,1536)}
W=[{k:jnp.asarray(rng.standard_normal(s,dtype=np.float32)*0.02) for k,s in shapes.items()} for _ in range(L)]
def mm_dot(x,w): return jnp.einsum('ti,oi->to',x,w)
def mm_mv(x,w): return jnp.stack([w@x[t] for t in range(x.shape[0])])
def mm_mvT(x,w): return jnp.stack([x[t]@w.T for t in range(x.shape[0])])
def mm_conv(x,w):
    # x [T,in] as NWC with W=T? use 1x1 conv: lhs [1, in, T] (NCW), rhs [out,in,1]
    y=lax.conv_general_dilated(x.T[None],w[:,:,None],(1,),'VALID',dimension_numbers=('NCH','OIH','NCH'))
    return y[0].T
def mm_wx(x,w): return (w@x.T).T
def make(mm):
    def run(x,W):
        for w in W:
            q=mm(x,w['qkv'])
            x=x+mm(q,w['o'])
            g=mm(x,w['gu']); a=g[:, :1536]*g[:,1536:]
            x=x+mm(a,w['down'])
            x=x*0.5
        return x
    return jax.jit(run)
fs={n:make(m) for n,m in (('dot',mm_dot),('mv',mm_mv),('wx',mm_wx),('conv',mm_conv))}
for T in (1,2,5,8,13):
    x=jnp.asarray(rng.standard_normal((T,H),dtype=np.float32))
    ref=fs['dot'](x,W)
    res={}
    for n,f in fs.items():
        o=f(x,W).block_until_ready()
        assert np.allclose(o,ref,rtol=1e-4,atol=1e-6),n
        ts=[]
        for _ in range(12):
            t=time.perf_counter(); f(x,W).block_until_ready(); ts.append(time.perf_counter()-t)
        res[n]=round(min(ts)*1e3,1)
    print(T,res,flush=True)
