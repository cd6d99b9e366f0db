#!/usr/bin/env python3
"""Speed of MTP for candidate shapes of the shipped model, before training any of them (issue 4).

Issue 4 asks for the size/recipe under the 20 MB budget that gets closest to its CPU speed targets. A
model's MTP speedup is the product of two things: the acceptance its head reaches (a property of the
training) and what a verify row and a head pass cost against a plain step (a property of the shape and
the machine). This script measures the second for each candidate shape, at fixed acceptances, with
random weights: `mtpx synth --shape CONFIG --mtp` writes a checkpoint of the shape, and
`mtpx bench --synthetic-acceptance A` replaces the head's drafts by tokens that match the trunk's greedy
output with probability A (the head's passes still run, so their cost is counted).

Rounds alternate the shapes, and each ratio pairs plain and MTP decoding within one bench run (this
machine's speed drifts by 5-10%); the table gives the median over rounds.

    python3 bench/recipe_sweep.py --mtpx build/mtpx [--rounds 5] [--threads 2]
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = ROOT / "models" / "default"

# name: (vocab, hidden, layers, intermediate); the heads stay those of the shipped model (attention 4/2 of
# 64, DeltaNet 2 key / 4 value heads of 64), and layers follow its 3:1 DeltaNet/attention pattern.
RECIPES = {
    "shipped (V8192 h256 L8 I512)": (8192, 256, 8, 512),
    "V8192 h256 L10 I512": (8192, 256, 10, 512),
    "V4096 h256 L12 I512": (4096, 256, 12, 512),
    "V4096 h256 L8 I1024": (4096, 256, 8, 1024),
    "V4096 h320 L8 I640": (4096, 320, 8, 640),
    "V2048 h256 L13 I512": (2048, 256, 13, 512),
}


def recipe_config(vocab, hidden, layers, intermediate):
    cfg = json.loads((BASE / "config.json").read_text())
    t = cfg["text_config"]
    t.update(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate)
    t["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    for key in ("bos_token_id", "eos_token_id"):
        t[key] = vocab - 3
    for i, key in enumerate(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")):
        cfg[key] = vocab - 6 + i
    cfg["vision_config"]["out_hidden_size"] = hidden
    return cfg


def bench(mtpx, model, threads, draft, draft_vocab, acceptance, tokens, runs):
    cmd = [mtpx, "bench", "--model", str(model), "--threads", str(threads), "--max-tokens", str(tokens),
           "--runs", str(runs), "--draft", str(draft), "--synthetic-acceptance", str(acceptance), "--json"]
    if draft_vocab:
        cmd += ["--draft-vocab", str(draft_vocab)]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    plain = next(r for r in out["results"] if r["draft"] == 0)
    mtp = next(r for r in out["results"] if r["draft"] > 0)
    return plain["tok_s_median"], mtp["speedup_vs_plain"], mtp["tokens_per_step"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtpx", default=str(ROOT / "build" / "mtpx"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--acceptance", default="0.84,0.90")
    ap.add_argument("--max-draft", type=int, default=2)
    args = ap.parse_args()
    acceptances = [float(a) for a in args.acceptance.split(",")]
    tokenizer_bytes = (BASE / "tokenizer.json").stat().st_size

    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name, shape in RECIPES.items():
            d = pathlib.Path(tmp) / str(len(models))
            d.mkdir()
            (d / "config.json").write_text(json.dumps(recipe_config(*shape)))
            subprocess.run([args.mtpx, "synth", "--shape", str(d / "config.json"), "--mtp", "--out",
                            str(d / "model")], check=True, capture_output=True)
            weights = (d / "model" / "model.safetensors").stat().st_size
            # The tokenizer's size grows with its vocabulary (its vocab and merges lists).
            disk = weights + tokenizer_bytes * shape[0] / 8192 + 8192
            models[name] = (d / "model", shape, disk)

        cases = []  # (draft, draft_vocab, acceptance)
        for k in range(1, args.max_draft + 1):
            for a in acceptances:
                cases.append((k, 0, a))
                cases.append((k, 4096, a))
        results = {}  # (name, case) -> [(plain tok/s, ratio, tokens/step)]
        for r in range(args.rounds):
            for name, (model, shape, _) in models.items():
                for case in cases:
                    k, dv, a = case
                    if dv and dv >= shape[0]:
                        continue
                    results.setdefault((name, case), []).append(
                        bench(args.mtpx, model, args.threads, k, dv, a, args.tokens, args.runs))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    print(f"threads {args.threads}, {args.rounds} rounds x {args.runs} runs of {args.tokens} tokens, "
          f"median over rounds of the paired MTP / plain ratio (greedy)\n")
    header = "| shape | MB on disk | plain tok/s | " + " | ".join(
        f"K={k}{' d4096' if dv else ''} A={a:.2f}" for k, dv, a in cases) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, (_, shape, disk) in models.items():
        plain = statistics.median(p for case in cases for p, _, _ in results.get((name, case), []))
        cells = []
        for case in cases:
            xs = results.get((name, case))
            cells.append(f"{statistics.median(x[1] for x in xs):.2f}x" if xs else "-")
        print(f"| {name} | {disk / 1e6:.1f} | {plain:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
