#!/usr/bin/env bash
# The GPU test suite and the GPU benchmarks in one go (for the GPU machine), ending with a short table.
#
#   scripts/gpu_check.sh [BIN_DIR] [--quick]
#
# BIN_DIR holds mtpx, mtpx_tests and bench_cuda (a build directory, or a folder of binaries carried from
# the build machine with their shared libraries in BIN_DIR/lib). --quick runs the 0.8B benchmark alone (35B-A3B-L8: the
# MoE shape's first 8 layers, synthesized in memory). The
# 4-bit 9B benchmark runs on a checkpoint written first by `mtpx synth --bits 4` (about 5.5 GB in $TMPDIR).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_shapes.sh
bin=${1:-build}
quick=${2:-}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bin/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

status=0
# Tests that run the CLI start the build tree's mtpx (its path is compiled in): carried binaries stand in.
if [ "$bin" != build ] && [ ! -e build/mtpx ]; then mkdir -p build && ln -s "$(realpath "$bin")/mtpx" build/mtpx; fi
# The 4-bit row kernels quantize the activations to int8 on both sides by default (quant_matmul.h,
# affine.cu); the quantized tests run again with float activations on both sides.
"$bin/mtpx_tests" --gtest_filter='Cuda*:*CudaFixture*:*CudaQuantized*:*CudaMoeFixture*' --gtest_brief=1 2>&1 | tee "$out/gpu_tests.log" || status=1
MTPX_AFFINE_ACTIVATIONS=f32 "$bin/mtpx_tests" --gtest_filter='*CudaQuantized*' --gtest_brief=1 2>&1 | tee -a "$out/gpu_tests.log" || status=1
# 4-bit products of few rows split each row over 2 warps by default (affine.cu, int8_slices); again with one.
MTPX_INT8_SLICES=1 "$bin/mtpx_tests" --gtest_filter='Cuda.FourBit*:*CudaQuantized*' --gtest_brief=1 2>&1 | tee -a "$out/gpu_tests.log" || status=1
# bf16 rows run on tensor cores by default (matmul.cu, bf16_tile_rows); the bf16 tests run again on the FMA kernel.
MTPX_BF16_ROWS=fma "$bin/mtpx_tests" --gtest_filter='Cuda.Bf16*:*CudaFixture*:Cuda.GreedyMtp*' --gtest_brief=1 2>&1 | tee -a "$out/gpu_tests.log" || status=1
# Up to 4 bf16 rows stream their weights through shared memory by default (bf16_stream_rows); again without.
MTPX_BF16_STREAM=0 "$bin/mtpx_tests" --gtest_filter='Cuda.Bf16*:*CudaFixture*:Cuda.GreedyMtp*' --gtest_brief=1 2>&1 | tee -a "$out/gpu_tests.log" || status=1
# The bf16 row kernels take their input's RMSNorm by default (kernels.h, RowNorm); again with a norm kernel first.
MTPX_FUSED_NORMS=0 "$bin/mtpx_tests" --gtest_filter='*CudaFixture*:Cuda.GreedyMtp*' --gtest_brief=1 2>&1 | tee -a "$out/gpu_tests.log" || status=1
# Kernels load weights and states before their griddep_wait by default (runtime.h, early_loads); again without.
MTPX_EARLY_LOADS=0 "$bin/mtpx_tests" --gtest_filter='*CudaFixture*:Cuda.GreedyMtp*' --gtest_brief=1 2>&1 | tee -a "$out/gpu_tests.log" || status=1
passed=$(grep -c '^\[       OK \]' "$out/gpu_tests.log" || true)
failed=$(grep -c '^\[  FAILED  \]' "$out/gpu_tests.log" || true)
passed=$(grep -oP '\[  PASSED  \] \K[0-9]+' "$out/gpu_tests.log" | awk '{s += $1} END {print s + 0}')

shapes="0.8B 9B 9B-q4 35B-A3B-L8"
[ "$quick" = "--quick" ] && shapes="0.8B"
for s in $shapes; do
  shape_args "$bin" "$s" || status=1
  "$bin/bench_cuda" "${args[@]}" --context-tokens 4096 32768 --sampling-tokens 64 --json > "$out/bench_$s.json" 2> "$out/bench_$s.err" || { status=1; cat "$out/bench_$s.err"; }
done

python3 - "$out" "$passed" "$failed" $shapes <<'PY'
import json, sys, os
out, passed, failed, shapes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
print(f"\nGPU tests: {passed} passed, {failed} failed")
print("| shape | copy GB/s | decode tok/s | roofline tok/s | fraction | c(1) | c(3) | c(7) | c(1) / c(3) argmax | decode at 4096 / 32768 context | prefill tok/s | prefill / GEMM | MTP best (K) | MTP best, draft vocab (K) | MoE experts a layer, K = 0 / 1 / 3 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for s in shapes:
    p = os.path.join(out, f"bench_{s}.json")
    try:
        r = json.load(open(p))
    except Exception as e:
        print(f"| {s} | failed: {e} |"); continue
    c = r["verify_cost_c"]
    ca = r.get("verify_cost_c_argmax", {"1": 0, "3": 0})
    best = max(r.get("mtp_synthetic", {}).get("rows", [{"speedup": 0, "draft": 0}]), key=lambda x: x["speedup"])
    vocab = r.get("mtp_synthetic_draft_vocab", {})
    at_context = " / ".join("%.1f" % x["tok_s"] for x in r.get("decode_at_context", [])) or "-"
    best_vocab = max(vocab.get("rows", [{"speedup": 0, "draft": 0}]), key=lambda x: x["speedup"])
    print(f"| {s} | {r['copy_bandwidth_GBs']:.0f} | {r['decode_tok_s']:.1f} | {r['roofline_tok_s']:.1f} | "
          f"{r['decode_fraction_of_roofline']:.2f} | {c['1']:.3f} | {c['3']:.3f} | {c['7']:.3f} | "
          f"{ca['1']:.3f} / {ca['3']:.3f} | "
          f"{at_context} | "
          f"{r.get('prefill_tok_s', 0):.0f} | {r.get('prefill_fraction_of_gemm', 0):.2f} | "
          f"{best['speedup']:.2f}x (K={best['draft']}) | "
          f"{best_vocab['speedup']:.2f}x (K={best_vocab['draft']}, {vocab.get('draft_vocab', '-')}) | "
          f"{' / '.join('%.1f' % r['experts_per_layer_pass'][k] for k in ('0', '1', '3')) if 'experts_per_layer_pass' in r else '-'} |")
print("\nDecoding per sampler, tok/s (draws below the top ids / rows fetched whole / single logits fetched; MTP: acceptance)")
names = None
for s in shapes:
    try:
        rows = json.load(open(os.path.join(out, f"bench_{s}.json")))["sampling"]["rows"]
    except Exception:
        continue
    if names is None:
        names = [x["sampler"] for x in rows]
        print("| shape | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
    def cell(x):
        extra = f"; {x['acceptance']:.2f}" if "MTP" in x["sampler"] else ""
        return (f"{x['tok_s']:.1f} ({x.get('draws_below', 0)} / {x['logit_rows_fetched']} / "
                f"{x.get('logit_values_fetched', 0)}{extra})")
    print(f"| {s} | " + " | ".join(cell(x) for x in rows) + " |")
PY
exit $status
