#!/usr/bin/env bash
# Builds mtpx and runs the whole test suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# Formatting is part of the build: every C++ source must be as clang-format (.clang-format) writes it.
find src tests bench fuzz -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | sort |
  xargs clang-format --dry-run -Werror
# A unity build (CMake batches of source files compiled as one) by default: a fresh build takes a third of
# the time (the header-only libraries, CLI11 above all, are parsed once per batch, not once per file).
# MTPX_UNITY_BUILD=OFF builds file by file (quicker for editing one file, and it checks each file's own
# includes).
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD="${MTPX_UNITY_BUILD:-ON}" >/dev/null
cmake --build build -j "$jobs"
# One test process at a time: every test already uses all cores through OpenMP, and two OpenMP teams
# spinning on the same cores slow each other down by 10-100x.
ctest --test-dir build --output-on-failure "$@"
