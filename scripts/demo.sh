#!/usr/bin/env bash
# The README's main command: install dependencies, build, and generate from the shipped model with MTP, then
# the decode speed with and without MTP side by side.
#   scripts/demo.sh [extra generate flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '[%s] %s\n' "$1" "$2" >&2; }
step 1/4 "build dependencies (Debian packages; the first run installs them, a few minutes)"
bash scripts/setup.sh 2>&1 | sed 's/^/      /' >&2
step 2/4 "building mtpx in build/ (the configuration scripts/test.sh uses; a first build takes a few minutes)"
bash scripts/configure.sh
# Ninja's progress on one line: "[n/N]" as each file finishes.
cmake --build build -j "$(nproc)" --target mtpx |
  awk '/^\[[0-9]+\/[0-9]+\]/ { printf "\r      compiled %s", $1; fflush(); shown = 1 }
       !/^\[[0-9]+\/[0-9]+\]/ && !/^ninja: no work to do/ { print > "/dev/stderr" }
       END { if (shown) printf "\n" }' >&2
prompt="def fibonacci(n):"
step 3/4 "generating 96 tokens with MTP (K=2) from the shipped model, a small Python code model for trying mtpx"
./build/mtpx generate --prompt "$prompt" --max-tokens 96 --mtp --draft 2 --threads 1 "$@"
echo
step 4/4 "decode speed on the same prompt, plain and with MTP (1 thread)"
speed() { ./build/mtpx generate --prompt "$prompt" --max-tokens 96 --threads 1 --json "$@" |
  sed -n 's/.*"decode_tok_s": *\([0-9.]*\).*/\1/p' | head -1; }
plain=$(speed --no-mtp "$@")
mtp=$(speed --mtp --draft 2 "$@")
awk -v p="$plain" -v m="$mtp" 'BEGIN { printf "plain decoding %.0f tok/s | MTP K=2 %.0f tok/s | %.2fx\n", p, m, m / p }'
