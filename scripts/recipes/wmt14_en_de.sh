#!/usr/bin/env bash
# WMT 2014 English-German, the base or big model as the paper trained it (§5, Table 3).
#
#   accelerate config   # once: the GPUs (the precision is the recipe's: bf16 where the GPU has it)
#   bash scripts/recipes/wmt14_en_de.sh base|big OUTPUT_DIR [NUM_PROCESSES]
#
# The paper: 4.5M sentence pairs (datasets' `wmt14`, de-en), a shared BPE vocabulary of about
# 37,000 tokens (§5.1), batches of about 25,000 source and 25,000 target tokens (§5.1), Adam
# (0.9, 0.98, 1e-9) with 4,000 warm-up steps (§5.3), label smoothing 0.1 (§5.4), checkpoints
# written at 10-minute intervals (§6.1). Base: 100,000 steps (12 hours on 8 P100 GPUs, §5.2),
# dropout 0.1, the average of the last 5 checkpoints. Big: 300,000 steps (3.5 days), dropout 0.3,
# the average of the last 20. With fewer GPUs, --update-freq keeps 25,000 tokens per step.
# A killed run continues where it stopped when the same command is run again (--resume).
set -euo pipefail
SIZE=${1:?usage: wmt14_en_de.sh base|big OUTPUT_DIR [NUM_PROCESSES]}
OUTPUT_DIR=${2:?usage: wmt14_en_de.sh base|big OUTPUT_DIR [NUM_PROCESSES]}
PROCESSES=${3:-8}
case "$SIZE" in
    base) STEPS=100000; AVERAGE=5 ;;   # dropout 0.1: the base preset's
    big) STEPS=300000; AVERAGE=20 ;;   # dropout 0.3: the big preset's
    *) echo "wmt14_en_de.sh: SIZE must be base or big, got '$SIZE'" >&2; exit 2 ;;
esac
MAX_TOKENS=${MAX_TOKENS:-3125}  # per side and device; 8 x 3125 = 25,000
UPDATE_FREQ=$(( (25000 + MAX_TOKENS * PROCESSES - 1) / (MAX_TOKENS * PROCESSES) ))

accelerate launch --num_processes "$PROCESSES" -m vaswani_transformer.cli train \
    --dataset wmt14 --dataset-config de-en --source-lang en --target-lang de \
    --output-dir "$OUTPUT_DIR" --preset "$SIZE" --vocab-size 37000 --max-length 256 \
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --warmup-steps 4000 --max-steps "$STEPS" \
    --log-steps 100 --eval-steps 1000 --bleu-sentences 500 --save-minutes 10 --save-steps "$STEPS" \
    --average-last "$AVERAGE" --mixed-precision auto --resume
echo "$OUTPUT_DIR"
