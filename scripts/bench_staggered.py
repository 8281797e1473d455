"""Staggered arrivals of long prompts against builds of our gateway,
alternated: for each pair, each build serves the same config in turn and
CLIENTS clients send streamed completions, client k starting k*GAP seconds
in and sending PER_CLIENT requests back to back (prompts of ~WORDS common
words, about one token each; 64 tokens out, ignore_eos; every prompt
different, so no prefix-cache hit). Reports TTFT and TPOT (per token
after the first) p50/p99 over all requests, output tok/s over the run's
span and the 1-minute load average around it, one JSON line per run (also
appended to --out).

    .mlx/venv/bin/python scripts/bench_staggered.py \\
        --build main=<main's target/release> --build branch=target/release \\
        --config bench-batched.yaml --pairs 3 --out docs/bench/staggered/cpu.jsonl

The config should name the model and route every request to the engine
under test (e.g. config.yaml with `engines: {batched: {kind: batched}}`
and `policy: {default: batched}`). A build may name its own config
(`--build NAME=DIR:CONFIG`), to alternate settings of one build."""
import argparse, http.client, json, os, random, signal, subprocess, threading, time
from pathlib import Path
from urllib.parse import urlparse

WORDS = """the of and to in is was for on that with as by at from his he it an were are which this be or
has had first one their its new after who they have her she two been other when there all during into school
time may years more most only over city some world would where later up such used many can state about national
out known university united then made under also while people team through part well between three since
against both game life same day each four year work long high film group family music home water house""".split()


def prompts(n, words, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def one(url, model, prompt, max_tokens):
    """One streamed completion: (start, ttft, end, output tokens, prompt tokens)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}})
    t0 = time.time()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, tokens, prompt_tokens = None, 0, 0
    for line in r:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        d = json.loads(line[5:])
        if d.get("choices") and d["choices"][0].get("text") and ttft is None:
            ttft = time.time() - t0
        if d.get("usage"):
            tokens, prompt_tokens = d["usage"]["completion_tokens"], d["usage"]["prompt_tokens"]
    end = time.time()
    conn.close()
    return t0, ttft, end, tokens, prompt_tokens


def staggered(url, model, args):
    texts = prompts(args.clients * args.per_client, args.words, args.seed)
    records, lock = [], threading.Lock()

    def client(k):
        time.sleep(k * args.gap)
        for i in range(args.per_client):
            rec = one(url, model, texts[k * args.per_client + i], args.output_len)
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ttfts = sorted(r[1] * 1000 for r in records)
    # Time per output token after the first: what decoding rows pay for
    # the prompts prefilled beside them.
    tpots = sorted((r[2] - r[0] - r[1]) * 1000 / (r[3] - 1) for r in records if r[3] > 1)
    pct = lambda xs, p: xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]
    span = max(r[2] for r in records) - min(r[0] for r in records)
    return {"requests": len(records), "ttft_p50_ms": round(pct(ttfts, 50)), "ttft_p99_ms": round(pct(ttfts, 99)),
            "tpot_p50_ms": round(pct(tpots, 50), 1), "tpot_p99_ms": round(pct(tpots, 99), 1),
            "output_tok_s": round(sum(r[3] for r in records) / span, 2), "span_s": round(span, 1),
            "prompt_tokens_mean": round(sum(r[4] for r in records) / len(records))}


def load():
    return float(Path("/proc/loadavg").read_text().split()[0])


def serve(gateway, config, log):
    """Starts `gateway serve`; returns the process and its URL."""
    proc = subprocess.Popen([gateway, "serve", "--config", config, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True, start_new_session=True,
                            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
    for line in proc.stdout:
        if line.startswith("gateway listening on "):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.split()[-1].strip()
    raise SystemExit(f"{gateway} did not come up; see {log}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", action="append", required=True,
                   help="NAME=DIR holding gateway and its plugins[:CONFIG, else --config]")
    p.add_argument("--config", help="the config of builds that name none")
    p.add_argument("--model", default=None, help="the `model` field (default: the first of /v1/models)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-client", type=int, default=1)
    p.add_argument("--gap", type=float, default=1.5, help="seconds between clients' starts")
    p.add_argument("--words", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=None, help="append each run's JSON line here")
    args = p.parse_args()
    builds = []
    for b in args.build:
        name, rest = b.split("=", 1)
        bin_dir, _, config = rest.partition(":")
        builds.append((name, bin_dir, config or args.config))
    for pair in range(1, args.pairs + 1):
        for name, bin_dir, config in builds:
            proc, url = serve(str(Path(bin_dir) / "gateway"), config, f"/tmp/bench_staggered-{name}.log")
            try:
                u = urlparse(url)
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
                conn.request("GET", "/v1/models")
                model = args.model or json.loads(conn.getresponse().read())["data"][0]["id"]
                one(url, model, prompts(1, args.words, 99)[0], 8)  # warm-up
                before = load()
                result = staggered(url, model, args)
                result = {"build": name, "config": Path(config).name, "pair": pair, "load_before": before, "load_after": load(), **result}
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
            line = json.dumps(result)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
