"""mlx-lm's raw generation loop, timed the way benches/raw_loop.rs times
ours: prefill tok/s (prompt tokens / time to the first token) and decode
tok/s (further tokens / their time), best of `reps`. Prints JSON.
An optional fifth argument (float32, ...) casts the model's floating-point
parameters first. `--batch B` (B > 1) times B equal-length rows stepped
together instead, each step's tokens read, as raw_loop's `--batch` does
ours: tokens per second over all rows."""

import json
import sys
import time

import mlx.core as mx
import mlx_lm_compat  # noqa: F401  (mlx-lm 0.32.2 on mlx 0.32.2)
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache


def batch_rates(model, prompt, vocab, rows, gen):
    """Prefill and decode tok/s (all rows) of `rows` prompts stepped together."""
    batch = mx.stack([(prompt + r) % vocab for r in range(rows)])
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    token = mx.argmax(model(batch, cache=cache)[:, -1, :], axis=-1)
    mx.eval(token)
    prefill = rows * prompt.size / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(gen - 1):
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
        token.tolist()
    return prefill, rows * (gen - 1) / (time.perf_counter() - start)


def main():
    argv = sys.argv[1:]
    rows = 1
    if "--batch" in argv:
        i = argv.index("--batch")
        rows = int(argv[i + 1])
        del argv[i : i + 2]
    model_dir, prompt_len, gen, reps = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    model, _ = load(model_dir)
    if len(argv) > 4:
        model.set_dtype(getattr(mx, argv[4]))
    # Qwen 3.5's arguments nest the text model's.
    args = getattr(model.args, "text_config", None) or model.args
    vocab = args["vocab_size"] if isinstance(args, dict) else args.vocab_size
    prompt = mx.array([(i * 7919 + 13) % vocab for i in range(prompt_len)])
    best = {"prefill_tps": 0.0, "decode_tps": 0.0}
    if rows > 1:
        for rep in range(reps + 1):  # the first run warms up
            prefill, decode = batch_rates(model, prompt, vocab, rows, gen)
            if rep:
                best = {"prefill_tps": max(best["prefill_tps"], prefill), "decode_tps": max(best["decode_tps"], decode)}
        json.dump(best, sys.stdout)
        return
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
