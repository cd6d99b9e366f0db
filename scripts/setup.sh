#!/usr/bin/env bash
# Installs what mtpx needs to build and test, from Debian's packages (idempotent).
#   scripts/setup.sh            C++ toolchain and libraries
#   scripts/setup.sh --python   also the Python tooling (scripts/requirements.txt) used to
#                               regenerate reference fixtures and golden files
#   scripts/setup.sh --test-python  also the light Python packages the end-to-end tests use
#                               (scripts/requirements-test.txt: mlx-lm interop, OpenAI client, Selenium)
#                               and curl + chromium + chromium-driver for the server's browser test
set -euo pipefail
packages=(build-essential cmake ninja-build pkg-config git
  nlohmann-json3-dev libcli11-dev libpcre2-dev libutf8proc-dev libfmt-dev libspdlog-dev
  clang-format libhwy-dev libopenblas-openmp-dev libcpp-httplib-dev libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-dev libomp-dev)  # clang, its libFuzzer/sanitizer runtimes and OpenMP: scripts/fuzz.sh
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# pip into the interpreter the tests run with; Debian's own python3 refuses plain pip installs (PEP 668).
pip_install() {
  python3 -m pip --version >/dev/null 2>&1 || { SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo";
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-pip; }
  python3 -m pip install -q -r "$1" 2>/dev/null || python3 -m pip install -q --break-system-packages -r "$1"
}
# Debian packages, installed only when missing.
apt_install() {
  local want=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || want+=("$p")
  done
  [ ${#want[@]} -eq 0 ] && return 0
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${want[@]}"
}
for arg in "$@"; do
  case "$arg" in
    --python) pip_install "$(dirname "$0")/requirements.txt" ;;
    --test-python) pip_install "$(dirname "$0")/requirements-test.txt" ||
      echo "setup: warning: test Python packages not installed; those tests will be skipped" >&2
      # The server's end-to-end tests also use curl, and a headless Chromium (with chromedriver) for the chat page.
      apt_install curl chromium chromium-driver ||
        echo "setup: warning: curl/chromium not installed; the server tests will be skipped" >&2 ;;
    *) echo "setup.sh: unknown option '$arg'" >&2; exit 2 ;;
  esac
done
echo "setup: dependencies present"
