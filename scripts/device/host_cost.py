"""What the host pays per MLX node on the GPU: chains of N small nodes of
one kind (an add, an RMSNorm, a product of one row, a custom kernel with a
short and with a 6 KB source), timed as the graph's building (Python's
calls, a floor for ours), its launch (`async_eval`: MLX's allocation,
recording and launch) and the wait for the device after it, per node:

    source scripts/device/gpu-env.sh && python3 scripts/device/host_cost.py [N]
"""
import sys, time
import mlx.core as mx

N = int(sys.argv[1]) if len(sys.argv) > 1 else 800
H = 2560
x0 = mx.random.normal((1, H)).astype(mx.bfloat16)
w = mx.random.normal((H,)).astype(mx.bfloat16)
W = (mx.random.normal((H, 256)) * 0.02).astype(mx.bfloat16)
Wb = (mx.random.normal((256, H)) * 0.02).astype(mx.bfloat16)
T64 = (mx.random.normal((64, H)) * 0.02).astype(mx.bfloat16)
mx.eval(x0, w, W, Wb, T64)

BODY = """
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < inp_shape[1]) out[e] = static_cast<T>(static_cast<float>(inp[e]) * 0.5f + 1.0f);
"""
PAD = "\n".join("// " + "x" * 76 for _ in range(80))  # 6.4 KB of comment
small = mx.fast.cuda_kernel(name="hc_small", input_names=["inp"], output_names=["out"], source=BODY)
large = mx.fast.cuda_kernel(name="hc_large", input_names=["inp"], output_names=["out"], source=BODY + PAD)
nocontig = mx.fast.cuda_kernel(name="hc_nc", input_names=["inp"], output_names=["out"], source=BODY,
                               ensure_row_contiguous=False)

def custom(k):
    return lambda y: k(inputs=[y], template=[("T", mx.bfloat16)], grid=(H, 1, 1), threadgroup=(256, 1, 1),
                       output_shapes=[(1, H)], output_dtypes=[mx.bfloat16])[0]

KINDS = {
    "add": lambda y: y * 0.5 + 1.0,  # two nodes
    "rms_norm": lambda y: mx.fast.rms_norm(y, w, 1e-6),
    "matmul pair": lambda y: (y @ W) @ Wb,  # two nodes
    "matmul tiny": lambda y: y[:, :64] @ T64,  # slice + product
    "custom small": custom(small),
    "custom 6KB": custom(large),
    "custom no-copy": custom(nocontig),
}
NODES = {"add": 2, "matmul pair": 2, "matmul tiny": 2}

def phases(build):
    """The fastest of five timed runs (after two unmeasured ones) of
    `build()`, which builds a graph and returns its outputs: seconds to
    build, to launch (`async_eval`) and to wait for the device."""
    best = None
    for rep in range(7):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        t3 = time.perf_counter()
        if rep >= 2:
            cur = (t1 - t0, t2 - t1, t3 - t2)
            best = cur if best is None or sum(cur) < sum(best) else best
    return best


def chain(f):
    y = x0
    for _ in range(N):
        y = f(y)
    return y


def run(kind, f):
    best = phases(lambda: chain(f))
    n = N * NODES.get(kind, 1)
    print(f"{kind:16s} nodes {n:5d}  build {best[0]/n*1e6:6.2f} us/node  launch {best[1]/n*1e6:6.2f} us/node  wait {best[2]/n*1e6:6.2f} us/node", flush=True)

print(mx.default_device(), "N", N)
for rnd in range(2):
    for k, f in KINDS.items():
        run(k, f)

# The step's products themselves, as independent nodes (no chain): MLX's
# x @ w.T against the skinny product kernel, one row and sixteen.
SKINNY = mx.fast.cuda_kernel(name="skinny_product", input_names=["x", "wt"], output_names=["y"],
                             source=open("engines/runtime/src/kernels/skinny_product.cu").read(),
                             header=open("engines/runtime/src/kernels/silu_mul.cuh").read(),
                             ensure_row_contiguous=False)


def skinny(x, wt):
    m, n = x.shape[0], wt.shape[1]
    return SKINNY(inputs=[x, wt], template=[("T", x.dtype), ("BF16", 1), ("GATED", 0), ("MT", (m + 7) // 8),
                                            ("WK", 4 if m <= 8 else 8), ("U", 2)],
                  grid=(n // 16 * 32 * (4 if m <= 8 else 8), 1, 1), threadgroup=(32 * (4 if m <= 8 else 8), 1, 1),
                  output_shapes=[(m, n)], output_dtypes=[x.dtype])[0]


ws = [mx.random.normal((6144, H)).astype(mx.bfloat16) for _ in range(6)]
mx.eval(ws)
P = 144
for rows in (1, 16):
    x = mx.random.normal((rows, H)).astype(mx.bfloat16)
    mx.eval(x)
    for name, f in (("mlx x @ w.T", lambda i: x @ ws[i % 6].T), ("skinny", lambda i: skinny(x, ws[i % 6].T))):
        best = phases(lambda: [f(i) for i in range(P)])
        print(f"{rows:2d} rows {name:12s} x{P}: build {best[0]/P*1e6:6.2f} launch {best[1]/P*1e6:6.2f} "
              f"wait {best[2]/P*1e6:6.2f} us/product", flush=True)
