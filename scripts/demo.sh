#!/usr/bin/env bash
# The README's main command: install dependencies, build, and generate from the shipped model.
#   scripts/demo.sh [extra generate flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target mtpx >/dev/null
./build/mtpx generate --prompt "def fibonacci(n):" --max-tokens 96 --mtp --draft 2 --threads 1 "$@"
