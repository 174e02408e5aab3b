#!/usr/bin/env bash
# The README's test command: install what the tests need, then run the default (non-slow) suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
if [ "$#" -gt 0 ]; then exec $PY -m pytest "$@"; fi
# The files marked `parallel` (tests/conftest.py: they compute in one process) on two workers, a file
# per worker, then the others one test at a time; every failure of both runs is reported.
# --durations: where CI time goes (the 90-minute limit; 2-core CI machines differ 2.5x in speed)
status=0
$PY -m pytest -m "not slow and parallel" -n 2 --dist loadfile --durations=30 || status=$?
$PY -m pytest -m "not slow and not parallel" --durations=30 || status=$?
exit $status
