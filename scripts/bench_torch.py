#!/usr/bin/env python3
"""The PyTorch peer of the GPU benchmarks: a compiled decode loop over the
same Hugging Face checkpoint our gateway serves (issue 18).

    python3 scripts/bench_torch.py --model DIR --batches 1,16,32,64 \\
        --prompt 128 --gen 128 [--json OUT]

transformers loads DIR in bfloat16 on the GPU; a static KV cache sized for
prompt + gen and `torch.compile(mode="reduce-overhead")` (CUDA graphs) on
the one-token decode forward, which is what "a plain compiled PyTorch loop"
means: no scheduler, no HTTP, every row the same length. Per batch size B:
random prompts of `--prompt` tokens (seeded), one prefill forward, then
`--gen - 1` greedy decode steps; one untimed warm-up run per B compiles.
Prints and writes per B: prefill ms, decode tok/s (B rows, after the first
token) and end-to-end output tok/s (B * gen over prefill + decode), the
figure to set beside a server's aggregate throughput.
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, StaticCache


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config.json + safetensors)")
    p.add_argument("--batches", default="1,16,32,64")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--gen", type=int, default=128, help="output tokens per row")
    p.add_argument("--reps", type=int, default=2, help="timed runs per batch size (best kept)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def static_cache(model, batch, length):
    """One static cache per batch size, reused (reset) by every run: CUDA
    graphs replay over fixed addresses. transformers 5 sizes the batch at
    the first write; 4.x takes it up front."""
    try:
        return StaticCache(config=model.config, max_cache_len=length)
    except TypeError:
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=length,
                           device="cuda", dtype=torch.bfloat16)


def run(model, step, cache, batch, prompt, gen, seed):
    """One batch: prefill, then greedy decode through the compiled step.
    Returns (prefill seconds, decode seconds)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=g).cuda()
    cache.reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pos = torch.arange(prompt, device="cuda")
    logits = model(ids, past_key_values=cache, cache_position=pos, use_cache=True).logits
    tok = logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for i in range(gen - 1):
        pos = torch.tensor([prompt + i], device="cuda")
        tok = step(tok, cache, pos).argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1


def main():
    args = parse_args()
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    except TypeError:  # transformers before 4.56
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model = model.cuda().eval()

    def forward(tok, cache, pos):
        return model(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1]

    step = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    results = []
    with torch.inference_mode():
        for b in [int(x) for x in args.batches.split(",")]:
            cache = static_cache(model, b, args.prompt + args.gen)
            t = time.perf_counter()
            run(model, step, cache, b, args.prompt, args.gen, seed=b)  # compiles for this shape
            warm = time.perf_counter() - t
            best = min((run(model, step, cache, b, args.prompt, args.gen, seed=b + r) for r in range(args.reps)),
                       key=lambda pd: pd[0] + pd[1])
            prefill, decode = best
            r = {
                "batch": b,
                "prompt": args.prompt,
                "gen": args.gen,
                "prefill_ms": round(prefill * 1000, 1),
                "decode_tok_s": round(b * (args.gen - 1) / decode, 1),
                "output_tok_s": round(b * args.gen / (prefill + decode), 1),
                "warmup_s": round(warm, 1),
            }
            print(json.dumps(r), flush=True)
            results.append(r)
            if args.json:  # after every batch size: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"model": args.model, "torch": torch.__version__,
                               "device": torch.cuda.get_device_name(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
