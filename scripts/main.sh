#!/usr/bin/env bash
# The README's main job: install, then run the BERT benchmark recipe on its CPU preset.
# It prints the seed-shaped table and writes JSON + PNG under results/bert_benchmark/.
# Extra arguments go to the recipe, e.g. `bash scripts/main.sh --preset tiny`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
exec $PY -m recipes.bert_benchmark "$@"
