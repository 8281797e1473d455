#!/usr/bin/env python3
"""What MLX CUDA pays the first time it sees a forward shape (issue 18).

    python3 scripts/device/probe_shapes.py MODEL_DIR

1. Prefill forwards of a dense model (mlx-lm, no server): new prompt
   lengths, the same lengths again, lengths all padded to one width, and
   batches of 1, 4 and 16 rows, first call and again.
2. MLX's 4-bit quantized matmuls (dense and gathered, the MoE experts' at
   the Gemma 4 26B-A4B shape) at new and repeated token counts.
Prints milliseconds per call.
"""

import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def timed(f):
    t = time.perf_counter()
    mx.eval(f())
    return (time.perf_counter() - t) * 1e3


def prefills(model_dir):
    model, _ = load(model_dir)

    def prefill(length, rows=1):
        x = mx.random.randint(0, 1000, (rows, length))
        mx.eval(x)
        return timed(lambda: model(x, cache=make_prompt_cache(model)))

    prefill(64)
    for label, lengths in [("new lengths", range(120, 136)), ("same lengths again", range(120, 136)),
                           ("new lengths 2", range(136, 152)), ("all padded to 160", [160] * 16)]:
        print(f"prefill, {label}: " + " ".join(f"{prefill(n):.0f}" for n in lengths), flush=True)
    for rows in (1, 4, 16):
        print(f"prefill, {rows} x 160: first {prefill(160, rows):.0f} ms, again {prefill(160, rows):.0f} ms", flush=True)


def quantized():
    d, f, experts, top = 2816, 704, 128, 8

    def q(w):
        return mx.quantize(w, group_size=64, bits=4)

    wd, sd, bd = q(mx.random.normal((f * 3, d)).astype(mx.bfloat16) * 0.02)
    we, se, be = q(mx.random.normal((experts, f, d)).astype(mx.bfloat16) * 0.02)
    mx.eval(wd, sd, bd, we, se, be)

    def qmm(m):
        x = mx.random.normal((m, d)).astype(mx.bfloat16)
        return mx.quantized_matmul(x, wd, sd, bd, transpose=True, group_size=64, bits=4)

    def gather(m):
        x = mx.random.normal((m * top, 1, d)).astype(mx.bfloat16)
        idx = mx.sort(mx.random.randint(0, experts, (m * top,)))
        return mx.gather_qmm(x, we, se, be, rhs_indices=idx, transpose=True, group_size=64, bits=4,
                             sorted_indices=True)

    for label, fn in [("quantized_matmul", qmm), ("gather_qmm (sorted)", gather)]:
        for ms in [(100, 101, 102, 130, 131), (100, 101, 102, 130, 131), (256, 320, 384, 640, 960, 1920)]:
            print(f"{label}: " + " ".join(f"M={m}:{timed(lambda: fn(m)):.0f}ms" for m in ms), flush=True)


if __name__ == "__main__":
    prefills(sys.argv[1])
    quantized()
