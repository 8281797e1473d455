"""MLX's operations at the shapes small models' steps use, on the GPU
against the CPU (docs/gpu.md, "Known problem: small models on the GPU"):
attention under bool, additive and causal masks over a cache's strided
columns, RoPE with per-row offsets on transposed views, RMSNorm of views,
a dynamic slice_update; with `--products`, dense and quantized products
at 1-30 rows (slow: the CPU's reference). Prints every case that differs.

    python3 scripts/device/small_shapes_check.py [--products]
"""

import sys

import mlx.core as mx
import numpy as np

mx.random.seed(0)
try:
    with mx.stream(mx.gpu):
        pass
    GPU = mx.gpu
except ValueError:
    GPU = mx.cpu  # no GPU here: the script only runs through


def gpu_and_cpu(f):
    """Largest |GPU - CPU| and the CPU result's largest magnitude."""
    outs = []
    for dev in (GPU, mx.cpu):
        with mx.stream(dev):
            r = f()
            mx.eval(r)
            outs.append(r.astype(mx.float32))
    return mx.abs(outs[0] - outs[1]).max().item(), mx.abs(outs[1]).max().item()


def step_ops():
    differing = 0
    for dt in (mx.float32, mx.bfloat16):
        tol = 1e-3 if dt == mx.float32 else 5e-2
        for (B, H, KVH, L, D, T, cap) in [(3, 4, 2, 1, 16, 37, 64), (3, 4, 2, 5, 16, 41, 64), (1, 4, 2, 7, 16, 7, 64),
                                          (3, 9, 3, 1, 64, 37, 256), (3, 9, 3, 6, 64, 200, 256), (5, 9, 3, 1, 64, 100, 128)]:
            xq = mx.random.normal((B * L, H * D)).astype(dt)
            q = xq.reshape(B, L, H, D).transpose(0, 2, 1, 3)
            kbuf = mx.random.normal((B, KVH, cap, D)).astype(dt)
            vbuf = mx.random.normal((B, KVH, cap, D)).astype(dt)
            k, v = kbuf[:, :, :T, :], vbuf[:, :, :T, :]
            starts = [i * 3 % max(1, T - L) for i in range(B)]
            col = mx.arange(T)[None, None, None, :]
            qpos = (T - L + mx.arange(L))[None, None, :, None]
            allowed = (col >= mx.array(starts)[:, None, None, None]) & (col <= qpos)
            additive = mx.where(allowed, 0.0, -1e9).astype(dt)
            cases = [(f"attention, {name}", lambda m=m: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=m))
                     for name, m in (("bool mask", allowed), ("additive mask", additive),
                                     ("causal", "causal" if L > 1 else None), ("no mask", None))]
            offsets = mx.array([s + 3 for s in starts], dtype=mx.int32)
            cases.append(("rope, per-row offsets", lambda: mx.fast.rope(q, D, traditional=False, base=10000.0, scale=1.0, offset=offsets)))
            cases.append(("rms_norm of a view", lambda: mx.fast.rms_norm(xq.reshape(B, L, H, D)[:, :, 1:, :], mx.ones((D,), dtype=dt), 1e-6)))
            update = mx.random.normal((B, KVH, L, D)).astype(dt)
            cases.append(("slice_update at an array start", lambda: mx.slice_update(kbuf, update, mx.array([T - L]), axes=(2,))))
            for name, f in cases:
                err, scale = gpu_and_cpu(f)
                if err > tol * max(1.0, scale):
                    differing += 1
                    print(f"DIFFERS {name} {dt} B{B} H{H}/{KVH} L{L} D{D} T{T}: |gpu - cpu| {err:.3g} (largest {scale:.3g})")
    return differing


def products():
    """x @ w.T and quantized_matmul against a float64 product on the CPU."""
    differing = 0

    def check(name, f, ref, tol):
        nonlocal differing
        errs = []
        for dev in (GPU, GPU, mx.cpu):
            with mx.stream(dev):
                g = f()
                mx.eval(g)
            errs.append(np.abs(np.array(g.astype(mx.float32)) - ref).max() / max(1e-6, np.abs(ref).max()))
        if not all(np.isfinite(errs)) or max(errs[:2]) > max(tol, 3 * errs[2]):
            differing += 1
            print(f"DIFFERS {name}: relative error on the GPU {errs[0]:.3g} / {errs[1]:.3g}, on the CPU {errs[2]:.3g}")

    f64 = lambda a: np.array(a.astype(mx.float32)).astype(np.float64)
    for dt, tol in ((mx.float32, 5e-3), (mx.bfloat16, 3e-2), (mx.float16, 1e-2)):
        for M in (1, 5, 16, 30):
            for K, N in ((16, 64), (64, 64), (64, 128), (64, 512), (128, 64), (576, 576), (576, 192), (576, 1536),
                         (1536, 576), (576, 49152), (64, 32), (960, 2560)):
                if N > 10000 and M > 5:
                    continue
                x = mx.random.normal((1, M, K)).astype(dt)
                w = mx.random.normal((N, K)).astype(dt) / K ** 0.5
                check(f"{dt} x[1,{M},{K}] @ w[{N},{K}].T", lambda: x @ w.T, f64(x) @ f64(w).T, tol)
                xs = mx.random.normal((M * 3, K)).astype(dt)[::3]
                check(f"{dt} strided x[{M},{K}] @ w[{N},{K}].T", lambda: xs @ w.T, f64(xs) @ f64(w).T, tol)
        for bits, group in ((4, 32), (4, 64), (8, 32), (8, 64)):
            for M in (1, 3, 16):
                for K, N in ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (64, 128)):
                    if K % group or (N > 10000 and M > 3):
                        continue
                    w = mx.random.normal((N, K)).astype(dt) / K ** 0.5
                    wq, scales, biases = mx.quantize(w, group, bits)
                    x = mx.random.normal((1, M, K)).astype(dt)
                    ref = f64(x) @ f64(mx.dequantize(wq, scales, biases, group, bits)).T
                    check(f"{bits}-bit group {group} {dt} M{M} K{K} N{N}",
                          lambda: mx.quantized_matmul(x, wq, scales, biases, True, group, bits), ref, 2 * tol)
    return differing


if __name__ == "__main__":
    differing = step_ops()
    if "--products" in sys.argv[1:]:
        differing += products()
    print(f"{differing} cases differ")
