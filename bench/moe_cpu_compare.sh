#!/usr/bin/env bash
# mtpx against llama.cpp on the same mixture-of-experts weights, on this CPU, side by side in one run
# (BENCHMARKS.md, "Mixture-of-experts models, CPU"). Rounds alternate the engines so that both see the
# same machine; each figure is the median over the rounds.
#
#   bash bench/moe_cpu_compare.sh --hf DIR --mtpx DIR --gguf-dir DIR [--rounds 3] [--threads 2]
#   (RESULTS=DIR keeps the raw JSON of every run there; default a new /tmp directory)
#
#   --hf DIR        the bf16 Hugging Face checkpoint both builds come from, e.g.
#                     build/mtpx synth --shape 35B-A3B --layers 8 --mtp --out DIR
#   --mtpx DIR      mtpx's 4-bit build of it:  build/mtpx quantize --model HF --out DIR --bits 4 --method mlx
#   --gguf-dir DIR  llama.cpp's builds of it, made by bench/llama_cpp_peer.sh --model HF --gguf-dir DIR
#                   (which also builds llama-bench into ${LLAMA_WORK:-$HOME/.cache/mtpx-llama})
# Measures: decode (mtpx: 128 tokens after an 8-token prompt, greedy; llama.cpp: llama-bench tg128) and
# prefill (512 random token ids; llama-bench pp512), llama.cpp on Q4_K_M and Q4_0; mtpx MTP at synthetic
# acceptance 0.8 (K = 1, 2, drafts from the first 32768 ids: the head's lm_head pass reads those rows only)
# against its plain decoding in the same runs, and the distinct experts a verify pass reads per layer.
set -euo pipefail
cd "$(dirname "$0")/.."
HF="" MTPX_DIR="" GGUF_DIR="" ROUNDS=3 THREADS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --hf) HF="$2"; shift 2 ;;
    --mtpx) MTPX_DIR="$2"; shift 2 ;;
    --gguf-dir) GGUF_DIR="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    *) echo "moe_cpu_compare.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ -d "$HF" ] && [ -d "$MTPX_DIR" ] && [ -d "$GGUF_DIR" ] ||
  { echo "moe_cpu_compare.sh: --hf, --mtpx and --gguf-dir must be existing directories" >&2; exit 2; }
WORK="${LLAMA_WORK:-$HOME/.cache/mtpx-llama}"
LLAMA_BENCH="$WORK/build-cpu/bin/llama-bench"
[ -x "$LLAMA_BENCH" ] || { echo "moe_cpu_compare.sh: no $LLAMA_BENCH (run bench/llama_cpp_peer.sh first)" >&2; exit 2; }
name=$(basename "$HF")
declare -A GGUF=([Q4_K_M]="$GGUF_DIR/$name-Q4_K_M.gguf" [Q4_0]="$GGUF_DIR/$name-Q4_0.gguf")
for q in "${!GGUF[@]}"; do [ -f "${GGUF[$q]}" ] || { echo "moe_cpu_compare.sh: missing ${GGUF[$q]}" >&2; exit 2; }; done

out="${RESULTS:-$(mktemp -d /tmp/moe_cpu_compare.XXXXXX)}"
mkdir -p "$out"
echo "raw results in $out" >&2
ids512=$(python3 -c "import random; random.seed(1); print(','.join(str(random.randrange(1000, 200000)) for _ in range(512)))")
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  for k in 1 2; do
    build/mtpx bench --model "$MTPX_DIR" --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 128 --runs 1 --draft $k \
      --draft-vocab 32768 --synthetic-acceptance 0.8 --threads "$THREADS" --json > "$out/mtpx_k${k}_$r.json"
  done
  build/mtpx generate --model "$MTPX_DIR" --prompt-ids "$ids512" --max-tokens 1 --temperature 0 \
    --threads "$THREADS" --json > "$out/mtpx_pp_$r.json"
  for q in Q4_K_M Q4_0; do
    "$LLAMA_BENCH" -m "${GGUF[$q]}" -p 512 -n 128 -t "$THREADS" -r 1 -ngl 0 -o json > "$out/llama_${q}_$r.json" 2>/dev/null
  done
done

python3 - "$out" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def med(xs): return statistics.median(xs)
plain, k1, k2, pp, mtp1, mtp2, e1, e2 = [], [], [], [], [], [], [], []
for r in range(1, rounds + 1):
    a = json.load(open(f"{out}/mtpx_k1_{r}.json"))["results"]
    b = json.load(open(f"{out}/mtpx_k2_{r}.json"))["results"]
    plain += [a[0]["tok_s_median"], b[0]["tok_s_median"]]
    k1.append(a[1]["tok_s_median"] / a[0]["tok_s_median"])
    k2.append(b[1]["tok_s_median"] / b[0]["tok_s_median"])
    mtp1.append(a[1]["tok_s_median"]); mtp2.append(b[1]["tok_s_median"])
    e1.append(a[1].get("experts_per_layer_pass", 0)); e2.append(b[1].get("experts_per_layer_pass", 0))
    s = json.load(open(f"{out}/mtpx_pp_{r}.json"))["stats"]
    pp.append(s["prefill_tok_s"])
llama = {}
for q in ("Q4_K_M", "Q4_0"):
    tg, p = [], []
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/llama_{q}_{r}.json")):
            (p if row["n_prompt"] > 0 else tg).append(row["avg_ts"])
    llama[q] = (med(tg), med(p))
print(f"| engine | decode tok/s | prefill 512 tok/s | decode vs mtpx | prefill vs mtpx |")
print(f"|---|---|---|---|---|")
print(f"| mtpx 4-bit (MLX affine g64) | {med(plain):.2f} | {med(pp):.1f} | 1.00x | 1.00x |")
for q, (tg, p) in llama.items():
    print(f"| llama.cpp {q} | {tg:.2f} | {p:.1f} | mtpx {med(plain) / tg:.2f}x | mtpx {med(pp) / p:.2f}x |")
print(f"| mtpx MTP K=1 (synthetic acceptance 0.8, draft vocab 32768) | {med(mtp1):.2f} | | | |")
print(f"| mtpx MTP K=2 (synthetic acceptance 0.8, draft vocab 32768) | {med(mtp2):.2f} | | | |")
for q, (tg, p) in llama.items():
    print(f"mtpx MTP K=1 vs llama.cpp {q} decode: {med(mtp1) / tg:.2f}x")
print(f"mtpx MTP vs its plain decoding: K=1 {med(k1):.2f}x, K=2 {med(k2):.2f}x; distinct experts per layer and "
      f"verify pass: K=1 {med(e1):.1f}, K=2 {med(e2):.1f} (a plain step reads k)")
EOF
