"""SentencePiece itself, the oracle of the GGUF SentencePiece tokenizer tests.

Reads a JSON request on stdin: {"corpus": str, "vocab_size": int,
"add_dummy_prefix": bool, "user_defined": [str], "control": [str],
"texts": [str], "transformers_arch": str or null}. Trains a SentencePiece
BPE model on the corpus lines the way Gemma's and Llama 2's were set up
(byte fallback, identity normalization, whitespace kept as written) and
prints:

* "tokens", "scores", "types": the pieces as a GGUF file stores them
  (llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user defined,
  5 unused, 6 byte), and "unk", "bos", "eos": those ids;
* "ids": each text encoded. SentencePiece does not look for control pieces
  in text; llama.cpp and Hugging Face match them whole, so the text is cut
  at them (leftmost, longest first) and each piece between is encoded on
  its own, as those do;
* "decoded": SentencePiece's decoding of those ids (control pieces
  dropped);
* "transformers": the ids of transformers' GGUF tokenizer conversion for
  `transformers_arch`, when given.
"""

import io
import json
import sys

try:
    import sentencepiece as spm
except ImportError:
    raise SystemExit("spm_reference.py: the sentencepiece package is missing; run scripts/setup")


def train(req):
    model = io.BytesIO()
    lines = [line for line in req["corpus"].split("\n") if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=req["vocab_size"],
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=req["add_dummy_prefix"],
        allow_whitespace_only_pieces=True,
        user_defined_symbols=req["user_defined"] or None,
        control_symbols=req["control"] or None,
        num_threads=1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def token_type(sp, user_defined, i):
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_byte(i):
        return 6
    if sp.is_unused(i):
        return 5
    return 4 if sp.id_to_piece(i) in user_defined else 1


def encode(sp, control, text):
    ids, start, at = [], 0, 0
    while at < len(text):
        hit = max((c for c in control if text.startswith(c, at)), key=len, default=None)
        if hit is None:
            at += 1
            continue
        ids += sp.encode(text[start:at]) + [sp.piece_to_id(hit)]
        at += len(hit)
        start = at
    return ids + sp.encode(text[start:])


def transformers_ids(arch, vocab, texts):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    backend, _ = convert_gguf_tokenizer(arch, vocab)
    return [backend.encode(t, add_special_tokens=False).ids for t in texts]


def main():
    req = json.load(sys.stdin)
    sp = train(req)
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    scores = [sp.get_score(i) for i in range(n)]
    types = [token_type(sp, set(req["user_defined"]), i) for i in range(n)]
    ids = [encode(sp, req["control"], t) for t in req["texts"]]
    out = {
        "tokens": tokens,
        "scores": scores,
        "types": types,
        "unk": sp.unk_id(),
        "bos": sp.bos_id(),
        "eos": sp.eos_id(),
        "ids": ids,
        "decoded": [sp.decode(i) for i in ids],
    }
    if req.get("transformers_arch"):
        vocab = {
            "tokenizer_type": "llama",
            "tokens": tokens,
            "scores": scores,
            "token_type": types,
            "unk_token_id": sp.unk_id(),
            "bos_token_id": sp.bos_id(),
            "eos_token_id": sp.eos_id(),
            "add_prefix_space": req["add_dummy_prefix"],
        }
        out["transformers"] = transformers_ids(req["transformers_arch"], vocab, req["texts"])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
