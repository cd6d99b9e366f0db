#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ (clang, AddressSanitizer + UndefinedBehaviorSanitizer, in its own
# build directory) and runs each for a bounded time, then prints a table per target: executions, coverage
# (edges) and features, corpus size, findings.
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]      default: 10 s, every fuzz/fuzz_*.cpp
# Corpora: fuzz/corpus/<target>/ (committed: hand-written seeds and the inputs of past findings), seeds
# generated from the repository's files (fuzz/make_seeds.py), and BUILD/corpus/<target>/, where the fuzzer
# keeps what it finds between runs. A finding (crash, leak, timeout, out-of-memory) is written to
# BUILD/artifacts/<target>/ and makes the script exit 1 after the table.
# Environment: MTPX_FUZZ_BUILD (default build-fuzz), MTPX_FUZZ_JOBS (default nproc), MTPX_FUZZ_ARGS (extra
# libFuzzer flags).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
shift || true
build=${MTPX_FUZZ_BUILD:-build-fuzz}
jobs=${MTPX_FUZZ_JOBS:-$(nproc)}

# -O1 -g1 keeps executions fast and reports readable; no NDEBUG, so assertions stay on.
cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DMTPX_FUZZ=ON -DMTPX_BUILD_TESTS=OFF \
  -DMTPX_BUILD_BENCH=OFF -DMTPX_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DCMAKE_UNITY_BUILD=ON >/dev/null
cmake --build "$build" --target fuzz_all -j "$jobs"

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for source in fuzz/fuzz_*.cpp; do targets+=("$(basename "$source" .cpp)"); done
fi
rm -rf "$build/seeds"
python3 fuzz/make_seeds.py "$build/seeds" >/dev/null

dictionary_of() {
  case "$1" in
    fuzz_chat_template) echo fuzz/dict/jinja.dict ;;
    fuzz_tool_calls) echo fuzz/dict/tool_calls.dict ;;
    fuzz_tokenizer_encode) echo "" ;;
    *) echo fuzz/dict/json.dict ;;
  esac
}

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
failed=0
rows=()
for target in "${targets[@]}"; do
  mkdir -p "$build/corpus/$target" "$build/artifacts/$target" "$build/logs" "$build/seeds/$target"
  dictionary=$(dictionary_of "$target")
  corpora=("$build/corpus/$target" "$build/seeds/$target")
  [ -d "fuzz/corpus/$target" ] && corpora+=("fuzz/corpus/$target")
  log="$build/logs/$target.log"
  touch "$build/logs/$target.start"  # findings of this run: artifacts newer than this
  # -timeout: one input running longer is a finding (a hang); -rss_limit_mb: so is using more memory.
  set +e
  "$build/fuzz/$target" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build/artifacts/$target/" ${dictionary:+-dict=$dictionary} ${MTPX_FUZZ_ARGS:-} \
    "${corpora[@]}" >"$log" 2>&1
  rc=$?
  set -e
  executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  [ -n "$executions" ] || executions=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
  coverage=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  features=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  corpus=$(grep -o 'corp: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  findings=$(find "$build/artifacts/$target" -type f -newer "$build/logs/$target.start" \( -name 'crash-*' -o \
    -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
  if [ "$rc" -ne 0 ] || [ "$findings" -ne 0 ]; then
    failed=1
    echo "fuzz: $target failed (exit $rc); log: $log" >&2
    grep -E 'ERROR: |SUMMARY: |runtime error|Test unit written' "$log" | head -5 >&2 || true
  fi
  rows+=("$(printf '%-24s %12s %8s %8s %7s %9s' "$target" "${executions:-?}" "${coverage:-?}" "${features:-?}" \
    "${corpus:-?}" "$findings")")
done

printf '%-24s %12s %8s %8s %7s %9s\n' target executions cov ft corpus findings
printf '%s\n' "${rows[@]}"
exit "$failed"
