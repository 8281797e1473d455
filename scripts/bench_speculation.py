#!/usr/bin/env python3
"""Prompt lookup against the batched engine and the default policy, over
HTTP on the default model: gateways on config.yaml (`default`: its policy
as shipped; `batched`: every request to the batched engine; `lookup`:
every request to prompt lookup, allowed 16 at once and never handing
over; `fastpath` with `--servers`: every request to the fast path, the
batched engine where it cannot serve one), the `bench` sweep against each per
prompt set and temperature, servers in a rotating order and the whole
grid `--reps` times, so a noisy neighbour hits each alike. Prints one
markdown table: per prompt set, temperature and concurrency, the batched
engine's output tok/s (all output tokens over the wall time, prefill
included; median of the reps) and each other server's median ratio to
it, measured in the same rep, then the same for decode tok/s (1000 / TPOT
p50: the rate after the first token). Unseeded, each server writes its
own texts, so at temperature > 0 a cell also measures how long its
answers ran; `--seeded` gives request i seed i, the same requests to
every server.

    .mlx/venv/bin/python scripts/bench_speculation.py [--bin-dir target/release --reps 2 \\
        --levels 1,4,16 --temperatures 0,0.7 --prompts bench/prompts/quoting.jsonl,mixed --output-len 96]

`--paired SEEDS` measures one request at a time instead: each prompt of
each set with seeds 0..SEEDS-1 at each temperature, the same request to
every server in a rotating order, so each server decodes the same text
(counted: requests whose texts differ between servers, 0 when every
engine samples alike) and load hits them alike; prints each server's
tokens over its summed request time, as a ratio to batched.
With it, `--compare DIR` adds a server, `lookup@DIR`: the lookup gateway of
another build (its `gateway` and plugins), for a build-against-build
ratio of the same requests.

`--bin-dir` holds `gateway`, its engine plugins and `bench` (cargo build
--release -p gateway -p engine-batched -p engine-fastpath -p engine-dflash -p bench).
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
# Every server this script knows; `--servers` picks them (batched always).
SERVERS = ["batched", "lookup", "fastpath", "default"]


def args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", type=Path, default=ROOT / "target" / "release")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--levels", default="1,4,16")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--prompts", default=str(ROOT / "bench/prompts/quoting.jsonl") + ",mixed")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--seeded", action="store_true",
                   help="the sweep's request i carries seed i, so every server samples the same requests "
                        "(engines that draw alike write the same texts, and a cell's ratio is not the "
                        "answers' lengths)")
    p.add_argument("--out", type=Path, default=ROOT / "target" / "bench-speculation")
    p.add_argument("--paired", type=int, default=0, metavar="SEEDS")
    p.add_argument("--compare", type=Path, metavar="DIR")
    p.add_argument("--servers", default="batched,lookup,default",
                   help=f"comma-separated subset of {','.join(SERVERS)}; `fastpath` sends every request to the "
                        "fast path (the batched engine where it cannot serve one)")
    return p.parse_args()


def config(server):
    """config.yaml with its model path made absolute and, but for the
    default server, one engine taking every request."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["model"]["path"] = str(ROOT / cfg["model"]["path"])
    if server == "batched":
        cfg["policy"] = {"default": "batched"}
    elif server == "fastpath":
        cfg["policy"] = {"default": "fastpath", "fallback": ["batched"]}
    elif server == "lookup":
        cfg["engines"]["lookup"].update({"max_concurrent": 16, "hand_over": False})
        cfg["policy"] = {"default": "lookup", "fallback": ["batched"]}
    return cfg


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(a, server, work):
    port = free_port()
    server, _, bin_dir = server.partition("@")
    cfg = config(server)
    cfg["server"]["port"] = port
    name = server + ("-compared" if bin_dir else "")
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(work / f"{name}.log", "w")
    gateway = Path(bin_dir or a.bin_dir) / "gateway"
    proc = subprocess.Popen([str(gateway), "serve", "--config", str(path)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(1)
    sys.exit(f"{server} did not come up: see {work / (server + '.log')}")


def run(a, url, label, prompts, temperature, level, out):
    cmd = [str(a.bin_dir / "bench"), "run", "--url", url, "--label", label, "--out", str(out),
           "--concurrency", str(level), "--prompts", prompts, "--no-tools", "--rounds", "1",
           "--min-requests", "4", "--output-len", str(a.output_len), "--temperature", str(temperature),
           "--warmup", "1"] + (["--request-seeds", "0"] if a.seeded else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    level = json.loads(out.read_text())["levels"][0]
    return (level["output_tok_s"], 1000.0 / level["tpot_ms"]["p50"]), level.get("engines", {})


def chat(url, model, prompt, seed, temperature, output_len):
    """One chat request; its time and the answer's tokens and text."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "temperature": temperature, "seed": seed, "max_tokens": output_len}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as r:
        answer = json.loads(r.read())
    return time.perf_counter() - start, answer["usage"]["completion_tokens"], answer["choices"][0]["message"]["content"]


def prompt_texts(prompts):
    """A prompt set's texts: a JSONL file's `prompt` fields, or `bench`'s bundled set by name."""
    if Path(prompts).is_file():
        return [json.loads(line)["prompt"] for line in Path(prompts).read_text().splitlines() if line.strip()]
    sys.exit("--paired takes prompt files (JSONL with a `prompt` field each)")


def paired(a, servers, sets):
    """`--paired`: the same seeded requests to every server in turn (see the
    header); `sets`: each prompt file's texts."""
    names = list(servers)
    with urllib.request.urlopen(servers[names[0]][1] + "/v1/models") as r:
        model = json.loads(r.read())["data"][0]["id"]
    for prompts, texts in sets.items():
        for t in (float(t) for t in a.temperatures.split(",")):
            for n in names:  # warm-up
                chat(servers[n][1], model, texts[0], 10**6, t, a.output_len)
            total = {n: [0.0, 0] for n in names}
            differ = turn = 0
            for seed in range(a.paired):
                for text in texts:
                    order = names[turn % len(names):] + names[:turn % len(names)]
                    turn += 1
                    answers = set()
                    for n in order:
                        took, tokens, answer = chat(servers[n][1], model, text, seed, t, a.output_len)
                        total[n][0] += took
                        total[n][1] += tokens
                        answers.add(answer)
                    differ += len(answers) > 1
            rate = {n: total[n][1] / total[n][0] for n in names}
            ratios = ", ".join(f"{n} {rate[n] / rate['batched']:.3f}x" for n in names if n != "batched")
            print(f"{Path(prompts).stem} t={t}: batched {rate['batched']:.1f} tok/s; {ratios}; "
                  f"{differ} of {turn} requests' texts differ between servers", flush=True)


def main():
    a = args()
    a.out.mkdir(parents=True, exist_ok=True)
    # Read before any server starts, so a set --paired cannot take fails first.
    sets = {p: prompt_texts(p) for p in a.prompts.split(",")} if a.paired else {}
    work = Path(tempfile.mkdtemp(prefix="bench-speculation-"))
    chosen = [s for s in SERVERS if s == "batched" or s in a.servers.split(",")]
    names = chosen + ([f"lookup@{a.compare}"] if a.paired and a.compare else [])
    servers = {s: start(a, s, work) for s in names}
    rates = {}  # (prompts, temperature, level, server) -> [tok/s per rep]
    try:
        if a.paired:
            return paired(a, servers, sets)
        cells = [(p, float(t), int(c)) for p in a.prompts.split(",") for t in a.temperatures.split(",")
                 for c in a.levels.split(",")]
        for rep in range(a.reps):
            for i, (prompts, t, c) in enumerate(cells):
                k = (rep + i) % len(chosen)
                for server in chosen[k:] + chosen[:k]:
                    name = Path(prompts).stem
                    out = a.out / f"{name}-t{t}-c{c}-{server}-{rep}.json"
                    rate, engines = run(a, servers[server][1], server, prompts, t, c, out)
                    rates.setdefault((name, t, c, server), []).append(rate)
                    print(f"rep {rep} {name} t={t} c={c} {server}: {rate[0]:.1f} tok/s, decode {rate[1]:.1f} {engines}",
                          flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
    others = [s for s in chosen if s != "batched"]
    for metric, title in [(0, "output tok/s"), (1, "decode tok/s")]:
        print(f"\n| prompts | temperature | c | batched {title} | "
              + " | ".join(f"{s} / batched" for s in others) + " |")
        print("|---|---|---|---|" + "---|" * len(others))
        for (name, t, c, server), got in sorted(rates.items()):
            if server != "batched":
                continue
            base = [g[metric] for g in got]
            ratio = lambda s: statistics.median(x[metric] / y for x, y in zip(rates[(name, t, c, s)], base))
            print(f"| {name} | {t} | {c} | {statistics.median(base):.1f} | "
                  + " | ".join(f"{ratio(s):.2f}x" for s in others) + " |")


if __name__ == "__main__":
    main()
