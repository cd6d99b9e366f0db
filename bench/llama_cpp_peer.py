#!/usr/bin/env python3
"""Helper for bench/llama_cpp_peer.sh (llama.cpp peer benchmark on mtpx's weights).

Subcommands:
  convert   run llama.cpp's convert_hf_to_gguf.py from a llama.cpp source tree on a
            Hugging Face checkpoint directory, telling its pre-tokenizer check that a
            tokenizer whose pre-tokenizer regex is Qwen3.5's is "qwen35" (see below).
  check     sanity-check a checkpoint + tokenizer pair before conversion.
  gguf-info print a GGUF's architecture, layer / MTP (nextn) layer counts and vocab size.
  report    merge llama-bench JSON outputs (+ optional speculative log) into a table
            and a results JSON.

Why the pre-tokenizer shim: convert_hf_to_gguf.py identifies a BPE pre-tokenizer by
hashing the token ids its tokenizer gives for a fixed text (get_vocab_base_pre) and
refuses unknown hashes. The hash depends on the whole vocabulary, so any tokenizer
other than the official Qwen3.5 one (here: the small byte-level BPE tokenizer shipped
with mtpx's toy model) is "unknown" even when its pre-tokenizer is exactly Qwen3.5's.
Instead of editing the llama.cpp tree, we wrap get_vocab_base_pre at run time: when
the tokenizer.json pre-tokenizer regex is byte-for-byte Qwen3.5's, that tokenizer's
hash is added to the table as "qwen35"; every other hash goes through the original
code unchanged. Nothing is written into the llama.cpp source tree.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from hashlib import sha256
from pathlib import Path

# Qwen3.5's pre-tokenizer split regex, as in its tokenizer.json (llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_QWEN35 quotes the same string in src/llama-vocab.cpp).
QWEN35_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| "
    "?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


def tokenizer_split_regexes(tok_json: dict) -> list[str]:
    out: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "Split" and isinstance(node.get("pattern"), dict):
                rx = node["pattern"].get("Regex")
                if rx is not None:
                    out.append(rx)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(tok_json.get("pre_tokenizer"))
    return out


def text_config(cfg: dict) -> dict:
    return {**cfg, **cfg.get("text_config", {})}


def cmd_check(args) -> int:
    model = Path(args.model)
    cfg = json.loads((model / "config.json").read_text())
    tc = text_config(cfg)
    tok = json.loads((Path(args.tokenizer) / "tokenizer.json").read_text())
    n_tok = len(tok["model"]["vocab"])
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    max_id = max(ids)
    vocab = tc.get("vocab_size")
    arch = (cfg.get("architectures") or ["?"])[0]
    rx = tokenizer_split_regexes(tok)
    print(f"model: {arch}, layers={tc.get('num_hidden_layers')}, hidden={tc.get('hidden_size')}, "
          f"experts={tc.get('num_experts', 0)}, mtp_layers={tc.get('mtp_num_hidden_layers', 0)}, vocab_size={vocab}")
    print(f"tokenizer: {n_tok} BPE tokens + {len(tok.get('added_tokens', []))} added, max id {max_id}, "
          f"pre-tokenizer regex is Qwen3.5's: {QWEN35_REGEX in rx}")
    if vocab is not None and max_id >= vocab:
        print(f"error: tokenizer ids go up to {max_id} but the model's vocab_size is {vocab}; "
              f"the converter pads a smaller tokenizer up to vocab_size with [PADn] tokens but cannot "
              f"shrink a larger one. Make the checkpoint with a vocab_size >= {max_id + 1} "
              f"(e.g. mtpx synth --shape CONFIG.json with text_config.vocab_size raised).", file=sys.stderr)
        return 1
    return 0


def cmd_convert(args, rest: list[str]) -> int:
    llama = Path(args.llama_dir).resolve()
    sys.path.insert(0, str(llama))
    sys.path.insert(1, str(llama / "gguf-py"))

    import ast
    import conversion.base as cb
    m = re.search(r"chktxt = (.*)\n", Path(cb.__file__).read_text())
    assert m, "cannot find chktxt in conversion/base.py (get_vocab_base_pre changed?)"
    chktxt = ast.literal_eval(m.group(1))

    def chk_hash(tokenizer) -> str:  # exactly as get_vocab_base_pre computes it
        return sha256(str(tokenizer.encode(chktxt)).encode()).hexdigest()

    tok_path = Path(args.model) / "tokenizer.json"
    extra_hashes: set[str] = set()
    if tok_path.exists():
        rx = tokenizer_split_regexes(json.loads(tok_path.read_text()))
        if QWEN35_REGEX in rx:
            from transformers import AutoTokenizer
            h = chk_hash(AutoTokenizer.from_pretrained(args.model))
            extra_hashes.add(h)
            print(f"[peer] tokenizer's pre-tokenizer regex == Qwen3.5's; adding its check hash {h} as 'qwen35'",
                  flush=True)
        else:
            print("[peer] tokenizer's pre-tokenizer regex is not Qwen3.5's; pre-tokenizer check left alone",
                  flush=True)

    orig = cb.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        if extra_hashes and chk_hash(tokenizer) in extra_hashes:
            return "qwen35"
        return orig(self, tokenizer)

    cb.TextModel.get_vocab_base_pre = get_vocab_base_pre

    import runpy
    sys.argv = [str(llama / "convert_hf_to_gguf.py")] + rest
    runpy.run_path(str(llama / "convert_hf_to_gguf.py"), run_name="__main__")
    return 0


def cmd_gguf_info(args) -> int:
    sys.path.insert(0, str(Path(args.llama_dir).resolve() / "gguf-py"))
    import gguf
    rd = gguf.GGUFReader(args.gguf)

    def field(name):
        f = rd.fields.get(name)
        if f is None:
            return None
        v = f.contents()
        return v

    arch = field("general.architecture")
    n_block = field(f"{arch}.block_count")
    n_nextn = field(f"{arch}.nextn_predict_layers") or 0
    n_vocab = len(rd.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in rd.fields else None
    pre = field("tokenizer.ggml.pre")
    mtp_blocks = set(range(n_block - n_nextn, n_block)) if n_nextn else set()
    mtp_tensors = [t.name for t in rd.tensors
                   if t.name.startswith("blk.") and int(t.name.split(".")[1]) in mtp_blocks]
    types = {}
    for t in rd.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    info = {"arch": arch, "block_count": n_block, "nextn_predict_layers": n_nextn,
            "mtp_tensors": len(mtp_tensors), "n_vocab": n_vocab, "tokenizer_pre": pre,
            "n_tensors": len(rd.tensors), "tensor_types": types}
    print(json.dumps(info))
    return 0


def fmt_size(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def cmd_report(args) -> int:
    rows = []
    meta: dict = {}
    for spec in args.bench:
        quant, path = spec.split("=", 1)
        data = json.loads(Path(path).read_text() or "[]")
        row = {"quant": quant}
        for e in data:
            meta.setdefault("build_commit", e.get("build_commit"))
            meta.setdefault("build_number", e.get("build_number"))
            meta.setdefault("cpu_info", e.get("cpu_info"))
            meta.setdefault("backends", e.get("backends"))
            row["model_type"] = e.get("model_type")
            row["model_size_bytes"] = e.get("model_size")
            row["model_n_params"] = e.get("model_n_params")
            row["n_threads"] = e.get("n_threads")
            if e.get("n_prompt", 0) > 0 and e.get("n_gen", 0) == 0:
                key = f"pp{e['n_prompt']}"
            elif e.get("n_gen", 0) > 0 and e.get("n_prompt", 0) == 0:
                key = f"tg{e['n_gen']}"
            else:
                key = f"pp{e.get('n_prompt')}+tg{e.get('n_gen')}"
            row[key] = {"avg_ts": e.get("avg_ts"), "stddev_ts": e.get("stddev_ts"),
                        "samples_ts": e.get("samples_ts"), "reps": len(e.get("samples_ts") or [])}
        rows.append(row)
    infos = dict(x.split("=", 1) for x in args.info)
    for q in list(args.gguf) + list(infos):
        if not any(r["quant"] == q for r in rows):
            rows.append({"quant": q})
    for row in rows:
        row["gguf"] = args.gguf.get(row["quant"])
        if row["quant"] in infos:
            row["gguf_info"] = json.loads(Path(infos[row["quant"]]).read_text())

    spec_res = []
    for spec in args.spec or []:
        quant, path = spec.split("=", 1)
        txt = Path(path).read_text(errors="replace")
        r = {"quant": quant, "log": path}
        for k, pat in [("n_draft", r"n_draft\s*=\s*(\d+)"), ("n_predict", r"n_predict\s*=\s*(\d+)"),
                       ("n_drafted", r"n_drafted\s*=\s*(\d+)"), ("n_accept", r"n_accept\s*=\s*(\d+)"),
                       ("accept_pct", r"accept\s*=\s*([\d.]+)%"),
                       ("decode_tok_s", r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s"),
                       ("encode_tok_s", r"encoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s")]:
            m = re.search(pat, txt)
            if m:
                r[k] = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
        spec_res.append(r)

    # table
    keys = sorted({k for r in rows for k in r if re.match(r"^(pp|tg)\d+$", k)}, key=lambda k: (k[:2] != "pp", k))
    hdr = f"{'quant':<8} {'size':>11} " + " ".join(f"{k + ' tok/s':>20}" for k in keys)
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append(f"{v['avg_ts']:>11.2f} ± {v['stddev_ts']:<6.2f}" if v else f"{'-':>20}")
        size = fmt_size(r["model_size_bytes"]) if r.get("model_size_bytes") else "-"
        print(f"{r['quant']:<8} {size:>11} " + " ".join(f"{c:>20}" for c in cells))
    for s in spec_res:
        print(f"MTP speculative ({s['quant']}): draft n_max={s.get('n_draft')}, drafted={s.get('n_drafted')}, "
              f"accepted={s.get('n_accept')} ({s.get('accept_pct')}%), decode {s.get('decode_tok_s')} tok/s")

    out = {"llama_cpp": {**meta, "version": args.version}, "model_dir": args.model, "threads": args.threads,
           "reps": args.reps, "host": os.uname().nodename, "cpu_count": os.cpu_count(),
           "results": rows, "speculative_mtp": spec_res}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--llama-dir", required=True)
    c.add_argument("--model", required=True)
    k = sub.add_parser("check")
    k.add_argument("--model", required=True)
    k.add_argument("--tokenizer", required=True)
    g = sub.add_parser("gguf-info")
    g.add_argument("--llama-dir", required=True)
    g.add_argument("gguf")
    r = sub.add_parser("report")
    r.add_argument("--bench", action="append", default=[], help="QUANT=llama-bench.json")
    r.add_argument("--spec", action="append", default=[], help="QUANT=speculative.log")
    r.add_argument("--info", action="append", default=[], help="QUANT=gguf-info.json")
    r.add_argument("--gguf-map", default=None, help="JSON {quant: path}")
    r.add_argument("--model", default=None)
    r.add_argument("--version", default=None)
    r.add_argument("--threads", type=int, default=None)
    r.add_argument("--reps", type=int, default=None)
    r.add_argument("--out", default=None)
    args, rest = ap.parse_known_args()
    if args.cmd == "convert":
        return cmd_convert(args, rest)
    if rest:
        ap.error(f"unrecognized arguments: {rest}")
    if args.cmd == "check":
        return cmd_check(args)
    if args.cmd == "gguf-info":
        return cmd_gguf_info(args)
    args.gguf = json.loads(args.gguf_map) if args.gguf_map else {}
    return cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
