"""Dense bf16 products x[M, K] @ W[N, K]^T at M = 1..64, MLX beside PyTorch
(when installed) on the same GPU: microseconds per product and the weight
bandwidth it reaches. The Qwen3-4B shape's MLP product.

    python3 scripts/bench_matmul.py
"""
import time, mlx.core as mx
def bench(f, n=200):
    for _ in range(10): mx.eval(f())
    t=time.perf_counter()
    outs=[f() for _ in range(n)]
    mx.eval(outs)
    return (time.perf_counter()-t)/n*1e6
K,N=2560,9728
W=mx.random.normal((N,K)).astype(mx.bfloat16); mx.eval(W)
for M in [1,2,4,8,16,32,64]:
    x=mx.random.normal((M,K)).astype(mx.bfloat16); mx.eval(x)
    us=bench(lambda: x@W.T)
    print(f"mlx M={M:3d} {us:8.1f} us  {N*K*2/us/1e3:7.1f} GB/s")
try:
    import torch
    Wt=torch.randn(N,K,dtype=torch.bfloat16,device='cuda')
    for M in [1,16,64]:
        xt=torch.randn(M,K,dtype=torch.bfloat16,device='cuda')
        for _ in range(10): y=xt@Wt.T
        torch.cuda.synchronize(); t=time.perf_counter()
        for _ in range(200): y=xt@Wt.T
        torch.cuda.synchronize(); us=(time.perf_counter()-t)/200*1e6
        print(f"torch M={M:3d} {us:8.1f} us  {N*K*2/us/1e3:7.1f} GB/s")
except Exception as e: print("torch:", e)
