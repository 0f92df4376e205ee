#!/usr/bin/env bash
# The main job on a fresh machine: install, train a translator, score it with sacreBLEU, translate.
#
#   bash scripts/main_job.sh [DATA_DIR] [OUTPUT_DIR] [SOURCE_LANG] [TARGET_LANG]
#
# DATA_DIR holds train.<lang>, val.<lang> and test*.<lang> files (default: ../shared/data/multi30k).
# It is the Multi30k recipe (scripts/recipes/multi30k.sh: Transformer-tiny, shared 8,000-token BPE)
# with TRAIN_MINUTES (default 20) of training, so that the whole job fits in 25 minutes on 2 cores,
# the `tiny` preset's d_ff of 256, whose steps are faster than the recipe's 512,
# batches of 2,048 tokens (on an AVX2-only CPU far more steps a minute than 4,096-token ones, and
# more tokens a second: a slow machine makes too few updates in 20 minutes with larger batches;
# docs/training.md, "The main job on an AVX2-only CPU"),
# with no dropout (Table 3, row D's variation) and a peak learning rate of 4.9e-3 (Eq. 3 scaled by
# 1.75): a slow CPU makes so few steps in 20 minutes that dropout costs more than it regularises
# (docs/training.md, "The main job on a slower machine"); the last 5 checkpoints,
# 100 steps apart, are averaged (§6.1's number for the base model), which smooths the last steps'
# noise without reaching back to a much weaker model in so short a run, and the length penalty is
# chosen on the validation set among two (beam 4). It trains in float32 (`--mixed-precision no`, where the
# recipe says auto): its settings were chosen, and its scores measured, in float32.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
DATA_DIR=${1:-../shared/data/multi30k}
OUTPUT_DIR=${2:-outputs/multi30k-en-de}
# Paths given are relative to where the script was called from; the defaults to the repository root.
if [ $# -ge 1 ] && [[ $1 != /* ]]; then DATA_DIR=$caller/$1; fi
if [ $# -ge 2 ] && [[ $2 != /* ]]; then OUTPUT_DIR=$caller/$2; fi
SRC=${3:-en}
TGT=${4:-de}

python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[plot]"  # plot: learning_curve.png

TRAIN_MINUTES=${TRAIN_MINUTES:-20} bash scripts/recipes/multi30k.sh "$DATA_DIR" "$OUTPUT_DIR" "$SRC" "$TGT" \
    --model-option d_ff=256 --model-option dropout=0.0 --max-tokens 2048 --learning-rate-scale 1.75 --eval-steps 1000 \
    --save-steps 100 --save-minutes 0 --average-last 5 --mixed-precision no --choose-num-beams 4 --choose-length-penalty 0.6 1.0 > /dev/null

for source in "$DATA_DIR"/test*."$SRC"; do
    [ -e "$source" ] || continue
    name=$(basename "$source" ."$SRC")
    echo "== $name: sacreBLEU (cased, detokenized, 13a; and lowercased)"
    cat "$OUTPUT_DIR/$name.bleu.json"
    echo "== $name: sample translations"
    head -n 5 "$source" > "$OUTPUT_DIR/samples.$SRC"
    vaswani-transformer translate --model "$OUTPUT_DIR" --input "$OUTPUT_DIR/samples.$SRC" > "$OUTPUT_DIR/samples.$TGT"
    paste -d '\n' <(sed "s/^/  $SRC: /" "$OUTPUT_DIR/samples.$SRC") <(sed "s/^/  $TGT: /" "$OUTPUT_DIR/samples.$TGT")
done
