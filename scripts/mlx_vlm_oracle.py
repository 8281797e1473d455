"""Reference greedy decoding with mlx-vlm (Gemma 3 and Gemma 4 vision), for
the vision oracle tests.

Reads a JSON request on stdin and prints JSON results. Two modes:

* {"model": DIR, "cases": [{"ids": [...], "pixels": FILE, "images": N}],
   "max_tokens": N}: the prompt ids and the exact pixel tensor (raw
  little-endian float32, [N, H, W, 3]) are given; prints {"results":
  [{"tokens": [...], "logits": [[...] per step]}]}. Tokens come from
  mlx-vlm's own generate_step; logits from the model called step by step
  (prefill through get_input_embeddings), and the two must agree. With
  "bidirectional": true the prefill gets Hugging Face's Gemma 3 mask
  (causal, or within the same image) and only the stepwise run is used.
* {"model": DIR, "processor": [{"messages": [...] or "prompt": TEXT,
  "images": [FILE...], "max_tokens": N (optional)}]}: renders the chat
  template, runs mlx-vlm's processor (Hugging Face's Gemma 3 image
  processor and the Gemma 3 prompt expansion) and, with max_tokens, greedy
  generation; prints {"processed": [{"ids": [...], "pixels": [...flat
  float32 NHWC, image after image...], "shapes": [[H, W], ...],
  "tokens": [...], "logprobs": [...]}]}.
"""

import json
import sys
from pathlib import Path

try:
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.generate import generate_step
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model
except ImportError as e:
    raise SystemExit(f"the vision reference is missing ({e}): run scripts/setup")


def greedy(x):
    return mx.argmax(x, axis=-1)


def same_image(ids, image_token):
    """`[n, n]`: whether positions q and k are tokens of one image."""
    ids = np.array(ids).reshape(-1)
    is_image = ids == image_token
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    block = np.where(is_image, np.cumsum(starts) - 1, -1)
    return (block[:, None] == block[None, :]) & (block[:, None] >= 0)


def image_block_mask(ids, image_token):
    """Hugging Face's Gemma 3 prefill mask: causal, or within one image."""
    n = np.array(ids).size
    causal = np.tril(np.ones((n, n), dtype=bool))
    return mx.array(causal | same_image(ids, image_token))[None, None]


def greedy_walk(logits, n, step):
    """`n` greedy tokens from the prefill's last `logits`, with each step's
    float32 logits; `step(token)` runs the model on one token."""
    tokens, rows = [], []
    for _ in range(n):
        logits = logits.astype(mx.float32)
        rows.append(logits[0].tolist())
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        logits = step(token)
    return tokens, rows


def checked(model, ids, images, n, walk):
    """`walk(model, ids, images, n)`'s tokens and logits, after checking its
    tokens equal mlx-vlm's own generation."""
    official = [
        int(t)
        for t, _ in generate_step(ids, model, images, mx.ones_like(ids), max_tokens=n, sampler=greedy)
    ]
    tokens, rows = walk(model, ids, images, n)
    if tokens != official:
        raise SystemExit(f"mlx-vlm disagrees with itself: {tokens} vs {official}")
    return tokens, rows


def stepwise(model, ids, pixels, n, mask=None):
    lm = model.language_model
    cache = make_prompt_cache(lm)
    emb = model.get_input_embeddings(ids, pixels, mask=mx.ones_like(ids))
    out = lm(ids, inputs_embeds=emb.inputs_embeds, cache=cache, mask=mask)
    return greedy_walk(out.logits[:, -1, :], n, lambda t: lm(mx.array([[t]]), cache=cache).logits[:, -1, :])


def hf_gemma4_masks(lm, ids, image_token):
    """Hugging Face's Gemma 4 prefill masks per layer for one sequence."""
    n = np.array(ids).size
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    causal = k <= q
    same = same_image(ids, image_token)
    window = (q - k) < lm.model.window_size
    full = mx.array(causal)[None, None]
    sliding = mx.array(window & (causal | same))[None, None]
    return [sliding if l.layer_type == "sliding_attention" else full for l in lm.model.layers]


def stepwise_gemma4(model, ids, images, n, masks=None):
    lm = model.language_model
    cache = make_prompt_cache(lm)
    emb = model.get_input_embeddings(ids, images)
    kw = {}
    if emb.per_layer_inputs is not None:
        kw["per_layer_inputs"] = emb.per_layer_inputs
    if masks is not None:
        lm.model._make_masks = lambda h, c, mm=None: masks
    out = lm(ids, inputs_embeds=emb.inputs_embeds, cache=cache, **kw)
    if masks is not None:
        del lm.model._make_masks
    return greedy_walk(out.logits[:, -1, :], n, lambda t: lm(mx.array([[t]]), cache=cache).logits[:, -1, :])


def run_gemma4_cases(req, model):
    n = req["max_tokens"]
    results = []
    for case in req["cases"]:
        ids = mx.array(case["ids"])[None]
        raw = np.fromfile(case["pixels"], dtype="<f4")
        images, at = [], 0
        for h, w in case["shapes"]:
            size = h * w * 3
            images.append(mx.array(raw[at : at + size].reshape(1, h, w, 3)).transpose(0, 3, 1, 2))
            at += size
        features = [
            model.encode_image(im).astype(mx.float32).reshape(-1).tolist() for im in images
        ]
        if case.get("bidirectional"):
            masks = hf_gemma4_masks(model.language_model, case["ids"], model.config.image_token_id)
            tokens, rows = stepwise_gemma4(model, ids, images, n, masks)
        else:
            tokens, rows = checked(model, ids, images, n, stepwise_gemma4)
        results.append({"tokens": tokens, "logits": rows, "features": features})
    return {"results": results}


def run_cases(req):
    model = load_model(Path(req["model"]))
    if model.config.model_type == "gemma4":
        return run_gemma4_cases(req, model)
    size = model.config.vision_config.image_size
    n = req["max_tokens"]
    results = []
    for case in req["cases"]:
        ids = mx.array(case["ids"])[None]
        raw = np.fromfile(case["pixels"], dtype="<f4").reshape(case["images"], size, size, 3)
        pixels = mx.array(raw).transpose(0, 3, 1, 2)  # the model takes NCHW
        if case.get("bidirectional"):
            # mlx-vlm's own generation is causal; the model takes a mask.
            mask = image_block_mask(case["ids"], model.config.image_token_index)
            tokens, rows = stepwise(model, ids, pixels, n, mask)
            results.append({"tokens": tokens, "logits": rows})
            continue
        tokens, rows = checked(model, ids, pixels, n, stepwise)
        results.append({"tokens": tokens, "logits": rows if req.get("logits", True) else []})
    return {"results": results}


def run_processor(req):
    from mlx_vlm.utils import load_processor
    from PIL import Image

    # Loading the model also imports its mlx-vlm processor module, which
    # registers the processor with AutoProcessor (Gemma 4's otherwise falls
    # back to transformers' own, which wants an audio feature extractor).
    model = load_model(Path(req["model"]))
    processor = load_processor(Path(req["model"]))
    tokenizer = processor.tokenizer
    out = []
    for case in req["processor"]:
        images = [Image.open(p) for p in case["images"]]
        prompt = case.get("prompt")
        if prompt is None:
            prompt = tokenizer.apply_chat_template(
                case["messages"], add_generation_prompt=True, tokenize=False
            )
        # The rendered template already starts with <bos>.
        inputs = processor(
            text=prompt,
            images=images or None,
            return_tensors="np",
            add_special_tokens=not prompt.startswith(tokenizer.bos_token),
        )
        ids = np.array(inputs["input_ids"]).reshape(-1).tolist()
        result = {"ids": [int(i) for i in ids], "pixels": [], "shapes": []}
        pixels = None
        if images:
            pv = inputs["pixel_values"]  # NCHW, or a list of CHW (Gemma 4, sizes differ)
            each = [np.array(p, dtype=np.float32).reshape(-1, *np.shape(p)[-3:]) for p in pv]
            flat = []
            for p in each:
                for img in p:
                    flat.extend(img.transpose(1, 2, 0).reshape(-1).tolist())
                    result["shapes"].append(list(img.shape[1:]))
            result["pixels"] = flat
            pixels = [mx.array(p) for p in each] if isinstance(pv, list) else mx.array(np.array(pv))
        n = case.get("max_tokens")
        if n:
            x = mx.array(ids)[None]
            tokens, logprobs = [], []
            for t, lp in generate_step(x, model, pixels, mx.ones_like(x), max_tokens=n, sampler=greedy):
                tokens.append(int(t))
                logprobs.append(float(lp[int(t)].item()))
            result["tokens"] = tokens
            result["logprobs"] = logprobs
        out.append(result)
    return {"processed": out}


def main():
    req = json.load(sys.stdin)
    if "processor" in req:
        result = run_processor(req)
    else:
        result = run_cases(req)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
