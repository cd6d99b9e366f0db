#!/usr/bin/env bash
# A/B of one environment variable on the GPU benchmarks (for the GPU machine): bench_cuda's decode and
# verify cost, each setting in turn, alternated, in one call. Prints a table of every run, then the medians.
#
#   scripts/gpu_ab.sh BIN_DIR VAR "VALUE_A VALUE_B" "SHAPES" [ROUNDS]
#   e.g. scripts/gpu_ab.sh /tmp/g/bin MTPX_CUDA_PDL "1 0" "9B 0.8B" 2
#
# BIN_DIR holds bench_cuda and mtpx (and lib/ with their shared libraries); shapes as gpu_shapes.sh names
# them (9B-q4 included). Results (one JSON per run) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_shapes.sh
bin=$1 var=$2 values=$3 shapes=$4 rounds=${5:-2}
out=${OUT:-/tmp/gpu_ab}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bin/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
for s in $shapes; do
  for r in $(seq 1 "$rounds"); do
    for v in $values; do
      f="$out/ab_${s}_${var}_${v}_${r}.json"
      shape_args "$bin" "$s" || echo "mtpx synth for $s failed"
      env "$var=$v" "$bin/bench_cuda" "${args[@]}" --prefill-tokens 0 --mtp-tokens 0 --json >"$f" 2>"$f.err" ||
        { echo "bench_cuda --shape $s with $var=$v failed:"; tail -3 "$f.err"; }
    done
  done
done
python3 - "$out" "$var" <<'PY'
import glob, json, os, statistics, sys
out, var = sys.argv[1], sys.argv[2]
rows = {}
print(f"| shape | {var} | round | decode tok/s | fraction of roofline | c(1) | c(3) | c(7) | c(1) / c(3) argmax |")
print("|---|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(out, f"ab_*_{var}_*.json"))):
    shape, value, rnd = os.path.basename(f)[3:-5].split(f"_{var}_")[0], *os.path.basename(f)[:-5].split("_")[-2:]
    try:
        r = json.load(open(f))
    except Exception as e:
        print(f"| {shape} | {value} | {rnd} | failed: {e} |"); continue
    c = r["verify_cost_c"]
    ca = r.get("verify_cost_c_argmax", {"1": 0, "3": 0})
    rows.setdefault((shape, value), []).append(r)
    print(f"| {shape} | {value} | {rnd} | {r['decode_tok_s']:.1f} | {r['decode_fraction_of_roofline']:.3f} | "
          f"{c['1']:.3f} | {c['3']:.3f} | {c['7']:.3f} | {ca['1']:.3f} / {ca['3']:.3f} |")
print(f"\nmedians\n| shape | {var} | decode tok/s | fraction | c(1) | c(3) | c(1) argmax | c(3) argmax |\n|---|---|---|---|---|---|---|---|")
for (shape, value), rs in sorted(rows.items()):
    med = lambda f: statistics.median(f(r) for r in rs)
    print(f"| {shape} | {value} | {med(lambda r: r['decode_tok_s']):.1f} | "
          f"{med(lambda r: r['decode_fraction_of_roofline']):.3f} | {med(lambda r: r['verify_cost_c']['1']):.3f} | "
          f"{med(lambda r: r['verify_cost_c']['3']):.3f} | "
          f"{med(lambda r: r.get('verify_cost_c_argmax', {}).get('1', 0)):.3f} | "
          f"{med(lambda r: r.get('verify_cost_c_argmax', {}).get('3', 0)):.3f} |")
PY
