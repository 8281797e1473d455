"""ggml's own reading of quantized blocks, for the GGUF block tests.

Reads a JSON request on stdin: {"type": "Q4_K", "data": FILE, "rows": R,
"out": FILE} and writes to "out" the R rows of blocks in "data" (raw ggml
blocks, a row after another) dequantized to little-endian float32 by
llama.cpp's Python package (`gguf.quants.dequantize`, numpy, written from
ggml-quants.c). Prints {"values": R * columns}.
"""

import json
import sys

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize


def main():
    req = json.load(sys.stdin)
    raw = np.fromfile(req["data"], dtype=np.uint8).reshape(req["rows"], -1)
    values = dequantize(raw, GGMLQuantizationType[req["type"]]).astype("<f4")
    values.tofile(req["out"])
    json.dump({"values": int(values.size)}, sys.stdout)


if __name__ == "__main__":
    main()
