# Evidence (reports/README.md): ran at commit 4283a0b, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=4283a0b p=reports/decode_cpu/matmul_forms/torch_linear.py
import torch, time
torch.set_num_threads(2)
H=576;L=30
g=torch.Generator().manual_seed(0)
shapes={'qkv':(960,H),'o':(H,960),'gu':(3072,H),'down':(H,1536)}
W=[{k:torch.randn(s,generator=g)*0.02 for k,s in shapes.items()} for _ in range(L)]
F=torch.nn.functional
def run(x):
    for w in W:
        q=F.linear(x,w['qkv']); x=x+F.linear(q,w['o'])
        gg=F.linear(x,w['gu']); a=gg[:, :1536]*gg[:,1536:]
        x=(x+F.linear(a,w['down']))*0.5
    return x
with torch.no_grad():
  for T in (1,2,5,8,13):
    x=torch.randn(T,H)
    run(x); ts=[]
    for _ in range(12):
        t=time.perf_counter(); run(x); ts.append(time.perf_counter()-t)
    print(T, round(min(ts)*1e3,1), flush=True)
