#!/usr/bin/env python3
"""Time to first token along a growing greedy chat, with the shared prefix
cache and without it, side by side in one run: the same gateway binary and
config (default: config.yaml, whose policy sends a lone greedy chat to the
fast path), once with `model.prefix_cache_entries: 0` (every turn prefills
its whole history, as before the cache reached the fast path) and once as
configured. Each chat has `--turns` user messages; every answer goes back
into the history. `--chats` different chats per server; the table shows
the median TTFT per turn and the cached prompt tokens the server reported.

    cargo build -p gateway -p engine-batched -p engine-fastpath
    .mlx/venv/bin/python scripts/bench_chat_turns.py --bin-dir target/debug
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", type=Path, default=ROOT / "target/release", help="gateway and its plugins")
    p.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--chats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, entries, workdir):
    config = yaml.safe_load(args.config.read_text())
    model = Path(config["model"]["path"])
    if not model.is_absolute():
        config["model"]["path"] = str((args.config.parent / model).resolve())
    config["model"]["prefix_cache_entries"] = entries
    path = Path(workdir) / f"config-{entries}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(Path(workdir) / f"gateway-{entries}.log", "w")
    proc = subprocess.Popen([str(args.bin_dir / "gateway"), "serve", "--config", str(path), "--port", str(port)],
                            stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, base, config["model"].get("name") or model.stem
        except OSError:
            time.sleep(0.2)
    proc.kill()
    sys.exit(f"the gateway did not start; see {log.name}")


def turn(base, model, messages, max_tokens):
    """Streams one turn: (answer, seconds to the first content, cached tokens, engine)."""
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    started = time.perf_counter()
    ttft, answer, cached = None, "", None
    with urllib.request.urlopen(req, timeout=600) as r:
        engine = r.headers.get("x-engine")
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content")
                if text and ttft is None:
                    ttft = time.perf_counter() - started
                answer += text or ""
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                prompt = chunk["usage"]["prompt_tokens"]
    return answer, ttft if ttft is not None else time.perf_counter() - started, cached, prompt, engine


TOPICS = ["the sea", "mountains", "bread", "trains", "music", "gardens", "winter", "bees", "libraries", "rivers"]


def run_chats(args, base, model):
    """Per turn: TTFTs over the chats, and the last chat's cached and prompt tokens."""
    ttfts = [[] for _ in range(args.turns)]
    tokens = [None] * args.turns
    for c in range(args.chats):
        messages = [{"role": "system", "content": f"You are a helpful assistant. Conversation {c}."}]
        for t in range(args.turns):
            topic = TOPICS[(c * 3 + t) % len(TOPICS)]
            messages.append({"role": "user", "content": f"Tell me one more short fact about {topic}."})
            answer, ttft, cached, prompt, engine = turn(base, model, messages, args.max_tokens)
            messages.append({"role": "assistant", "content": answer})
            ttfts[t].append(ttft)
            tokens[t] = (cached, prompt, engine)
    return ttfts, tokens


def main():
    args = parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for label, entries in [("no prefix cache", 0), ("prefix cache", None)]:
            if entries is None:
                entries = yaml.safe_load(args.config.read_text())["model"].get("prefix_cache_entries", 16)
            proc, base, model = start(args, entries, workdir)
            try:
                turn(base, model, [{"role": "user", "content": "warm up"}], 4)
                results[label] = run_chats(args, base, model)
            finally:
                proc.terminate()
                proc.wait()
    print(f"median TTFT (ms) over {args.chats} chats per turn; cached/prompt tokens of the last chat")
    print(f"{'turn':>4} | {'no prefix cache':>22} | {'prefix cache':>22} | speedup")
    for t in range(args.turns):
        cells = []
        for label in ["no prefix cache", "prefix cache"]:
            ttfts, tokens = results[label]
            cached, prompt, engine = tokens[t]
            cells.append((statistics.median(ttfts[t]) * 1e3, cached, prompt, engine))
        (a, ca, pa, ea), (b, cb, pb, eb) = cells
        print(f"{t + 1:>4} | {a:8.1f} ({ca:>4}/{pa:<4} {ea}) | {b:8.1f} ({cb:>4}/{pb:<4} {eb}) | {a / b:5.2f}x")


if __name__ == "__main__":
    main()
