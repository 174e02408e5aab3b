#!/usr/bin/env bash
# Install bagua-integrations with every extra into the current Python.
# torch is pinned to the local CPU build first: an unpinned torch pulls a multi-GB CUDA build.
# fairseq-fixed drags in a CUDA torchaudio that cannot load with CPU torch and breaks
# `import transformers`; fairseq's text tasks do not need it, so it is removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
$PY -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION}"
$PY -m pip install -q --disable-pip-version-check -e ".[all,test]"
$PY -m pip uninstall -y -q torchaudio 2>/dev/null || true
