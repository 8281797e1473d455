"""Loads an mlx-vlm drafter from a generated checkpoint directory the way
its own loader would (config.json, then the sanitized safetensors), without
mlx-vlm's full model loader and the dependencies it pulls in. Shared by the
drafter oracle scripts."""

import json
from pathlib import Path

import mlx.core as mx


def load_drafter(model_cls, config_cls, drafter_dir):
    drafter_dir = Path(drafter_dir)
    draft = model_cls(config_cls.from_dict(json.loads((drafter_dir / "config.json").read_text())))
    weights = {}
    for file in sorted(drafter_dir.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    draft.load_weights(list(draft.sanitize(weights).items()))
    mx.eval(draft.parameters())
    return draft
