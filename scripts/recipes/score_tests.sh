#!/usr/bin/env bash
# Score a trained model on every test set of a corpus directory: sacreBLEU through `vaswani-transformer evaluate`.
#
#   bash scripts/recipes/score_tests.sh DATA_DIR OUTPUT_DIR SOURCE_LANG TARGET_LANG [--check]
#
# For each DATA_DIR/test*.SRC (with its test*.TGT), the translations go to OUTPUT_DIR/NAME.hyp.TGT and the scores
# (one JSON line, as `evaluate` prints it) to OUTPUT_DIR/NAME.bleu.json; the model card records them. With
# --check it only verifies that there is a test set, so that a recipe can refuse a corpus before training on it.
set -euo pipefail
usage="usage: score_tests.sh DATA_DIR OUTPUT_DIR SOURCE_LANG TARGET_LANG [--check]"
DATA_DIR=${1:?$usage}
OUTPUT_DIR=${2:?$usage}
SRC=${3:?$usage}
TGT=${4:?$usage}
shopt -s nullglob
tests=("$DATA_DIR"/test*."$SRC")
if (( ${#tests[@]} == 0 )); then
    echo "$DATA_DIR holds no test*.$SRC file to score the model on." >&2
    exit 2
fi
[ "${5:-}" = "--check" ] && exit 0
for test in "${tests[@]}"; do
    name=$(basename "$test" ."$SRC")
    vaswani-transformer evaluate --model "$OUTPUT_DIR" --source "$test" --reference "$DATA_DIR/$name.$TGT" \
        --output "$OUTPUT_DIR/$name.hyp.$TGT" --dataset-name "$(basename "$DATA_DIR")" --split "$name" \
        > "$OUTPUT_DIR/$name.bleu.json"
done
