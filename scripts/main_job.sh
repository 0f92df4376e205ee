#!/usr/bin/env bash
# The main job on a fresh machine: install, train a translator for TRAIN_MINUTES (default 20), score it with
# sacreBLEU on every test set, translate a few sentences.
#
#   bash scripts/main_job.sh [DATA_DIR] [OUTPUT_DIR] [SOURCE_LANG] [TARGET_LANG]
#
# DATA_DIR holds train.<lang>, val.<lang> and test*.<lang> files (default: ../shared/data/multi30k). The
# settings below are the Multi30k recipe's (scripts/recipes/multi30k.sh) cut to 20 minutes on 2 cores; why
# each differs: docs/training.md, "Multi30k on 2 cores".
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

python=$(python -c 'import sys; print(sys.executable)')
bash scripts/install_torch.sh "$python"  # a torch within the range is kept; with none, the CPU build
python -m pip install --quiet --disable-pip-version-check -e ".[plot]"  # plot: learning_curve.png

bash scripts/recipes/score_tests.sh "$DATA_DIR" "$OUTPUT_DIR" "$SRC" "$TGT" --check  # before the training
settings=(
    --preset tiny --model-option dropout=0.0  # Transformer-tiny, its d_ff of 256; no dropout in so short a run
    --vocab-size 8000 --max-tokens 2048       # a shared 8,000-token BPE; small batches: more updates a minute
    --warmup-steps 1000 --learning-rate-scale 1.75  # Eq. 3, its peak raised for a run of ~2,500 steps
    --max-minutes "${TRAIN_MINUTES:-20}" --mixed-precision no  # float32: the settings were chosen in it
    --threads "$(nproc)"  # every core: the job has the machine to itself (the default leaves one to a neighbour)
    --log-steps 100 --eval-steps 1000 --bleu-sentences 300
    --save-steps 100 --save-minutes 0 --average-last 5  # the last 5 checkpoints averaged (§6.1)
    --choose-num-beams 4 --choose-length-penalty 0.6 1.0  # alpha chosen on the validation set (§6.1)
)
vaswani-transformer train --data-dir "$DATA_DIR" --source-lang "$SRC" --target-lang "$TGT" \
    --output-dir "$OUTPUT_DIR" --resume "${settings[@]}"
bash scripts/recipes/score_tests.sh "$DATA_DIR" "$OUTPUT_DIR" "$SRC" "$TGT"

for source in "$DATA_DIR"/test*."$SRC"; do
    name=$(basename "$source" ."$SRC")
    echo "== $name: sacreBLEU (cased, detokenized, 13a; and lowercased)"
    cat "$OUTPUT_DIR/$name.bleu.json"
    echo "== $name: sample translations"
    head -n 5 "$source" > "$OUTPUT_DIR/samples.$SRC"
    vaswani-transformer translate --model "$OUTPUT_DIR" --input "$OUTPUT_DIR/samples.$SRC" > "$OUTPUT_DIR/samples.$TGT"
    paste -d '\n' <(sed "s/^/  $SRC: /" "$OUTPUT_DIR/samples.$SRC") <(sed "s/^/  $TGT: /" "$OUTPUT_DIR/samples.$TGT")
done
