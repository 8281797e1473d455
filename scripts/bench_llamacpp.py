#!/usr/bin/env python3
"""Peer benchmark on the CPU: our gateway against llama.cpp's `llama-server`
serving the same GGUF, driven by the project's bench client (`bench run`)
at each concurrency level, plus the time to first token of a ~1,000-token
prompt; writes the table to docs/benchmarks.md (replaced in place on a
re-run). A benchmark, not a test.

    .mlx/venv/bin/python scripts/bench_llamacpp.py                       # the default model
    .mlx/venv/bin/python scripts/bench_llamacpp.py --gguf PATH --name gemma3-270m

llama-server is built once (cached under target/llamacpp/) from the
llama.cpp tree vendored in the PyPI sdist of llama-cpp-python (pinned
below), with AVX2/FMA/F16C and no native tuning (the native build with
AVX-512/AMX crashed on the 2-core test machine); CMake and Ninja come from
PyPI into a venv there. It runs as `llama-server -m GGUF -t THREADS -c 32768
-np 16`; ours as `gateway serve` with config.yaml's model path replaced.
Both servers are up at once and levels alternate between them, so a noisy
neighbour hits both alike.
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
from types import SimpleNamespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import yaml  # noqa: E402  (mlx-lm's dependency: run with .mlx/venv/bin/python)
from bench_serving import ROOT, Server, binaries, free_port, machine, run, write_docs  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
CACHE = ROOT / "target" / "llamacpp"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DLLAMA_CURL=OFF"]
DEFAULT_GGUF = ROOT / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the model both servers serve")
    p.add_argument("--name", default="smollm2-135m", help="names the docs section and result folder")
    p.add_argument("--bin-dir", type=Path, help="prebuilt gateway, plugins and bench (default: cargo build --release)")
    p.add_argument("--config", type=Path, default=ROOT / "config.yaml", help="our configuration (model path replaced)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t")
    p.add_argument("--levels", default="1,4,16")
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64, help="random prompt length in words")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-words", type=int, default=700,
                   help="words of the long prompt (the default model's tokenizer makes ~740 tokens of 700)")
    p.add_argument("--ttft-requests", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1, help="sweeps, alternating the servers' order")
    p.add_argument("--out", type=Path, help="result folder (default: target/bench-llamacpp/NAME)")
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p.parse_args()


def llama_server():
    """The cached llama-server binary, built on first use."""
    binary = CACHE / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    venv = CACHE / "venv"
    if not (venv / "bin" / "cmake").exists():
        run([sys.executable, "-m", "venv", venv])
        run([venv / "bin" / "pip", "install", "-q", "cmake", "ninja", "scikit-build-core"])
    sdist = CACHE / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        # The sdist only (no wheel); its own build backend prepares the metadata.
        run([venv / "bin" / "pip", "download", "-q", "--no-deps", "--no-build-isolation",
             "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", sdist.parent])
    src = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not src.exists():
        with tarfile.open(sdist) as t:
            t.extractall(CACHE, filter="data")
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
    run(["cmake", "-S", src / "vendor" / "llama.cpp", "-B", CACHE / "build", "-G", "Ninja", *CMAKE_FLAGS], env=env)
    run(["nice", "-n", "19", "cmake", "--build", CACHE / "build", "--target", "llama-server",
         "-j", str(os.cpu_count())], env=env)
    return binary


def start_ours(args, gateway, out):
    config = yaml.safe_load(args.config.read_text())
    config["model"]["path"] = str(args.gguf.resolve())
    config["model"].pop("name", None)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "warn")
    server = Server("ours", [gateway, "serve", "--config", path, "--port", "0"], env, out / "ours.log")
    return server, server.wait_gateway(args.start_timeout)


def start_llama(args, binary, out):
    port = free_port()
    server = Server("llama-server", [binary, "-m", args.gguf, "-t", args.threads, "-c", 32768, "-np", 16,
                                     "--host", "127.0.0.1", "--port", port], dict(os.environ),
                    out / "llama-server.log")
    return server, server.wait_http(f"http://127.0.0.1:{port}", args.start_timeout)


def bench_run(bench, url, name, part, c, requests, input_len, output_len, first_prompt, warm):
    cmd = [bench, "run", "--url", url, "--label", name, "--out", part, "--concurrency", c,
           "--requests", requests, "--input-len", input_len, "--output-len", output_len, "--ignore-eos",
           "--first-prompt", first_prompt, "--warmup", "1,4" if warm else "0"]
    run(cmd)
    return json.loads(Path(part).read_text())["levels"][0]


def best(a, b, key):
    """Of two runs of a level, the one better by `key` (higher is better)."""
    if a is None:
        return b
    return a if key(a) >= key(b) else b


def main():
    args = parse_args()
    out = args.out or ROOT / "target" / "bench-llamacpp" / args.name
    out.mkdir(parents=True, exist_ok=True)
    binary = llama_server()
    gateway, bench = binaries(args)
    levels = [int(c) for c in args.levels.split(",")]
    requests = {c: max(args.min_requests, args.rounds * c) for c in levels}
    firsts = {c: sum(requests[d] for d in levels[:i]) for i, c in enumerate(levels)}
    names = ["llama-server", "ours"]
    results = {n: {} for n in names}
    ttft = {n: None for n in names}
    loads = []
    servers = []
    try:
        s, url = start_llama(args, binary, out)
        servers.append(s)
        urls = {"llama-server": url}
        s, url = start_ours(args, gateway, out)
        servers.append(s)
        urls["ours"] = url
        for rep in range(args.repeats):
            for i, c in enumerate(levels):
                order = names if (rep + i) % 2 == 0 else names[::-1]
                for name in order:
                    loads.append(os.getloadavg()[0])
                    got = bench_run(bench, urls[name], name, out / f"{name}-c{c}-r{rep}.json", c, requests[c],
                                    args.input_len, args.output_len, firsts[c], rep == 0 and i == 0)
                    prev = results[name].get(c)
                    results[name][c] = best(prev, got, lambda l: l["output_tok_s"])
            for name in (names if rep % 2 == 0 else names[::-1]):
                loads.append(os.getloadavg()[0])
                got = bench_run(bench, urls[name], name, out / f"{name}-ttft-r{rep}.json", 1, args.ttft_requests,
                                args.ttft_words, 8, 10_000, False)
                ttft[name] = best(ttft[name], got, lambda l: -l["ttft_ms"]["p50"])
    finally:
        for s in servers:
            s.stop()
    text = section(args, levels, results, ttft, loads)
    (out / "table.md").write_text(text)
    print(text)
    if not args.no_docs:
        # bench_serving's writer: the section sits between its markers.
        write_docs(SimpleNamespace(section=f"llamacpp-{args.name}", docs=args.docs), text)


def section(args, levels, results, ttft, loads):
    decode = lambda l: 1000.0 / l["tpot_ms"]["p50"]
    rows = ["| c | llama-server output tok/s (TPOT p50) | ours output tok/s (TPOT p50) | ours / llama-server |",
            "|---|---|---|---|"]
    for c in levels:
        a, b = results["llama-server"][c], results["ours"][c]
        rows.append(f"| {c} | {a['output_tok_s']:.1f} ({a['tpot_ms']['p50']:.1f} ms) | "
                    f"{b['output_tok_s']:.1f} ({b['tpot_ms']['p50']:.1f} ms) | "
                    f"{b['output_tok_s'] / a['output_tok_s']:.2f}x |")
    lo, hi = min(levels), max(levels)
    t_llama, t_ours = ttft["llama-server"], ttft["ours"]
    prompt = t_ours["prompt_tokens"] / max(1, t_ours["completed"])
    ratio = lambda n, c: results["ours"][c][n] / results["llama-server"][c][n]
    goals = [
        f"* c={lo} decode (1000 / TPOT p50), ours / llama-server: "
        f"{decode(results['ours'][lo]) / decode(results['llama-server'][lo]):.2f}x "
        f"(output tok/s {ratio('output_tok_s', lo):.2f}x)",
        f"* c={hi} aggregate output tok/s, ours / llama-server: {ratio('output_tok_s', hi):.2f}x",
        f"* TTFT p50 of a {prompt:.0f}-token prompt: llama-server {t_llama['ttft_ms']['p50']:.0f} ms, "
        f"ours {t_ours['ttft_ms']['p50']:.0f} ms",
    ]
    command = " ".join(["scripts/bench_llamacpp.py"] + [a for a in sys.argv[1:]])
    return (f"### {args.name}: ours vs llama-server (`{args.gguf.name}`)\n\n"
            f"    .mlx/venv/bin/python {command}\n\n"
            f"{machine()}; llama-server from llama-cpp-python {LLAMA_CPP_PYTHON}'s vendored llama.cpp "
            f"(`{' '.join(CMAKE_FLAGS[1:])}`), run as `-t {args.threads} -c 32768 -np 16`. "
            f"{args.input_len}-word random prompts, {args.output_len} tokens (ignore_eos), "
            f"best of {args.repeats} sweep(s) per cell; 1-minute load average "
            f"{min(loads):.1f}-{max(loads):.1f} while it ran.\n\n"
            + "\n".join(rows) + "\n\n" + "\n".join(goals) + "\n")


if __name__ == "__main__":
    main()
