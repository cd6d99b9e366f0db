#!/usr/bin/env bash
# llama.cpp peer benchmark on the same weights as mtpx.
#
# Builds llama.cpp from the source vendored in PyPI's llama-cpp-python sdist (no code
# from elsewhere enters this repo: everything is downloaded and built at run time into
# a work directory, and an existing download/build there is reused), converts a Hugging
# Face Qwen3.5 / Qwen3.6 checkpoint directory (dense or MoE, e.g. one written by
# `mtpx synth`) with that tree's convert_hf_to_gguf.py, quantizes it with its
# llama-quantize, and measures it with llama-bench (pp / tg, several repetitions).
# Optionally runs llama.cpp's own MTP speculative decoding (llama-speculative-simple
# --spec-type draft-mtp) on the same GGUF and reports its draft acceptance and speed.
#
# Usage:
#   bash bench/llama_cpp_peer.sh --model DIR [options]
# e.g.
#   build/mtpx synth --shape 35B-A3B --layers 8 --mtp --out /work/bench_data/m
#   bash bench/llama_cpp_peer.sh --model /work/bench_data/m --gguf-dir /work/bench_data/gguf \
#        --threads 2 --reps 3 --spec --out results.json
# Prints the table (quant, size, pp tok/s, tg tok/s, mean ± stddev over --reps) and writes
# the JSON (llama-bench samples, GGUF paths and contents, llama.cpp version, MTP run).
#
# Options:
#   --model DIR          HF checkpoint directory (config.json + *.safetensors). Required.
#   --quants "LIST"      GGUF types to bench (default "BF16 Q4_K_M Q4_0"); BF16 is the
#                        conversion output, the others come from llama-quantize.
#   --threads N          CPU threads for llama-bench/quantize/speculative (default: nproc)
#   --reps N             llama-bench repetitions (default 3)
#   --pp N / --tg N      prompt / generation lengths (default 512 / 128)
#   --out FILE           results JSON (default: WORK/results/<model>-<time>.json)
#   --gguf-dir DIR       where the GGUFs go (default: WORK/gguf/<model name>); existing
#                        GGUFs there are reused, so a second run only benchmarks
#   --tokenizer DIR      tokenizer.json + tokenizer_config.json to use when the model dir
#                        has none (default: this repo's models/default, mtpx's toy model:
#                        8192 ids, so the model's vocab_size must be >= 8192; the converter
#                        pads the vocabulary up to vocab_size with [PADn] tokens). A
#                        tokenizer with Qwen3.5's pre-tokenizer regex is declared "qwen35"
#                        to the converter's pre-tokenizer hash check (see llama_cpp_peer.py).
#   --work DIR           work directory (default ${LLAMA_WORK:-$HOME/.cache/mtpx-llama})
#   --lcp-version V      llama-cpp-python sdist version (default 0.3.36; "latest" = newest)
#   --spec               also run MTP speculative decoding (draft-mtp) on --spec-quants
#                        (the MTP head is kept by the converter as extra nextn layer(s));
#                        on random synth weights the acceptance is ~0%, so there it only
#                        measures the machinery's cost
#   --spec-quants "LIST" quants for --spec (default: the first of --quants that is not BF16)
#   --spec-draft N       draft tokens per step for --spec (default 3)
#   --spec-n N           tokens to generate for --spec (default 128)
#   --no-bench           skip llama-bench (e.g. only --spec)
#   --cuda               CUDA build (build-cuda/, -DGGML_CUDA=ON, -ngl 99)
#   --cuda-arch A        CMAKE_CUDA_ARCHITECTURES for --cuda (default "native": the build
#                        machine's GPU; "90" builds for an H100/H200 on a machine without one)
#   --build-only         download and build, then stop (e.g. to carry bin/ to a GPU machine)
#   --src DIR            use the llama.cpp source tree in DIR (for the converter only:
#                        convert_hf_to_gguf.py, conversion/, gguf-py/) instead of the sdist;
#                        with --bin, nothing is downloaded or built (a GPU machine)
#   --bin DIR            use the llama.cpp binaries in DIR (llama-bench, llama-quantize, ...)
#                        instead of building them (a GPU machine with no network or compiler
#                        time to spare); the source tree is still needed for the converter
#   --ngl N              GPU layers for llama-bench/speculative (default 0 CPU, 99 --cuda)
#   --bench-args "ARGS"  extra llama-bench arguments (e.g. "-fa on")
#   --jobs N             build parallelism (default: nproc)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"
PY="${PYTHON:-python3}"

MODEL=""
QUANTS="BF16 Q4_K_M Q4_0"
THREADS="$(nproc)"
REPS=3
PP=512
TG=128
OUT=""
GGUF_DIR=""
TOKENIZER="$REPO_DIR/models/default"
WORK="${LLAMA_WORK:-$HOME/.cache/mtpx-llama}"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SPEC=0
SPEC_QUANTS=""
SPEC_DRAFT=3
SPEC_N=128
BENCH=1
CUDA=0
CUDA_ARCH=native
BUILD_ONLY=0
PREBUILT_BIN=""
PREBUILT_SRC=""
NGL=""
BENCH_ARGS=""
JOBS="$(nproc)"

die() { echo "llama_cpp_peer: error: $*" >&2; exit 1; }
log() { echo "[llama_cpp_peer $(date +%H:%M:%S)] $*" >&2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --quants) QUANTS="$2"; shift 2 ;;
    --threads|-t) THREADS="$2"; shift 2 ;;
    --reps|-r) REPS="$2"; shift 2 ;;
    --pp) PP="$2"; shift 2 ;;
    --tg) TG="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --gguf-dir) GGUF_DIR="$2"; shift 2 ;;
    --tokenizer) TOKENIZER="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --lcp-version) LCP_VERSION="$2"; shift 2 ;;
    --spec) SPEC=1; shift ;;
    --spec-quants) SPEC_QUANTS="$2"; SPEC=1; shift 2 ;;
    --spec-draft) SPEC_DRAFT="$2"; shift 2 ;;
    --spec-n) SPEC_N="$2"; shift 2 ;;
    --no-bench) BENCH=0; shift ;;
    --cuda) CUDA=1; shift ;;
    --cuda-arch) CUDA_ARCH="$2"; shift 2 ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --bin) PREBUILT_BIN="$2"; shift 2 ;;
    --src) PREBUILT_SRC="$2"; shift 2 ;;
    --ngl) NGL="$2"; shift 2 ;;
    --bench-args) BENCH_ARGS="$2"; shift 2 ;;
    --jobs|-j) JOBS="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

if [[ $BUILD_ONLY == 1 ]]; then
  NAME=build-only
else
  [[ -n "$MODEL" ]] || die "--model DIR is required"
  MODEL="$(cd "$MODEL" && pwd)" || die "no such model dir"
  [[ -f "$MODEL/config.json" ]] || die "$MODEL/config.json not found"
  NAME="$(basename "$MODEL")"
fi
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
if [[ $BUILD_ONLY == 0 ]]; then
  [[ -n "$GGUF_DIR" ]] || GGUF_DIR="$WORK/gguf/$NAME"
  mkdir -p "$GGUF_DIR" "$WORK/results"
  GGUF_DIR="$(cd "$GGUF_DIR" && pwd)"
  STAMP="$(date +%Y%m%d-%H%M%S)"
  [[ -n "$OUT" ]] || OUT="$WORK/results/$NAME-$STAMP.json"
  RUN_DIR="$WORK/results/$NAME-$STAMP"
  mkdir -p "$RUN_DIR"
fi
if [[ -z "$NGL" ]]; then if [[ $CUDA == 1 ]]; then NGL=99; else NGL=0; fi; fi

# ---------------------------------------------------------------- 1. source
if [[ -n "$PREBUILT_SRC" ]]; then
  LLAMA="$(cd "$PREBUILT_SRC" && pwd)" || die "--src $PREBUILT_SRC: no such directory"
  [[ -f "$LLAMA/convert_hf_to_gguf.py" ]] || die "--src $LLAMA has no convert_hf_to_gguf.py"
  LLAMA_COMMIT="$(cat "$LLAMA/.llama_commit" 2>/dev/null || echo unknown)"
  VERSION_STR="llama.cpp source tree $LLAMA, ggml-org/llama.cpp@$LLAMA_COMMIT"
  log "$VERSION_STR"
else
SRC_ROOT="$WORK/src"
mkdir -p "$WORK/dl" "$SRC_ROOT"
if [[ "$LCP_VERSION" == latest ]]; then
  SDIST="$(ls -1t "$WORK"/dl/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)"
  if [[ -z "$SDIST" ]]; then
    log "downloading the newest llama-cpp-python sdist from PyPI"
    "$PY" -m pip download --no-binary :all: --no-deps llama-cpp-python -d "$WORK/dl" >&2
    SDIST="$(ls -1t "$WORK"/dl/llama_cpp_python-*.tar.gz | head -1)"
  fi
else
  SDIST="$WORK/dl/llama_cpp_python-$LCP_VERSION.tar.gz"
  if [[ ! -f "$SDIST" ]]; then
    log "downloading llama-cpp-python==$LCP_VERSION sdist from PyPI"
    "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$LCP_VERSION" -d "$WORK/dl" >&2
  fi
fi
[[ -f "$SDIST" ]] || die "sdist $SDIST missing after download"
SDIST_NAME="$(basename "$SDIST" .tar.gz)"
LCP_DIR="$SRC_ROOT/$SDIST_NAME"
if [[ ! -f "$LCP_DIR/.extracted" ]]; then
  log "extracting $SDIST"
  rm -rf "$LCP_DIR"
  tar xzf "$SDIST" -C "$SRC_ROOT"
  touch "$LCP_DIR/.extracted"
fi
LLAMA="$LCP_DIR/vendor/llama.cpp"
[[ -f "$LLAMA/convert_hf_to_gguf.py" ]] || die "no vendor/llama.cpp in $SDIST"
LCP_VER="${SDIST_NAME#llama_cpp_python-}"
# the sdist has no git metadata for vendor/llama.cpp; its CHANGELOG names the commit
LLAMA_COMMIT="$(awk -v v="## [$LCP_VER]" 'index($0, v)==1 {f=1; next} f && /^## \[/ {exit} f && match($0, /llama\.cpp@[0-9a-f]+/) {print substr($0, RSTART+10, RLENGTH-10); exit}' "$LCP_DIR/CHANGELOG.md")"
[[ -n "$LLAMA_COMMIT" ]] || LLAMA_COMMIT=unknown
VERSION_STR="llama-cpp-python $LCP_VER sdist, vendor/llama.cpp = ggml-org/llama.cpp@$LLAMA_COMMIT"
log "$VERSION_STR"
fi

# ---------------------------------------------------------------- 2. build
if [[ $CUDA == 1 ]]; then BUILD="$WORK/build-cuda"; else BUILD="$WORK/build-cpu"; fi
TARGETS=(llama-quantize)
[[ $BENCH == 1 || $BUILD_ONLY == 1 ]] && TARGETS+=(llama-bench)
[[ $SPEC == 1 || $BUILD_ONLY == 1 ]] && TARGETS+=(llama-speculative-simple)
if [[ -n "$PREBUILT_BIN" ]]; then
  BIN="$(cd "$PREBUILT_BIN" && pwd)" || die "--bin $PREBUILT_BIN: no such directory"
  for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || die "--bin $BIN has no $t"; done
  BUILD="$BIN"
  log "using the prebuilt binaries in $BIN"
else
# a build of another source tree (e.g. another --lcp-version) is not reused
if [[ -f "$BUILD/CMakeCache.txt" ]] && \
   [[ "$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")" != "$LLAMA" ]]; then
  log "$BUILD was configured for another source tree; reconfiguring"
  rm -rf "$BUILD"
fi
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  log "configuring llama.cpp in $BUILD ($([[ $CUDA == 1 ]] && echo CUDA || echo CPU-only), Release)"
  GPU_FLAGS=(-DGGML_CUDA=OFF)
  [[ $CUDA == 1 ]] && GPU_FLAGS=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH" -DGGML_CUDA_NCCL=OFF)
  cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${GPU_FLAGS[@]}" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT" >"$BUILD.configure.log" 2>&1 \
    || { tail -30 "$BUILD.configure.log" >&2; die "cmake configure failed (log: $BUILD.configure.log)"; }
fi
log "building ${TARGETS[*]} (-j$JOBS; up-to-date targets are reused)"
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}" >"$BUILD.build.log" 2>&1 \
  || { tail -30 "$BUILD.build.log" >&2; die "build failed (log: $BUILD.build.log)"; }
BIN="$BUILD/bin"
fi
if [[ $BUILD_ONLY == 1 ]]; then
  echo "llama.cpp: $VERSION_STR; binaries in $BIN"
  exit 0
fi

# ---------------------------------------------------------------- 3. python deps for the converter
if ! "$PY" -c "import numpy, torch, safetensors, transformers, yaml, sentencepiece" 2>/dev/null; then
  log "installing converter Python dependencies from PyPI (gguf itself comes from the tree's gguf-py)"
  "$PY" -m pip install -q numpy safetensors transformers pyyaml tqdm requests sentencepiece protobuf >&2
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch >&2
fi

# ---------------------------------------------------------------- 4. convert to BF16 GGUF
BF16_GGUF="$GGUF_DIR/$NAME-BF16.gguf"
if [[ ! -f "$BF16_GGUF" ]]; then
  # a staging dir of links: the model dir is left untouched, a tokenizer is added if missing
  STAGE="$WORK/stage/$NAME"
  rm -rf "$STAGE"; mkdir -p "$STAGE"
  for f in "$MODEL"/*; do ln -s "$f" "$STAGE/"; done
  if [[ ! -f "$MODEL/tokenizer.json" ]]; then
    [[ -f "$TOKENIZER/tokenizer.json" ]] || die "$MODEL has no tokenizer.json and --tokenizer $TOKENIZER has none either"
    log "model has no tokenizer: using $TOKENIZER/tokenizer*.json"
    for f in tokenizer.json tokenizer_config.json; do
      [[ -f "$TOKENIZER/$f" ]] && cp "$TOKENIZER/$f" "$STAGE/$f"
    done
  fi
  "$PY" "$SCRIPT_DIR/llama_cpp_peer.py" check --model "$MODEL" --tokenizer "$STAGE" >&2
  log "converting $MODEL -> $BF16_GGUF"
  "$PY" "$SCRIPT_DIR/llama_cpp_peer.py" convert --llama-dir "$LLAMA" --model "$STAGE" \
    "$STAGE" --outtype bf16 --outfile "$BF16_GGUF.tmp" >"$RUN_DIR/convert.log" 2>&1 \
    || { tail -30 "$RUN_DIR/convert.log" >&2; die "conversion failed (log: $RUN_DIR/convert.log)"; }
  grep -E "^\[peer\]|Model successfully" "$RUN_DIR/convert.log" >&2 || true
  mv "$BF16_GGUF.tmp" "$BF16_GGUF"
  rm -rf "$STAGE"
else
  log "reusing $BF16_GGUF"
fi

# ---------------------------------------------------------------- 5. quantize
declare -A GGUF
for q in $QUANTS; do
  if [[ "$q" == BF16 ]]; then GGUF[$q]="$BF16_GGUF"; continue; fi
  f="$GGUF_DIR/$NAME-$q.gguf"
  if [[ ! -f "$f" ]]; then
    log "quantizing -> $f"
    "$BIN/llama-quantize" "$BF16_GGUF" "$f.tmp" "$q" "$THREADS" >"$RUN_DIR/quantize-$q.log" 2>&1 \
      || { tail -20 "$RUN_DIR/quantize-$q.log" >&2; die "llama-quantize $q failed"; }
    mv "$f.tmp" "$f"
  else
    log "reusing $f"
  fi
  GGUF[$q]="$f"
done

# what each GGUF holds (architecture, MTP/nextn layers kept, vocab, tensor types)
REPORT_ARGS=()
for q in $QUANTS; do
  "$PY" "$SCRIPT_DIR/llama_cpp_peer.py" gguf-info --llama-dir "$LLAMA" "${GGUF[$q]}" >"$RUN_DIR/info-$q.json" \
    && { log "$q: $(cat "$RUN_DIR/info-$q.json")"; REPORT_ARGS+=(--info "$q=$RUN_DIR/info-$q.json"); } \
    || log "gguf-info $q failed"
done

# ---------------------------------------------------------------- 6. llama-bench
GMAP="{"
for q in $QUANTS; do GMAP+="\"$q\": \"${GGUF[$q]}\","; done
GMAP="${GMAP%,}}"
if [[ $BENCH == 1 ]]; then
  for q in $QUANTS; do
    log "llama-bench $q: pp$PP + tg$TG, -t $THREADS, -r $REPS, -ngl $NGL"
    # shellcheck disable=SC2086
    "$BIN/llama-bench" -m "${GGUF[$q]}" -t "$THREADS" -r "$REPS" -p "$PP" -n "$TG" \
      -ngl "$NGL" $BENCH_ARGS -o json >"$RUN_DIR/bench-$q.json" 2>"$RUN_DIR/bench-$q.log" \
      || { tail -20 "$RUN_DIR/bench-$q.log" >&2; die "llama-bench $q failed"; }
    REPORT_ARGS+=(--bench "$q=$RUN_DIR/bench-$q.json")
  done
fi

# ---------------------------------------------------------------- 7. MTP speculative decoding
if [[ $SPEC == 1 ]]; then
  if [[ -z "$SPEC_QUANTS" ]]; then
    for q in $QUANTS; do [[ "$q" != BF16 ]] && { SPEC_QUANTS="$q"; break; }; done
    [[ -n "$SPEC_QUANTS" ]] || SPEC_QUANTS="BF16"
  fi
  PROMPT="Here is a quick sort implementation in C++. Just code, no comments:

#include"
  for q in $SPEC_QUANTS; do
    [[ -n "${GGUF[$q]:-}" ]] || die "--spec-quants $q is not among --quants"
    log "llama-speculative-simple $q: --spec-type draft-mtp --spec-draft-n-max $SPEC_DRAFT, -n $SPEC_N"
    if "$BIN/llama-speculative-simple" -m "${GGUF[$q]}" -p "$PROMPT" \
        --spec-type draft-mtp --spec-draft-n-max "$SPEC_DRAFT" -n "$SPEC_N" \
        --temp 0 --top-k 1 --seed 42 -t "$THREADS" -ngl "$NGL" -ngld "$NGL" -c 4096 \
        >"$RUN_DIR/spec-$q.log" 2>&1; then
      REPORT_ARGS+=(--spec "$q=$RUN_DIR/spec-$q.log")
    else
      tail -20 "$RUN_DIR/spec-$q.log" >&2
      log "llama-speculative-simple $q failed (log: $RUN_DIR/spec-$q.log); continuing"
    fi
  done
fi

# ---------------------------------------------------------------- 8. report
echo "llama.cpp: $VERSION_STR ($([[ $CUDA == 1 ]] && echo CUDA || echo CPU) build, $BUILD)"
echo "model:     $MODEL"
echo "threads:   $THREADS, reps: $REPS, logs: $RUN_DIR"
"$PY" "$SCRIPT_DIR/llama_cpp_peer.py" report "${REPORT_ARGS[@]}" --gguf-map "$GMAP" \
  --model "$MODEL" --version "$VERSION_STR" --threads "$THREADS" --reps "$REPS" --out "$OUT"
echo "GGUFs:"
for q in $QUANTS; do echo "  $q: ${GGUF[$q]} ($(du -h "${GGUF[$q]}" | cut -f1))"; done
