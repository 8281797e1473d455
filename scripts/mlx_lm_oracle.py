"""Reference greedy decoding with mlx-lm, for the oracle tests.

Reads a JSON request on stdin: {"model": DIR, "prompts": [[ids]...],
"max_tokens": N, "dtype": null | "float32" | ..., "kv_bits": null | 8 | 4,
"kv_group_size": 64} and prints {"results": [{"tokens": [...], "logits":
[[...V floats] per step]}]}. EOS is ignored: exactly N tokens per prompt.
Tokens come from mlx-lm's own generate_step; logits from the same model
called step by step, and the two token sequences must agree.

With kv_bits, every full-attention layer's cache is mlx-lm's
QuantizedKVCache from the first token on (keys and values quantized as
they are appended; attention through base.quantized_scaled_dot_product_attention),
handed to generate_step as its prompt cache. (generate_step's own kv_bits
switch quantizes only once the prompt is in, and refuses sliding-window
caches.)
"""

import json
import sys

import mlx.core as mx
import mlx_lm_compat  # noqa: F401  (mlx-lm 0.32.2 on mlx 0.32.2)
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache



def new_cache(model, kv):
    cache = make_prompt_cache(model)
    if kv is None:
        return cache
    bits, group_size = kv
    return [
        QuantizedKVCache(group_size=group_size, bits=bits) if type(c) is KVCache else c
        for c in cache
    ]


def stepwise(model, prompt, n, kv):
    cache = new_cache(model, kv)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    tokens, rows = [], []
    for _ in range(n):
        logits = logits.astype(mx.float32)
        rows.append(logits[0].tolist())
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return tokens, rows


def main():
    req = json.load(sys.stdin)
    model, _ = load(req["model"])
    if req.get("dtype"):
        # What our `model.compute_dtype` does at load: every floating-point
        # parameter (quantized scales and biases included) in that dtype.
        model.set_dtype(getattr(mx, req["dtype"]))
    n = req["max_tokens"]
    kv = (req["kv_bits"], req.get("kv_group_size") or 64) if req.get("kv_bits") else None
    results = []
    for prompt in req["prompts"]:
        official = [
            int(t)
            for t, _ in generate_step(
                mx.array(prompt),
                model,
                max_tokens=n,
                sampler=lambda x: mx.argmax(x, axis=-1),
                prompt_cache=new_cache(model, kv),
            )
        ]
        tokens, rows = stepwise(model, prompt, n, kv)
        if tokens != official:
            raise SystemExit(f"mlx-lm disagrees with itself: {tokens} vs {official}")
        results.append({"tokens": tokens, "logits": rows if req.get("logits", True) else []})
    json.dump({"results": results}, sys.stdout)


if __name__ == "__main__":
    main()
