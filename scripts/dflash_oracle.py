"""Reference drafts of a DFlash drafter, for the oracle test of the dflash
engine's drafter.

mlx-vlm's DFlash drafter (`qwen3_dflash`, or `gemma4_dflash` with "gemma4":
true; its own config and sanitize) bound to mlx-lm's target, driven through
the calls mlx-vlm's DFlash round loop (`speculative/dflash.py`,
`_dflash_rounds`) makes: one drafter cache from `reset`, then each round
the block [newest, mask, ...] drafted against the target hidden states of
the positions committed since the last round (the outputs of
`target_layer_ids`, concatenated; the whole prompt before the first).

Reads {"model": TARGET_DIR, "drafter": DIR, "prompt": [ids], "draft_tokens":
K, "accept": [A per round], "gemma4": bool} on stdin. Each round drafts K
tokens and then accepts the first min(A, K) of them whatever the target
says, followed by the target's greedy token after them. The target runs
over the whole sequence each round. Prints {"rounds": [{"drafts": [...],
"committed": [...], "logits": [[V floats] per draft]}]}: the drafts are the
argmax of the drafter's logits (its __call__, the body of draft_block).
"""

import json
import sys

import mlx.core as mx
from mlx_lm import load
from reference_drafter import load_drafter


class Tap:
    """Records a decoder layer's output hidden state (mlx-vlm's
    capture_layer_ids, for an mlx-lm target)."""

    def __init__(self, layer, sink, idx):
        self.layer, self.sink, self.idx = layer, sink, idx

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.sink[self.idx] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):
        return getattr(self.layer, name)


def main():
    req = json.load(sys.stdin)
    k = req["draft_tokens"]
    if req.get("gemma4"):
        from mlx_vlm.speculative.drafters.gemma4_dflash import Model, ModelConfig
    else:
        from mlx_vlm.speculative.drafters.qwen3_dflash import Model, ModelConfig
    model, _ = load(req["model"])
    lm = getattr(model, "language_model", model)
    inner = lm.model

    draft = load_drafter(Model, ModelConfig, req["drafter"])
    cache = draft.reset(model)
    ids = list(draft.config.target_layer_ids)
    sink = {}
    for i in ids:
        inner.layers[i] = Tap(inner.layers[i], sink, i)

    def target(tokens):
        """The tapped hidden states `[1, L, H * len(ids)]` and the greedy
        token after every position."""
        logits = lm(mx.array(tokens)[None])
        tapped = mx.concatenate([sink[i] for i in ids], axis=-1)
        return tapped, [int(t) for t in mx.argmax(logits, axis=-1)[0].tolist()]

    history = list(req["prompt"])
    hidden, greedy = target(history)
    bonus = greedy[-1]
    history.append(bonus)
    mask_id = int(draft.config.mask_token_id)
    rounds = []
    for forced in req["accept"]:
        block = mx.array([[bonus] + [mask_id] * k], dtype=mx.int32)
        logits = draft(block, hidden, cache)[:, 1:, :].astype(mx.float32)
        d = [int(t) for t in mx.argmax(logits, axis=-1)[0].tolist()]
        start = len(history) - 1
        verify, greedy = target(history + d)
        a = min(forced, k)
        committed = d[:a] + [greedy[start + a]]
        bonus = committed[-1]
        # The newest token and the accepted drafts are the next context.
        hidden = verify[:, start : start + a + 1, :]
        history += committed
        rounds.append(
            {"drafts": d, "committed": committed, "logits": logits[0].tolist()}
        )
    print(json.dumps({"rounds": rounds}))


if __name__ == "__main__":
    main()
