"""Reference drafts of a Gemma 4 assistant drafter, for the oracle test of
the mtp engine's assistant drafter.

mlx-vlm's Gemma4AssistantDraftModel (its own config and sanitize) bound to
mlx-lm's Gemma 4 target, driven through the calls mlx-vlm's MTP round loop
(`speculative/mtp.py`, `_mtp_rounds`) makes: `set_shared_kv` with the
target's keys and values of its last layer of each attention type, the
cache length as `kv_offset` and `kv_valid_len` and the draft position one
before it (the last cached token), then `draft_block` from the newest
token and the target's final normed hidden state before it.

Reads {"model": TARGET_DIR, "drafter": DIR, "prompt": [ids],
"draft_tokens": K, "accept": [A per round]} on stdin. Each round drafts K
tokens and then accepts the first min(A, K) of them whatever the target
says, followed by the target's greedy token after them. The target runs
over the whole sequence each round with plain caches, so the shared keys
and values are every position's in order (the layout mlx-vlm's buffered
cache has until it first drops old sliding-window keys). Prints {"rounds":
[{"drafts": [...], "committed": [...], "logits": [[V floats] per draft
step]}]}: each step's logits are the drafter's own forward (its __call__,
what draft_block samples from) on that step's input.
"""

import json
import sys

import mlx.core as mx
from mlx_lm import load
from reference_drafter import load_drafter
from mlx_lm.models.cache import KVCache
from mlx_vlm.speculative.drafters.gemma4_assistant import (
    Gemma4AssistantDraftModel,
    ModelConfig,
)


def greedy(logits):
    return mx.argmax(logits, axis=-1)


def main():
    req = json.load(sys.stdin)
    k = req["draft_tokens"]
    model, _ = load(req["model"])
    lm = getattr(model, "language_model", model)
    inner = lm.model
    first_shared = len(inner.layers) - lm.args.num_kv_shared_layers
    # The last layer of each attention type that keeps its own keys (the
    # KV-shared layers after it read the same ones).
    owner = {inner.layers[i].layer_type: i for i in range(first_shared)}

    draft = load_drafter(Gemma4AssistantDraftModel, ModelConfig, req["drafter"])
    draft.reset(model)

    def target(tokens):
        """Final normed hidden states and each owner layer's keys/values."""
        cache = [KVCache() for _ in range(first_shared)]
        h = inner(mx.array(tokens)[None], cache=cache)
        kv = {t: (cache[i].keys, cache[i].values) for t, i in owner.items()}
        return h, kv

    def target_token(h):
        logits = (
            lm.lm_head(h)
            if hasattr(lm, "lm_head")
            else inner.embed_tokens.as_linear(h)
        )
        return int(greedy(logits).reshape(-1).item())

    def shared(kv, n):
        return {t: (keys[..., :n, :], values[..., :n, :]) for t, (keys, values) in kv.items()}

    history = list(req["prompt"])
    h, kv = target(history)
    bonus = target_token(h[:, -1:, :])
    history.append(bonus)
    last_hidden = h[:, -1:, :]
    kv_offset = len(req["prompt"])
    kv = shared(kv, kv_offset)
    rounds = []
    for forced in req["accept"]:
        draft.set_shared_kv(
            kv, kv_offset, position=max(kv_offset - 1, 0), kv_valid_len=kv_offset
        )
        drafts = draft.draft_block(
            bonus, last_hidden, None, k + 1, greedy, mx.int32, greedy=True
        )
        d = [int(t) for t in drafts.reshape(-1).tolist()]
        # The drafter's logits at each step, on the inputs draft_block gave it.
        logits = []
        h_prev = last_hidden
        position_ids = mx.array([[kv_offset - 1]])
        for tok in [bonus] + d[:-1]:
            embed = draft._input_embed(mx.array([[tok]])) * draft._input_embed_scale
            h_prev, step = draft(
                mx.concatenate([embed, h_prev], axis=-1), kv, position_ids
            )
            logits.append(step.astype(mx.float32).reshape(-1).tolist())
        verify, kv = target(history + d)
        verify = verify[:, len(history) - 1 :, :]
        a = min(forced, k)
        bonus = target_token(verify[:, a : a + 1, :])
        committed = d[:a] + [bonus]
        # The newest token and the accepted drafts join the cache.
        kv_offset = len(history) + a
        kv = shared(kv, kv_offset)
        history += committed
        last_hidden = verify[:, a : a + 1, :]
        rounds.append({"drafts": d, "committed": committed, "logits": logits})
    print(json.dumps({"rounds": rounds}))


if __name__ == "__main__":
    main()
