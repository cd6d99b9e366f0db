# Sourced by the GPU scripts (gpu_check.sh, gpu_ab.sh, gpu_profile.sh): the bench_cuda arguments of a shape.
#
#   shape_args BIN_DIR SHAPE    sets the array `args`; fails if a checkpoint could not be written
#
# A spec §9 shape (0.8B, 9B, 35B-A3B, ...) is synthesized in the benchmark; SHAPE-LN (35B-A3B-L8) is its
# first N layers. 9B-q4 is a checkpoint written once by
# `mtpx synth --shape 9B --bits 4 --group-size 64 --mtp` into $TMPDIR (about 5.5 GB; synth writes it
# atomically, so a directory there is whole).
shape_args() {
  local bin=$1 shape=$2
  args=(--shape "$shape")
  if [[ $shape == *-L[0-9]* ]]; then  # a reduced-depth shape: 35B-A3B-L8 is the 35B-A3B's first 8 layers
    args=(--shape "${shape%-L*}" --layers "${shape##*-L}")
  elif [ "$shape" = "9B-q4" ]; then
    local dir=${TMPDIR:-/tmp}/mtpx_9b_q4
    [ -d "$dir" ] || "$bin/mtpx" synth --shape 9B --bits 4 --group-size 64 --mtp --out "$dir" >/dev/null || return 1
    args=(--model "$dir")
  fi
}
