#!/usr/bin/env python3
"""Where single requests stall (issue 18): per-token gaps over HTTP.

    python3 scripts/device/probe_stalls.py URL [REQUESTS]

Sends REQUESTS (default 16) streamed greedy completions one after another
(random-word prompts of 40-70 words, 128 tokens, `ignore_eos`) and prints,
per request, the time to the first token, the end-to-end time and every
gap between streamed tokens above 20 ms with the token index it came
before.
"""

import http.client
import json
import random
import sys
import time
import urllib.parse


def model_name(url):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def one(url, model, prompt):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 128, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    times = []
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                times.append(time.perf_counter())
    conn.close()
    return t0, times


def main(url, n):
    rng = random.Random(7)
    words = "alpha beta gamma delta river stone cloud paper garden window light table music yellow north".split()
    model = model_name(url)
    for i in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(40, 70)))
        t0, times = one(url, model, prompt)
        gaps = [(j, (b - a) * 1e3) for j, (a, b) in enumerate(zip(times, times[1:]), start=1)]
        slow = ", ".join(f"#{j}: {g:.0f} ms" for j, g in gaps if g > 20)
        print(f"request {i}: ttft {(times[0] - t0) * 1e3:.1f} ms, e2e {(times[-1] - t0) * 1e3:.0f} ms, "
              f"{len(times)} chunks; gaps > 20 ms: {slow or 'none'}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16)
