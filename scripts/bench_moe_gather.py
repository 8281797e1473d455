#!/usr/bin/env python3
"""Times one MoE expert projection through MLX's gathered matmuls, with the
(token, expert) pairs sorted by expert first and without, for a range of
decode batch sizes. The runtime sorts from 64 pairs on (mlx-lm's threshold,
engines/runtime/src/model/experts.rs); this shows, per device, where sorting
starts to pay. Default shape: Qwen3-30B-A3B's gate/up projection (128
experts of 768 x 2048, 8 per token, 4-bit groups of 64).

    python3 scripts/bench_moe_gather.py --rows 1,4,8,16,32,64
"""

import argparse
import time

import mlx.core as mx


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--layers", type=int, default=48, help="projections chained per timed graph (3 per layer)")
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()

    mx.random.seed(0)
    w = mx.random.normal((a.experts, a.inter, a.hidden)).astype(mx.bfloat16) * 0.02
    wq, scales, biases = mx.quantize(w, group_size=a.group_size, bits=a.bits)
    w_down = mx.random.normal((a.experts, a.hidden, a.inter)).astype(mx.bfloat16) * 0.02
    dq, dscales, dbiases = mx.quantize(w_down, group_size=a.group_size, bits=a.bits)
    mx.eval(wq, scales, biases, dq, dscales, dbiases)
    print(f"device: {mx.default_device()}; experts {a.experts} x [{a.inter}, {a.hidden}], "
          f"top-{a.top_k}, {a.bits}-bit; {a.layers} layers of up+gate+down per timed graph")
    print("| rows | pairs | unsorted ms/layer | sorted ms/layer | sorted / unsorted | max abs difference |")
    print("|---|---|---|---|---|---|")

    def layer(x, idx, sort):
        k = idx.shape[-1]
        shape = idx.shape
        xe = mx.expand_dims(x, (-2, -3))
        inverse = None
        if sort:
            flat = idx.flatten()
            order = mx.argsort(flat)
            inverse = mx.argsort(order)
            xe = xe.flatten(0, -3)[order // k]
            idx = flat[order]
        up = mx.gather_qmm(xe, wq, scales, biases, rhs_indices=idx, transpose=True,
                           group_size=a.group_size, bits=a.bits, sorted_indices=sort)
        gate = mx.gather_qmm(xe, wq, scales, biases, rhs_indices=idx, transpose=True,
                             group_size=a.group_size, bits=a.bits, sorted_indices=sort)
        h = mx.sigmoid(gate) * gate * up
        y = mx.gather_qmm(h, dq, dscales, dbiases, rhs_indices=idx, transpose=True,
                          group_size=a.group_size, bits=a.bits, sorted_indices=sort)
        if sort:
            y = y[inverse].reshape(*shape, 1, a.hidden)
        return y.squeeze(-2).sum(-2)

    for rows in [int(r) for r in a.rows.split(",")]:
        x = (mx.random.normal((rows, 1, a.hidden)) * 0.1).astype(mx.bfloat16)
        scores = mx.random.normal((rows, 1, a.experts))
        idx = mx.argpartition(scores, kth=a.experts - a.top_k, axis=-1)[..., -a.top_k:].astype(mx.uint32)
        mx.eval(x, idx)
        times = {}
        outs = {}
        for sort in (False, True):
            def run():
                h = x
                for _ in range(a.layers):
                    h = layer(h, idx, sort) * 0.5 + x
                return h
            mx.eval(run())  # warm-up
            best = float("inf")
            for _ in range(a.reps):
                t = time.perf_counter()
                out = run()
                mx.eval(out)
                best = min(best, time.perf_counter() - t)
            times[sort] = best * 1e3 / a.layers
            outs[sort] = out
        diff = mx.abs(outs[True].astype(mx.float32) - outs[False].astype(mx.float32)).max().item()
        print(f"| {rows} | {rows * a.top_k} | {times[False]:.3f} | {times[True]:.3f} | "
              f"{times[True] / times[False]:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
