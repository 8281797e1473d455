"""An independent reading of a GGUF file, for the GGUF oracle tests.

Reads a JSON request on stdin: {"gguf": FILE, "out": DIR, "texts": [str],
"chats": [[messages]]} and writes to DIR a model directory that mlx-lm
loads (scripts/mlx_lm_oracle.py runs it): the tensors as MLX's own GGUF
loader (`mx.load`) returns them, renamed to Hugging Face's names with
llama.cpp's Llama q/k row permutation undone, and the tokenizer as
transformers converts it from the GGUF metadata. Prints {"ids": [[...]]}
(the texts encoded without special tokens) and {"prompts": [[...]]} (the
chats rendered by transformers' apply_chat_template, tokenized).
"""

import json
import os
import sys

import mlx.core as mx
import numpy as np

GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def scalar(meta, key):
    v = meta[key]
    return v.item() if hasattr(v, "item") else v


def hf_name(name):
    stem, suffix = name.rsplit(".", 1)
    if stem in GLOBAL:
        return f"{GLOBAL[stem]}.{suffix}"
    _, layer, part = stem.split(".", 2)
    return f"model.layers.{layer}.{LAYER[part]}.{suffix}"


def unpermute(a, heads):
    # llama.cpp's convert_hf_to_gguf permutes rows as
    # reshape(heads, 2, d/2, ...).swapaxes(1, 2); this is its inverse.
    a = np.array(a)
    rows = a.shape[0]
    return mx.array(
        a.reshape(heads, rows // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
    )


def mlx_lm_weights(gguf):
    """The tensors under Hugging Face's names and the mlx-lm config of a
    llama GGUF (mlx and numpy only: scripts/train_dflash.py reads the
    target through this on machines without transformers)."""
    weights, meta = mx.load(gguf, return_metadata=True)
    arch = meta["general.architecture"]
    if arch != "llama":
        raise SystemExit(f"gguf_reference.py reads llama GGUFs, not {arch}")
    m = lambda k: scalar(meta, f"llama.{k}")
    heads, kv_heads = m("attention.head_count"), m("attention.head_count_kv")
    hf = {}
    quant = {"group_size": 32, "bits": 4}
    for name, a in weights.items():
        new = hf_name(name)
        prefix = new.rsplit(".", 1)[0]
        if "q_proj" in new:
            a = unpermute(a, heads)
        elif "k_proj" in new:
            a = unpermute(a, kv_heads)
        if new.endswith(".scales"):
            in_features = a.shape[-1] * 32
            packed = weights[name.replace(".scales", ".weight")].shape[-1]
            quant[prefix] = {"group_size": 32, "bits": packed * 32 // in_features}
        hf[new] = a
    config = {
        "model_type": "llama",
        "hidden_size": m("embedding_length"),
        "intermediate_size": m("feed_forward_length"),
        "num_hidden_layers": m("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": m("attention.layer_norm_rms_epsilon"),
        "rope_theta": m("rope.freq_base"),
        "max_position_embeddings": m("context_length"),
        "vocab_size": m("vocab_size"),
        "tie_word_embeddings": "output.weight" not in weights,
        "quantization": quant,
    }
    return hf, config


def convert(gguf, out):
    hf, config = mlx_lm_weights(gguf)
    os.makedirs(out, exist_ok=True)
    mx.save_safetensors(os.path.join(out, "model.safetensors"), hf)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    tok = tokenizer(gguf)
    tok.save_pretrained(out)
    return tok


def tokenizer(gguf):
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerFast

    # transformers' GGUF tokenizer conversion; its own GGUF reader needs
    # PyTorch, so the metadata is read with llama.cpp's gguf-py instead.
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = GGUFReader(gguf).fields
    value = lambda k: fields[k].contents()
    groups = {
        group: {name: value(f"tokenizer.{k}") for k, name in renames.items() if f"tokenizer.{k}" in fields}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    vocab, config = groups["tokenizer"], groups["tokenizer_config"]
    backend, _ = convert_gguf_tokenizer(value("general.architecture"), vocab)
    tokens = vocab["tokens"]
    special = {
        name: tokens[vocab[key]]
        for name, key in [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unk_token_id"), ("pad_token", "pad_token_id")]
        if key in vocab
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=config.get("chat_template"), **special
    )


def main():
    req = json.load(sys.stdin)
    tok = convert(req["gguf"], req["out"])
    ids = [tok.encode(t, add_special_tokens=False) for t in req.get("texts", [])]
    prompts = [
        tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
        for c in req.get("chats", [])
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    json.dump({"ids": ids, "prompts": prompts, "eos": tok.eos_token_id}, sys.stdout)


if __name__ == "__main__":
    main()
