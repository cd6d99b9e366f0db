#!/usr/bin/env bash
# scripts/skip_summary.awk on a ctest log holding a gtest skip, a Python skip (exit 77), a passing and a
# failing test: each skipped test is named with its reason, and the last line counts skips by reason.
set -euo pipefail
cd "$(dirname "$0")/../.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cat >"$log" <<'LOG'
Start testing: Dec 07 19:53 UTC
----------------------------------------------------------
1/5 Testing: Cuda.One
Output:
/src/tests/cuda_test.cpp:10: Skipped
no CUDA GPU found
[  SKIPPED ] Cuda.One (0 ms)
[  SKIPPED ] 1 test, listed below:
[  SKIPPED ] Cuda.One
Test Passed.
2/5 Testing: Cuda.Two
Output:
/src/tests/cuda_test.cpp:20: Skipped
no CUDA GPU found
[  SKIPPED ] Cuda.Two (0 ms)
Test Passed.
3/5 Testing: Python.ServerChatPage
Output:
skipped: selenium is not installed
Test Passed.
4/5 Testing: Sampler.Works
Output:
[       OK ] Sampler.Works (3 ms)
Test Passed.
5/5 Testing: Sampler.Fails
Output:
[  FAILED  ] Sampler.Fails (3 ms)
Test Failed.
LOG
got=$(awk -f scripts/skip_summary.awk "$log")
want='skipped Cuda.One: no CUDA GPU found
skipped Cuda.Two: no CUDA GPU found
skipped Python.ServerChatPage: selenium is not installed
tests skipped: 3 (2 no CUDA GPU found; 1 selenium is not installed)'
if [ "$got" != "$want" ]; then
  printf 'skip_summary.awk printed:\n%s\n--- wanted:\n%s\n' "$got" "$want" >&2
  exit 1
fi
printf 'Start testing\n1/1 Testing: A.B\n[       OK ] A.B (1 ms)\n' >"$log"
[ "$(awk -f scripts/skip_summary.awk "$log")" = "tests skipped: none" ]
