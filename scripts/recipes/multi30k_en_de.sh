#!/usr/bin/env bash
# Multi30k English -> German: scripts/recipes/multi30k.sh in that direction.
#
#   bash scripts/recipes/multi30k_en_de.sh DATA_DIR OUTPUT_DIR [TRAIN_OPTION ...]
exec bash "$(dirname "$0")/multi30k.sh" "${1:?usage: multi30k_en_de.sh DATA_DIR OUTPUT_DIR [TRAIN_OPTION ...]}" \
    "${2:?usage: multi30k_en_de.sh DATA_DIR OUTPUT_DIR [TRAIN_OPTION ...]}" en de "${@:3}"
