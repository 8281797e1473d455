#!/usr/bin/env python3
"""What a verify forward costs against a decode step, in MLX itself (issue 18).

    python3 scripts/device/probe_verify.py MODEL_DIR

mlx-lm's own model on the same weights, no server, no gateway: a forward
of n tokens (1 = a decode step, 2..16 = a verify of n - 1 drafts) after a
512-token context, for 1 and 4 rows; then the products of one layer at
the same token counts (bf16 `x @ W.T` at the q/o/gate/down shapes), and
the output head. Prints milliseconds per call (median of 20, warm) and
the ratio to n = 1: where a verify's extra cost comes from.
"""

import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def ms(f, reps=20):
    for _ in range(3):
        mx.eval(f())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(f())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def forwards(model_dir):
    model, _ = load(model_dir)
    for rows in (1, 4):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.random.randint(0, 1000, (rows, 512)), cache=cache))
        base = None
        cells = []
        for n in (1, 2, 4, 9, 16):
            x = mx.random.randint(0, 1000, (rows, n))

            def step():
                out = model(x, cache=cache)
                for c in cache:
                    c.offset -= n  # roll back: every call sees the same context
                return out

            t = ms(step)
            base = base or t
            cells.append(f"n={n} {t:.2f} ms ({t / base:.2f}x)")
        print(f"forward, {rows} row(s) after 512 tokens: " + ", ".join(cells), flush=True)
    args = model.args
    h, inter, vocab = args.hidden_size, args.intermediate_size, args.vocab_size
    q = args.num_attention_heads * getattr(args, "head_dim", h // args.num_attention_heads)
    shapes = {"q/o": (q, h), "gate/up": (inter, h), "down": (h, inter), "head": (vocab, h)}
    for name, (out_f, in_f) in shapes.items():
        w = mx.random.normal((out_f, in_f)).astype(mx.bfloat16)
        mx.eval(w)
        base = None
        cells = []
        for n in (1, 2, 4, 9, 16, 36):
            x = mx.random.normal((n, in_f)).astype(mx.bfloat16)
            mx.eval(x)
            t = ms(lambda: x @ w.T)
            base = base or t
            cells.append(f"n={n} {t * 1e3:.0f} us ({t / base:.2f}x)")
        print(f"matmul {name} [{out_f}x{in_f}]: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    forwards(sys.argv[1])
