"""ggml's own reading of quantized blocks, for the GGUF block tests.

Reads a JSON request on stdin: {"tensors": [{"type": "Q4_K", "data": FILE,
"rows": R, "out": FILE}, ...]} and writes to each "out" the R rows of
blocks in its "data" (raw ggml blocks, a row after another) dequantized to
little-endian float32 by llama.cpp's Python package
(`gguf.quants.dequantize`, numpy, written from ggml-quants.c). Prints
{"values": [count per tensor]}.
"""

import json
import sys

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize


def main():
    counts = []
    for t in json.load(sys.stdin)["tensors"]:
        raw = np.fromfile(t["data"], dtype=np.uint8).reshape(t["rows"], -1)
        values = dequantize(raw, GGMLQuantizationType[t["type"]]).astype("<f4")
        values.tofile(t["out"])
        counts.append(int(values.size))
    json.dump({"values": counts}, sys.stdout)


if __name__ == "__main__":
    main()
