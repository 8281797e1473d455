"""The skinny product kernel (engines/runtime/src/kernels/skinny_product.cu,
its plain mode) against MLX's product at 1-64 rows on the device: errors
against a float32 product, and each kernel's device time as CUPTI sees it
(torch.profiler; MLX's kernels included), over distinct weight copies so
that L2 holds none of them:

    source scripts/device/gpu-env.sh && python3 scripts/device/skinny_product.py [ROWS]
"""
import sys, time
import mlx.core as mx
import torch

SRC = open("engines/runtime/src/kernels/skinny_product.cu").read()
HEADER = open("engines/runtime/src/kernels/silu_mul.cuh").read()
KERNEL = mx.fast.cuda_kernel(name="skinny_product", input_names=["x", "wt"], output_names=["y"],
                             source=SRC, header=HEADER, ensure_row_contiguous=False)
SHAPES = [(2560, 6144), (4096, 2560), (2560, 19456), (9728, 2560), (2560, 151936)]

def ours(x, wt, WK, U):
    m, k = x.shape
    n = wt.shape[1]
    mt = (m + 7) // 8
    return KERNEL(inputs=[x, wt], template=[("T", x.dtype), ("BF16", int(x.dtype == mx.bfloat16)), ("GATED", 0), ("MT", mt), ("WK", WK), ("U", U)],
                grid=(n // 16 * 32 * WK, 1, 1), threadgroup=(32 * WK, 1, 1),
                output_shapes=[(m, n)], output_dtypes=[x.dtype])[0]

# correctness
for dt in (mx.bfloat16, mx.float16):
    for m in (1, 3, 8, 13, 16, 33, 64):
        for k, n in [(2560, 6144), (9728, 2560), (96, 48)]:
            x = mx.random.normal((m, k)).astype(dt)
            w = mx.random.normal((n, k)).astype(dt)
            ref = x.astype(mx.float32) @ w.astype(mx.float32).T
            got = ours(x, w.T, 8 if m > 48 else 4, 2)
            mlx = x @ w.T
            e1 = mx.abs(got.astype(mx.float32) - ref).max().item()
            e2 = mx.abs(mlx.astype(mx.float32) - ref).max().item()
            eq = (got == mlx).astype(mx.float32).mean().item()
            print(f"check {dt} m={m} k={k} n={n}: ours err {e1:.3f} mlx err {e2:.3f} equal-to-mlx {eq:.3f}", flush=True)
# a strided x (the last row of each of 3 sequences)
x3 = mx.random.normal((3, 5, 2560)).astype(mx.bfloat16)
w = mx.random.normal((6144, 2560)).astype(mx.bfloat16)
xs = x3[:, -1, :]
ref = xs.astype(mx.float32) @ w.astype(mx.float32).T
print("strided rows err", mx.abs(ours(xs, w.T, 4, 2).astype(mx.float32) - ref).max().item())

COPIES = 6
from torch.profiler import profile, ProfilerActivity


def gpu_us(f, reps=4):
    """Mean device time of one kernel launched by f(): CUPTI sees every
    kernel in the process, MLX's included."""
    mx.eval(f())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            mx.eval(f())
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and "memcpy" not in e.key.lower() and "memset" not in e.key.lower()]
    total = sum(e.device_time_total for e in ev)
    count = sum(e.count for e in ev)
    return total / max(count, 1), [(e.key[:40], e.count) for e in ev][:3]


print("| rows | k x n | mlx µs | ours best µs (WK,U) | ours TB/s | mlx kernels |")
for m in [int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16,32,64").split(",")]:
    for k, n in SHAPES:
        copies = COPIES if n < 100000 else 2
        ws = [mx.random.normal((n, k)).astype(mx.bfloat16) for _ in range(copies)]
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        mx.eval(ws, x)
        chain = 12
        t_mlx, names = gpu_us(lambda: [x @ ws[i % copies].T for i in range(chain)])
        best = None
        for WK in (4, 8, 16):
            if WK * ((m + 7) // 8) > 96:
                continue
            for U in (1, 2, 4):
                tt, _ = gpu_us(lambda: [ours(x, ws[i % copies].T, WK, U) for i in range(chain)])
                if best is None or tt < best[0]:
                    best = (tt, WK, U)
        print(f"| {m} | {k}x{n} | {t_mlx:.1f} | {best[0]:.1f} ({best[1]},{best[2]}) | {2*n*k/best[0]/1e6:.2f} | {names} |", flush=True)
