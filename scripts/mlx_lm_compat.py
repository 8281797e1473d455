"""What mlx-lm 0.32.2 needs to run on mlx 0.32.2, applied on import.

mlx-lm's quantized experts (QuantizedSwitchLinear) always pass
`global_scale`, which mlx 0.32.2's gather_qmm does not take; affine
quantization never sets it, so it is dropped when it is None. Imported by
every script that runs mlx-lm (the oracle, the raw-loop peer, the server
peer)."""

import mlx.core as mx

_gather_qmm = mx.gather_qmm


def _gather_qmm_affine(*args, global_scale=None, **kwargs):
    if global_scale is not None:
        raise SystemExit("quantized experts with a global scale are not supported")
    return _gather_qmm(*args, **kwargs)


mx.gather_qmm = _gather_qmm_affine
