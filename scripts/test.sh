#!/usr/bin/env bash
# Builds mtpx and runs the whole test suite (the README's test command); ends with the skipped tests, each
# with its reason, and one line of counts by reason.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# Formatting is part of the build: every C++ source must be as clang-format (.clang-format) writes it.
find src tests bench fuzz -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | sort |
  xargs clang-format --dry-run -Werror
bash scripts/configure.sh
cmake --build build -j "$jobs"
# One test process at a time: every test already uses all cores through OpenMP, and two OpenMP teams
# spinning on the same cores slow each other down by 10-100x.
status=0
ctest --test-dir build --output-on-failure "$@" || status=$?
awk -f scripts/skip_summary.awk build/Testing/Temporary/LastTest.log || true
exit "$status"
