#!/usr/bin/env python3
"""Trains a small real Qwen3.5-architecture Python-code model WITH a trained native MTP head, and exports it in the
official checkpoint layout (the layout `mtpx` loads).

How to run it on the GPU machine (device tool, kind nvidia-h200: one H200, 16 cores, no network)
-----------------------------------------------------------------------------------------------
The working tree is copied there; $OUT is an empty folder whose files come back (at most 8 files, 16 MiB each). The
script writes exactly 8 files directly into --out, so point --out at $OUT itself:

    run(kind="nvidia-h200", timeout_s=600,
        command="PYTHONUNBUFFERED=1 python3 scripts/train_small_model.py --out $OUT --deadline-minutes 9.2")

A model.safetensors over 16 MiB (e.g. --vocab 4096 --layers 12: 18.6 MiB) does not come back that way; write to a
local folder and return it as a split tar (join the parts here with `cat model.tar.* | tar -xf -`):

    command="PYTHONUNBUFFERED=1 python3 scripts/train_small_model.py --out /tmp/m --vocab 4096 --layers 12
             --max-model-mib 19 --deadline-minutes 9.0; tar -C /tmp/m -cf - . | split -b 15000000 - $OUT/model.tar."

One device command may run at most 10 minutes, so the whole script is driven by a wall-clock deadline
(--deadline-minutes, counted from the script's start): data collection + tokenizer training + tokenization take
~0.5-1.5 min, training runs until `deadline - export reserve (--export-reserve-s, 45 s)`, then the final float32
evaluation, export, reload check, reference outputs and held-out samples take ~20-50 s. Expected total: the
deadline (9.2 min by default) +- a few seconds; the training part gets ~7.5 min (--train-minutes caps it further).
The log goes to stdout (the tool returns its last 12,000 characters); report.json holds every number, including
the eval history, so no log file is needed. Nothing else on that machine is touched; no network is used.
The H200 image has neither flash-linear-attention nor causal-conv1d, so the GDN layers run transformers' pure-torch
chunked fallback (the script logs a fwd+bwd micro-benchmark of one GDN mixer vs one attention mixer vs one MLP at the
batch shape). Throughput there has not been measured yet; the estimate is ~50-120 ms per 32 K-token step (memory-
and launch-bound fp32 chunk math; the matmul FLOPs are ~1.6 TFLOP per step), i.e. ~120-300 M tokens in the ~7.5 min
of training, 2-5 passes over the ~60 M training tokens of 200 MB of code. The wall-clock schedule adapts to whatever
the speed is. If a run may take longer than 10 minutes, raise --deadline-minutes (e.g. 11.5 for a 12-minute budget).

Afterwards, here (needs the engine binary; CPU only, ~1 min):

    python3 scripts/train_small_model.py --out DIR --check-only --check-engine /tmp/b/mtpx

compares the engine's logits / hidden / mtp_logits with reference.safetensors (relative max-abs error per row, must
be < 1e-3), its teacher-forced MTP / trunk top-1 predictions on the 20 held-out samples with PyTorch's, its greedy
output with transformers' greedy output, and prints the MTP acceptance of `generate --mtp --draft 2` on the samples.

A second run that retrains only the MTP head of a trained model (the trunk and the shared embedding stay
bit-identical: checked at export), for chained drafting (K >= 2) and against the trunk's own distribution:

    command="PYTHONUNBUFFERED=1 python3 scripts/train_small_model.py --out $OUT --init-from models/default
             --head-only --mtp-steps 2 --distill --lr 6e-4 --warmup-steps 100 --min-lr-frac 0.05"

Step k >= 2 of the head takes step k-1's output as its hidden, attends to the step-1 rows up to its own
(the MTP KV slots of committed tokens) and to its chain's earlier steps, at position t+k-1: exactly what the
engine computes when it drafts K tokens (qwen35_arch.md §6.3). `check_chain` verifies this all-rows-at-once
form against drafting one row at a time at start-up. The report gains `chain_eval_before` / `chain_eval_after_*`
(per step: head argmax == trunk argmax, all steps so far agreeing, sum min(p_trunk, q_head)).

`--rank-vocab` renumbers the BPE tokens by their count in the training data, most frequent first (the special
tokens keep the last ids). Byte-level BPE numbers tokens in merge order, which only approximates frequency, and
mtpx's draft vocabulary (`--draft-vocab N`) is the first N ids: ranked, the first 4096 ids of the shipped model
cover 94% of code tokens instead of 90%. With --init-from and no training (--train-minutes 0) it renumbers a
trained model (the embedding rows move with their tokens: the same model, a different numbering) and writes new
reference outputs and samples:

    command="PYTHONUNBUFFERED=1 python3 scripts/train_small_model.py --out $OUT --init-from models/default
             --head-only --rank-vocab --train-minutes 0 --deadline-minutes 3 --export-reserve-s 0"

Smoke test on a CPU (~1-2 min, tiny data / model / step count; outputs must stay out of the repository):

    python3 scripts/train_small_model.py --smoke --out /tmp/smoke_model --check-engine /tmp/b/mtpx

Requirements: torch (CUDA for the real run), transformers==5.17.0, tokenizers, safetensors, numpy; this script also
imports scripts/make_reference_fixtures.py (config layout, MTP reference `mtp_forward_hf`) and
scripts/make_placeholder_model.py (tokenizer configuration, ChatML template, tokenizer_config.json).

What it does
------------
1. Data: every *.py file under the standard library (sysconfig stdlib) and site-packages (purelib, platlib,
   site.getsitepackages()), deduplicated by real path and by content, files of 64 B .. --max-file-kb (256 KiB),
   valid UTF-8, no line > 4000 chars, mean line length <= 120 (skips minified / generated data). Order: sorted by
   sha1 of the path relative to its root ("stdlib/..." / "site/..."), i.e. deterministic and independent of where
   Python is installed; taken in that order until --data-mb (200 MB). Split by FILE: a file is held out iff
   sha1("heldout:" + relpath) mod 10000 < --heldout-frac * 10000 (1 %). Each file is followed by <|endoftext|>.
2. Tokenizer: byte-level BPE trained with `tokenizers` on the first --tok-train-mb (30 MB) of training files,
   configured exactly like scripts/make_placeholder_model.py (NFC; Split(Qwen3.5 regex, isolated) + ByteLevel(
   add_prefix_space=False, trim_offsets=False, use_regex=False); ByteLevel decoder), --vocab (8192) tokens in total
   = vocab-3 BPE tokens then <|endoftext|>, <|im_start|>, <|im_end|>. Tokenization of the data: one process per core
   (the Qwen3.5 split regex runs at ~1 MB/s per core), token stream uint16 (int32 if the vocab exceeds 65535).
3. Model: transformers Qwen3_5ForCausalLM from a Qwen3_5TextConfig (default: V 8192, H 256, 8 layers = 3 Gated
   DeltaNet : 1 gated full attention (full_attention_interval 4), I 512, attention heads 4/2 of dim 64, partial
   rotary 0.25 (rotary dim 16), rope_theta 1e7 in rope_parameters (interleaved M-RoPE sections [3,3,2]), GDN heads
   2 key / 4 value of dims 64/64, conv kernel 4, tied embeddings) plus the MTP head of qwen35_arch.md §6:
   mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc [H, 2H] over concat(norm(embed(x_{t+1})), norm(h_t))
   (embedding FIRST), one full-attention transformers Qwen3_5DecoderLayer (config with layer_types
   ["full_attention"], its own positions 0..T-2 = the trunk positions t), mtp.norm, shared embed_tokens / lm_head.
   h_t = the trunk's post-final-norm hidden (last_hidden_state = model.model.norm output = lm_head input, verified
   with hooks at start-up). ~8.1 M parameters = ~15.5 MiB in bf16 (asserted <= --max-model-mib).
   Loss = CE(trunk logits_t, x_{t+1}) + --mtp-lambda (0.5) * CE(MTP row t, x_{t+2}); the MTP gradient also flows into
   the trunk through h_t. AdamW (0.9, 0.95, wd 0.1 on matrices), bf16 autocast on CUDA, LR: linear warmup then
   cosine to 10 % over the wall-clock training budget, grad clip 1.0, random windows of --seq-len+1 tokens
   (default 512+1, batch 64 = 32 K tokens/step), periodic held-out eval (every --eval-every-s seconds).
   GDN kernels: transformers resolves flash-linear-attention / causal-conv1d when installed, else its pure-torch
   fallbacks (torch_chunk_gated_delta_rule, F.conv1d); the one used is recorded in report.json ("gdn_impl") and the
   measured step time in "train".
4. Export (all weights rounded to bf16 first; the final metrics are computed in float32 on exactly these values):
     config.json               Qwen3_5ForConditionalGeneration wrapper: text_config (mtp_num_hidden_layers 1,
                               layer_types, rope_parameters, tie_word_embeddings, bos/eos = <|endoftext|>), a tiny
                               vision_config (as scripts/make_placeholder_model.py)
     model.safetensors         bf16: model.language_model.* (trunk), mtp.* (15 tensors, names of spec §1.2),
                               2 tiny dummy model.visual.* tensors (text engines ignore them), no lm_head (tied)
     tokenizer.json, tokenizer_config.json (ChatML template), generation_config.json (do_sample, T 0.7, top_k 20,
                               top_p 0.95, eos [<|im_end|>, <|endoftext|>])
     report.json               parameter counts, data sizes, steps, tokens seen, wall times, eval history, final
                               held-out trunk / MTP loss and top-1 accuracy, MTP-vs-trunk argmax agreement, GDN
                               implementation, export checks
     reference.safetensors     transformers float32 (CPU, eager attention, TF32 off) outputs of the exported weights
                               for 2 held-out prompts of 48 tokens: prompt_{i} int32 [48], logits_{i} [48, V],
                               hidden_{i} [48, H] (post-final-norm), mtp_logits_{i} [47, V], mtp_hidden_{i} [47, H]
                               (teacher-forced MTP, make_reference_fixtures.mtp_forward_hf: row t = (h_t, x_{t+1},
                               position t) predicts x_{t+2})
     heldout_samples.json      20 held-out code prompts of 64 tokens (ids + text, starting at a line start) with the
                               next 64 real tokens, transformers' float32 greedy continuation (32 tokens) with its
                               top1-top2 margins, and PyTorch's teacher-forced trunk / MTP argmax over prompt+next
     Checks: reload through Qwen3_5ForConditionalGeneration.from_pretrained (and AutoModelForCausalLM) reproduces the
     float32 logits of the bf16-rounded in-memory model; the training MTP module equals mtp_forward_hf.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import multiprocessing as mp
import os
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

T_START = time.time()
MIB = 1 << 20
OUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
             "report.json", "reference.safetensors", "heldout_samples.json")


def log(msg: str):
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------

SMOKE = dict(data_mb=3.0, tok_train_mb=1.5, heldout_frac=0.06, vocab=1024, hidden=64, layers=4, intermediate=128,
             heads=2, kv_heads=1, head_dim=64, lin_k_heads=2, lin_v_heads=4, lin_k_dim=16, lin_v_dim=16,
             seq_len=128, batch=8, lr=3e-3, warmup_steps=20, train_minutes=0.5, deadline_minutes=3.0,
             eval_every_s=10.0, eval_windows=16, final_eval_windows=32, export_reserve_s=30.0, stdlib_only=True,
             device="cpu", torch_threads=1, engine_threads=1, log_every=25)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output model directory (on the GPU machine: $OUT)")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of the whole pipeline (~1-2 min)")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch CPU threads (0: torch's default; the smoke run uses 1: a tiny model gains nothing "
                         "from more and loses a lot when the cores are shared)")
    # data
    ap.add_argument("--data-mb", type=float, default=200.0, help="total source bytes to collect (MB)")
    ap.add_argument("--max-file-kb", type=float, default=256.0, help="skip files larger than this")
    ap.add_argument("--heldout-frac", type=float, default=0.01, help="fraction of FILES held out")
    ap.add_argument("--stdlib-only", action="store_true", help="only the standard library (no site-packages)")
    ap.add_argument("--workers", type=int, default=0, help="tokenization processes (default: all cores)")
    ap.add_argument("--chat-frac", type=float, default=0.0,
                    help="share of the training tokens that are chat exchanges built from the training files "
                         "(scripts/chat_examples.py: a request from a function's docstring, signature or comment, "
                         "the function in a fenced block as the answer, <|im_end|> after it); 0: plain code only")
    ap.add_argument("--chat-max-lines", type=int, default=40, help="longest function used as a chat answer")
    # tokenizer
    ap.add_argument("--tok-train-mb", type=float, default=30.0, help="MB of training text for the BPE trainer")
    ap.add_argument("--vocab", type=int, default=8192, help="tokenizer size incl. the 3 special tokens")
    # model
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lin-k-heads", type=int, default=2)
    ap.add_argument("--lin-v-heads", type=int, default=4)
    ap.add_argument("--lin-k-dim", type=int, default=64)
    ap.add_argument("--lin-v-dim", type=int, default=64)
    ap.add_argument("--full-attention-interval", type=int, default=4)
    ap.add_argument("--max-model-mib", type=float, default=15.9, help="assert: bf16 model.safetensors size budget")
    # training
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--mtp-lambda", type=float, default=0.5, help="weight of the MTP loss")
    ap.add_argument("--train-minutes", type=float, default=None, help="cap on the training time")
    ap.add_argument("--deadline-minutes", type=float, default=9.2,
                    help="wall-clock budget of the WHOLE script; training stops at deadline - export reserve")
    ap.add_argument("--export-reserve-s", type=float, default=45.0, help="seconds kept for final eval + export")
    ap.add_argument("--max-steps", type=int, default=0, help="optional step cap (0: time-limited only)")
    ap.add_argument("--eval-every-s", type=float, default=60.0)
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows per periodic eval")
    ap.add_argument("--final-eval-windows", type=int, default=512, help="held-out windows for the final eval")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--compile", action="store_true", help="torch.compile the training loss (falls back if it fails)")
    # outputs / checks
    ap.add_argument("--n-samples", type=int, default=20)
    ap.add_argument("--sample-len", type=int, default=64)
    ap.add_argument("--ref-len", type=int, default=48)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--check-engine", default=None, metavar="BINARY", help="compare the mtpx engine with the outputs")
    ap.add_argument("--check-only", action="store_true", help="only run --check-engine on an existing --out")
    ap.add_argument("--engine-threads", type=int, default=0)
    g = ap.add_argument_group("continuing from a trained model (e.g. a second training run of the MTP head)")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this model directory: its tokenizer, config and weights (no tokenizer training;"
                        " the shape options are ignored)")
    g.add_argument("--head-only", action="store_true",
                   help="train only the mtp.* tensors; the trunk (and the shared embedding) stay bit-identical")
    g.add_argument("--mtp-steps", type=int, default=1,
                   help="chained draft steps trained (--head-only): step k feeds step k-1's output as the hidden, "
                        "as drafting does for K >= k")
    g.add_argument("--rank-vocab", action="store_true",
                   help="renumber the BPE tokens by their frequency in the training data (most frequent first; "
                        "special tokens keep their ids), so that a draft vocabulary of the first N ids covers the "
                        "most text; with --init-from the embedding rows move with their tokens (same model)")
    g.add_argument("--distill", action="store_true",
                   help="(--head-only) target of each head row = the trunk's own next-token distribution at that "
                        "position (soft cross-entropy), not the data token: acceptance is agreement with the trunk")
    args = ap.parse_args(argv)
    if (args.head_only or args.distill or args.mtp_steps != 1) and not args.init_from:
        ap.error("--head-only, --distill and --mtp-steps need --init-from (a trained trunk)")
    if (args.distill or args.mtp_steps != 1) and not args.head_only:
        ap.error("--distill and --mtp-steps need --head-only")
    if args.mtp_steps < 1:
        ap.error("--mtp-steps must be >= 1")
    if not 0.0 <= args.chat_frac < 1.0:
        ap.error("--chat-frac must be in [0, 1)")
    if args.smoke:
        given = {a.dest for a in ap._actions if a.option_strings and any(s in (argv or sys.argv[1:]) for s in
                                                                         a.option_strings)}
        for k, v in SMOKE.items():
            if k not in given:
                setattr(args, k, v)
    return args


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def _h(s: str) -> int:
    return int(hashlib.sha1(s.encode()).hexdigest()[:12], 16)


def source_roots(stdlib_only: bool) -> list[tuple[str, str]]:
    paths = sysconfig.get_paths()
    roots = [("stdlib", paths["stdlib"])]
    if not stdlib_only:
        cands = [paths.get("purelib"), paths.get("platlib")]
        try:
            cands += site.getsitepackages()
        except Exception:
            pass
        try:
            cands.append(site.getusersitepackages())
        except Exception:
            pass
        seen = set()
        for c in cands:
            if c and os.path.isdir(c) and os.path.realpath(c) not in seen:
                seen.add(os.path.realpath(c))
                roots.append(("site", c))
    return roots


def collect_files(args) -> dict:
    """Deterministic file list: (relpath, text) for train and held-out."""
    roots = source_roots(args.stdlib_only)
    entries, seen_real = [], set()
    max_bytes = int(args.max_file_kb * 1024)
    for tag, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith(".")
                                 and not (tag == "stdlib" and d in ("site-packages", "dist-packages")))
            for f in sorted(filenames):
                if not f.endswith(".py"):
                    continue
                full = os.path.join(dirpath, f)
                try:
                    real = os.path.realpath(full)
                    if real in seen_real or not os.path.isfile(real):
                        continue
                    seen_real.add(real)
                    size = os.path.getsize(real)
                except OSError:
                    continue
                if 64 <= size <= max_bytes:
                    entries.append((tag + "/" + os.path.relpath(full, root).replace(os.sep, "/"), real, size))
    entries.sort(key=lambda e: (_h(e[0]), e[0]))
    cap = int(args.data_mb * 1e6)
    train, held, seen_content, total = [], [], set(), 0
    skipped = {"non_utf8": 0, "long_lines": 0, "duplicate": 0}
    for rel, real, size in entries:
        if total >= cap:
            break
        try:
            raw = open(real, "rb").read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            skipped["non_utf8"] += 1
            continue
        digest = hashlib.sha1(raw).digest()
        if digest in seen_content:
            skipped["duplicate"] += 1
            continue
        seen_content.add(digest)
        lines = text.split("\n")
        if max(len(x) for x in lines) > 4000 or len(text) / len(lines) > 120:
            skipped["long_lines"] += 1
            continue
        total += len(raw)
        if _h("heldout:" + rel) % 10000 < args.heldout_frac * 10000:
            held.append((rel, text))
        else:
            train.append((rel, text))
    return {"roots": [f"{t}:{r}" for t, r in roots], "candidates": len(entries), "train": train, "held": held,
            "bytes": total, "skipped": skipped}


def build_tokenizer(texts: list[str], vocab: int):
    import make_placeholder_model as mpm
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(mpm.QWEN35_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = BpeTrainer(vocab_size=vocab - len(mpm.SPECIALS), min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    nbpe = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False, single_word=False, lstrip=False,
                                       rstrip=False) for s in mpm.SPECIALS])
    assert tok.get_vocab_size() == nbpe + len(mpm.SPECIALS)
    return tok


_WORKER_TOK = None


def _worker_init(tok_json: str):
    global _WORKER_TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER_TOK = Tokenizer.from_str(tok_json)


def _worker_encode(job):
    texts, eot, dtype = job
    enc = _WORKER_TOK.encode_batch_fast(texts) if hasattr(_WORKER_TOK, "encode_batch_fast") else \
        _WORKER_TOK.encode_batch(texts)
    return [np.asarray(e.ids, dtype=dtype) for e in enc]


def encode_docs(tok, texts: list[str], workers: int, dtype) -> list[np.ndarray]:
    """Token ids of each text (no separators), in order. One spawned process per core (single-threaded tokenizers)."""
    if not texts:
        return []
    eot = tok.token_to_id("<|endoftext|>")
    # jobs of ~0.5 MB, in order
    jobs, cur, cur_b = [], [], 0
    for t in texts:
        cur.append(t)
        cur_b += len(t)
        if cur_b >= 500_000:
            jobs.append((cur, eot, dtype))
            cur, cur_b = [], 0
    if cur:
        jobs.append((cur, eot, dtype))
    if workers <= 1 or len(jobs) == 1:
        enc = tok.encode_batch_fast(texts) if hasattr(tok, "encode_batch_fast") else tok.encode_batch(texts)
        return [np.asarray(e.ids, dtype=dtype) for e in enc]
    ctx = mp.get_context("spawn")  # fresh interpreters: the parent has tokenizers (rayon) threads running
    out = []
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tok.to_str(),)) as pool:
        for part in pool.imap(_worker_encode, jobs, chunksize=1):
            out.extend(part)
    return out


def _chat_worker(job):
    import chat_examples

    files, max_lines = job
    return [chat_examples.examples_from_source(rel, text, max_lines) for rel, text in files]


def chat_docs_of(files: list[tuple[str, str]], max_lines: int, workers: int) -> list[str]:
    """The chat examples of every file (scripts/chat_examples.py), in file order; parsed by a pool of processes."""
    jobs, cur, cur_b = [], [], 0
    for rel, text in files:
        cur.append((rel, text))
        cur_b += len(text)
        if cur_b >= 2_000_000:
            jobs.append((cur, max_lines))
            cur, cur_b = [], 0
    if cur:
        jobs.append((cur, max_lines))
    out = []
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            for examples in _chat_worker(job):
                out.extend(examples)
        return out
    with mp.get_context("spawn").Pool(workers) as pool:
        for part in pool.imap(_chat_worker, jobs, chunksize=1):
            for examples in part:
                out.extend(examples)
    return out


def mix_chat(code_docs: list[np.ndarray], chat_docs: list[np.ndarray], frac: float, seed: int):
    """Code documents plus chat documents making `frac` of the tokens (the chat examples cycled in a seeded
    random order if there are too few), shuffled together; returns the documents and the chat token count."""
    code_tokens = sum(int(d.size) + 1 for d in code_docs)
    target = int(frac / (1.0 - frac) * code_tokens)
    rng = np.random.RandomState(seed)
    chosen, total = [], 0
    while chat_docs and total < target:
        for i in rng.permutation(len(chat_docs)):
            if total >= target:
                break
            chosen.append(chat_docs[i])
            total += int(chat_docs[i].size) + 1
    docs = list(code_docs) + chosen
    order = rng.permutation(len(docs))
    return [docs[i] for i in order], total


def join_docs(docs: list[np.ndarray], eot: int, dtype) -> np.ndarray:
    if not docs:
        return np.zeros(0, dtype=dtype)
    sep = np.array([eot], dtype=dtype)
    parts = []
    for d in docs:
        parts.append(d)
        parts.append(sep)
    return np.concatenate(parts)


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


def mrope_section(rot: int) -> list[int]:
    s = rot // 2
    base, rem = divmod(s, 3)
    return [base + (rem > 0), base + (rem > 1), base]


def text_config_dict(args, V: int, eot: int) -> dict:
    L = args.layers
    layer_types = ["full_attention" if (i + 1) % args.full_attention_interval == 0 else "linear_attention"
                   for i in range(L)]
    rot = int(args.head_dim * 0.25)
    return {
        "vocab_size": V,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": L,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "full_attention_interval": args.full_attention_interval,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": args.lin_k_dim,
        "linear_value_head_dim": args.lin_v_dim,
        "linear_num_key_heads": args.lin_k_heads,
        "linear_num_value_heads": args.lin_v_heads,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 32768,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "output_gate_type": "swish",
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": mrope_section(rot),
        },
        "tie_word_embeddings": True,
        "use_cache": True,
        "dtype": "bfloat16",
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": None,
        "initializer_range": 0.02,
    }


def hf_config(tc: dict, attn: str):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    d = copy.deepcopy(tc)
    d.pop("dtype", None)
    cfg = Qwen3_5TextConfig(**d)
    cfg._attn_implementation = attn
    return cfg


def make_mtp_head(cfg):
    import torch
    from torch import nn
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    class MTPHead(nn.Module):
        """qwen35_arch.md §6. Parameter names (prefixed "mtp.") are exactly the checkpoint's 15 mtp.* tensors."""

        def __init__(self, cfg):
            super().__init__()
            H = cfg.hidden_size
            lcfg = copy.deepcopy(cfg)
            lcfg.layer_types = ["full_attention"]
            lcfg.num_hidden_layers = 1
            self.lcfg = lcfg
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.layers = nn.ModuleList([Qwen3_5DecoderLayer(lcfg, layer_idx=0)])
            assert self.layers[0].block_type == "full_attention"
            self.norm = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)

        def fc_input(self, embed_tokens, hidden, ids):
            """mtp.fc over concat(norm(embed(ids)), norm(hidden)): the embedding first (spec §6)."""
            e = self.pre_fc_norm_embedding(embed_tokens(ids))
            return self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))

        def forward(self, embed_tokens, rotary_emb, hidden, next_ids):
            """hidden [B, R, H] = h_0..h_{R-1} (post-final-norm), next_ids [B, R] = x_1..x_R.
            Returns the MTP output hidden m [B, R, H]; row t predicts x_{t+2}. Causal attention over rows, RoPE
            position t (sdpa with no mask = causal)."""
            B, R = next_ids.shape
            u = self.fc_input(embed_tokens, hidden, next_ids)
            pos = torch.arange(R, device=u.device)[None].expand(B, R)
            cos, sin = rotary_emb(u, pos[None].expand(3, B, R))
            mask = None
            if self.lcfg._attn_implementation != "sdpa":
                from transformers.masking_utils import create_causal_mask

                mask = create_causal_mask(config=self.lcfg, inputs_embeds=u, attention_mask=None,
                                          past_key_values=None, position_ids=pos)
            out = self.layers[0](u, position_embeddings=(cos, sin), attention_mask=mask, position_ids=pos)
            return self.norm(out)

        def chain(self, embed_tokens, rotary_emb, hidden, ids_per_step):
            """Chained drafting as the engine runs it (qwen35_arch.md §6.3), for every row at once.
            hidden [B, R, H] = h_0..h_{R-1}; ids_per_step[k-1] [B, R] = the tokens x_{t+k} of step k. Step 1 row t
            is forward()'s row t (position t). Step k >= 2 row t takes step k-1's output m as its hidden and sits
            at position t+k-1; it attends to the step-1 rows 0..t (the MTP KV slots of committed rows, written
            from trunk hiddens) and to its own chain's rows of steps 2..k (the slots drafting wrote). Returns
            [m_1, ..., m_K], each [B, R, H]; m_k row t predicts x_{t+k+1}."""
            B, R = ids_per_step[0].shape
            us, poss, outs = [], [], []
            hid = hidden
            for k, ids in enumerate(ids_per_step):
                us.append(self.fc_input(embed_tokens, hid, ids))
                poss.append(torch.arange(R, device=ids.device) + k)
                u = torch.cat(us, dim=1)
                pos = torch.cat(poss)[None].expand(B, -1)
                cos, sin = rotary_emb(u, pos[None].expand(3, B, -1))
                out = self.layers[0](u, position_embeddings=(cos, sin), attention_mask=self.chain_mask(R, k + 1, u),
                                     position_ids=pos)
                hid = self.norm(out[:, k * R:])
                outs.append(hid)
            return outs

        def chain_mask(self, R, steps, u):
            """[1, 1, steps*R, steps*R] over rows (step a, row t): (a, t) sees (0, j) for j <= t and (b, t) for
            1 <= b <= a. sdpa takes a boolean mask (True = attend), eager an additive one."""
            idx = torch.arange(steps * R, device=u.device)
            a, t = idx // R, idx % R
            ok = ((a[None, :] == 0) & (t[None, :] <= t[:, None])) | (
                (a[None, :] >= 1) & (t[None, :] == t[:, None]) & (a[None, :] <= a[:, None]))
            if self.lcfg._attn_implementation == "sdpa":
                return ok[None, None]
            return torch.zeros(ok.shape, dtype=torch.float32, device=u.device).masked_fill(
                ~ok, torch.finfo(torch.float32).min)[None, None]

    head = MTPHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.zero_()  # (1+w) norms: identity
            else:
                p.normal_(0.0, cfg.initializer_range)
    return head


def param_counts(model, head) -> dict:
    emb = model.model.embed_tokens.weight.numel()
    trunk = sum(p.numel() for n, p in model.named_parameters()) - emb  # tied lm_head not double counted
    mtp = sum(p.numel() for p in head.parameters())
    return {"embedding": emb, "trunk_without_embedding": trunk, "mtp_head": mtp, "total": emb + trunk + mtp}


def gdn_impl_info() -> dict:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    out = {}
    for fname in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                  "causal_conv1d_update"):
        f = getattr(m, fname)
        impl = _find_cell(f, "implementation") or f
        out[fname] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
    out["pure_torch_fallback"] = all(v.startswith("transformers.") for v in out.values())
    try:
        import transformers.integrations.hub_kernels as hk

        out["kernels_hub_enabled"] = bool(getattr(hk, "_kernels_enabled", False))
    except Exception:
        pass
    return out


def bench_layers(model, args, device) -> dict:
    """Forward+backward time of one GDN mixer, one gated-attention mixer and one MLP at the training batch shape
    (bf16 autocast, CUDA), to show what the GDN implementation costs."""
    import torch

    B, T, H = args.batch, args.seq_len, args.hidden
    cos_sin = model.model.rotary_emb(torch.zeros(1, device=device),
                                      torch.arange(T, device=device)[None, None].expand(3, B, T))
    res = {}
    for kind in ("linear_attention", "full_attention"):
        idx = model.config.layer_types.index(kind)
        layer = model.model.layers[idx]
        mixer = layer.linear_attn if kind == "linear_attention" else layer.self_attn
        x = torch.randn(B, T, H, device=device, requires_grad=True)

        def run_mixer_only():
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                y = mixer(hidden_states=x) if kind == "linear_attention" else \
                    mixer(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)[0]
            y.float().square().mean().backward()

        for _ in range(2):
            run_mixer_only()
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(5):
            run_mixer_only()
        torch.cuda.synchronize()
        res[f"{kind}_mixer_fwd_bwd_ms"] = round((time.time() - t0) / 5 * 1e3, 2)
    mlp = model.model.layers[0].mlp
    x = torch.randn(B, T, H, device=device, requires_grad=True)
    for i in range(7):
        if i == 2:
            torch.cuda.synchronize()
            t0 = time.time()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            y = mlp(x)
        y.float().square().mean().backward()
    torch.cuda.synchronize()
    res["mlp_fwd_bwd_ms"] = round((time.time() - t0) / 5 * 1e3, 2)
    model.zero_grad(set_to_none=True)
    return res


def _find_cell(f, name, depth=0):
    """Value of closure variable `name` somewhere inside the decorator chain of f."""
    if depth > 6 or f is None:
        return None
    code = getattr(f, "__code__", None)
    if code is not None and f.__closure__:
        cells = dict(zip(code.co_freevars, f.__closure__))
        if name in cells:
            try:
                return cells[name].cell_contents
            except ValueError:
                return None
        for c in f.__closure__:
            try:
                v = c.cell_contents
            except ValueError:
                continue
            if callable(v):
                r = _find_cell(v, name, depth + 1)
                if r is not None:
                    return r
    return _find_cell(getattr(f, "__wrapped__", None), name, depth + 1)


class PureTorchGDN:
    """Context manager: the GDN helpers resolve to transformers' pure-torch functions (CPU float32 reference), even
    if flash-linear-attention / causal-conv1d are installed."""

    NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update")

    def __enter__(self):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        self.saved = {}
        for n in self.NAMES:
            f = getattr(m, n)
            tf = _find_cell(f, "torch_function")
            if tf is not None and tf is not _find_cell(f, "implementation"):
                self.saved[n] = f
                setattr(m, n, tf)
        return self

    def __exit__(self, *exc):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        for n, f in self.saved.items():
            setattr(m, n, f)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def chat_request_weights(stream, im_start: int, header_len: int):
    """Target weights of a token stream [N] (torch): 0 inside a chat example's request, from its first <|im_start|>
    through the assistant header that the second one opens (header_len tokens: "<|im_start|>assistant\n"), 1
    elsewhere. The request is context, not a target: a model trained to predict requests learns that a bare
    `def f(x):` at the start of a text ends with <|im_end|>, and then answers a plain completion with nothing."""
    import torch

    starts = (stream == im_start).nonzero().flatten()
    assert starts.numel() % 2 == 0, "every chat example has one request and one answer"
    edges = torch.zeros(stream.numel() + header_len + 1, dtype=torch.int32, device=stream.device)
    edges.index_add_(0, starts[0::2], torch.ones_like(starts[0::2], dtype=torch.int32))
    edges.index_add_(0, starts[1::2] + header_len, -torch.ones_like(starts[1::2], dtype=torch.int32))
    return (edges.cumsum(0)[:stream.numel()] == 0).to(torch.float32)


def forward_losses(model, head, x, lam: float, need_stats: bool = False, w=None):
    """x [B, T+1] long. Trunk on x[:, :T] predicts x[:, 1:]; MTP rows t = 0..T-2 use (h_t, x_{t+1}) -> x_{t+2}.
    w [B, T+1]: each token's weight as a target (chat_request_weights); None: all 1."""
    import torch
    import torch.nn.functional as F

    def mean_ce(logits, tgt, weights):
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
        if weights is None:
            return ce.mean()
        weights = weights.reshape(-1)
        return (ce * weights).sum() / weights.sum().clamp(min=1.0)

    inp = x[:, :-1]
    h = model.model(input_ids=inp, use_cache=False).last_hidden_state  # post-final-norm = lm_head input
    logits = model.lm_head(h)
    tgt = x[:, 1:]
    loss_main = mean_ce(logits, tgt, None if w is None else w[:, 1:])
    m = head(model.model.embed_tokens, model.model.rotary_emb, h[:, :-1], x[:, 1:-1])
    mlog = model.lm_head(m)
    mtgt = x[:, 2:]
    loss_mtp = mean_ce(mlog, mtgt, None if w is None else w[:, 2:])
    loss = loss_main + lam * loss_mtp
    if not need_stats:
        return loss, loss_main.detach(), loss_mtp.detach()
    with torch.no_grad():
        pred = logits.argmax(-1)  # [B, T]: pred[:, t] predicts x_{t+1}
        mpred = mlog.argmax(-1)  # [B, T-1]: row t predicts x_{t+2}
        st = {
            "main_correct": (pred == tgt).sum(),
            "main_n": tgt.numel(),
            "mtp_correct": (mpred == mtgt).sum(),
            "mtp_n": mtgt.numel(),
            "agree": (mpred == pred[:, 1:]).sum(),  # draft == trunk's own next-step argmax (greedy acceptance proxy)
            # acceptance proxy restricted to rows where the trunk's argmax at t is right (x_{t+1} = greedy token)
            "agree_given_main_ok": ((mpred == pred[:, 1:]) & (pred[:, :-1] == tgt[:, :-1])).sum(),
            "main_ok_rows": (pred[:, :-1] == tgt[:, :-1]).sum(),
        }
    return loss, loss_main.detach(), loss_mtp.detach(), st


def forward_losses_head(model, head, x, steps: int, distill: bool, need_stats: bool = False):
    """--head-only: the trunk runs without gradients; the head's chained steps 1..steps are trained (step k row t:
    token x_{t+k}, predicts x_{t+k+1}). Target: the data token, or with `distill` the trunk's own distribution at
    row t+k (soft cross-entropy = KL(trunk || head) + const), since a draft is accepted when it agrees with the
    trunk, not with the data. Returns (weighted mean loss over steps, step-1 loss, step-`steps` loss[, stats])."""
    import torch
    import torch.nn.functional as F

    inp = x[:, :-1]
    T = inp.shape[1]
    R = T - steps
    with torch.no_grad():
        h = model.model(input_ids=inp, use_cache=False).last_hidden_state
        logits = model.lm_head(h)
    ms = head.chain(model.model.embed_tokens, model.model.rotary_emb, h[:, :R],
                    [x[:, k:k + R] for k in range(1, steps + 1)])
    losses, st = [], {}
    joint = None
    # Step k's acceptance only counts once steps 1..k-1 were accepted, so earlier steps weigh more: steps-k+1.
    weights = [steps - k for k in range(steps)]
    for k, m in enumerate(ms, 1):
        lsm = F.log_softmax(model.lm_head(m).float(), dim=-1)
        p = F.softmax(logits[:, k:k + R].float(), dim=-1) if distill or need_stats else None
        if distill:
            losses.append(-(p * lsm).sum(-1).mean())
        else:
            losses.append(F.nll_loss(lsm.reshape(-1, lsm.shape[-1]), x[:, k + 1:k + 1 + R].reshape(-1)))
        if need_stats:
            with torch.no_grad():
                agree = lsm.argmax(-1) == logits[:, k:k + R].argmax(-1)
                joint = agree if joint is None else joint & agree
                st[k] = {"agree": agree.sum(), "joint_agree": joint.sum(),
                         "overlap": torch.minimum(p, lsm.exp()).sum(-1).sum(),
                         "data_correct": (lsm.argmax(-1) == x[:, k + 1:k + 1 + R]).sum(), "n": agree.numel()}
    loss = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
    if not need_stats:
        return loss, losses[0].detach(), losses[-1].detach()
    return loss, losses[0].detach(), losses[-1].detach(), st


def evaluate_chain(model, head, windows, batch: int, steps: int, amp_dtype, device) -> dict:
    """Teacher-forced chained drafting on held-out windows, per step k: head argmax == trunk argmax (greedy
    acceptance of position k given the tokens), all steps <= k agreeing (greedy acceptance of the whole prefix),
    sum_v min(p_trunk, q_head) at temperature 1 (the acceptance probability of rejection sampling) and top-1 against
    the data."""
    import torch

    model.eval()
    head.eval()
    tot = {}
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            x = windows[i:i + batch].to(device, non_blocking=True).long()
            with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                st = forward_losses_head(model, head, x, steps, True, need_stats=True)[3]
            for k, d in st.items():
                for n, v in d.items():
                    tot.setdefault(k, {}).setdefault(n, 0.0)
                    tot[k][n] += float(v)
    head.train()
    return {f"step{k}": {"agree_with_trunk_argmax": d["agree"] / d["n"], "all_steps_agree": d["joint_agree"] / d["n"],
                         "sampling_acceptance_T1": d["overlap"] / d["n"], "data_top1": d["data_correct"] / d["n"],
                         "rows": int(d["n"])} for k, d in tot.items()}


def check_chain(model, head, x, steps: int) -> float:
    """head.chain (all rows at once, masked) against drafting one row at a time: step k of row t recomputed as the
    last row of a causal sequence [step-1 rows 0..t, step-2..k rows of t] at positions [0..t, t+1..t+k-1], from
    forward()'s step-1 outputs. float32, TF32 off. Returns the largest |difference|."""
    import torch

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    emb, rot = model.model.embed_tokens, model.model.rotary_emb
    try:
        with torch.no_grad():
            T = x.shape[1] - 1
            R = T - steps
            h = model.model(input_ids=x[:, :-1], use_cache=False).last_hidden_state
            ms = head.chain(emb, rot, h[:, :R], [x[:, k:k + R] for k in range(1, steps + 1)])
            m1 = head(emb, rot, h[:, :R], x[:, 1:1 + R])
            worst = float((ms[0] - m1).abs().max())
            B = x.shape[0]

            for t in sorted({0, 1, R // 2, R - 1}):
                rows = [head.fc_input(emb, h[:, :t + 1], x[:, 1:t + 2])]
                hid = m1[:, t:t + 1]
                for k in range(2, steps + 1):
                    rows.append(head.fc_input(emb, hid, x[:, t + k:t + k + 1]))
                    u = torch.cat(rows, dim=1)
                    pos = torch.cat([torch.arange(t + 1), torch.arange(t + 1, t + k)]).to(x.device)[None].expand(B, -1)
                    cos, sin = rot(u, pos[None].expand(3, B, -1))
                    mask = None
                    if head.lcfg._attn_implementation != "sdpa":
                        from transformers.masking_utils import create_causal_mask

                        mask = create_causal_mask(config=head.lcfg, inputs_embeds=u, attention_mask=None,
                                                  past_key_values=None, position_ids=pos)
                    out = head.layers[0](u, position_embeddings=(cos, sin), attention_mask=mask, position_ids=pos)
                    hid = head.norm(out[:, -1:])
                    worst = max(worst, float((hid[:, 0] - ms[k - 1][:, t]).abs().max()))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return worst


def evaluate(model, head, windows, batch: int, lam: float, amp_dtype, device) -> dict:
    import torch

    model.eval()
    head.eval()
    tot = {"main_loss": 0.0, "mtp_loss": 0.0}
    cnt = {}
    nb = 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            x = windows[i:i + batch].to(device, non_blocking=True).long()
            with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                _, lm, lt, st = forward_losses(model, head, x, lam, need_stats=True)
            w = x.shape[0]
            tot["main_loss"] += float(lm) * w
            tot["mtp_loss"] += float(lt) * w
            nb += w
            for k, v in st.items():
                cnt[k] = cnt.get(k, 0) + int(v)
    model.train()
    head.train()
    return {
        "main_loss": tot["main_loss"] / nb,
        "mtp_loss": tot["mtp_loss"] / nb,
        "main_top1": cnt["main_correct"] / cnt["main_n"],
        "mtp_top1": cnt["mtp_correct"] / cnt["mtp_n"],
        "mtp_agrees_with_trunk_argmax": cnt["agree"] / cnt["mtp_n"],
        "mtp_agrees_with_trunk_argmax_given_trunk_right": cnt["agree_given_main_ok"] / max(1, cnt["main_ok_rows"]),
        "windows": nb,
        "tokens": cnt["main_n"],
    }


def chain_summary(ev: dict) -> str:
    return " | ".join(f"{k}: agree {d['agree_with_trunk_argmax']:.4f} all {d['all_steps_agree']:.4f} sampled "
                      f"{d['sampling_acceptance_T1']:.4f} data {d['data_top1']:.4f}"
                      for k, d in ev.items() if k.startswith("step"))


def lr_at(step: int, progress: float, args) -> float:
    warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
    p = min(1.0, max(0.0, progress))
    return args.lr * warm * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def train(model, head, train_stream, eval_windows, args, device, report, train_weights=None) -> list:
    import torch

    is_cuda = device.type == "cuda"
    amp_dtype = torch.bfloat16 if is_cuda else None
    decay, no_decay = [], []
    trained = (head,) if args.head_only else (model, head)
    if args.head_only:
        model.eval()
        model.requires_grad_(False)
    for mod in trained:
        for n, p in mod.named_parameters():
            if p.ndim >= 2 and "embed_tokens" not in n:
                decay.append(p)
            else:
                no_decay.append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt_kw = {"fused": True} if is_cuda else {}
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **opt_kw)

    T = args.seq_len
    N = train_stream.shape[0]
    assert N > T + 2, f"training stream too short ({N} tokens)"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    offs = torch.arange(T + 1, device=device)

    def batch():
        starts = torch.randint(0, N - T - 1, (args.batch,), device=device, generator=gen)
        idx = starts[:, None] + offs
        return train_stream[idx].long(), None if train_weights is None else train_weights[idx]

    def loss_fn(model, head, x, lam, w):
        return forward_losses(model, head, x, lam, w=w)
    uses_compiled = False
    if args.head_only:
        def loss_fn(model, head, x, lam, w):
            return forward_losses_head(model, head, x, args.mtp_steps, args.distill)
    elif args.compile and train_weights is None:
        try:
            compiled = torch.compile(forward_losses)
            loss_fn = lambda model, head, x, lam, w: compiled(model, head, x, lam)  # noqa: E731
            uses_compiled = True
        except Exception as e:  # noqa: BLE001
            log(f"torch.compile unavailable ({e}); eager")

    t_train0 = time.time()
    deadline = T_START + args.deadline_minutes * 60 - args.export_reserve_s
    end = deadline
    if args.train_minutes is not None:
        end = min(end, t_train0 + args.train_minutes * 60)
    budget = max(1.0, end - t_train0)
    log(f"training: budget {budget:.0f} s (until t={end - T_START:.0f}s), batch {args.batch} x {T + 1} tokens, "
        f"lr {args.lr}, warmup {args.warmup_steps}, mtp lambda {args.mtp_lambda}, amp {amp_dtype}")
    history = []
    step, tokens = 0, 0
    next_eval = t_train0 + args.eval_every_s
    run_main = run_mtp = None
    step_times = []
    t_last, step_last = time.time(), 0
    compiled_ok = not args.compile
    eval_time = 0.0
    while True:
        now = time.time()
        if now >= end or (args.max_steps and step >= args.max_steps):
            break
        progress = (now - t_train0) / budget
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x, xw = batch()
        with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            try:
                loss, lm, lt = loss_fn(model, head, x, args.mtp_lambda, xw)
            except Exception as e:  # noqa: BLE001
                if not uses_compiled:
                    raise
                uses_compiled = False
                log(f"torch.compile failed at the first step ({type(e).__name__}: {e}); falling back to eager")
                loss_fn = lambda model, head, x, lam, w: forward_losses(model, head, x, lam, w=w)  # noqa: E731
                loss, lm, lt = loss_fn(model, head, x, args.mtp_lambda, xw)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_([p for mod in trained for p in mod.parameters()], args.grad_clip)
        opt.step()
        step += 1
        tokens += x.shape[0] * T
        if step == 1 and not compiled_ok:
            log(f"first (compiled) step done after {time.time() - now:.1f}s")
        if step % args.log_every == 0 or step == 1:
            lm_v, lt_v, gn_v = float(lm), float(lt), float(gn)  # syncs
            run_main = lm_v if run_main is None else 0.9 * run_main + 0.1 * lm_v
            run_mtp = lt_v if run_mtp is None else 0.9 * run_mtp + 0.1 * lt_v
            t_now = time.time()
            if step > 1:
                step_times.append((t_now - t_last) / (step - step_last))
            dt = (t_now - t_last) / max(1, step - step_last)
            t_last, step_last = t_now, step
            log(f"step {step:6d} lr {lr:.2e} loss {lm_v:.4f} mtp {lt_v:.4f} (ema {run_main:.3f}/{run_mtp:.3f}) "
                f"|g| {gn_v:.2f} {dt * 1e3:.1f} ms/step {x.shape[0] * T / dt / 1e3:.0f} Ktok/s "
                f"tokens {tokens / 1e6:.1f}M")
        if time.time() >= next_eval:
            te = time.time()
            if args.head_only:
                ev = evaluate_chain(model, head, eval_windows, args.batch, args.mtp_steps, amp_dtype, device)
                log(f"eval step {step}: " + chain_summary(ev))
            else:
                ev = evaluate(model, head, eval_windows, args.batch, args.mtp_lambda, amp_dtype, device)
                log(f"eval step {step}: held-out loss {ev['main_loss']:.4f} top1 {ev['main_top1']:.3f} | MTP loss "
                    f"{ev['mtp_loss']:.4f} top1 {ev['mtp_top1']:.3f} agree {ev['mtp_agrees_with_trunk_argmax']:.3f}")
            ev.update(step=step, tokens=tokens, t=round(time.time() - T_START, 1))
            history.append(ev)
            eval_time += time.time() - te
            t_last, step_last = time.time(), step  # step timing excludes the eval
            next_eval = time.time() + args.eval_every_s
    if is_cuda:
        torch.cuda.synchronize()
    wall = time.time() - t_train0
    st = sorted(step_times)
    report["train"] = {
        "steps": step,
        "tokens_seen": tokens,
        "epochs_over_train_tokens": tokens / max(1, N),
        "wall_s": round(wall, 1),
        "eval_s": round(eval_time, 1),
        "median_step_ms": round(1e3 * st[len(st) // 2], 2) if st else None,
        "tokens_per_s": round(tokens / max(1e-9, wall - eval_time)),
        "batch": args.batch,
        "seq_len": T,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "min_lr_frac": args.min_lr_frac,
        "weight_decay": args.weight_decay,
        "mtp_lambda": args.mtp_lambda,
        "head_only": bool(args.head_only),
        "mtp_steps": args.mtp_steps,
        "distill": bool(args.distill),
        "amp": str(amp_dtype),
        "compile": bool(args.compile),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if is_cuda else "cpu",
    }
    log(f"training done: {step} steps, {tokens / 1e6:.1f}M tokens in {wall:.0f}s")
    return history


# ---------------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------------


def round_params_bf16(*mods):
    import torch

    with torch.no_grad():
        for mod in mods:
            for p in mod.parameters():
                p.copy_(p.to(torch.bfloat16).to(p.dtype))


def export_tensors(model, head, seed: int) -> dict:
    import make_reference_fixtures as mrf
    import torch

    out = {}
    for n, t in model.state_dict().items():
        if n == "lm_head.weight":
            continue  # tied
        assert n.startswith("model."), n
        out["model.language_model." + n[len("model."):]] = t.detach().to("cpu", torch.bfloat16).contiguous()
    for n, t in head.state_dict().items():
        out["mtp." + n] = t.detach().to("cpu", torch.bfloat16).contiguous()
    for n, t in mrf.fake_vision_tensors(seed, torch.bfloat16).items():
        out[n] = t
    return out


def write_model_dir(out: Path, tok, tc: dict, tensors: dict):
    import make_placeholder_model as mpm
    import make_reference_fixtures as mrf
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    case = {"layout": "wrapper", "text": tc, "tied": True}
    (out / "config.json").write_text(json.dumps(mrf.full_config(case), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(mpm.tokenizer_config(tok), indent=2) + "\n")
    eot, ime = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    gen = {"bos_token_id": eot, "do_sample": True, "eos_token_id": [ime, eot], "pad_token_id": eot,
           "temperature": 0.7, "top_k": 20, "top_p": 0.95, "transformers_version": "5.17.0"}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def pick_samples(held_docs: list[np.ndarray], tok, n: int, plen: int, clen: int, seed: int) -> list[tuple]:
    """(doc index, start) of n windows of plen+clen tokens inside held-out files, starting at a line start, one per
    file (more if there are too few files)."""
    rng = np.random.RandomState(seed)
    nl_ids = {i for tkn, i in tok.get_vocab().items() if tkn.endswith("Ċ")}  # ByteLevel '\n' = 'Ċ'
    order = rng.permutation(len(held_docs))
    picks = []
    for rounds in range(4):
        for di in order:
            d = held_docs[di]
            if len(d) < plen + clen + 2:
                continue
            cands = [s for s in range(1, len(d) - plen - clen) if int(d[s - 1]) in nl_ids]
            cands = [s for s in cands if (int(di), s) not in picks]
            if not cands:
                continue
            picks.append((int(di), int(cands[rng.randint(len(cands))])))
            if len(picks) == n:
                return picks
    return picks


def teacher_forced_argmax(ref_model, head, ids):
    """float32, one sequence [n]: (trunk argmax [n], mtp argmax [n-1], top1-top2 margins)."""
    import torch

    with torch.no_grad():
        x = ids[None]
        h = ref_model.model(input_ids=x, use_cache=False).last_hidden_state
        logits = ref_model.lm_head(h)[0]
        m = head(ref_model.model.embed_tokens, ref_model.model.rotary_emb, h[:, :-1], x[:, 1:])
        mlog = ref_model.lm_head(m)[0]
    t2 = logits.topk(2, -1).values
    m2 = mlog.topk(2, -1).values
    return logits.argmax(-1), mlog.argmax(-1), (t2[:, 0] - t2[:, 1]), (m2[:, 0] - m2[:, 1])


def finalize(args, out: Path, tok, tc: dict, model, head, held_docs, report: dict, device):
    """Round to bf16, final float32 eval, export, references, samples, reload check."""
    import make_reference_fixtures as mrf
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    round_params_bf16(model, head)
    tensors = export_tensors(model, head, args.seed)
    mtp_names = sorted(n for n in tensors if n.startswith("mtp."))
    expect = mrf.mtp_shapes(tc)
    assert mtp_names == sorted(expect), (mtp_names, sorted(expect))
    for n in mtp_names:
        assert tuple(tensors[n].shape) == tuple(expect[n]), (n, tensors[n].shape, expect[n])
    write_model_dir(out, tok, tc, tensors)
    size = (out / "model.safetensors").stat().st_size
    log(f"wrote {out}/model.safetensors: {size} B ({size / MIB:.2f} MiB), {len(tensors)} tensors "
        f"({len(mtp_names)} mtp.*)")
    report["export"] = {"model_safetensors_bytes": size, "tensors": len(tensors), "mtp_tensors": mtp_names}

    # float32 reference copy on the CPU: eager attention, pure-torch GDN, TF32 off, exactly the stored bf16 values
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg_eager = hf_config(tc, "eager")
    ref = Qwen3_5ForCausalLM(cfg_eager).float().eval()
    ref.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()}, strict=True)
    ref_head = make_mtp_head(cfg_eager).float().eval()
    ref_head.load_state_dict({k: v.detach().float().cpu() for k, v in head.state_dict().items()}, strict=True)
    mtp_sd = {n: t.float() for n, t in tensors.items() if n.startswith("mtp.")}

    # held-out samples (prompt + continuation), picked from held-out files
    plen, clen = args.sample_len, args.sample_len
    picks = pick_samples(held_docs, tok, args.n_samples + 2, plen, clen, args.seed)
    assert len(picks) >= 3, "too few held-out files for samples"
    ref_picks, sample_picks = picks[:2], picks[2:]

    refd, mtp_diff = {}, 0.0
    with PureTorchGDN():
        for i, (di, s) in enumerate(ref_picks):
            ids = torch.from_numpy(held_docs[di][s:s + args.ref_len].astype(np.int64))
            with torch.no_grad():
                h = ref.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
                logits = ref.lm_head(h)
                ml, mh = mrf.mtp_forward_hf(ref, mtp_sd, cfg_eager, ids, h)
                mine = ref_head(ref.model.embed_tokens, ref.model.rotary_emb, h[None, :-1], ids[None, 1:])[0]
            mtp_diff = max(mtp_diff, float((mine - mh).abs().max()))
            refd[f"prompt_{i}"] = ids.to(torch.int32).contiguous()
            refd[f"logits_{i}"] = logits.float().contiguous()
            refd[f"hidden_{i}"] = h.float().contiguous()
            refd[f"mtp_logits_{i}"] = ml.float().contiguous()
            refd[f"mtp_hidden_{i}"] = mh.float().contiguous()
        save_file(refd, str(out / "reference.safetensors"), metadata={
            "generator": "scripts/train_small_model.py: transformers float32 CPU eager, bf16-rounded weights; "
                         "mtp_* = make_reference_fixtures.mtp_forward_hf (teacher-forced)"})
        log(f"reference.safetensors: 2 held-out prompts of {args.ref_len} tokens; training MTP module vs "
            f"mtp_forward_hf max |diff| = {mtp_diff:.2e}")
        assert mtp_diff < 1e-4, f"training MTP module != mtp_forward_hf ({mtp_diff})"
        report["checks"] = {"mtp_module_vs_mtp_forward_hf_max_abs": mtp_diff}

        # reload the written directory through transformers and compare with the float32 in-memory model
        import logging

        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

        transformers.logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        ids = refd["prompt_1"].long()[None]
        rl = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
        with torch.no_grad():
            d_cg = float((rl(input_ids=ids, use_cache=False).logits[0].float() - refd["logits_1"]).abs().max())
        del rl
        try:
            ra = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
            with torch.no_grad():
                d_auto = float((ra(input_ids=ids, use_cache=False).logits[0].float() - refd["logits_1"]).abs().max())
            auto_cls = type(ra).__name__
            del ra
        except Exception as e:  # noqa: BLE001
            d_auto, auto_cls = None, f"failed: {type(e).__name__}: {e}"
        transformers.logging.set_verbosity_warning()
        log(f"reload check: Qwen3_5ForConditionalGeneration max |logits diff| = {d_cg:.2e}; AutoModelForCausalLM "
            f"({auto_cls}) = {d_auto}")
        assert d_cg < 1e-4, f"reloaded model logits differ by {d_cg}"
        report["checks"].update(reload_conditional_generation_max_abs=d_cg, reload_auto_causal_lm_max_abs=d_auto,
                                reload_auto_class=auto_cls)

        # samples: teacher-forced argmax over prompt+continuation, greedy continuation (float32, CPU)
        samples = []
        gcfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=args.greedy_tokens,
                                min_new_tokens=args.greedy_tokens, eos_token_id=None, bos_token_id=None,
                                pad_token_id=0, use_cache=True, output_logits=True, return_dict_in_generate=True)
        P = torch.stack([torch.from_numpy(held_docs[di][s:s + plen].astype(np.int64)) for di, s in sample_picks])
        with torch.no_grad():
            g = ref.generate(input_ids=P, attention_mask=torch.ones_like(P), generation_config=gcfg)
        glog = torch.stack([l.float() for l in g.logits], dim=1)  # [n, G, V]
        gtop = glog.topk(2, -1).values
        gmargin = gtop[..., 0] - gtop[..., 1]
        tf_main = tf_mtp = tf_main_n = tf_mtp_n = 0
        for k, (di, s) in enumerate(sample_picks):
            d = held_docs[di]
            full = torch.from_numpy(d[s:s + plen + clen].astype(np.int64))
            am, amt, mm, mmt = teacher_forced_argmax(ref, ref_head, full)
            main_ok = int((am[:-1] == full[1:]).sum())
            mtp_ok = int((amt[:-1] == full[2:]).sum())  # the last MTP row predicts beyond the window
            tf_main += main_ok
            tf_mtp += mtp_ok
            tf_main_n += len(full) - 1
            tf_mtp_n += len(full) - 2
            greedy = g.sequences[k, plen:].tolist()
            samples.append({
                "file": None,  # filled below
                "prompt_ids": full[:plen].tolist(),
                "prompt_text": tok.decode(full[:plen].tolist(), skip_special_tokens=False),
                "next_ids": full[plen:].tolist(),
                "next_text": tok.decode(full[plen:].tolist(), skip_special_tokens=False),
                "greedy_ids": greedy,
                "greedy_text": tok.decode(greedy, skip_special_tokens=False),
                "greedy_margins": [round(float(v), 5) for v in gmargin[k]],
                "teacher_forced": {
                    "ids": full.tolist(),
                    "trunk_argmax": am.tolist(),
                    "trunk_margin": [round(float(v), 5) for v in mm],
                    "mtp_argmax": amt.tolist(),
                    "mtp_margin": [round(float(v), 5) for v in mmt],
                    "trunk_correct": main_ok,
                    "mtp_correct": mtp_ok,
                },
            })
    for smp, (di, s) in zip(samples, sample_picks):
        smp["file"] = report["_held_names"][di]
        smp["start_token"] = s
    (out / "heldout_samples.json").write_text(json.dumps({
        "description": "held-out code windows: prompt_ids (64) + next_ids (64 real tokens); greedy_ids = "
                       "transformers float32 greedy continuation of prompt_ids; teacher_forced over prompt+next: "
                       "trunk_argmax[t] predicts ids[t+1], mtp_argmax[t] (inputs h_t, ids[t+1]) predicts ids[t+2]",
        "teacher_forced_trunk_top1": tf_main / tf_main_n,
        "teacher_forced_mtp_top1": tf_mtp / tf_mtp_n,
        "samples": samples}, indent=1) + "\n")
    report["samples"] = {"n": len(samples), "prompt_tokens": plen, "teacher_forced_trunk_top1": tf_main / tf_main_n,
                         "teacher_forced_mtp_top1": tf_mtp / tf_mtp_n, "greedy_tokens": args.greedy_tokens}
    log(f"heldout_samples.json: {len(samples)} samples; teacher-forced trunk top1 {tf_main / tf_main_n:.3f}, "
        f"MTP top1 {tf_mtp / tf_mtp_n:.3f}")
    s0 = samples[0]
    log(f"sample 0 prompt: {s0['prompt_text'][-200:]!r}\n          greedy: {s0['greedy_text']!r}")


# ---------------------------------------------------------------------------------------------------------------
# Engine check
# ---------------------------------------------------------------------------------------------------------------


def check_engine(binary: str, out: Path, threads: int = 0) -> dict:
    """Compares the mtpx engine with reference.safetensors / heldout_samples.json in `out`. Returns a dict; ok=True
    iff every logits / hidden / mtp_logits row has relative max-abs error < 1e-3 (max |engine - ref| over the row
    divided by max |ref| over the row)."""
    from safetensors.numpy import load_file

    binary = str(Path(binary).resolve())
    thr = ["--threads", str(threads)] if threads else []
    res = {"binary": binary, "rows": {}, "ok": True}
    ref = load_file(str(out / "reference.safetensors"))
    n_prompts = len([k for k in ref if k.startswith("prompt_")])
    with tempfile.TemporaryDirectory() as td:
        for i in range(n_prompts):
            ids = ",".join(str(int(v)) for v in ref[f"prompt_{i}"])
            f = os.path.join(td, f"e{i}.safetensors")
            subprocess.run([binary, "logits", "--model", str(out), "--prompt-ids", ids, "--mtp", "--out", f] + thr,
                           check=True, capture_output=True, text=True)
            eng = load_file(f)
            assert np.array_equal(eng["prompt"], ref[f"prompt_{i}"]), "engine prompt ids differ"
            for name in ("logits", "hidden", "mtp_logits"):
                a, b = eng[name].astype(np.float64), ref[f"{name}_{i}"].astype(np.float64)
                assert a.shape == b.shape, (name, a.shape, b.shape)
                rel = np.abs(a - b).max(-1) / np.maximum(np.abs(b).max(-1), 1e-30)
                worst = float(rel.max()) if rel.size else 0.0
                res["rows"][f"{name}_{i}"] = {"rows": int(a.shape[0]), "max_rel_row_err": worst,
                                              "max_abs_err": float(np.abs(a - b).max()) if a.size else 0.0}
                if not worst < 1e-3:
                    res["ok"] = False
        for k, v in res["rows"].items():
            print(f"  engine vs transformers {k:14s}: rows {v['rows']:3d}  max rel row err {v['max_rel_row_err']:.2e}"
                  f"  max abs {v['max_abs_err']:.2e}")

        sp = out / "heldout_samples.json"
        cfg = json.loads((out / "config.json").read_text())
        import make_placeholder_model as mpm

        n_regular = cfg.get("text_config", cfg)["vocab_size"] - len(mpm.SPECIALS)  # the specials are the last ids
        if sp.exists():
            S = json.loads(sp.read_text())
            agree_t = agree_m = n_t = n_m = ok_t = ok_m = ok_t_ref = ok_m_ref = 0
            unsure = 0
            greedy_match = greedy_cmp = 0
            mtp_same_as_plain = 0
            acc = {"drafted": 0, "accepted": 0, "steps": 0, "generated": 0}
            json_errors = 0
            for k, smp in enumerate(S["samples"]):
                tf = smp["teacher_forced"]
                ids = tf["ids"]
                f = os.path.join(td, f"s{k}.safetensors")
                subprocess.run([binary, "logits", "--model", str(out), "--prompt-ids", ",".join(map(str, ids)),
                                "--mtp", "--out", f] + thr, check=True, capture_output=True, text=True)
                eng = load_file(f)
                ea = eng["logits"].argmax(-1)
                em = eng["mtp_logits"].argmax(-1)
                for t in range(len(ids) - 1):
                    n_t += 1
                    ok_t += int(ea[t] == ids[t + 1])
                    if ea[t] == tf["trunk_argmax"][t]:
                        agree_t += 1
                    elif tf["trunk_margin"][t] < 1e-3:
                        unsure += 1
                for t in range(len(ids) - 2):
                    n_m += 1
                    ok_m += int(em[t] == ids[t + 2])
                    if em[t] == tf["mtp_argmax"][t]:
                        agree_m += 1
                    elif tf["mtp_margin"][t] < 1e-3:
                        unsure += 1
                ok_t_ref += tf["trunk_correct"]
                ok_m_ref += tf["mtp_correct"]
                # greedy generation: plain and MTP (draft 2)
                outs = {}
                for mode, extra in (("plain", ["--no-mtp"]), ("mtp", ["--mtp", "--draft", "2"])):
                    r = subprocess.run([binary, "generate", "--model", str(out), "--prompt-ids",
                                        ",".join(map(str, smp["prompt_ids"])), "--max-tokens",
                                        str(len(smp["greedy_ids"])), "--temperature", "0", "--json"] + extra + thr,
                                       capture_output=True, text=True)
                    if r.returncode != 0:
                        json_errors += 1
                        outs[mode] = None
                        continue
                    j = json.loads(r.stdout)
                    outs[mode] = j
                if outs.get("plain") is not None:
                    toks = outs["plain"]["tokens"]
                    ref_toks = smp["greedy_ids"]
                    # compare up to the first near-tie of the reference, and up to the engine's first special
                    # token: the reference was generated with min_new_tokens, which suppresses end-of-text
                    lim = len(ref_toks)
                    for t, mg in enumerate(smp["greedy_margins"]):
                        if mg < 1e-3:
                            lim = t + 1
                            break
                    first_special = next((t for t, x in enumerate(toks) if x >= n_regular), len(toks))
                    lim = min(lim, first_special)
                    greedy_cmp += 1
                    greedy_match += int(toks[:lim] == ref_toks[:lim])
                    if outs.get("mtp") is not None:
                        mtp_same_as_plain += int(outs["mtp"]["tokens"] == toks)
                if outs.get("mtp") is not None:
                    st = outs["mtp"].get("stats", {}).get("mtp", {})
                    acc["drafted"] += int(st.get("drafted", 0))
                    acc["accepted"] += int(st.get("accepted", 0))
                    acc["steps"] += int(st.get("steps", 0))
                    acc["generated"] += len(outs["mtp"]["tokens"])
            res["samples"] = {
                "n": len(S["samples"]),
                "engine_trunk_top1": ok_t / n_t, "pytorch_trunk_top1": ok_t_ref / n_t,
                "engine_mtp_top1": ok_m / n_m, "pytorch_mtp_top1": ok_m_ref / n_m,
                "trunk_argmax_agreement": agree_t / n_t, "mtp_argmax_agreement": agree_m / n_m,
                "disagreements_at_near_ties": unsure,
                "greedy_prefix_match": f"{greedy_match}/{greedy_cmp}",
                "mtp_greedy_equals_plain_greedy": f"{mtp_same_as_plain}/{greedy_cmp}",
                "mtp_draft2_acceptance": acc["accepted"] / max(1, acc["drafted"]),
                "mtp_draft2_tokens_per_step": acc["generated"] / max(1, acc["steps"]),
                "generate_json_errors": json_errors,
            }
            s = res["samples"]
            print(f"  teacher-forced on {s['n']} held-out samples: trunk top1 engine {s['engine_trunk_top1']:.4f} / "
                  f"pytorch {s['pytorch_trunk_top1']:.4f}; MTP top1 engine {s['engine_mtp_top1']:.4f} / pytorch "
                  f"{s['pytorch_mtp_top1']:.4f}; argmax agreement trunk {s['trunk_argmax_agreement']:.4f} MTP "
                  f"{s['mtp_argmax_agreement']:.4f}")
            print(f"  greedy vs transformers: {s['greedy_prefix_match']} match; --mtp --draft 2 == plain: "
                  f"{s['mtp_greedy_equals_plain_greedy']}; acceptance {s['mtp_draft2_acceptance']:.3f}, "
                  f"{s['mtp_draft2_tokens_per_step']:.2f} tokens/step; generate --json failures {json_errors}")
            if s["engine_mtp_top1"] != s["pytorch_mtp_top1"] and s["disagreements_at_near_ties"] == 0:
                res["ok"] = False
    r = subprocess.run([binary, "generate", "--model", str(out), "--prompt", "def add(a, b):", "--max-tokens", "20",
                        "--mtp", "--draft", "2", "--seed", "1"] + thr, capture_output=True, text=True)
    res["generate_demo"] = {"rc": r.returncode, "stdout": r.stdout, "stderr_tail": r.stderr[-400:]}
    print(f"  generate --prompt 'def add(a, b):' --mtp --draft 2 (rc {r.returncode}): {r.stdout!r}")
    print(f"    {r.stderr.strip()[-300:]}")
    if r.returncode != 0:
        res["ok"] = False
    print(f"ENGINE CHECK {'PASSED' if res['ok'] else 'FAILED'}")
    return res


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    if args.check_only:
        if not args.check_engine:
            sys.exit("--check-only needs --check-engine BINARY")
        res = check_engine(args.check_engine, out, args.engine_threads)
        sys.exit(0 if res["ok"] else 1)

    report = {"args": vars(args).copy(), "timing": {}}
    # ---- data (before any CUDA work) ----
    t = time.time()
    data = collect_files(args)
    train_files, held_files = data["train"], data["held"]
    log(f"data: {len(train_files)} train + {len(held_files)} held-out files, {data['bytes'] / 1e6:.1f} MB "
        f"(of {data['candidates']} candidate files; skipped {data['skipped']}); roots {data['roots']}")
    report["timing"]["collect_s"] = round(time.time() - t, 1)

    t = time.time()
    tok_texts, b = [], 0
    init = load_init_dir(Path(args.init_from)) if args.init_from else None
    if init:
        tok = init["tokenizer"]
        log(f"init from {args.init_from}: its tokenizer, config and {len(init['tensors'])} tensors")
        report["init_from"] = {"dir": str(args.init_from), "report": init["report"]}
    else:
        for _, text in train_files:
            if b >= args.tok_train_mb * 1e6:
                break
            tok_texts.append(text)
            b += len(text.encode())
        tok = build_tokenizer(tok_texts, args.vocab)
    ntok = tok.get_vocab_size()
    eot = tok.token_to_id("<|endoftext|>")
    log(f"tokenizer: {ntok} tokens (trained on {b / 1e6:.1f} MB); <|endoftext|>={eot} <|im_start|>="
        f"{tok.token_to_id('<|im_start|>')} <|im_end|>={tok.token_to_id('<|im_end|>')}")
    report["timing"]["tokenizer_train_s"] = round(time.time() - t, 1)

    t = time.time()
    dtype = np.uint16 if ntok <= 65535 else np.int32
    workers = args.workers or os.cpu_count() or 1
    train_docs = encode_docs(tok, [x for _, x in train_files], workers, dtype)
    held_docs = encode_docs(tok, [x for _, x in held_files], workers, dtype)
    chat_held_stream = None
    if args.chat_frac > 0:
        tc0 = time.time()
        chat_train = chat_docs_of(train_files, args.chat_max_lines, workers)
        chat_held = chat_docs_of(held_files, args.chat_max_lines, workers)
        chat_train_docs = encode_docs(tok, chat_train, workers, dtype)
        chat_held_stream = join_docs(encode_docs(tok, chat_held, workers, dtype), eot, dtype)
        ime = tok.token_to_id("<|im_end|>")
        assert all(int(d[-2]) == ime for d in chat_train_docs[:100]), "chat examples must end with <|im_end|> \\n"
        train_docs, chat_tokens = mix_chat(train_docs, chat_train_docs, args.chat_frac, args.seed)
        report["chat"] = {"frac": args.chat_frac, "train_examples": len(chat_train),
                          "train_example_tokens": int(sum(d.size for d in chat_train_docs)),
                          "train_tokens_used": chat_tokens, "heldout_examples": len(chat_held),
                          "heldout_tokens": int(chat_held_stream.size), "build_s": round(time.time() - tc0, 1),
                          "example": chat_train[0] if chat_train else None}
        log(f"chat: {len(chat_train)} train examples ({report['chat']['train_example_tokens'] / 1e6:.2f}M tokens; "
            f"{chat_tokens / 1e6:.2f}M in the mix), {len(chat_held)} held-out, {report['chat']['build_s']}s")
        del chat_train, chat_train_docs
    train_stream = join_docs(train_docs, eot, dtype)
    old_of_new = None
    if args.rank_vocab:
        tok, new_of_old, report["rank_vocab"] = rank_vocab(tok, train_stream)
        old_of_new = np.argsort(new_of_old)
        train_stream = new_of_old[train_stream].astype(dtype)
        held_docs = [new_of_old[d].astype(dtype) for d in held_docs]
        log(f"vocabulary ranked by frequency: {report['rank_vocab']}")
    held_stream = join_docs(held_docs, eot, dtype)
    train_bytes = sum(len(x.encode()) for _, x in train_files)
    held_bytes = sum(len(x.encode()) for _, x in held_files)
    report["_held_names"] = [r for r, _ in held_files]
    del train_docs
    log(f"tokenized with {workers} processes: train {train_stream.size / 1e6:.2f}M tokens "
        f"({train_bytes / max(1, train_stream.size):.2f} bytes/token), held-out {held_stream.size / 1e6:.3f}M tokens")
    report["timing"]["tokenize_s"] = round(time.time() - t, 1)
    report["data"] = {
        "roots": data["roots"], "candidate_files": data["candidates"], "skipped": data["skipped"],
        "train_files": len(train_files), "heldout_files": len(held_files), "train_bytes": train_bytes,
        "heldout_bytes": held_bytes, "train_tokens": int(train_stream.size), "heldout_tokens": int(held_stream.size),
        "tokenizer_train_bytes": b, "tokenizer_size": ntok, "bytes_per_token": train_bytes / max(1, train_stream.size),
        "heldout_rule": f"sha1('heldout:'+relpath) % 10000 < {args.heldout_frac * 10000:g}",
    }
    del train_files, held_files, data, tok_texts

    # ---- model ----
    import torch

    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    V = (ntok + 63) // 64 * 64
    tc = init["text_config"] if init else text_config_dict(args, V, eot)
    assert tc["vocab_size"] == V, (tc["vocab_size"], V)
    cfg = hf_config(tc, "sdpa")
    model = Qwen3_5ForCausalLM(cfg)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
    if V > ntok:
        with torch.no_grad():
            model.model.embed_tokens.weight[ntok:] = 0.0  # rows no token maps to
    head = make_mtp_head(cfg)
    if init:
        if old_of_new is not None:
            init["tensors"] = permute_embedding(init["tensors"], old_of_new)
        load_init_weights(model, head, init["tensors"])
    pc = param_counts(model, head)
    bf16_mib = (pc["total"] * 2) / MIB
    log(f"model: V {V} H {tc['hidden_size']} L {tc['num_hidden_layers']} {tc['layer_types']} I "
        f"{tc['intermediate_size']} attn {tc['num_attention_heads']}/{tc['num_key_value_heads']}x{tc['head_dim']} "
        f"GDN {tc['linear_num_key_heads']}/{tc['linear_num_value_heads']} x {tc['linear_key_head_dim']}/"
        f"{tc['linear_value_head_dim']}; params {pc} = {bf16_mib:.2f} MiB bf16")
    assert bf16_mib <= args.max_model_mib, f"model too large: {bf16_mib:.2f} MiB > {args.max_model_mib}"
    report["params"] = pc
    report["params"]["bf16_mib"] = round(bf16_mib, 3)
    report["model_config"] = tc
    report["gdn_impl"] = gdn_impl_info()
    log(f"GDN implementation: {report['gdn_impl']}")
    model.to(device).train()
    head.to(device).train()
    if device.type == "cuda" and not args.head_only:
        try:
            report["layer_bench_batch_shape"] = bench_layers(model, args, device)
            log(f"layer fwd+bwd at batch shape {args.batch}x{args.seq_len} (bf16 autocast): "
                f"{report['layer_bench_batch_shape']}")
        except Exception as e:  # noqa: BLE001
            log(f"layer benchmark failed: {type(e).__name__}: {e}")

    # the MTP hidden is the post-final-norm one: last_hidden_state == model.norm output == lm_head input
    cap = {}
    h1 = model.model.norm.register_forward_hook(lambda m, i, o: cap.__setitem__("norm", o.detach()))
    h2 = model.lm_head.register_forward_pre_hook(lambda m, i: cap.__setitem__("head_in", i[0].detach()))
    with torch.no_grad():
        xs = torch.from_numpy(held_stream[:33].astype(np.int64))[None].to(device)
        o = model.model(input_ids=xs, use_cache=False, output_hidden_states=True)
        model.lm_head(o.last_hidden_state)
    h1.remove()
    h2.remove()
    post_ok = bool(torch.equal(o.last_hidden_state, cap["norm"]) and torch.equal(cap["norm"], cap["head_in"]))
    hs_last_post = bool(o.hidden_states is not None and torch.allclose(o.hidden_states[-1], cap["norm"]))
    assert post_ok, "last_hidden_state is not the model.norm output"
    report["checks_startup"] = {"last_hidden_state_is_norm_output_and_lm_head_input": post_ok,
                                "output_hidden_states_last_is_postnorm": hs_last_post}
    log(f"post-norm check: last_hidden_state == norm output == lm_head input: {post_ok}; "
        f"output_hidden_states[-1] post-norm: {hs_last_post}")

    # ---- data on the device ----
    T = args.seq_len
    tdt = torch.int32
    train_t = torch.from_numpy(train_stream.astype(np.int32)).to(device)
    nwin = held_stream.size // (T + 1)

    def windows(stream, k):
        """k windows of T + 1 tokens spread evenly over the whole stream (not just its first files)."""
        n = stream.size // (T + 1)
        all_w = torch.from_numpy(stream[:n * (T + 1)].astype(np.int32)).view(n, T + 1).to(tdt)
        return all_w[torch.from_numpy(np.unique(np.linspace(0, n - 1, min(n, k)).round().astype(np.int64)))]

    eval_w = windows(held_stream, args.eval_windows)
    final_w = windows(held_stream, args.final_eval_windows)
    chat_w = None
    if chat_held_stream is not None and chat_held_stream.size > T + 1:
        chat_w = windows(chat_held_stream, args.final_eval_windows)
    log(f"held-out eval: {eval_w.shape[0]} windows periodic, {final_w.shape[0]} final (of {nwin})")
    report["timing"]["prep_s"] = round(time.time() - T_START, 1)

    if args.head_only:
        xs = torch.from_numpy(held_stream[:4 * 65].astype(np.int64)).view(4, 65).to(device)
        diff = check_chain(model, head, xs, max(2, args.mtp_steps))
        log(f"chained drafting, all rows at once vs one row at a time: max |diff| {diff:.2e}")
        assert diff < 1e-4, f"head.chain differs from drafting row by row ({diff})"
        report["checks_startup"]["chain_vs_row_by_row_max_abs"] = diff
        amp = torch.bfloat16 if device.type == "cuda" else None
        ev0 = evaluate_chain(model, head, final_w, args.batch, args.mtp_steps, amp, device)
        report["chain_eval_before"] = ev0
        log(f"before training (held-out, {final_w.shape[0]} windows): " + chain_summary(ev0))

    train_w = None
    if args.chat_frac > 0 and not args.head_only:
        header = tok.encode("<|im_start|>assistant\n").ids
        assert header[0] == tok.token_to_id("<|im_start|>"), header
        train_w = chat_request_weights(train_t, header[0], len(header))
        report["chat"]["request_tokens_not_targets"] = int((train_w == 0).sum())
        log(f"chat: {report['chat']['request_tokens_not_targets'] / 1e6:.2f}M request tokens are context only")
    history = train(model, head, train_t, eval_w, args, device, report, train_w)
    del train_t
    report["eval_history"] = history
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({k: v for k, v in report.items() if not k.startswith("_")},
                                                indent=1, default=str) + "\n")  # overwritten at the end

    # ---- final float32 eval on the bf16-rounded weights ----
    t = time.time()
    round_params_bf16(model, head)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with PureTorchGDN() if device.type == "cpu" else _null():
        fin = evaluate(model, head, final_w, args.batch, args.mtp_lambda, None, device)
        if args.head_only:
            fin_chain = evaluate_chain(model, head, final_w, args.batch, args.mtp_steps, None, device)
            report["chain_eval_after_fp32_bf16_weights"] = fin_chain
            log(f"FINAL chained drafting (float32, exported bf16 weights): " + chain_summary(fin_chain))
    report["final_heldout_eval_fp32_bf16_weights"] = fin
    if chat_w is not None:
        with PureTorchGDN() if device.type == "cpu" else _null():
            fin_chat = evaluate(model, head, chat_w, args.batch, args.mtp_lambda, None, device)
        report["final_chat_heldout_eval_fp32_bf16_weights"] = fin_chat
        log(f"FINAL held-out chat exchanges ({fin_chat['tokens']} tokens): trunk loss {fin_chat['main_loss']:.4f} "
            f"top1 {fin_chat['main_top1']:.4f} | MTP argmax == trunk argmax {fin_chat['mtp_agrees_with_trunk_argmax']:.4f}")
    log(f"FINAL held-out (float32, exported bf16 weights, {fin['tokens']} tokens): trunk loss {fin['main_loss']:.4f} "
        f"top1 {fin['main_top1']:.4f} | MTP loss {fin['mtp_loss']:.4f} top1 {fin['mtp_top1']:.4f} | MTP argmax == "
        f"trunk argmax {fin['mtp_agrees_with_trunk_argmax']:.4f} (given trunk right "
        f"{fin['mtp_agrees_with_trunk_argmax_given_trunk_right']:.4f})")
    report["timing"]["final_eval_s"] = round(time.time() - t, 1)

    t = time.time()
    model.cpu()
    head.cpu()
    finalize(args, out, tok, tc, model, head, held_docs, report, device)
    if init:
        keep_init_files(Path(args.init_from), out, init["tensors"], args.head_only, keep_tokenizer=not args.rank_vocab)
    report["timing"]["export_s"] = round(time.time() - t, 1)
    report["timing"]["total_s"] = round(time.time() - T_START, 1)
    report.pop("_held_names", None)
    report["summary"] = {
        "model_safetensors_mib": round(report["export"]["model_safetensors_bytes"] / MIB, 3),
        "params_total": pc["total"], "steps": report["train"]["steps"],
        "tokens_seen": report["train"]["tokens_seen"], "train_wall_s": report["train"]["wall_s"],
        "heldout_trunk_loss": fin["main_loss"], "heldout_trunk_top1": fin["main_top1"],
        "heldout_mtp_loss": fin["mtp_loss"], "heldout_mtp_top1": fin["mtp_top1"],
        "heldout_mtp_argmax_equals_trunk_argmax": fin["mtp_agrees_with_trunk_argmax"],
        "gdn_pure_torch_fallback": report["gdn_impl"]["pure_torch_fallback"],
        "total_wall_s": report["timing"]["total_s"],
    }
    report["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                          "tokenizers": __import__("tokenizers").__version__, "python": sys.version.split()[0]}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")

    files = sorted(out.iterdir())
    extra = [f.name for f in files if f.name not in OUT_FILES]
    for f in files:
        log(f"  {f.name:26s} {f.stat().st_size:10d} B")
    big = [f.name for f in files if f.stat().st_size > 16 * MIB]
    if extra or big:
        log(f"WARNING: files beyond the 8 expected: {extra}; over 16 MiB: {big}")
    log(f"done in {time.time() - T_START:.0f}s")

    if args.check_engine:
        res = check_engine(args.check_engine, out, args.engine_threads)
        if not res["ok"]:
            sys.exit(1)


def load_init_dir(d: Path) -> dict:
    """A model directory written by this script: tokenizer, text_config, tensors and its report (if any)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    cfg = json.loads((d / "config.json").read_text())
    assert "text_config" in cfg, f"{d}/config.json: expected the Qwen3_5ForConditionalGeneration layout"
    tc = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
    rep = d / "report.json"
    return {"tokenizer": Tokenizer.from_file(str(d / "tokenizer.json")), "text_config": tc,
            "tensors": load_file(str(d / "model.safetensors")),
            "report": json.loads(rep.read_text()) if rep.exists() else None}


def load_init_weights(model, head, tensors: dict):
    import torch

    trunk = {"model." + n[len("model.language_model."):]: t for n, t in tensors.items()
             if n.startswith("model.language_model.")}
    mtp = {n[len("mtp."):]: t for n, t in tensors.items() if n.startswith("mtp.")}
    with torch.no_grad():
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in trunk.items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        head.load_state_dict({k: v.float() for k, v in mtp.items()}, strict=True)


def rank_vocab(tok, train_stream: np.ndarray):
    """Renumbers the BPE tokens by descending count in `train_stream` (ties: old id order); the special tokens
    (added after the BPE vocabulary) keep their ids. Returns the new tokenizer, new_of_old (old id -> new id) and
    coverage figures. Encoding is unchanged up to the renumbering (BPE merges are stored as strings)."""
    import make_placeholder_model as mpm
    from tokenizers import Tokenizer

    ntok = tok.get_vocab_size()
    nbpe = ntok - len(mpm.SPECIALS)
    counts = np.bincount(train_stream.astype(np.int64), minlength=ntok)
    order = np.argsort(-counts[:nbpe], kind="stable")  # new id -> old id
    new_of_old = np.arange(ntok, dtype=np.int64)
    new_of_old[order] = np.arange(nbpe)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    assert len(vocab) == nbpe and max(vocab.values()) == nbpe - 1, "special tokens inside the BPE vocabulary"
    j["model"]["vocab"] = {t: int(new_of_old[i]) for t, i in vocab.items()}
    ranked = Tokenizer.from_str(json.dumps(j))
    probe = "def f(x):\n    return {'key': x ** 2}  # comment\n<|im_start|>user\nhi<|im_end|>"
    assert ranked.encode(probe).ids == [int(new_of_old[i]) for i in tok.encode(probe).ids], "renumbering changed BPE"
    total = float(counts[:nbpe].sum())
    cover = {f"first_{n}_ids_before": round(float(counts[:min(n, nbpe)].sum()) / total, 4) for n in (2048, 4096)}
    cover.update({f"first_{n}_ids_after": round(float(counts[order[:n]].sum()) / total, 4) for n in (2048, 4096)})
    return ranked, new_of_old, cover


def permute_embedding(tensors: dict, old_of_new: np.ndarray) -> dict:
    import torch

    name = "model.language_model.embed_tokens.weight"
    out = dict(tensors)
    out[name] = tensors[name][torch.from_numpy(old_of_new)].contiguous()  # row new = old row old_of_new[new]
    return out


def keep_init_files(src: Path, out: Path, init_tensors: dict, head_only: bool, keep_tokenizer: bool = True):
    """The files this run does not change are copied byte for byte; with --head-only the written trunk tensors must
    equal the initial ones bit for bit (after --rank-vocab: the renumbered embedding)."""
    import shutil

    from safetensors.torch import load_file

    for name in ("config.json", "tokenizer_config.json", "generation_config.json") + (
            ("tokenizer.json",) if keep_tokenizer else ()):
        shutil.copyfile(src / name, out / name)
    if head_only:
        new = load_file(str(out / "model.safetensors"))
        assert sorted(new) == sorted(init_tensors), "tensor names changed"
        changed = [n for n in new if not n.startswith("mtp.") and not new[n].equal(init_tensors[n])]
        assert not changed, f"--head-only changed trunk tensors: {changed[:5]}"
        log(f"trunk tensors bit-identical to {src}" + ("" if keep_tokenizer else " (embedding rows renumbered)"))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
