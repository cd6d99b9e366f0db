#!/usr/bin/env bash
# Installs what mtpx needs to build and test, from Debian's packages (idempotent).
#   scripts/setup.sh            C++ toolchain and libraries
#   scripts/setup.sh --python   also the Python tooling (scripts/requirements.txt) used to
#                               regenerate reference fixtures and golden files
set -euo pipefail
packages=(build-essential cmake ninja-build pkg-config git
  nlohmann-json3-dev libcli11-dev libpcre2-dev libutf8proc-dev libfmt-dev libspdlog-dev
  clang-format libhwy-dev libopenblas-openmp-dev libcpp-httplib-dev libgtest-dev libgmock-dev libbenchmark-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
if [ "${1:-}" = "--python" ]; then
  python3 -m pip install -q -r "$(dirname "$0")/requirements.txt"
fi
echo "setup: dependencies present"
