#!/usr/bin/env bash
# mtpx against llama.cpp on the same mixture-of-experts weights, on one NVIDIA GPU, side by side in one run
# (BENCHMARKS.md, "Mixture-of-experts models, GPU"). Rounds alternate the engines so that both see the same
# card; each figure is the median over the rounds. bf16 against llama.cpp's BF16 GGUF, mtpx's 4-bit against
# its Q4_K_M, converted from the one bf16 checkpoint.
#
#   bash bench/moe_gpu_compare.sh --hf DIR --q4 DIR --gguf-dir DIR --llama-bin DIR [--mtpx BIN]
#                                 [--rounds 3] [--draft 3]
#   (RESULTS=DIR keeps the raw JSON of every run there; default a new /tmp directory)
#
#   --hf DIR         the bf16 Hugging Face checkpoint both engines' builds come from, e.g.
#                      mtpx synth --shape 35B-A3B --layers 8 --mtp --out DIR
#   --q4 DIR         mtpx's 4-bit build of it:  mtpx quantize --model HF --out DIR --bits 4 --method mlx
#   --gguf-dir DIR   llama.cpp's BF16 and Q4_K_M builds of it, as bench/llama_cpp_peer.sh --model HF
#                    --gguf-dir DIR --quants "BF16 Q4_K_M" --cuda writes them (on a GPU machine without
#                    network: --bin and --src, see that script)
#   --llama-bin DIR  llama.cpp's CUDA binaries (llama-bench)
#   --mtpx BIN       the mtpx binary (default build/mtpx)
#   --draft K        mtpx's MTP draft depth (default 3)
# Measures: decode (mtpx: 128 tokens after an 8-token prompt, greedy, `bench --device cuda`; llama.cpp:
# llama-bench tg128, all layers on the GPU, flash attention on) and prefill (512 random token ids;
# llama-bench pp512); mtpx MTP at synthetic acceptance 0.8 (drafts from the first 32768 ids) against its
# plain decoding in the same runs, and the distinct experts a verify pass reads per layer.
set -euo pipefail
cd "$(dirname "$0")/.."
HF="" Q4="" GGUF_DIR="" LLAMA_BIN="" MTPX=build/mtpx ROUNDS=3 DRAFT=3
while [ $# -gt 0 ]; do
  case "$1" in
    --hf) HF="$2"; shift 2 ;;
    --q4) Q4="$2"; shift 2 ;;
    --gguf-dir) GGUF_DIR="$2"; shift 2 ;;
    --llama-bin) LLAMA_BIN="$2"; shift 2 ;;
    --mtpx) MTPX="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --draft) DRAFT="$2"; shift 2 ;;
    *) echo "moe_gpu_compare.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ -d "$HF" ] && [ -d "$Q4" ] && [ -d "$GGUF_DIR" ] ||
  { echo "moe_gpu_compare.sh: --hf, --q4 and --gguf-dir must be existing directories" >&2; exit 2; }
[ -x "$LLAMA_BIN/llama-bench" ] || { echo "moe_gpu_compare.sh: no llama-bench in --llama-bin '$LLAMA_BIN'" >&2; exit 2; }
[ -x "$MTPX" ] || { echo "moe_gpu_compare.sh: no mtpx binary at '$MTPX'" >&2; exit 2; }
name=$(basename "$HF")
declare -A GGUF=([bf16]="$GGUF_DIR/$name-BF16.gguf" [q4]="$GGUF_DIR/$name-Q4_K_M.gguf")
declare -A MTPX_W=([bf16]="$HF" [q4]="$Q4")
for w in bf16 q4; do [ -f "${GGUF[$w]}" ] || { echo "moe_gpu_compare.sh: missing ${GGUF[$w]}" >&2; exit 2; }; done

out="${RESULTS:-$(mktemp -d /tmp/moe_gpu_compare.XXXXXX)}"
mkdir -p "$out"
echo "raw results in $out" >&2
ids512=$(python3 -c "import random; random.seed(1); print(','.join(str(random.randrange(1000, 200000)) for _ in range(512)))")
for r in $(seq 1 "$ROUNDS"); do
  for w in bf16 q4; do
    echo "round $r/$ROUNDS: $w" >&2
    "$MTPX" bench --device cuda --model "${MTPX_W[$w]}" --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 128 --runs 1 \
      --draft "$DRAFT" --draft-vocab 32768 --synthetic-acceptance 0.8 --json > "$out/mtpx_${w}_$r.json"
    "$MTPX" generate --device cuda --model "${MTPX_W[$w]}" --prompt-ids "$ids512" --max-tokens 1 \
      --temperature 0 --json > "$out/mtpx_pp_${w}_$r.json"
    "$LLAMA_BIN/llama-bench" -m "${GGUF[$w]}" -p 512 -n 128 -r 1 -ngl 99 -fa 1 -o json \
      > "$out/llama_${w}_$r.json" 2> "$out/llama_${w}_$r.log"
  done
done

python3 - "$out" "$ROUNDS" "$DRAFT" <<'EOF'
import json, statistics, sys
out, rounds, draft = sys.argv[1], int(sys.argv[2]), sys.argv[3]
med = statistics.median
print(f"| weights | mtpx decode tok/s | llama.cpp tg128 | mtpx / llama.cpp | mtpx prefill 512 tok/s | "
      f"llama.cpp pp512 | mtpx / llama.cpp | mtpx MTP K={draft} tok/s | MTP / plain | experts per layer, verify pass |")
print("|---|---|---|---|---|---|---|---|---|---|")
for w, label in (("bf16", "bf16 / GGUF BF16"), ("q4", "mtpx 4-bit g64 / Q4_K_M")):
    plain, mtp, ratio, experts, pp, tg, lpp = [], [], [], [], [], [], []
    for r in range(1, rounds + 1):
        res = json.load(open(f"{out}/mtpx_{w}_{r}.json"))["results"]
        plain.append(res[0]["tok_s_median"]); mtp.append(res[1]["tok_s_median"])
        ratio.append(res[1]["tok_s_median"] / res[0]["tok_s_median"])
        experts.append(res[1].get("experts_per_layer_pass", 0))
        pp.append(json.load(open(f"{out}/mtpx_pp_{w}_{r}.json"))["stats"]["prefill_tok_s"])
        for row in json.load(open(f"{out}/llama_{w}_{r}.json")):
            (lpp if row["n_prompt"] > 0 else tg).append(row["avg_ts"])
    print(f"| {label} | {med(plain):.1f} | {med(tg):.1f} | {med(plain) / med(tg):.2f}x | {med(pp):.0f} | "
          f"{med(lpp):.0f} | {med(pp) / med(lpp):.2f}x | {med(mtp):.1f} | {med(ratio):.2f}x | {med(experts):.1f} |")
EOF
