#!/usr/bin/env python3
"""Side by side on one machine, in one run: mlx-lm (PyPI `mlx[cpu]` + `mlx-lm`) vs mtpx decoding the
shipped model greedily on the same held-out prompts (64 tokens each).

    python3 -m pip install "mlx[cpu]" mlx-lm      # test tooling only
    python3 bench/compare_mlx.py [--mtpx-bench build/bench_model] [--threads 2]

mlx-lm's greedy tokens are also compared with transformers' (from the held-out sample file) as a
sanity check that both engines run the same model.
"""
import argparse
import json
import pathlib
import re
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def mlx_decode(model_dir, samples, max_tokens):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(model_dir))
    tokens = 0
    seconds = 0.0
    agree = compared = 0
    for s in samples:
        out = []
        start = None
        for i, (t, _) in enumerate(generate_step(mx.array(s["prompt_ids"]), model, max_tokens=max_tokens)):
            if i == 0:  # the first token comes out of the prefill, as in mtpx's decode_tok_s
                start = time.perf_counter()
            out.append(int(t))
        seconds += time.perf_counter() - start
        tokens += len(out) - 1
        for want, margin, got in zip(s["greedy_ids"], s["greedy_margins"], out):
            if margin < 1e-3:
                break
            compared += 1
            agree += want == got
    return tokens / seconds, agree / max(compared, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--samples", default=str(ROOT / "tests" / "fixtures" / "trained_default" / "heldout_samples.json"))
    ap.add_argument("--mtpx-bench", default=str(ROOT / "build" / "bench_model"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    samples = json.load(open(args.samples))["samples"]
    mlx_tok_s, agreement = mlx_decode(args.model, samples, args.tokens)
    out = subprocess.run([args.mtpx_bench, "--model", args.model, "--samples", args.samples, "--threads", str(args.threads),
                          "--tokens", str(args.tokens), "--repeats", "1"], check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\| greedy \| (\w+) \| (\d+) \|", line)
        if m:
            rows[m.group(1)] = float(m.group(2))
    best_k = max((k for k in rows if k != "AR"), key=lambda k: rows[k])
    print(json.dumps({
        "mlx_lm_tok_s": round(mlx_tok_s, 1),
        "mlx_lm_greedy_agreement_with_transformers": round(agreement, 4),
        "mtpx_threads": args.threads,
        "mtpx_ar_tok_s": rows["AR"],
        "mtpx_mtp_best_k": int(best_k),
        "mtpx_mtp_tok_s": rows[best_k],
        "mtpx_ar_over_mlx_lm": round(rows["AR"] / mlx_tok_s, 2),
        "mtpx_mtp_over_mlx_lm": round(rows[best_k] / mlx_tok_s, 2),
    }, indent=1))


if __name__ == "__main__":
    main()
