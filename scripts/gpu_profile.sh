#!/usr/bin/env bash
# Where one decode step's GPU time goes, per kernel, for each shape (for the GPU machine): Nsight Compute
# times every kernel of one step (clocks left alone), bench/ncu_breakdown.py sums them per kernel.
#
#   scripts/gpu_profile.sh BIN_DIR ["SHAPES"] [ROWS]   e.g. scripts/gpu_profile.sh /tmp/g/bin "0.8B 9B 9B-q4"
#
# ROWS (default 1) > 1 profiles a recorded verify window of that many rows instead of a decode step;
# prefill=N profiles one prompt prefill of N tokens.
# BIN_DIR holds bench_cuda and mtpx (and lib/ with their shared libraries); shapes as gpu_shapes.sh names
# them (9B-q4 included). The CSVs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_shapes.sh
bin=$1 shapes=${2:-"0.8B 9B 9B-q4"} rows=${3:-1}
out=${OUT:-/tmp/gpu_profile}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bin/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
status=0
for s in $shapes; do
  shape_args "$bin" "$s" || { status=1; continue; }
  what=(--profile-steps 1 --profile-rows "$rows")
  [[ $rows == prefill=* ]] && what=(--profile-prefill "${rows#prefill=}")
  csv="$out/ncu_${s}_${rows}.csv"
  ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum "$bin/bench_cuda" "${args[@]}" \
    "${what[@]}" >"$csv" 2>"$out/ncu_$s.err" || { status=1; tail -3 "$out/ncu_$s.err"; continue; }
  echo "== $s, ${what[*]}"
  python3 bench/ncu_breakdown.py "$csv" | head -20 || status=1
done
exit $status
