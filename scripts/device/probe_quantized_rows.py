#!/usr/bin/env python3
"""MLX CUDA's 4-bit products at few rows, on Gemma 4 26B-A4B's shapes (issue 15).

    python3 scripts/device/probe_quantized_rows.py

Per call, in microseconds: one `quantized_matmul`, the rows split into calls
of at most 7 (MLX takes its qmv kernel below 8), and the same weights
expanded to bf16 (cuBLAS); then the experts' gathered products, unsorted,
sorted by expert, and as two calls of 4 experts. Thirty distinct weights
per graph, so they rotate past L2. docs/gpu.md, "Gemma 4 and other MoE shapes".
"""
import time, mlx.core as mx
L = 30  # distinct weights per graph, so they rotate past L2
def q(w): return mx.quantize(w, group_size=64, bits=4)
def bench(fn, reps=5):
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter(); mx.eval(fn()); best = min(best, time.perf_counter() - t)
    return best * 1e6 / L
for name, N, K in [("qkv", 8192, 2816), ("o", 2816, 4096), ("mlp gate_up", 4224, 2816), ("mlp down", 2816, 2112)]:
    ws = [q(mx.random.normal((N, K)).astype(mx.bfloat16) * 0.02) for _ in range(L)]
    dense = [mx.dequantize(*w, group_size=64, bits=4) for w in ws]
    mx.eval(ws, dense)
    for R in [1, 4, 8, 16, 32]:
        x = mx.random.normal((R, 1, K)).astype(mx.bfloat16)
        one = lambda: [mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4) for w in ws]
        def chunks():
            return [mx.concatenate([mx.quantized_matmul(x[i:i + 7], *w, transpose=True, group_size=64, bits=4) for i in range(0, R, 7)]) for w in ws]
        bf = lambda: [x @ d.T for d in dense]
        print(f"{name:12s} R={R:2d}: one {bench(one):7.1f} us  chunks7 {bench(chunks):7.1f} us  bf16 {bench(bf):7.1f} us", flush=True)
    del ws, dense
E, F, D, KX = 128, 704, 2816, 8
for name, N, Kd in [("experts gate", F, D), ("experts gate_up", 2 * F, D), ("experts down", D, F)]:
    ws = [q(mx.random.normal((E, N, Kd)).astype(mx.bfloat16) * 0.02) for _ in range(4)]
    mx.eval(ws)
    for R in [1, 4, 16]:
        idx = mx.random.randint(0, E, (R, KX))
        x = mx.random.normal((R, 1, 1, Kd)).astype(mx.bfloat16)
        g = lambda s, i, xx: [mx.gather_qmm(xx, *ws[j % 4], rhs_indices=i, transpose=True, group_size=64, bits=4, sorted_indices=s) for j in range(L)]
        flat = idx.flatten(); order = mx.argsort(flat); xs = mx.broadcast_to(x, (R, KX, 1, Kd)).reshape(R * KX, 1, Kd)[order // KX]
        idx4 = [idx[:, :4], idx[:, 4:]]
        print(f"{name:16s} R={R:2d}: unsorted {bench(lambda: g(False, idx, x)):7.1f} us  sorted {bench(lambda: g(True, flat[order], xs)):7.1f} us"
              f"  two halves {bench(lambda: [a for h in idx4 for a in g(False, h, x)]):7.1f} us", flush=True)
