#!/usr/bin/env bash
# Configures build/ the one way scripts/demo.sh and scripts/test.sh both build it (so that running one after
# the other rebuilds nothing): Ninja, Release, and a unity build (CMake batches of source files compiled as
# one; a fresh build takes a third of the time, since the header-only libraries, CLI11 above all, are parsed
# once per batch). MTPX_UNITY_BUILD=OFF builds file by file (quicker for editing one file, and it checks each
# file's own includes).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD="${MTPX_UNITY_BUILD:-ON}" >/dev/null
