#!/usr/bin/env bash
# Multi30k English-German on a CPU: the paper's recipe scaled to 29,000 sentence pairs and about
# three hours on 2 cores, with checkpoint averaging (§6.1).
#
#   bash scripts/recipes/multi30k_en_de.sh DATA_DIR OUTPUT_DIR
#
# DATA_DIR holds train/val/test_2016_flickr .en and .de files. The "tiny" preset (N = 4,
# d_model = 128, d_ff = 256, h = 4) with the heavier dropout a small corpus wants (0.3, Table 3
# row D): on 2 cores it sees about twice as many epochs per hour as the "small" preset. An
# 8,000-token shared BPE vocabulary, 4,096-token batches, 2,000 warm-up steps to a peak learning
# rate of 5e-3 (the §5.3 schedule scaled by 2.5), validation BLEU on 200 sentences every 1,000
# steps, and the last 8 checkpoints (every 150 steps, plus those written at validations and at
# the end) averaged (§6.1). Run it again after an interruption: it resumes. The last line printed
# is the directory of the final, averaged model.
set -euo pipefail
DATA_DIR=${1:?usage: multi30k_en_de.sh DATA_DIR OUTPUT_DIR}
OUTPUT_DIR=${2:?usage: multi30k_en_de.sh DATA_DIR OUTPUT_DIR}
MINUTES=${TRAIN_MINUTES:-165}

vaswani-transformer train --data-dir "$DATA_DIR" --source-lang en --target-lang de --output-dir "$OUTPUT_DIR" \
    --preset tiny --vocab-size 8000 --max-tokens 4096 --warmup-steps 2000 --learning-rate-scale 2.5 \
    --max-steps 8000 --max-minutes "$MINUTES" --log-steps 100 --eval-steps 1000 --bleu-sentences 200 \
    --save-steps 150 --average-last 8 --resume >&2
vaswani-transformer evaluate --model "$OUTPUT_DIR" --source "$DATA_DIR/test_2016_flickr.en" \
    --reference "$DATA_DIR/test_2016_flickr.de" --output "$OUTPUT_DIR/test_2016_flickr.hyp.de" \
    --dataset-name multi30k --split test_2016_flickr >&2
echo "$OUTPUT_DIR"
