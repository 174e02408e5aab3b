#!/usr/bin/env bash
# The README's test command: install what the tests need, then run the default (non-slow) suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
# --durations: where CI time goes (the 90-minute limit; 2-core CI machines differ 2.5x in speed)
if [ "$#" -eq 0 ]; then set -- -m "not slow" --durations=30; fi
exec $PY -m pytest "$@"
