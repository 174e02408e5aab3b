#!/usr/bin/env bash
# The README's test command: install what the tests need, then run the default (non-slow) suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
exec $PY -m pytest "$@"
