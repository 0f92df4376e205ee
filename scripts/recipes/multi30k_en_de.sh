#!/usr/bin/env bash
# Multi30k English -> German: scripts/recipes/multi30k.sh in that direction.
#
#   bash scripts/recipes/multi30k_en_de.sh DATA_DIR OUTPUT_DIR
exec bash "$(dirname "$0")/multi30k.sh" "${1:?usage: multi30k_en_de.sh DATA_DIR OUTPUT_DIR}" \
    "${2:?usage: multi30k_en_de.sh DATA_DIR OUTPUT_DIR}" en de
