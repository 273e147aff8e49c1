import time, torch, triton
import torch.nn.functional as F
from torch_ref import flash_attention
def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=50)
for dtype in (torch.bfloat16,):
  for (B,S,H,D) in ((4,4096,16,128),(4,4096,16,64),(2,4096,8,256)):
    for causal in (False, True):
        q=torch.randn(B,S,H,D,device="cuda",dtype=dtype,requires_grad=True); k=torch.randn_like(q,requires_grad=True); v=torch.randn_like(q,requires_grad=True)
        do=torch.randn_like(q)
        flops=4*B*H*S*S*D/(2 if causal else 1)
        f_ours=lambda: flash_attention(q,k,v,causal=causal)
        qt,kt,vt=(x.transpose(1,2) for x in (q,k,v))
        f_sdpa=lambda: F.scaled_dot_product_attention(qt,kt,vt,is_causal=causal)
        def fb(f):
            def g():
                o=f(); torch.autograd.grad(o,(q,k,v),do if o.shape==do.shape else do.transpose(1,2))
            return g
        r=[]
        for name,f in (("ours",f_ours),("sdpa",f_sdpa)):
            tf=bench(f); tfb=bench(fb(f))
            r.append(f"{name}: fwd {flops/tf/1e9:.0f} TF/s fwd+bwd {3.5*flops/tfb/1e9:.0f} TF/s")
        print(dtype,B,S,H,D,"causal" if causal else "full"," | ".join(r), flush=True)
