#!/usr/bin/env bash
# The first burst after start against the same burst again: a fresh
# gateway (CONFIG serving MODEL), then for each concurrency c two bursts of
# c requests at once (no warm-up requests), printing TTFT p50/p99 and output
# tok/s of each, and the batched engine's steps over 40 ms from its log.
# MLX_PTX_CACHE_DIR is set to an empty folder unless given, so MLX's
# compiled-kernel cache starts cold as on a machine's first start.
#
#   scripts/device/first_burst.sh BIN_DIR MODEL CONFIG [c ...]   (default: 16 64)
set -euo pipefail
BIN=$1 MODEL=$2 CONFIG=$3
shift 3
LEVELS=("${@:-16 64}")
OUT=${OUT_DIR:-/tmp/first-burst}
rm -rf "$OUT" && mkdir -p "$OUT"
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$OUT/ptx}
sed "0,/^  path:.*/s##  path: $MODEL#" "$CONFIG" > "$OUT/config.yaml"
PORT=${PORT:-8123}
RUST_LOG=${RUST_LOG:-info,plugin=debug} "$BIN/gateway" serve --config "$OUT/config.yaml" --port "$PORT" > "$OUT/gateway.log" 2>&1 &
GW=$!
trap 'kill $GW 2>/dev/null || true' EXIT
started=$(date +%s%N)
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  kill -0 $GW 2>/dev/null || { tail -20 "$OUT/gateway.log"; exit 1; }
  sleep 0.5
done
echo "ready after $(( ($(date +%s%N) - started) / 1000000 )) ms"
grep 'forward shapes built' "$OUT/gateway.log" | tail -1 || true
ls "$MLX_PTX_CACHE_DIR" 2>/dev/null | sort > "$OUT/ptx-ready.txt" || true
first=0
for c in ${LEVELS[@]}; do
  for pass in 1 2; do
    "$BIN/bench" run --url "http://127.0.0.1:$PORT" --concurrency "$c" --requests "$c" --warmup 0 \
      --input-len 56 --output-len 32 --ignore-eos --first-prompt $first --out "$OUT/c$c-$pass.json" > /dev/null
    first=$((first + c))
    python3 - "$OUT/c$c-$pass.json" "$c" "$pass" <<'PY'
import json, sys
level = json.load(open(sys.argv[1]))["levels"][0]
t = level["ttft_ms"]
print(f"c={sys.argv[2]} burst {sys.argv[3]}: TTFT p50 {t['p50']:.0f} ms, p99 {t['p99']:.0f} ms; "
      f"{level['output_tok_s']:.0f} tok/s; {level['errors']} failed")
PY
  done
done
echo "kernels MLX compiled after start-up ($(wc -l < "$OUT/ptx-ready.txt") before):"
ls "$MLX_PTX_CACHE_DIR" 2>/dev/null | sort | comm -13 "$OUT/ptx-ready.txt" - || true
echo "steps over 40 ms:"
grep -E 'step rows' "$OUT/gateway.log" | awk '{for(i=1;i<=NF;i++) if ($i ~ /^ms=/) {split($i,a,"="); if (a[2]+0 > 40) print}}' | head -40
