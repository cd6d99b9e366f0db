#!/usr/bin/env bash
# Builds everything with AddressSanitizer + UndefinedBehaviorSanitizer (g++, MTPX_SANITIZE=ON, in
# build-asan/) and runs the whole test suite under them (CI runs it). Any sanitizer report fails the test
# that triggered it; LeakSanitizer checks every process at exit, the servers of the Python tests included.
#   scripts/test_sanitized.sh [--quick | --ci] [ctest arguments...]
# In this build the tests know they run sanitized: the Python tests skip their RSS limits (--sanitized:
# ASan's shadow memory and quarantine are not the program's memory) and the longest statistical test draws
# fewer samples (MTPX_SANITIZED in tests/speculative_test.cpp). --quick also leaves out the slowest tests,
# listed in kSlow below: the Python end-to-end tests and the long statistical and whole-checkpoint tests.
# --ci (what .ci/run uses) leaves out only the two that repeat the same paths thousands of times and take
# a third of the sanitized run (kRepetitive: the chi-square sampling test, 170 s, and the trained-model
# tests, 75 s, on the 2-core machine); the release suite runs them in full.
# Environment: MTPX_ASAN_BUILD (default build-asan), MTPX_ASAN_JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MTPX_ASAN_BUILD:-build-asan}
jobs=${MTPX_ASAN_JOBS:-$(nproc)}
kSlow='^(Python\.|SpeculativeSampling\.EarlyTokensHaveThePlainDistribution(OnAMixtureOfExperts)?$|Tools\.(Quantize|Bench|Graft|Tune)|TrainedModel\.)'
kRepetitive='^(SpeculativeSampling\.EarlyTokensHaveThePlainDistribution(OnAMixtureOfExperts)?$|TrainedModel\.)'
exclude=()
if [ "${1:-}" = "--quick" ]; then
  exclude=(-E "$kSlow")
  shift
elif [ "${1:-}" = "--ci" ]; then
  exclude=(-E "$kRepetitive")
  shift
fi
# -O1 -g1: quicker to build than -O2 -g, and line tables are all a sanitizer report needs. A unity build
# (scripts/test.sh says why): 1190 s of compiler time file by file on the 2-core machine.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DMTPX_SANITIZE=ON -DMTPX_BUILD_BENCH=OFF -DMTPX_CUDA=OFF -DCMAKE_UNITY_BUILD=ON >/dev/null
cmake --build "$build" -j "$jobs"
here=$(pwd)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$here/scripts/sanitizers/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# AddressSanitizer makes stack frames several times larger: the deepest chat template the limits allow
# (src/server/jinja/limits.h) needs 1-2 MB of stack in a release build and overflowed the default 8 MB
# under ASan. 64 MB for the tests' main thread.
ulimit -s 65536 2>/dev/null || true
# One test process at a time, as scripts/test.sh (OpenMP teams would fight over the cores).
ctest --test-dir "$build" --output-on-failure "${exclude[@]}" "$@"
