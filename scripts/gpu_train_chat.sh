#!/usr/bin/env bash
# The shipped model's chat training on the GPU machine (models/default/README.md, "Chat"), in one call of the
# device tool: a full fine-tune of models/default on code plus chat exchanges (--chat-frac), then the MTP
# head alone, distilled against the new trunk for chained drafting, on the same mix. Writes OUT/model.tar.*
# (the model directory, in parts under 16 MiB: join with `cat model.tar.* | tar -xf -`) and the two logs.
# FINE_TUNE_MINUTES 0 skips the fine-tune and continues the head's distillation from models/default (the
# shipped model's head: 2.6 min of it in the first call, 5.5 more in a second).
#   scripts/gpu_train_chat.sh OUT [FINE_TUNE_MINUTES] [HEAD_MINUTES]
set -euo pipefail
out=${1:?usage: gpu_train_chat.sh OUT [FINE_TUNE_MINUTES] [HEAD_MINUTES]}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
rm -rf /tmp/chat1 /tmp/chat2
head_from=models/default
if [ "${2:-4.9}" != 0 ]; then
  python3 scripts/train_small_model.py --out /tmp/chat1 --init-from models/default --chat-frac 0.25 --lr 8e-4 \
    --warmup-steps 100 --min-lr-frac 0.05 --deadline-minutes "${2:-4.9}" >"$out/run1.log" 2>&1 ||
    { tail -30 "$out/run1.log"; exit 1; }
  grep -E "chat:|FINAL|training done" "$out/run1.log"
  head_from=/tmp/chat1
fi
python3 scripts/train_small_model.py --out /tmp/chat2 --init-from "$head_from" --head-only --mtp-steps 2 --distill \
  --chat-frac 0.25 --lr 6e-4 --warmup-steps 100 --min-lr-frac 0.05 --deadline-minutes "${3:-4.15}" \
  >"$out/run2.log" 2>&1 || { tail -30 "$out/run2.log"; exit 1; }
grep -E "chat:|FINAL|training done|done in" "$out/run2.log"
tar -C /tmp/chat2 -cf - . | split -b 15000000 - "$out/model.tar."
ls -la "$out"
