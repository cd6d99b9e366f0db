#!/usr/bin/env python3
"""Load test of `mtpx serve` (not a unit test): N concurrent clients (OpenAI Python SDK) each send M
streamed greedy requests, half chat and half completions, over a set of prompts. Checks that there are
no errors, that every stream is complete (finish_reason, then usage, then [DONE]), that every output is
exactly what `mtpx generate` gives for the same prompt, and that the server's resident memory at the end
is within 5% of its value after a warm-up round. Reports p50/p99 latency and time to first token and the
aggregate decode rate.

    python3 scripts/load_test.py --binary build/mtpx [--clients 32 --requests 20 --max-tokens 64]

With --sweep 1,2,4,8,... it runs one round per concurrency level instead (the server started with --parallel
as large as the largest level, so no request queues) and prints, per level: aggregate tok/s, its ratio to one
user's, per-user decode tok/s, time to first token and inter-token latency (p50 / p99), and the greedy
mismatches (issue 44's sweep; --server-args "--no-mtp" for plain decoding):

    python3 scripts/load_test.py --binary build/mtpx --sweep 1,2,4 --requests 4 --max-tokens 64

Exit code 0 when every check passes.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
from mtpx_server import MtpxServer, rss_bytes  # noqa: E402

import openai  # noqa: E402

PROMPTS = [
    "def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
    "def quicksort(xs):", "for i in range(10):", "# Read a CSV file and print the rows\n",
    "def is_prime(n):", "with open('data.txt') as f:", "class Node:\n    def __init__(self, value",
    "def merge(a, b):", "import numpy as np\n\n", "def parse_args():", "try:\n    import json\nexcept",
    "def binary_search(xs, target):", "@dataclass\nclass Point:", "async def fetch(url):",
]


def chat_prompt(prompt):
    """The shipped model's chat template applied to one user message (what the server renders)."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def expected_text(binary, prompt, max_tokens):
    out = subprocess.run([binary, "generate", "--prompt", prompt, "--max-tokens", str(max_tokens), "--temperature",
                          "0", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["text"]


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


class Client(threading.Thread):
    def __init__(self, index, url, requests, max_tokens, expected, results):
        super().__init__()
        self.index, self.requests, self.max_tokens = index, requests, max_tokens
        self.expected, self.results = expected, results
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def one_request(self, r):
        prompt = PROMPTS[(self.index * 7 + r) % len(PROMPTS)]
        chat = (self.index + r) % 2 == 0
        record = {"chat": chat, "prompt": prompt, "error": None}
        t0 = time.perf_counter()
        first = None
        text, finish, usage = "", None, None
        try:
            if chat:
                stream = self.client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": prompt}], max_tokens=self.max_tokens,
                    temperature=0, stream=True)
            else:
                stream = self.client.completions.create(model="default", prompt=prompt, max_tokens=self.max_tokens,
                                                        temperature=0, stream=True)
            arrivals = []
            for chunk in stream:  # ends normally only after "data: [DONE]"
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    arrivals.append(now)
                    text += piece
                finish = chunk.choices[0].finish_reason or finish
            record["itl"] = [b - a for a, b in zip(arrivals, arrivals[1:])]
        except Exception as e:  # noqa: BLE001 - every failure is a counted error
            record["error"] = f"{type(e).__name__}: {e}"
        record["latency"] = time.perf_counter() - t0
        record["ttft"] = (first or time.perf_counter()) - t0
        record["complete"] = finish is not None and usage is not None
        record["tokens"] = usage.completion_tokens if usage else 0
        decode_s = record["latency"] - record["ttft"]
        record["user_tok_s"] = (record["tokens"] - 1) / decode_s if decode_s > 0 and record["tokens"] > 1 else 0.0
        record["match"] = text == self.expected[(prompt, chat)]
        return record

    def run(self):
        for r in range(self.requests):
            self.results.append(self.one_request(r))


def run_round(url, clients, requests, max_tokens, expected):
    results = []
    threads = [Client(i, url, requests, max_tokens, expected, results) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default="build/mtpx")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=20, help="streamed requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=4, help="the server's --parallel")
    parser.add_argument("--server-args", default="", help="more mtpx serve flags, space separated")
    parser.add_argument("--sweep", default="", help="concurrency levels, comma-separated (e.g. 1,2,4,8)")
    args = parser.parse_args()
    binary = os.path.abspath(args.binary)
    if args.sweep:
        return sweep(args, binary)

    print(f"expected outputs: mtpx generate on {len(PROMPTS)} prompts x (completion, chat)")
    expected = {}
    for p in PROMPTS:
        expected[(p, False)] = expected_text(binary, p, args.max_tokens)
        expected[(p, True)] = expected_text(binary, chat_prompt(p), args.max_tokens)

    server = MtpxServer(binary, "--quiet", "--parallel", str(args.parallel), *args.server_args.split())
    try:
        print(server.lines[0].strip())
        warm, _ = run_round(server.url, args.clients, 1, args.max_tokens, expected)
        rss_warm = rss_bytes(server.pid)
        print(f"warm-up: {len(warm)} requests, server RSS {rss_warm / 2**20:.1f} MiB")
        # RSS every 2 s during the run: a leak grows steadily, a warm-up effect levels off.
        timeline, running = [], threading.Event()
        running.set()

        def sample():
            while running.is_set():
                timeline.append(round(rss_bytes(server.pid) / 2**20, 1))
                time.sleep(2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        results, wall = run_round(server.url, args.clients, args.requests, args.max_tokens, expected)
        running.clear()
        sampler.join()
        time.sleep(0.5)
        rss_end = rss_bytes(server.pid)
    finally:
        code = server.stop()

    errors = [r for r in results if r["error"]]
    incomplete = [r for r in results if not r["error"] and not r["complete"]]
    mismatches = [r for r in results if not r["error"] and not r["match"]]
    tokens = sum(r["tokens"] for r in results)
    latency = [r["latency"] for r in results]
    ttft = [r["ttft"] for r in results]
    growth = (rss_end - rss_warm) / rss_warm
    report = {
        "requests": len(results), "clients": args.clients, "per_client": args.requests,
        "max_tokens": args.max_tokens, "server_parallel": args.parallel,
        "errors": len(errors), "incomplete_streams": len(incomplete), "greedy_mismatches": len(mismatches),
        "wall_s": round(wall, 2), "completion_tokens": tokens, "aggregate_tok_s": round(tokens / wall, 1),
        "latency_p50_s": round(percentile(latency, 50), 3), "latency_p99_s": round(percentile(latency, 99), 3),
        "ttft_p50_s": round(percentile(ttft, 50), 3), "ttft_p99_s": round(percentile(ttft, 99), 3),
        "latency_mean_s": round(statistics.mean(latency), 3),
        "rss_after_warmup_mib": round(rss_warm / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_growth_pct": round(100 * growth, 2), "server_exit_code": code,
    }
    print(json.dumps(report, indent=1))
    print("server RSS during the run (MiB, every 2 s):", " ".join(str(x) for x in timeline))
    for r in (errors + incomplete + mismatches)[:5]:
        print("example failure:", {k: r[k] for k in ("prompt", "chat", "error", "complete", "match")})
    ok = not errors and not incomplete and not mismatches and abs(growth) <= 0.05 and code == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def sweep(args, binary):
    levels = [int(x) for x in args.sweep.split(",")]
    print(f"expected outputs: mtpx generate on {len(PROMPTS)} prompts x (completion, chat)")
    expected = {}
    for p in PROMPTS:
        expected[(p, False)] = expected_text(binary, p, args.max_tokens)
        expected[(p, True)] = expected_text(binary, chat_prompt(p), args.max_tokens)
    server = MtpxServer(binary, "--quiet", "--parallel", str(max(levels)), *args.server_args.split())
    rows, ok = [], True
    try:
        print(server.lines[0].strip())
        run_round(server.url, max(levels), 1, args.max_tokens, expected)  # warm-up
        for c in levels:
            results, wall = run_round(server.url, c, args.requests, args.max_tokens, expected)
            bad = [r for r in results if r["error"] or not r["complete"] or not r["match"]]
            ok = ok and not bad
            itl = [x for r in results for x in r.get("itl", [])]
            ttft = [r["ttft"] for r in results]
            tokens = sum(r["tokens"] for r in results)
            rows.append({"users": c, "requests": len(results), "aggregate_tok_s": tokens / wall,
                         "user_tok_s_p50": statistics.median(r["user_tok_s"] for r in results),
                         "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
                         "itl_p50_ms": 1e3 * percentile(itl, 50) if itl else 0.0,
                         "itl_p99_ms": 1e3 * percentile(itl, 99) if itl else 0.0, "failures": len(bad)})
    finally:
        code = server.stop()
    base = rows[0]["aggregate_tok_s"] if rows else 1.0
    print(f"| users | aggregate tok/s | vs {levels[0]} user(s) | per-user tok/s (p50) | TTFT p50 / p99 ms | "
          f"inter-token p50 / p99 ms | failures |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['users']} | {r['aggregate_tok_s']:.1f} | {r['aggregate_tok_s'] / base:.2f}x | "
              f"{r['user_tok_s_p50']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
              f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['failures']} |")
    print(json.dumps(rows))
    ok = ok and code == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
