#!/usr/bin/env bash
# fairseq-train with the fused optimizer, data preparation included (a tiny language model on CPU).
#
#   bash examples/fairseq_language_model.sh [WORKDIR]
#
# 1. writes a small text corpus (replace it with your own train.txt / valid.txt, one sentence per line),
# 2. binarizes it with fairseq-preprocess --only-source (what --task language_modeling reads),
# 3. trains a 1-layer transformer_lm with --optimizer bagua_fused over fairseq's own adam.
# Needs `pip install 'bagua-integrations[fairseq]'`. fairseq's tools run as `python -m fairseq_cli.*`,
# the same programs as fairseq-preprocess / fairseq-train, with this Python.
set -euo pipefail
PY=${PYTHON:-python3}
WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK"

"$PY" - "$WORK" <<'PYTHON'
import random, sys
words = "the a model data fused optimizer step flat buffer gradient parameter update layer".split()
rng = random.Random(0)
for name, lines in (("train", 300), ("valid", 30)):
    with open(f"{sys.argv[1]}/{name}.txt", "w") as f:
        for _ in range(lines):
            f.write(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + "\n")
PYTHON

"$PY" -m fairseq_cli.preprocess --only-source --trainpref "$WORK/train.txt" --validpref "$WORK/valid.txt" \
    --destdir "$WORK/data-bin" --workers 1

"$PY" -m fairseq_cli.train "$WORK/data-bin" --task language_modeling --arch transformer_lm \
    --decoder-layers 1 --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-attention-heads 2 \
    --tokens-per-sample 32 --max-tokens 512 --max-update 20 --cpu --seed 1 --log-format simple --log-interval 5 \
    --user-dir "$("$PY" -m fairseq_plugin)" --optimizer bagua_fused --bagua-base-optimizer adam \
    --adam-betas '(0.9, 0.98)' --weight-decay 0.01 --lr 0.001 \
    --save-dir "$WORK/checkpoints" --no-epoch-checkpoints
echo "trained: $WORK/checkpoints/checkpoint_last.pt"
