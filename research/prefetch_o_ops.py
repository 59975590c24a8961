"""Device only (the L2 prefetch of O, measured and not kept): gemm_k O (B1, 4096x4096, 8 groups) with weights hot in L2 vs 8 rotating copies; attention+O."""
import sys
sys.path.insert(0, ".")
import torch
import kernels
from bench.common import graph_ms
from kernels_attention import attention_decode
torch.manual_seed(0)
dev = "cuda"
N = K = 4096
G = 8
for live in (8, 4):
    mask = torch.zeros(1, G, dtype=torch.bool, device=dev); mask[0, torch.randperm(G)[:live]] = True
    y = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, N, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(8)]
    tk = torch.zeros(4096, dtype=torch.int32, device=dev)
    cold = graph_ms(False, [lambda w=w: kernels.gemm_k(y, w, mask, K // G, residual=res, tickets=tk) for w in ws])
    hot = graph_ms(False, [lambda w=ws[0]: kernels.gemm_k(y, w, mask, K // G, residual=res, tickets=tk) for _ in ws])
    print(f"O live {live}/8: cold {cold*1e3:.2f} us, hot {hot*1e3:.2f} us", flush=True)
    # attention (1k) then O, with and without prefetch
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    kc = [torch.randn(1, 8, 8320, 128, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    vc = [torch.randn(1, 8, 8320, 128, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    kvl = torch.tensor([1024], device=dev)
    for pf in (False, True):
        def f(i, pf=pf):
            a = attention_decode(q, kc[i % 4], vc[i % 4], mask, kvl, tickets=tk[:64], prefetch=ws[i] if pf else None)
            return kernels.gemm_k(a.reshape(1, -1), ws[i], mask, K // G, residual=res, tickets=tk[64:])
        t = graph_ms(False, [lambda i=i: f(i) for i in range(8)])
        ta = graph_ms(False, [lambda i=i: attention_decode(q, kc[i % 4], vc[i % 4], mask, kvl, tickets=tk[:64],
                                                          prefetch=ws[i] if pf else None) for i in range(8)])
        print(f"  attention 1k + O, prefetch {pf}: {t*1e3:.2f} us; attention alone {ta*1e3:.2f} us", flush=True)
