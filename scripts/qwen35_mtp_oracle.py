"""Reference drafts of a Qwen 3.5 checkpoint's own MTP head, for the oracle
test of the mtp engine's `draft: checkpoint`.

mlx-vlm's Qwen3_5MTPDraftModel (its `mtp.*` weights through its own
sanitize) bound to mlx-lm's target, driven through the calls mlx-vlm's
speculative loop makes: prefill_from_target_hidden after the prompt,
draft_block each round, accept_verified_tokens after the verify, fed the
target's final normed hidden states.

Reads {"model": DIR, "prompt": [ids], "draft_tokens": K, "accept": [A per
round]} on stdin. Each round drafts K tokens and then accepts the first
min(A, K) of them whatever the target says (so rounds with accepted drafts
happen on random weights too), followed by the target's greedy token after
them. The target runs over the whole sequence each round (mlx-lm's hybrid
cache cannot be rolled back). Prints {"rounds": [{"drafts": [...],
"committed": [...]}], "prompt_logits": [[V floats] per prompt position]}:
the rounds, and first the head's float32 logits over the prompt (what
prefill_from_target_hidden computes, every position rather than the last).
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig, Qwen3_5MTPDraftModel


def greedy(logits):
    return mx.argmax(logits, axis=-1)


def main():
    req = json.load(sys.stdin)
    path = Path(req["model"])
    k = req["draft_tokens"]
    model, _ = load(str(path))
    lm = model.language_model

    text_config = json.loads((path / "config.json").read_text())["text_config"]
    draft = Qwen3_5MTPDraftModel(
        ModelConfig.from_dict({"text_config": text_config, "block_size": k + 1})
    )
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(
            {n: w for n, w in mx.load(str(file)).items() if n.startswith("mtp.")}
        )
    draft.load_weights(list(draft.sanitize(weights).items()))
    mx.eval(draft.parameters())
    draft.reset(model)

    def hidden(tokens):
        return lm.model(mx.array(tokens)[None])

    def target_token(h):
        return int(greedy(lm.lm_head(h)).reshape(-1).item())

    history = list(req["prompt"])
    h = hidden(history)
    bonus = target_token(h[:, -1:, :])
    shifted = mx.array([history[1:] + [bonus]])
    prompt_logits = lm.lm_head(draft._forward_tokens(shifted, h, mx.int32))
    prompt_logits = prompt_logits.astype(mx.float32)[0].tolist()
    draft.reset(model)
    draft.prefill_from_target_hidden(
        mx.array([history]), h, bonus, greedy, mx.int32, greedy=True
    )
    history.append(bonus)
    last_hidden = h[:, -1:, :]
    rounds = []
    for forced in req["accept"]:
        drafts = draft.draft_block(
            bonus, last_hidden, None, k + 1, greedy, mx.int32, greedy=True
        )
        d = [int(t) for t in drafts.reshape(-1).tolist()]
        # Hidden states of the newest token and the drafts.
        verify = hidden(history + d)[:, len(history) - 1 :, :]
        a = min(forced, k)
        bonus = target_token(verify[:, a : a + 1, :])
        committed = d[:a] + [bonus]
        draft.accept_verified_tokens(
            verify, drafts, a, committed, greedy, mx.int32, greedy=True
        )
        history += committed
        last_hidden = verify[:, a : a + 1, :]
        rounds.append({"drafts": d, "committed": committed})
    print(json.dumps({"rounds": rounds, "prompt_logits": prompt_logits}))


if __name__ == "__main__":
    main()
