#!/usr/bin/env python3
"""Where a decode step's GPU time goes in MLX (issue 18).

    python3 scripts/device/probe_profile.py MODEL_DIR [ROWS ...]

Runs mlx-lm's model on the same weights for decode steps of ROWS rows
(default 1 and 16) after a 256-token context, under PyTorch's profiler
(CUPTI sees every CUDA kernel in the process, MLX's included), and prints
per step: wall time, GPU kernel time, kernel launches, and the kernels
that took the most time.
"""

import collections
import os
import sys
import time

import mlx.core as mx
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import mlx_lm_compat  # noqa: E402,F401  (mlx-lm 0.32.2 on mlx 0.32.2)
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from torch.profiler import ProfilerActivity, profile


def main(model_dir, rows_list):
    model, _ = load(model_dir)
    for rows in rows_list:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.random.randint(0, 1000, (rows, 256)), cache=cache))
        x = mx.random.randint(0, 1000, (rows, 1))

        def step():
            out = model(x, cache=cache)
            mx.eval(out)
            for c in cache:
                c.offset -= 1

        for _ in range(5):
            step()
        steps = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            wall = (time.perf_counter() - t) * 1e3 / steps
        kernels = collections.Counter()
        counts = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:90]] += e.device_time / steps
                counts[e.name[:90]] += 1 / steps
        total = sum(kernels.values()) / 1e3
        launches = sum(counts.values())
        print(f"rows {rows}: wall {wall:.2f} ms/step, kernels {total:.2f} ms/step, {launches:.0f} launches/step")
        for name, us in kernels.most_common(20):
            print(f"  {us / 1e3:7.3f} ms  x{counts[name]:5.0f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1], [int(r) for r in sys.argv[2:]] or [1, 16])
