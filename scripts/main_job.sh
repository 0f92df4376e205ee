#!/usr/bin/env bash
# The main job on a fresh machine: install, train a translator, score it with sacreBLEU, translate.
#
#   bash scripts/main_job.sh [DATA_DIR] [OUTPUT_DIR] [SOURCE_LANG] [TARGET_LANG]
#
# DATA_DIR holds train.<lang>, val.<lang> and test*.<lang> files (default: ../shared/data/multi30k).
# The recipe is the paper's (§5) scaled to a 2-core CPU and about 20 minutes: the small preset,
# an 8,000-token BPE vocabulary, batches of 2,048 tokens, 300 warm-up steps to a peak learning
# rate of 2e-3, at most 1,400 steps, and the last 5 checkpoints, 40 steps apart, averaged (§6.1).
# bf16 autocast only where the CPU computes bf16 natively (AVX512-BF16 or AMX): elsewhere it is
# emulated and three times slower than float32. A step budget makes the result reproducible;
# TRAIN_MINUTES (default 23) caps the time on a slower machine, which then trains fewer steps.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_DIR=${1:-../shared/data/multi30k}
OUTPUT_DIR=${2:-outputs/multi30k-en-de}
SRC=${3:-en}
TGT=${4:-de}
TRAIN_STEPS=${TRAIN_STEPS:-1400}
TRAIN_MINUTES=${TRAIN_MINUTES:-23}
if grep -q -w -E "avx512_bf16|amx_bf16" /proc/cpuinfo 2>/dev/null; then PRECISION=bf16; else PRECISION=no; fi

python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[plot]"  # plot: learning_curve.png

vaswani-transformer train --data-dir "$DATA_DIR" --source-lang "$SRC" --target-lang "$TGT" \
    --output-dir "$OUTPUT_DIR" --preset small --vocab-size 8000 --max-tokens 2048 \
    --warmup-steps 300 --learning-rate-scale 0.55 --max-steps "$TRAIN_STEPS" --max-minutes "$TRAIN_MINUTES" \
    --mixed-precision "$PRECISION" \
    --eval-steps 300 --save-steps 40 --average-last 5

for source in "$DATA_DIR"/test*."$SRC"; do
    [ -e "$source" ] || continue
    name=$(basename "$source" ."$SRC")
    echo "== $name: sacreBLEU (cased, detokenized, 13a)"
    vaswani-transformer evaluate --model "$OUTPUT_DIR" --source "$source" \
        --reference "$DATA_DIR/$name.$TGT" --output "$OUTPUT_DIR/$name.hyp.$TGT"
    echo "== $name: sample translations"
    head -n 5 "$source" > "$OUTPUT_DIR/samples.$SRC"
    vaswani-transformer translate --model "$OUTPUT_DIR" --input "$OUTPUT_DIR/samples.$SRC" > "$OUTPUT_DIR/samples.$TGT"
    paste -d '\n' <(sed "s/^/  $SRC: /" "$OUTPUT_DIR/samples.$SRC") <(sed "s/^/  $TGT: /" "$OUTPUT_DIR/samples.$TGT")
done
