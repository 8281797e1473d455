"""A Qwen3-4B layer's products (bf16) at 1-64 rows on this GPU: MLX in three
layouts against PyTorch (cuBLAS). Each MLX figure is 20 chained products per
`mx.eval`, so MLX's per-op host cost is in it; PyTorch's includes its Python
launch (~20 µs a product sets a floor). Run on the device (docs/gpu.md):

    source scripts/device/gpu-env.sh && python3 scripts/device/products.py
"""
import time

import mlx.core as mx
import torch

SHAPES = [(2560, 6144), (4096, 2560), (2560, 19456), (9728, 2560)]  # q/k/v, o, gate/up, down


def mlx_time(f, reps=40):
    for _ in range(3):
        mx.eval(f())
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(f())
    return (time.perf_counter() - t0) / (reps * 20)


def torch_time(x, w, reps=40):
    for _ in range(3):
        x @ w.T
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps * 20):
        x @ w.T
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (reps * 20)


print("| rows | k x n | x @ w.T µs | x @ wt µs | (w @ x.T).T µs | torch µs | best MLX GB/s |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for m in (1, 2, 4, 8, 16, 32, 64):
    total = [0.0] * 4
    for k, n in SHAPES:
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        w = mx.random.normal((n, k)).astype(mx.bfloat16)
        wt = mx.contiguous(w.T)
        mx.eval(x, w, wt)
        a = mlx_time(lambda: [x @ w.T for _ in range(20)])
        b = mlx_time(lambda: [x @ wt for _ in range(20)])
        c = mlx_time(lambda: [(w @ x.T).T for _ in range(20)])
        tx = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        tw = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        d = torch_time(tx, tw)
        total = [t + v for t, v in zip(total, (a, b, c, d))]
        print(f"| {m} | {k}x{n} | {a*1e6:.1f} | {b*1e6:.1f} | {c*1e6:.1f} | {d*1e6:.1f} | {k*n*2/1e9/min(a, b, c):.0f} |")
    print(f"| {m} | layer | " + " | ".join(f"{t*1e6:.1f}" for t in total) + " | |")
