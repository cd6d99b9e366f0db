#!/usr/bin/env bash
# Packs the build's GPU binaries for the GPU machine (which has CUDA but not Debian's libraries): mtpx,
# mtpx_tests and bench_cuda into DIR, and the shared libraries they load from outside the C library and the
# CUDA driver into DIR/lib (scripts/gpu_check.sh, gpu_ab.sh and gpu_profile.sh take DIR as BIN_DIR).
#
#   scripts/gpu_bundle.sh DIR [BUILD_DIR]
#
# The tests find fixtures under the source path compiled in (tests/test_paths.h): on the GPU machine, link
# the checkout there first (mkdir -p "$(dirname SRC)" && ln -s "$PWD" SRC).
set -euo pipefail
out=${1:?usage: gpu_bundle.sh DIR [BUILD_DIR]}
build=${2:-build}
mkdir -p "$out/lib"
for b in mtpx mtpx_tests bench_cuda; do
  [ -x "$build/$b" ] || { echo "gpu_bundle: $build/$b is missing (build with CUDA first)" >&2; exit 2; }
  strip -o "$out/$b" "$build/$b"
done
# Every library the binaries load but the C runtime's own (libc, libm, ld-linux, libpthread, libdl, librt).
ldd "$out"/mtpx "$out"/mtpx_tests "$out"/bench_cuda | awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' | while read -r lib; do
    cp -L "$lib" "$out/lib/"
  done
du -sh "$out"
