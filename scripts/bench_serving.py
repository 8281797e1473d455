#!/usr/bin/env python3
"""Serving benchmark, side by side: our gateway (default policy, batched
only, fast path only) and mlx_lm.server on the same generated model, the
same `bench run` sweep against each in turn, then one plot, the tables and
a section of docs/benchmarks.md (replaced in place on a re-run).

Run it with a Python that has mlx-lm (it starts mlx_lm.server through
`scripts/mlx_lm_server.py`, which applies `scripts/mlx_lm_compat.py`, and
reads YAML with PyYAML, an mlx-lm dependency):

    .mlx/venv/bin/python scripts/bench_serving.py                    # CPU, builds release binaries
    python3 scripts/bench_serving.py --bin-dir DIR --section gpu \\
        --preset qwen3-4b --output-len 128                              # prebuilt binaries, no cargo

`--bin-dir` holds `gateway`, its engine plugins (`libengine_*.so`),
`bench` and `fixtures` (which writes the generated model), as `cargo build
--release -p gateway -p engine-batched -p engine-fastpath -p engine-dflash
-p bench -p fixtures` leaves them in target/release (config.yaml's prompt
lookup engine is of kind `dflash`).
"""

import argparse
import datetime
import json
import os
import platform
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OPENBLAS = ["/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib64/libopenblas.so.0"]
# Every server this script knows, in plot order.
SERVERS = ["ours-default", "ours-batched", "ours-fastpath", "mlx_lm", "mlx_lm-openblas"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", type=Path, help="prebuilt gateway, plugins and bench (default: cargo build --release)")
    p.add_argument("--python", default=None, help="Python with mlx-lm for mlx_lm.server (default: .mlx/venv/bin/python, else this one)")
    p.add_argument("--model-dir", type=Path, help="serve this model directory (default: a generated one, see --preset)")
    p.add_argument("--preset", default="bench", choices=["tiny", "bench", "qwen3-4b"], help="generated Qwen3 model")
    p.add_argument("--servers", default=None, help=f"comma-separated subset of {','.join(SERVERS)} "
                   "(default: all; mlx_lm-openblas only where OpenBLAS is installed and not on --section gpu)")
    p.add_argument("--config", type=Path, default=ROOT / "config.yaml", help="our default configuration (its policy is `ours-default`)")
    p.add_argument("--kv-cache-mb", type=int, help="override the config's KV pool size")
    p.add_argument("--kv-layout", choices=["contiguous", "paged"], help="override the config's model.kv_layout")
    p.add_argument("--memory-fraction", type=float,
                   help="override the config's memory.fraction (servers up at once share the GPU: two of ours "
                        "beside mlx_lm.server fit an 80 GB card at 0.3 each)")
    p.add_argument("--levels", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64,
                   help="random prompt length in words (the generated models' tokenizers make about 2 tokens "
                        "of a word; the docs report the servers' count)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (ignore_eos: ours always generates all of them)")
    p.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (0: greedy)")
    p.add_argument("--section", default="cpu", help="names the docs section, plot and result folder (cpu, gpu...)")
    p.add_argument("--out", type=Path, help="result folder (default: target/bench-serving/SECTION)")
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md", help="markdown file to write the section into")
    p.add_argument("--no-docs", action="store_true", help="only results, plot and tables; leave the docs alone")
    p.add_argument("--sequential", action="store_true",
                   help="one server at a time, each through every level (default: all servers up at once, "
                        "levels interleaved, so a noisy neighbour hits every server alike; needs memory for all)")
    p.add_argument("--torch-peer", action="store_true",
                   help="also run scripts/bench_torch.py (a compiled PyTorch decode loop, batch = each level) "
                        "on the same model with this Python, and tabulate it beside the servers")
    p.add_argument("--torch-json", type=Path,
                   help="with --torch-peer: tabulate this earlier bench_torch.py result (same model, levels, "
                        "prompt and output lengths) instead of running the loop again")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to come up")
    return p.parse_args()


def log(msg):
    print(f"[bench_serving] {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw):
    log("$ " + " ".join(shlex.quote(str(c)) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def binaries(args):
    if args.bin_dir:
        bin_dir = args.bin_dir.resolve()
    else:
        run(["cargo", "build", "--release", "--locked", "-p", "gateway", "-p", "engine-batched",
             "-p", "engine-fastpath", "-p", "engine-dflash", "-p", "bench", "-p", "fixtures"], cwd=ROOT)
        bin_dir = ROOT / "target" / "release"
    gateway, bench = bin_dir / "gateway", bin_dir / "bench"
    for f in (gateway, bench, bin_dir / "libengine_batched.so", bin_dir / "libengine_fastpath.so"):
        if not f.exists():
            sys.exit(f"missing {f}")
    return gateway, bench


def model_dir(args, bin_dir):
    if args.model_dir:
        return args.model_dir.resolve()
    out = ROOT / "target" / "bench-models" / f"qwen3-{args.preset}"
    if not (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists():
        run([bin_dir / "fixtures", "make-tiny-model", "--family", "qwen3", "--preset", args.preset, "--out", out])
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_config(args):
    """--config with the command line's overrides, for every variant."""
    config = yaml.safe_load(args.config.read_text())
    if args.kv_cache_mb:
        config["model"]["kv_cache_mb"] = args.kv_cache_mb
    if args.kv_layout:
        config["model"]["kv_layout"] = args.kv_layout
    if args.memory_fraction:
        config.setdefault("memory", {})["fraction"] = args.memory_fraction
    return config


def our_config(args, variant, model, out):
    """config.yaml with the model, and for the single-engine variants only
    that engine and a default-only policy."""
    config = base_config(args)
    config["model"]["path"] = str(model)
    if variant != "default":
        config["engines"] = {variant: (config.get("engines") or {}).get(variant) or {"kind": variant}}
        config["policy"] = {"default": variant}
    path = out / f"config-{variant}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class Server:
    """A server process, stopped (by its own pid) on exit."""

    def __init__(self, name, cmd, env, log_path):
        self.name = name
        self.cmd = [str(c) for c in cmd]
        self.log_file = open(log_path, "w")
        log(f"starting {name}: " + " ".join(shlex.quote(c) for c in self.cmd))
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.PIPE, stderr=self.log_file,
                                     text=True, start_new_session=True)

    def wait_gateway(self, timeout):
        """Our gateway prints `gateway listening on http://ADDR` once ready."""
        found = queue.Queue()

        def drain():
            # Keeps reading to the end, so the server never blocks on stdout.
            for line in self.proc.stdout:
                self.log_file.write(line)
                if line.startswith("gateway listening on "):
                    found.put(line.split()[-1].strip())
            found.put(None)

        threading.Thread(target=drain, daemon=True).start()
        try:
            url = found.get(timeout=timeout)
        except queue.Empty:
            url = None
        if url is None:
            self.stop()
            sys.exit(f"{self.name} did not come up; see {self.log_file.name}")
        return url

    def wait_http(self, url, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} exited ({self.proc.returncode}); see {self.log_file.name}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return url
            except OSError:
                time.sleep(0.5)
        self.stop()
        sys.exit(f"{self.name} did not answer within {timeout} s; see {self.log_file.name}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


def start(name, args, gateway, python, model, out):
    env = dict(os.environ)
    if name.startswith("ours-"):
        config = our_config(args, name.removeprefix("ours-"), model, out)
        env.setdefault("RUST_LOG", "warn")
        server = Server(name, [gateway, "serve", "--config", config, "--port", "0"], env, out / f"{name}.log")
        return server, server.wait_gateway(args.start_timeout), None
    port = free_port()
    if name == "mlx_lm-openblas":
        env["LD_PRELOAD"] = openblas()
    server = Server(name, [python, str(ROOT / "scripts" / "mlx_lm_server.py"), "--model", model, "--host", "127.0.0.1",
                           "--port", port, "--log-level", "WARNING"], env, out / f"{name}.log")
    # mlx_lm.server answers for the model it was started with as
    # `default_model`; any other name makes it load that model.
    return server, server.wait_http(f"http://127.0.0.1:{port}", args.start_timeout), "default_model"


def openblas():
    return next((lib for lib in OPENBLAS if os.path.exists(lib)), None)


# The 1-minute load average as each level started: other work on the
# machine, reported next to the numbers.
LOAD = []


def requests_at(args, c):
    return max(args.min_requests, args.rounds * c)


def run_level(args, bench, name, url, model_name, c, first_prompt, warm, part):
    """One `bench run` of one level; its result file is `part`."""
    cmd = [bench, "run", "--url", url, "--label", name, "--out", part, "--concurrency", c,
           "--rounds", args.rounds, "--min-requests", args.min_requests, "--input-len", args.input_len,
           "--output-len", args.output_len, "--ignore-eos", "--first-prompt", first_prompt,
           "--warmup", "1,4" if warm else "0", "--temperature", args.temperature]
    if model_name:
        cmd += ["--model", model_name]
    run(cmd)
    return json.loads(Path(part).read_text())


def merge(parts):
    """One result from a server's per-level results, in level order."""
    merged = dict(parts[0])
    merged["levels"] = [l for p in parts for l in p["levels"]]
    return merged


def sweep(args, names, gateway, bench, python, model, out):
    """Every level against every server. Each server sees the same prompts:
    level k starts at the prompt after level k-1's last."""
    levels = [int(c) for c in args.levels.split(",")]
    firsts = [sum(requests_at(args, c) for c in levels[:i]) for i in range(len(levels))]
    parts = {n: [] for n in names}
    parts_dir = out / "parts"
    parts_dir.mkdir(exist_ok=True)

    def level(name, url, model_name, i):
        c = levels[i]
        LOAD.append(os.getloadavg()[0])
        part = parts_dir / f"{name}-c{c}.json"
        parts[name].append(run_level(args, bench, name, url, model_name, c, firsts[i], i == 0, part))
        if name.startswith("ours-"):
            # Counters so far (routes per engine and rule, faults, memory):
            # what each level did inside the gateway.
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                (parts_dir / f"{name}-c{c}.metrics.txt").write_bytes(r.read())

    running = []
    try:
        if args.sequential:
            for name in names:
                server, url, model_name = start(name, args, gateway, python, model, out)
                running = [server]
                for i in range(len(levels)):
                    level(name, url, model_name, i)
                server.stop()
                running = []
        else:
            up = {}
            for name in names:
                server, url, model_name = start(name, args, gateway, python, model, out)
                running.append(server)
                up[name] = (url, model_name)
            for i in range(len(levels)):
                # Rotate who goes first, so no server always follows the same one.
                for name in names[i % len(names):] + names[: i % len(names)]:
                    level(name, *up[name], i)
    finally:
        for server in running:
            server.stop()
    results = {}
    for name in names:
        results[name] = merge(parts[name])
        (out / f"{name}.json").write_text(json.dumps(results[name], indent=2) + "\n")
    return results


def python_for_peer(args):
    if args.python:
        return args.python
    venv = ROOT / ".mlx" / "venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def servers(args):
    if args.servers:
        names = [s.strip() for s in args.servers.split(",") if s.strip()]
        unknown = [n for n in names if n not in SERVERS]
        if unknown:
            sys.exit(f"unknown servers {unknown}; known: {SERVERS}")
        return names
    # On the CPU the peer gets the BLAS our build links; mlx_lm as pip
    # installs it (reference BLAS) is ~10x slower there and would make
    # the sweep take most of an hour: ask for it by name.
    if args.section != "gpu" and openblas():
        return SERVERS[:3] + ["mlx_lm-openblas"]
    return SERVERS[:4]


def versions(gateway, bench, python):
    def out(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "?"

    peer = out([python, "-c", "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device())"])
    return {
        "gateway": out([str(gateway), "--version"]),
        "bench": out([str(bench), "--version"]),
        "git": out(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        "mlx, mlx-lm, device": peer,
    }


def machine():
    cpu = "?"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{platform.machine()}, {os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.release()}"
    if shutil.which("nvidia-smi"):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
        text += f"; GPU: {gpu}"
    return text


def model_line(model):
    c = json.loads((model / "config.json").read_text())
    keys = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "torch_dtype"]
    return ", ".join(f"{k} {c[k]}" for k in keys if k in c)


def prompt_tokens(results):
    """Mean prompt tokens per request, as the servers reported them."""
    levels = [l for r in results.values() for l in r["levels"] if l["prompt_tokens"]]
    return sum(l["prompt_tokens"] for l in levels) / max(1, sum(l["completed"] for l in levels))


def level(result, c):
    return next((l for l in result["levels"] if l["concurrency"] == c), None)


def peers(results):
    return [n for n in ("mlx_lm", "mlx_lm-openblas") if n in results and "ours-default" in results]


def headline(results):
    """Ratios computed from the results: the issue's goals and the policy's."""
    lines = []
    ours = results.get("ours-default")
    singles = [results[n] for n in ("ours-batched", "ours-fastpath") if n in results]
    for name in peers(results):
        peer = results[name]
        levels = [l["concurrency"] for l in ours["levels"]]
        lo, hi = min(levels), max(levels)

        def ratio(metric, c, invert=False):
            a, b = level(ours, c), level(peer, c)
            x, y = (metric(a) if a else None), (metric(b) if b else None)
            if not x or not y:
                return "-"
            return f"{(y / x if invert else x / y):.2f}x"

        decode = lambda l: 1000.0 / l["tpot_ms"]["p50"] if l["tpot_ms"] else None
        tput = lambda l: l["output_tok_s"] if l["completed"] else None
        ttft = lambda l: l["ttft_ms"]["p50"] if l["ttft_ms"] else None
        lines.append(f"* c={lo} decode tok/s (1000 / TPOT p50), ours-default / {name}: {ratio(decode, lo)}")
        lines.append(f"* c={hi} aggregate output tok/s, ours-default / {name}: {ratio(tput, hi)}")
        lines.append(
            f"* TTFT p50, {name} / ours-default (above 1: ours answers first): "
            + ", ".join(f"c={c} {ratio(ttft, c, invert=True)}" for c in levels))
    if ours and singles:
        parts = []
        for l in ours["levels"]:
            best = max((level(s, l["concurrency"]) or {}).get("output_tok_s", 0) for s in singles)
            if best > 0:
                parts.append(f"c={l['concurrency']} {l['output_tok_s'] / best:.2f}x")
        lines.append("* default policy / best single engine, output tok/s: " + ", ".join(parts))
    return "\n".join(lines)


def torch_peer(args, model, results, out):
    """The compiled PyTorch loop at batch c for each level, prompts as long
    as the servers' mean, and its table beside ours (issue 18)."""
    levels = args.levels
    path = args.torch_json or out / "torch.json"
    if not args.torch_json:
        run([sys.executable, str(ROOT / "scripts" / "bench_torch.py"), "--model", str(model), "--batches", levels,
             "--prompt", str(round(prompt_tokens(results))), "--gen", str(args.output_len), "--json", str(path)])
    loop = {r["batch"]: r for r in json.loads(path.read_text())["results"]}
    ours = [n for n in ("ours-default", "ours-batched") if n in results]
    rows = ["| c | torch loop output tok/s | torch loop decode tok/s | "
            + " | ".join(f"{n} output tok/s | {n} / torch" for n in ours) + " |",
            "|" + " --- |" * (3 + 2 * len(ours))]
    for c in [int(x) for x in levels.split(",")]:
        r = loop.get(c)
        if not r:
            continue
        cells = [str(c), f"{r['output_tok_s']:.0f}", f"{r['decode_tok_s']:.0f}"]
        for n in ours:
            l = level(results[n], c)
            got = l["output_tok_s"] if l and l["completed"] else 0
            cells += [f"{got:.0f}", f"{got / r['output_tok_s']:.2f}x"]
        rows.append("| " + " | ".join(cells) + " |")
    return ("Compiled PyTorch decode loop (`scripts/bench_torch.py`: transformers, static KV cache,\n"
            "`torch.compile` with CUDA graphs, batch c, no HTTP, every row the same length; output tok/s\n"
            "counts its prefill like the servers' figures):\n\n" + "\n".join(rows) + "\n")


def write_docs(args, section_text):
    begin, end = f"<!-- bench_serving:{args.section}:begin -->", f"<!-- bench_serving:{args.section}:end -->"
    block = f"{begin}\n{section_text.rstrip()}\n{end}\n"
    text = args.docs.read_text() if args.docs.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip() + "\n\n" + block
    args.docs.write_text(text)
    log(f"wrote the {args.section} section of {args.docs}")


def warn_shared_budget(args, names):
    """Our servers up at once each take their memory.fraction of the GPU;
    past about 80% together, with a peer beside them, a burst runs out of
    device memory (an H200 did at 0.45 each beside mlx_lm.server)."""
    if args.sequential:
        return
    ours = [n for n in names if n.startswith("ours-")]
    fraction = (base_config(args).get("memory") or {}).get("fraction")
    if fraction and len(ours) * fraction > 0.8:
        log(f"warning: {len(ours)} of our servers up at once budget {len(ours) * fraction:.0%} "
            f"of the GPU (memory.fraction {fraction}); pass --memory-fraction (0.3) or --sequential")


def main():
    args = parse_args()
    t0 = time.time()
    gateway, bench = binaries(args)
    python = python_for_peer(args)
    model = model_dir(args, gateway.parent)
    out = (args.out or ROOT / "target" / "bench-serving" / args.section).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = servers(args)
    warn_shared_budget(args, names)
    results = sweep(args, names, gateway, bench, python, model, out)

    svg = out / f"serving-{args.section}.svg"
    ratios = []
    for peer in peers(results):
        ratios.append(f"ours-default/{peer}")
    singles = [n for n in ("ours-batched", "ours-fastpath") if n in results]
    if "ours-default" in results and singles:
        ratios.append("ours-default/" + "|".join(singles))
    plot = [bench, "plot", *[out / f"{n}.json" for n in names], "--out", svg,
            "--title", f"Serving sweep ({args.section}): {model.name}", "--markdown", out / "tables.md"]
    for r in ratios:
        plot += ["--ratio", r]
    tables = run(plot, capture_output=True, text=True).stdout
    if args.torch_peer:
        tables = tables.rstrip() + "\n\n" + torch_peer(args, model, results, out)
    summary = headline(results)
    print(tables)
    print(summary)
    minutes = (time.time() - t0) / 60
    log(f"done in {minutes:.1f} min; results in {out}")
    if args.no_docs:
        return

    # The plot and the result files (which `bench plot` can redraw) go
    # next to the docs.
    img_dir = args.docs.parent / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(svg, img_dir / svg.name)
    svg = img_dir / svg.name
    keep = args.docs.parent / "bench" / args.section
    keep.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copy(out / f"{n}.json", keep / f"{n}.json")
    exe = Path(sys.executable)
    # Name the interpreter as typed when it lives in the repository (.mlx/venv).
    exe = os.path.relpath(exe, ROOT) if ROOT in exe.parents else exe.name
    command = " ".join(shlex.quote(str(a)) for a in [exe, "scripts/bench_serving.py", *sys.argv[1:]])
    v = versions(gateway, bench, python)
    rel_svg = os.path.relpath(svg, args.docs.parent)
    rel_keep = os.path.relpath(keep, ROOT)
    order = ("Servers ran one at a time, each through every level." if args.sequential else
             "All servers were up at once (an idle one costs nothing) and the levels\n"
             "interleaved: each level ran against every server in turn, so other work\n"
             "on the machine hit them alike.")
    section = f"""## Serving sweep, {args.section}: ours vs mlx_lm.server

Written by `scripts/bench_serving.py` on {datetime.date.today().isoformat()} ({minutes:.0f} min).
{order}
`bench run` sends the same requests to each: at concurrency c, c clients
stream requests back to back, {args.rounds} per client (at least {args.min_requests} per level),
random-word prompts of {args.input_len} words on average (seeded, +-25%, none repeated;
{prompt_tokens(results):.0f} tokens on average as the servers counted them),
`max_tokens` {args.output_len}, {'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}, `ignore_eos` (mlx_lm.server does not know it;
throughput counts the tokens each server reported), after an unmeasured
warm-up (1 request, then 4 at once).

* servers: {", ".join(names)}. `ours-default` is {args.config.name} (with
  config.yaml's policy it routes a request alone to prompt lookup while its
  drafts are kept, else a greedy one to `fastpath`, and anything beside
  others to `batched`); `ours-batched` and `ours-fastpath` load one engine with a
  default-only policy. The fast path serves one request at a time and has no
  queue: while it is busy it refuses, and with no engine to fall back on
  the gateway answers 503 `server_overloaded`, so `ours-fastpath` fails
  most requests above c=1, by design; failures are counted, not retried
  (the client pauses 100 ms), and its throughput is what it served.
  `mlx_lm-openblas` is mlx_lm.server with Debian's OpenBLAS preloaded (the
  BLAS our CPU build links); `mlx_lm` is as pip installs it.
* model: `{model.name}` ({model_line(model)})
* machine: {machine()}; 1-minute load average as the levels started:
  {min(LOAD):.1f} to {max(LOAD):.1f} (mean {sum(LOAD) / len(LOAD):.1f}), counting this sweep's own work
* versions: {"; ".join(f"{k}: {val}" for k, val in v.items())}
* reproduce: `{command}`; results (`bench` JSON, re-plot with
  `bench plot`): `{rel_keep}/`

![serving sweep, {args.section}]({rel_svg})

{tables.rstrip()}

Ratios:

{summary}
"""
    write_docs(args, section)


if __name__ == "__main__":
    main()
