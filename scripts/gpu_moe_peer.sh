#!/usr/bin/env bash
# The MoE side by side with llama.cpp on the GPU machine (BENCHMARKS.md, "Mixture-of-experts models, GPU"),
# in two calls of the device tool that fit its 10-minute limit:
#
#   scripts/gpu_moe_peer.sh prepare BIN_DIR LLAMA_DIR WORK   # weights: ~6 min on 16 cores, 45 GB of disk
#   scripts/gpu_moe_peer.sh compare BIN_DIR LLAMA_DIR WORK   # bench/moe_gpu_compare.sh, 3 rounds
#
# BIN_DIR: scripts/gpu_bundle.sh's output (mtpx, bench_cuda, lib/). LLAMA_DIR: bin/ (llama.cpp's CUDA
# llama-bench and llama-quantize, built on the CPU machine with bench/llama_cpp_peer.sh --build-only --cuda
# --cuda-arch 90) and src/ (its convert_hf_to_gguf.py, conversion/ and gguf-py/; the GPU machine has no
# network). prepare synthesizes the 35B-A3B shape's first 8 layers with an MTP head (bf16, random), mtpx's
# 4-bit of it, llama.cpp's BF16 and Q4_K_M GGUFs of it, and prints the card's ceilings (copy bandwidth,
# dependent-launch latency) and how many kernels a decode step of each build runs.
set -euo pipefail
phase=${1:?usage: gpu_moe_peer.sh prepare|compare BIN_DIR LLAMA_DIR WORK}
bin=$(cd "${2:?BIN_DIR}" && pwd)
llama=$(cd "${3:?LLAMA_DIR}" && pwd)
work=${4:?WORK}
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="$bin/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
mkdir -p "$work"
hf="$work/moe35l8"
case "$phase" in
  prepare)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$bin/bench_cuda" --shape 0.8B --decode-tokens 0 --prefill-tokens 0 --mtp-tokens 0 --json |
      python3 -c "import json,sys; r=json.load(sys.stdin); print({k: r[k] for k in ('device','copy_bandwidth_GBs','bf16_gemm_TFLOPs','dependent_launch_us')})"
    [ -f "$hf/config.json" ] || "$bin/mtpx" synth --shape 35B-A3B --layers 8 --mtp --out "$hf"
    [ -f "$work/q4/config.json" ] || "$bin/mtpx" quantize --model "$hf" --out "$work/q4" --bits 4 --method mlx
    for m in "$hf" "$work/q4"; do
      echo "kernels of a decode step, $(basename "$m"):"
      MTPX_CUDA_GRAPH_NODES=1 "$bin/mtpx" generate --device cuda --model "$m" --prompt-ids 1,2,3 --max-tokens 4 \
        --temperature 0 2>&1 | grep "captured" | sort | uniq -c
    done
    bash bench/llama_cpp_peer.sh --model "$hf" --gguf-dir "$work/gguf" --quants "BF16 Q4_K_M" --cuda \
      --bin "$llama/bin" --src "$llama/src" --work "$work/llama" --threads "$(nproc)" --no-bench
    ls -la "$work/gguf" && df -h "$work" | tail -1
    ;;
  compare)
    RESULTS="${RESULTS:-$work/results}" bash bench/moe_gpu_compare.sh --hf "$hf" --q4 "$work/q4" \
      --gguf-dir "$work/gguf" --llama-bin "$llama/bin" --mtpx "$bin/mtpx" --rounds "${ROUNDS:-3}"
    ;;
  *) echo "gpu_moe_peer.sh: unknown phase '$phase' (prepare or compare)" >&2; exit 2 ;;
esac
