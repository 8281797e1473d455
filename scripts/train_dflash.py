"""Trains a DFlash block-diffusion drafter for a target model by
self-distillation, in the checkpoint layout the `dflash` engine loads
(docs/speculative.md, "Training a drafter").

    python3 scripts/train_dflash.py --model models/smollm2-135m-instruct \\
        --out /tmp/drafter --minutes 6 [--prompts 4000 --seed 0]

1. Prompts: synthetic chat instructions (scripts/dflash_prompts.py) rendered
   with the target's chat template; `--prompt-ids FILE` keeps the token ids
   (written when missing, read when present: a machine without a tokenizer
   reads the file written on one with it).
2. Data: the target's own greedy answers (batched), then one teacher-forced
   target forward per sequence for the outputs of `target_layer_ids` and the
   target's argmax at every position.
3. Training: what the drafter does at inference. A block anchored at a
   response position p is [x_p, mask, ..., mask] at positions p..p+B-1; it
   attends to the projected target features of positions < p and, both
   ways, to its own block, and predicts x_{p+1..p+B-1}. Many anchors per
   sequence share one forward (each block sees only its own context).
   Cross-entropy with weights exp(-(k-1)/gamma) on block position k (early
   drafts matter most: a rejection ends the round); a label counts only
   while the sequence is the target's greedy chain up to it. The target's
   embeddings and output head are shared and frozen.
4. Held-out acceptance: on held-out prompts every response position drafts
   a block against the teacher-forced context (what the engine's drafter
   sees when everything before was accepted), then the rounds of greedy
   speculative decoding are walked: mean committed tokens per round
   (accepted drafts + the target's own token) is the acceptance length.

Needs mlx and mlx-lm only (plus, where no `--prompt-ids` file exists yet,
gguf-py and transformers for the GGUF's tokenizer and chat template). The
target is a GGUF file (read with MLX's GGUF loader through
scripts/gguf_reference.py) or an mlx-lm directory (Llama family).
"""

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import types
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))

OPENBLAS = ["/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib64/libopenblas.so.0"]
MASK_TOKEN = "<empty_output>"  # a SmolLM2 special token no chat uses


def mlx_lm_module(name):
    """An mlx-lm submodule. mlx-lm's package __init__ imports transformers
    (for its tokenizer) and the model code does not: where transformers is
    missing, the package is entered without its __init__."""
    try:
        import mlx_lm  # noqa: F401
    except Exception:  # transformers missing, or a version mlx-lm rejects
        spec = importlib.util.find_spec("mlx_lm")
        pkg = types.ModuleType("mlx_lm")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["mlx_lm"] = pkg
    return importlib.import_module(f"mlx_lm.{name}")


def gguf_file(path):
    path = Path(path)
    if path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf"))
    return found[0] if len(found) == 1 and not list(path.glob("*.safetensors")) else None


def load_target(path, dtype, dense):
    """The target as an mlx-lm Llama model, and its config. `dense`:
    quantized weights dequantized (the same values; MLX's CPU kernel for
    quantized matrix products of many rows is ~50x slower than dense BLAS)."""
    gguf = gguf_file(path)
    if gguf:
        from gguf_reference import mlx_lm_weights

        weights, config = mlx_lm_weights(str(gguf))
    else:
        config = json.loads((Path(path) / "config.json").read_text())
        weights = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            weights.update(mx.load(str(f)))
    if config.get("model_type") != "llama":
        raise SystemExit(f"train_dflash.py trains for Llama-family targets, not {config.get('model_type')}")
    llama = mlx_lm_module("models.llama")
    model = llama.Model(llama.ModelArgs.from_dict(config))
    q = config.get("quantization")
    if q and dense:
        for name in [k for k in weights if k.endswith(".scales")]:
            p = name[: -len(".scales")]
            g = q.get(p, q)
            weights[f"{p}.weight"] = mx.dequantize(
                weights[f"{p}.weight"], weights.pop(name), weights.pop(f"{p}.biases"), g["group_size"], g["bits"]
            )
        q = None
    if q:
        def quantized(p, m):
            if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                return False
            return q.get(p, True)

        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], class_predicate=quantized)
    model.load_weights(list(model.sanitize(weights).items()))
    model.set_dtype(dtype)
    model.freeze()
    mx.eval(model.parameters())
    return model, config


def tokenize(path, texts):
    """Chat-rendered prompt ids of `texts`, the stop ids and the mask id."""
    gguf = gguf_file(path)
    if gguf:
        from gguf_reference import tokenizer

        tok = tokenizer(str(gguf))
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
    ids = []
    for t in texts:
        p = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        ids.append(list(p["input_ids"]) if hasattr(p, "keys") else list(p))
    vocab = tok.get_vocab()
    stops = sorted({tok.eos_token_id} | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab})
    return ids, stops, vocab[MASK_TOKEN]


def prompt_set(args):
    file = Path(args.prompt_ids) if args.prompt_ids else None
    if file and file.exists():
        data = json.loads(file.read_text())
    else:
        from dflash_prompts import prompts

        n = max(args.prompts + args.held_out, args.pool)
        ids, stops, mask = tokenize(args.model, prompts(n, seed=1234))
        data = {"prompts": ids, "stops": stops, "mask_token_id": mask}
        if file:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(data, separators=(",", ":")))
    pool = data["prompts"]
    if len(pool) < args.prompts + args.held_out:
        raise SystemExit(f"{file} holds {len(pool)} prompts; asked for {args.prompts} + {args.held_out}")
    order = np.random.default_rng(args.seed).permutation(len(pool))
    held = [pool[i] for i in order[: args.held_out]]
    train = [pool[i] for i in order[args.held_out : args.held_out + args.prompts]]
    return train, held, data["stops"], data["mask_token_id"]


def through_stop(tokens, stops):
    """`tokens` up to and including the first stop token."""
    return tokens[: next((j + 1 for j, t in enumerate(tokens) if t in stops), len(tokens))]


def generate(model, prompts, max_new, stops, batch, until):
    """The target's greedy answer to each prompt (ending with its stop
    token, when it stops within `max_new`), batched over prompts of equal
    length (no padding, so no attention mask: MLX's GPU backend is far
    slower on masked decode steps); `None` for the prompts not reached by
    time `until`."""
    from_cache = mlx_lm_module("models.cache")
    out = [None] * len(prompts)
    by_len = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    groups = [g[s : s + batch] for _, g in sorted(by_len.items()) for s in range(0, len(g), batch)]
    stop_set = np.array(stops)
    for n, rows in enumerate(groups):
        if n and time.time() > until:
            break
        cache = [from_cache.KVCache() for _ in model.layers]
        tok = mx.argmax(model(mx.array([prompts[i] for i in rows]), cache=cache)[:, -1], axis=-1)
        steps, done = [], np.zeros(len(rows), bool)
        for _ in range(max_new):
            nxt = mx.argmax(model(tok[:, None], cache=cache)[:, -1], axis=-1)
            mx.async_eval(nxt)
            t = np.array(tok)
            steps.append(t)
            done |= np.isin(t, stop_set)
            if done.all():
                break
            tok = nxt
        gen = np.stack(steps, axis=1)
        for r, i in enumerate(rows):
            out[i] = through_stop([int(t) for t in gen[r]], stops)
    return out


def torch_generator(model, config):
    """`generate` (less its model argument) computed by PyTorch on a CUDA
    GPU from the same (dense) weights: MLX's CUDA backend runs a small
    model's decode step at ~13 ms whatever the batch, and rows of equal
    length are few, so left-padded batches of hundreds of rows through
    transformers (attention-masked) are ~30x faster there. A position
    where PyTorch's bfloat16 answer differs from MLX's argmax is masked
    out of training by the teacher-forced pass, as any disagreement is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
            "vocab_size", "tie_word_embeddings")
    cfg = LlamaConfig(**{k: config[k] for k in keys if k in config})
    net = LlamaForCausalLM(cfg).to(dtype=torch.bfloat16, device="cuda").eval()
    state = {k: torch.from_numpy(np.array(v.astype(mx.float32))).to(torch.bfloat16)
             for k, v in tree_flatten(model.parameters())}
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"weights do not map onto transformers' Llama: missing {missing}, unexpected {unexpected}")
    net.tie_weights()

    def generate(prompts, max_new, stops, batch, until):
        out = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        with torch.inference_mode():
            for s in range(0, len(order), batch):
                if s and time.time() > until:
                    break
                rows = order[s : s + batch]
                width = max(len(prompts[i]) for i in rows)
                pad = [width - len(prompts[i]) for i in rows]
                ids = torch.tensor([[0] * n + prompts[i] for n, i in zip(pad, rows)], device="cuda")
                mask = torch.tensor([[0] * n + [1] * (width - n) for n in pad], device="cuda")
                gen = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                   eos_token_id=list(stops), pad_token_id=stops[0])[:, width:].tolist()
                for r, i in enumerate(rows):
                    out[i] = through_stop(gen[r], stops)
        # Give PyTorch's cached blocks back: MLX allocates from the same card.
        torch.cuda.empty_cache()
        return out

    return generate


def target_pass(model, seqs, layer_ids, batch):
    """Per sequence: the target's tapped hidden states `[T, n * hidden]`
    (bfloat16) and whether each next token is the target's argmax."""
    feats, greedy_ok = [None] * len(seqs), [None] * len(seqs)
    inner = model.model
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for s in range(0, len(order), batch):
        rows = order[s : s + batch]
        width = max(len(seqs[i]) for i in rows)
        x = mx.array([seqs[i] + [0] * (width - len(seqs[i])) for i in rows])
        h = inner.embed_tokens(x)
        taps = []
        for i, layer in enumerate(inner.layers):
            h = layer(h, "causal", None)
            if i in layer_ids:
                taps.append(h)
        logits = model.model.embed_tokens.as_linear(inner.norm(h)) if model.args.tie_word_embeddings \
            else model.lm_head(inner.norm(h))
        tapped = mx.concatenate(taps, axis=-1).astype(mx.bfloat16)
        g = mx.argmax(logits, axis=-1)
        mx.eval(tapped, g)
        g = np.array(g)
        for r, i in enumerate(rows):
            n = len(seqs[i])
            feats[i] = tapped[r, :n]
            greedy_ok[i] = np.array(seqs[i][1:]) == g[r, : n - 1]
    return feats, greedy_ok


def rope(x, pos, theta):
    """Split-half (non-interleaved) rotary embedding of `x` [B, h, L, d] at
    per-token positions `pos` [B, L]: what nn.RoPE(traditional=False) does
    at one offset, here for blocks at scattered positions."""
    d = x.shape[-1]
    inv = theta ** (-mx.arange(0, d, 2, dtype=mx.float32) / d)
    ang = pos[:, None, :, None].astype(mx.float32) * inv
    cos, sin = mx.cos(ang).astype(x.dtype), mx.sin(ang).astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.kh, self.hd, self.theta = c["num_attention_heads"], c["num_key_value_heads"], hd, c["rope_theta"]
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.kh * hd, bias=False)
        self.v_proj = nn.Linear(h, self.kh * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=c["rms_norm_eps"])
        self.k_norm = nn.RMSNorm(hd, eps=c["rms_norm_eps"])

    def heads(self, t, n, norm=None):
        b, l, _ = t.shape
        t = t.reshape(b, l, n, self.hd)
        return (norm(t) if norm else t).transpose(0, 2, 1, 3)

    def __call__(self, x, ctx, qpos, cpos, mask):
        b, l, _ = x.shape
        q = rope(self.heads(self.q_proj(x), self.nh, self.q_norm), qpos, self.theta)
        # Context keys come from the projected target features (no input
        # norm), block keys from the block itself.
        k = mx.concatenate(
            [rope(self.heads(self.k_proj(ctx), self.kh, self.k_norm), cpos, self.theta),
             rope(self.heads(self.k_proj(x), self.kh, self.k_norm), qpos, self.theta)], axis=2)
        v = mx.concatenate([self.heads(self.v_proj(ctx), self.kh), self.heads(self.v_proj(x), self.kh)], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.hd**-0.5, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, l, -1))


class MLP(nn.Module):
    def __init__(self, h, inter):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c["hidden_size"], c["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
        self.post_attention_layernorm = nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])

    def __call__(self, x, ctx, qpos, cpos, mask):
        h = x + self.self_attn(self.input_layernorm(x), ctx, qpos, cpos, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    """The published DFlash drafter's parameters under their checkpoint
    names; the forward runs many blocks at once against one context."""

    def __init__(self, c):
        super().__init__()
        h = c["hidden_size"]
        self.fc = nn.Linear(h * len(c["dflash_config"]["target_layer_ids"]), h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=c["rms_norm_eps"])
        self.layers = [Layer(c) for _ in range(c["num_hidden_layers"])]
        self.norm = nn.RMSNorm(h, eps=c["rms_norm_eps"])

    def __call__(self, x, feats, qpos, mask):
        ctx = self.hidden_norm(self.fc(feats))
        b, s, _ = ctx.shape
        cpos = mx.broadcast_to(mx.arange(s)[None], (b, s))
        for layer in self.layers:
            x = layer(x, ctx, qpos, cpos, mask)
        return self.norm(x)


def drafter_config(target, layers, block, mask_id):
    n = target["num_hidden_layers"]
    # Spread from the second layer to the third-to-last, as the published
    # drafters (and fixtures::dflash::target_layer_ids) are.
    lo, hi = min(1, n - 1), max(n - 3, 1)
    ids = sorted({round(lo + (i / max(layers - 1, 1) if layers > 1 else 0.5) * (hi - lo)) for i in range(layers)})
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target.get("head_dim", target["hidden_size"] // target["num_attention_heads"]),
        "vocab_size": target["vocab_size"],
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": target["rope_theta"],
        "max_position_embeddings": target["max_position_embeddings"],
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "block_size": block,
        "num_target_layers": n,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask_id},
        "torch_dtype": "bfloat16",
    }


class Batch:
    """Blocks of `anchors` (one list per sequence) as drafter inputs: block
    tokens, their positions, the attention mask over [context | blocks],
    labels and loss weights (0 where a label does not count)."""

    def __init__(self, seqs, feats, ok, anchors, block, mask_id, gamma):
        b, n = len(seqs), max(len(a) for a in anchors)
        width = -(-max(len(s) for s in seqs) // 32) * 32  # fewer distinct shapes
        toks = np.full((b, n, block), mask_id, np.int32)
        pos = np.zeros((b, n, block), np.int32)
        labels = np.zeros((b, n, block - 1), np.int32)
        weight = np.zeros((b, n, block - 1), np.float32)
        ctx_mask = np.zeros((b, n, width), bool)
        decay = np.exp(-np.arange(block - 1) / gamma)
        for i, (s, a) in enumerate(zip(seqs, anchors)):
            for j, p in enumerate(a):
                toks[i, j, 0] = s[p]
                pos[i, j] = p + np.arange(block)
                ctx_mask[i, j, :p] = True
                k = min(block - 1, len(s) - 1 - p)
                labels[i, j, :k] = s[p + 1 : p + 1 + k]
                # A label counts while the sequence is the target's greedy
                # chain up to it.
                chain = np.cumprod(ok[i][p : p + k])
                weight[i, j, :k] = decay[:k] * chain
            if len(a) < n:
                pos[i, len(a) :] = np.arange(block)
        own = np.kron(np.eye(n, dtype=bool), np.ones((block, block), bool))
        mask = np.concatenate([np.repeat(ctx_mask, block, axis=1), np.broadcast_to(own, (b, n * block, n * block))], axis=2)
        self.tokens = mx.array(toks.reshape(b, -1))
        self.pos = mx.array(pos.reshape(b, -1))
        self.mask = mx.array(mask[:, None])
        self.labels = mx.array(labels.reshape(b, -1))
        self.weight = mx.array(weight.reshape(b, -1))
        self.feats = mx.stack([mx.pad(f, [(0, width - f.shape[0]), (0, 0)]) for f in feats]).astype(mx.float32)
        self.block, self.n = block, n


def block_logits(drafter, target, batch):
    """The drafter's logits for every block's positions 1.. `[B, n*(block-1), V]`."""
    embed = target.model.embed_tokens
    x = mx.stop_gradient(embed(batch.tokens)).astype(mx.float32)
    h = drafter(x, batch.feats, batch.pos, batch.mask)
    b, _, d = h.shape
    h = h.reshape(b, batch.n, batch.block, d)[:, :, 1:].reshape(b, -1, d)
    head = embed.as_linear if target.args.tie_word_embeddings else target.lm_head
    # The head computes in the target's dtype (its quantized kernels take
    # one dtype); the loss in float32.
    return head(h.astype(target.model.norm.weight.dtype)).astype(mx.float32)


def loss_fn(drafter, target, batch):
    logits = block_logits(drafter, target, batch)
    ce = nn.losses.cross_entropy(logits, batch.labels, reduction="none")
    w = batch.weight
    return (ce * w).sum() / mx.maximum(w.sum(), 1e-6), (mx.argmax(logits, -1) == batch.labels) * (w > 0)


def acceptance(drafter, target, held, cfg, chunk):
    """Mean committed tokens per round of greedy speculative decoding over
    the held-out responses, and the share of first drafts accepted."""
    block, mask_id = cfg["block_size"], cfg["dflash_config"]["mask_token_id"]
    committed = rounds = first = firsts = 0
    for seq, feat, ok, start in held:
        anchors = list(range(start, len(seq) - 1))
        accepted = {}
        for s in range(0, len(anchors), chunk):
            a = anchors[s : s + chunk]
            b = Batch([seq], [feat], [ok], [a], block, mask_id, 1.0)
            d = np.array(mx.argmax(block_logits(drafter, target, b), -1)).reshape(len(a), block - 1)
            for p, drafts in zip(a, d):
                truth = seq[p + 1 : p + block]
                n = 0
                while n < len(truth) and drafts[n] == truth[n]:
                    n += 1
                accepted[p] = n
        firsts += len(anchors)
        first += sum(1 for p in anchors if accepted[p] > 0)
        p = start
        while p < len(seq) - 1:
            a = accepted[p]
            committed += a + 1
            rounds += 1
            p += a + 1
    return committed / max(rounds, 1), first / max(firsts, 1)


def save(drafter, cfg, out, shard_mb, info):
    """config.json and the weights in bfloat16, in files of at most
    `shard_mb` MiB (what a device run can bring back per file)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    tensors = [(k, v.astype(mx.bfloat16)) for k, v in tree_flatten(drafter.parameters())]
    shards, cur, size = [], {}, 0
    for k, v in tensors:
        if cur and size + v.nbytes > shard_mb << 20:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + v.nbytes
    shards.append(cur)
    for i, s in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / name), s)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")


def with_openblas():
    """On the CPU, re-runs this process with OpenBLAS preloaded (the MLX
    wheel bundles the reference BLAS, ~20x slower), where it is installed."""
    lib = next((l for l in OPENBLAS if os.path.exists(l)), None)
    if mx.default_device() == mx.cpu and lib and lib not in os.environ.get("LD_PRELOAD", ""):
        env = dict(os.environ, LD_PRELOAD=lib)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def check_reference(out, target, held, cfg):
    """Loads the written checkpoint into this script's drafter and into
    mlx-vlm's `qwen3_dflash` drafter (the reference our engine's drafter is
    tested equal to) and compares their logits for one held-out block."""
    from mlx_vlm.speculative.drafters.qwen3_dflash import Model, ModelConfig
    from reference_drafter import load_drafter

    ref = load_drafter(Model, ModelConfig, out)
    ref.set_dtype(mx.float32)
    cache = ref.reset(target)
    weights = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    mine = Drafter(cfg)
    mine.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()])
    seq, feat, ok, p = held[0]
    block, mask_id = cfg["block_size"], cfg["dflash_config"]["mask_token_id"]
    ours = block_logits(mine, target, Batch([seq], [feat], [ok], [[p]], block, mask_id, 1.0))[0]
    tokens = mx.array([[seq[p]] + [mask_id] * (block - 1)])
    theirs = ref(tokens, feat[None, :p].astype(mx.float32), cache)[0, 1:].astype(mx.float32)
    diff = mx.abs(ours - theirs).max().item()
    same = (mx.argmax(ours, -1) == mx.argmax(theirs, -1)).all().item()
    print(f"reference check (mlx-vlm qwen3_dflash): max |logit diff| {diff:.2e}, drafts equal: {same}", flush=True)
    if diff > 1e-3 or not same:
        raise SystemExit("the checkpoint does not draft as mlx-vlm's drafter does")


def main():
    with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target: a GGUF file, a directory holding one, or an mlx-lm directory")
    ap.add_argument("--out", help="the drafter checkpoint directory to write")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget, data generation included")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the time budget alone)")
    ap.add_argument("--prompts", type=int, default=300, help="training prompts (data size)")
    ap.add_argument("--held-out", type=int, default=16, help="held-out prompts for the acceptance estimate")
    ap.add_argument("--pool", type=int, default=6000, help="prompts written to a new --prompt-ids file")
    ap.add_argument("--prompt-ids", help="tokenized prompt set: read if present, else written")
    ap.add_argument("--prepare", action="store_true", help="only write --prompt-ids (on a machine with the tokenizer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-reference", action="store_true",
                    help="after saving, compare the checkpoint's logits with mlx-vlm's drafter (needs mlx-vlm)")
    ap.add_argument("--gen", type=int, default=160, help="longest target answer, tokens")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4, help="drafter layers (and target layers read)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=float, default=0.2, help="held-out evaluation every this share of the budget")
    ap.add_argument("--data-share", type=float, default=0.4, help="most of the budget spent generating answers")
    ap.add_argument("--target-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="the target's compute dtype (auto: bfloat16 on a GPU, float32 on the CPU, as the engine)")
    ap.add_argument("--dense", choices=["yes", "no"], default="yes",
                    help="dequantize a quantized target (MLX's kernels for quantized products of many rows "
                         "are far slower than dense ones on the CPU, and on CUDA with 32-wide groups)")
    ap.add_argument("--shard-mb", type=int, default=15)
    ap.add_argument("--generator", choices=["mlx", "torch"], default="mlx",
                    help="who writes the target's answers: MLX, or PyTorch on a CUDA GPU (same weights, dense)")
    args = ap.parse_args()
    if args.prepare:
        if not args.prompt_ids:
            raise SystemExit("--prepare writes --prompt-ids FILE")
        prompt_set(args)
        print(f"wrote {args.prompt_ids}")
        return
    if not args.out:
        raise SystemExit("--out DIR is required")
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    gpu = mx.default_device() == mx.gpu
    print(f"device {mx.default_device()}, mlx {mx.__version__}", flush=True)

    dtype = {"auto": mx.bfloat16 if gpu else mx.float32, "float32": mx.float32, "bfloat16": mx.bfloat16}[args.target_dtype]
    dense = args.dense == "yes"
    target, tcfg = load_target(args.model, dtype, dense)
    train_p, held_p, stops, mask_id = prompt_set(args)
    cfg = drafter_config(tcfg, args.layers, args.block, mask_id)
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    print(f"target {args.model}: {tcfg['num_hidden_layers']} layers; drafter {args.layers} layers reading {layer_ids}, "
          f"block {args.block}; {len(train_p)} training + {len(held_p)} held-out prompts ({time.time() - t0:.1f} s)", flush=True)

    t = time.time()
    # Held-out answers first; the training data gets what is left of
    # `--data-share` of the budget.
    writer = (lambda *a: generate(target, *a)) if args.generator == "mlx" else torch_generator(target, tcfg)
    held_a = writer(held_p, args.gen, stops, args.gen_batch, float("inf"))
    answers = writer(train_p, args.gen, stops, args.gen_batch, t0 + args.data_share * (deadline - t0))
    del writer
    kept = [i for i, a in enumerate(answers) if a is not None]
    if len(kept) < len(train_p):
        print(f"time for {len(kept)} of {len(train_p)} training answers", flush=True)
    train_p, answers = [train_p[i] for i in kept], [answers[i] for i in kept] + held_a
    n_tok = sum(map(len, answers))
    print(f"target answers: {n_tok} tokens in {time.time() - t:.1f} s ({n_tok / (time.time() - t):.0f} tok/s)", flush=True)
    seqs = [p + a for p, a in zip(train_p + held_p, answers)]
    starts = [len(p) for p in train_p + held_p]
    t = time.time()
    # Fewer rows than generation: this pass holds every position's logits.
    feats, ok = target_pass(target, seqs, set(layer_ids), min(args.gen_batch, 64))
    agree = np.mean(np.concatenate([o[s:] for o, s in zip(ok, starts)]))
    print(f"target features: {sum(map(len, seqs))} positions in {time.time() - t:.1f} s; "
          f"answers equal the teacher-forced argmax at {agree:.4f} of positions", flush=True)
    n_train = len(train_p)
    held = list(zip(seqs[n_train:], feats[n_train:], ok[n_train:], starts[n_train:]))
    # Anchors: response positions whose next token is the target's choice.
    valid = [np.nonzero(o[s : len(q) - 1])[0] + s for q, o, s in zip(seqs[:n_train], ok[:n_train], starts[:n_train])]
    usable = [i for i in range(n_train) if len(valid[i])]
    if not usable:
        raise SystemExit("no training answer has a position to draft from")

    drafter = Drafter(cfg)
    mx.eval(drafter.parameters())
    n_params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(args.block, max(1.0, args.block / 2 - 1))
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.01)
    step_fn = nn.value_and_grad(drafter, loss_fn)
    tau0, first0 = acceptance(drafter, target, held, cfg, 64)
    print(f"drafter {n_params / 1e6:.1f}M parameters; untrained: acceptance length {tau0:.3f}, "
          f"first draft accepted {first0:.3f}", flush=True)

    train_start = time.time()
    # Leave time for the last evaluation and the save.
    budget = max(deadline - train_start - 20, 1)
    next_eval, step, best = args.eval_every, 0, None
    losses, hits, counts = [], 0.0, 0.0
    history = []
    while True:
        # The schedule runs over the time budget, or over --steps when
        # those end first.
        frac = max((time.time() - train_start) / budget, step / args.steps if args.steps else 0)
        if frac >= 1 or (args.steps and step >= args.steps):
            break
        # Linear warm-up over 5% of the budget, then cosine to 10%.
        lr = args.lr * (min(1.0, frac / 0.05) if frac < 0.05 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        opt.learning_rate = mx.array(lr)
        rows = rng.choice(usable, size=min(args.batch, len(usable)), replace=False)
        anchors = [sorted(rng.choice(valid[i], size=min(args.anchors, len(valid[i])), replace=False)) for i in rows]
        batch = Batch([seqs[i] for i in rows], [feats[i] for i in rows], [ok[i] for i in rows], anchors,
                      args.block, mask_id, gamma)
        (loss, correct), grads = step_fn(drafter, target, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(drafter, grads)
        mx.eval(drafter.parameters(), opt.state, loss, correct)
        step += 1
        losses.append(loss.item())
        hits += correct[..., :].sum().item()
        counts += (batch.weight > 0).sum().item()
        if step % 10 == 0:
            print(f"step {step} ({time.time() - t0:.0f} s): loss {np.mean(losses):.4f}, "
                  f"draft accuracy {hits / max(counts, 1):.3f}, lr {lr:.2e}", flush=True)
            losses, hits, counts = [], 0.0, 0.0
        if frac >= next_eval:
            next_eval += args.eval_every
            tau, first = acceptance(drafter, target, held, cfg, 64)
            history.append({"step": step, "seconds": round(time.time() - t0), "acceptance_length": tau})
            print(f"held-out at step {step}: acceptance length {tau:.3f}, first draft accepted {first:.3f}", flush=True)
    tau, first = acceptance(drafter, target, held, cfg, 64)
    history.append({"step": step, "seconds": round(time.time() - t0), "acceptance_length": tau})
    info = {
        "command": " ".join(sys.argv),
        "device": str(mx.default_device()),
        "steps": step,
        "training_prompts": n_train,
        "training_tokens": int(sum(len(s) - st for s, st in zip(seqs[:n_train], starts[:n_train]))),
        "held_out_prompts": len(held),
        "untrained_acceptance_length": tau0,
        "acceptance_length": tau,
        "first_draft_accepted": first,
        "history": history,
    }
    save(drafter, cfg, Path(args.out), args.shard_mb, info)
    if args.check_reference:
        check_reference(args.out, target, held, cfg)
    print(f"done: {step} steps in {time.time() - t0:.0f} s; held-out acceptance length {tau:.3f} "
          f"(untrained {tau0:.3f}), first draft accepted {first:.3f}; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
