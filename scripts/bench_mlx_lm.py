"""mlx-lm's raw generation loop, timed the way benches/raw_loop.rs times
ours: prefill tok/s (prompt tokens / time to the first token) and decode
tok/s (further tokens / their time), best of `reps`. Prints JSON.
An optional fifth argument (float32, ...) casts the model's floating-point
parameters first."""

import json
import sys
import time

import mlx.core as mx
import mlx_lm_compat  # noqa: F401  (mlx-lm 0.32.2 on mlx 0.32.2)
from mlx_lm import load
from mlx_lm.generate import generate_step


def main():
    model_dir, prompt_len, gen, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    model, _ = load(model_dir)
    if len(sys.argv) > 5:
        model.set_dtype(getattr(mx, sys.argv[5]))
    # Qwen 3.5's arguments nest the text model's.
    args = getattr(model.args, "text_config", None) or model.args
    vocab = args["vocab_size"] if isinstance(args, dict) else args.vocab_size
    prompt = mx.array([(i * 7919 + 13) % vocab for i in range(prompt_len)])
    best = {"prefill_tps": 0.0, "decode_tps": 0.0}
    for _ in range(reps + 1):  # the first run warms up
        start = time.perf_counter()
        first = None
        n = 0
        for token, _ in generate_step(prompt, model, max_tokens=gen, sampler=lambda x: mx.argmax(x, axis=-1)):
            n += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        prefill = prompt_len / (first - start)
        decode = (n - 1) / (end - first)
        best = {"prefill_tps": max(best["prefill_tps"], prefill), "decode_tps": max(best["decode_tps"], decode)}
    json.dump(best, sys.stdout)


if __name__ == "__main__":
    main()
