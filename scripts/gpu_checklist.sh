#!/usr/bin/env bash
# What to run on a GPU machine, in parts that each finish well under 9 minutes on one H100.
#
#   bash scripts/gpu_checklist.sh tests        # tests/test_cuda.py, then the non-slow suite (time left: ~8 min total)
#   bash scripts/gpu_checklist.sh bench        # the optimizer-step benchmark on CUDA, fp32 then bf16; fails
#                                              # (status 1, "COMPILED PATH NOT USED") if a compiled row ran eagerly
#   bash scripts/gpu_checklist.sh lent         # one call of a lent session (~8.5 min): the step benchmark fp32
#                                              # (BertAdam, LAMB, pytorch-optimizer's Lamb, AdamW, torch.compile
#                                              # peers, traffic floors), the uint8 codec's GB/s, the FSDP2 step with
#                                              # one NCCL rank (device and host time), then bf16 in the time left
#
# Smaller pieces, when a part needs its whole time budget:
#   tests-cuda | tests-suite | bench-fp32 | bench-bf16 | codec | fsdp2 | fsdp2-offload
#   fsdp2-all: tests/test_cuda.py (FSDP2 over NCCL included), then fsdp2 and fsdp2-offload; ~8 min
#   host: segmented CUDA tests, then the step's host overhead (--model tiny) and BERT-base (~5 min)
#   profile: tests/test_cuda.py, then where the host time of a step goes (benchmarks/profile_step_host.py,
#            201 tiny tensors), then the step benchmark's host rows on BERT-base; ~7.5 min
#   recheck: after CPU-side changes (~9 min): the FSDP2 step with new gradients each step (NCCL, one rank),
#            the step benchmark's fused rows beside torch's fused AdamW and the traffic floors on BERT-base,
#            fp32, then the uint8 codec. Run tests-cuda in a call of its own first (all of it took
#            180 s on an H200, 2026-11-29)
#   first-steps: a fused compiled step's build and first steps in fresh processes, cold caches
#            (benchmarks/bench_first_steps.py --device cuda; LAMB: 14 s on an H200, torch 2.11)
#   recipe: Bagua's BERT-base table (python -m recipes.bert_benchmark --preset bert-base), fp32 then bf16,
#           on RECIPE_EPOCHS of an epoch (default 0.05: ~105 updates a row, epoch time extrapolated)
#
# Logs and JSON go to $OUT (default: ./gpu_checklist_out). Run from anywhere; it cd's to the repo.
# Environment knobs: PYTHON (default python3), PYTEST_EXTRA (more pytest arguments),
# BENCH_MODEL (default bert-base), BENCH_REPEATS (default 30), BENCH_ROWS (default: the benchmark's own).
# pytorch-optimizer (for its Lamb rows) is not on the GPU image: carry it as a wheel (device README).
#
# fairseq is not needed: its tests skip themselves when it is missing (pytestmark = requires_fairseq,
# pytest.importorskip("fairseq"), or an in-test check); every test module imports without it
# (checked by collecting the suite with fairseq, omegaconf and hydra blocked), so nothing is --ignore'd.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_checklist_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

PART_BUDGET=${PART_BUDGET:-500}          # seconds for a whole part (the device allows 600 per command)
CUDA_TESTS_BUDGET=240    # tests/test_cuda.py is designed for < 3 minutes
PER_TEST_TIMEOUT=300     # pytest-timeout, per test (module fixtures that spawn ranks count toward one test)
FAIRSEQ_IGNORES=()       # test files that fail to import without fairseq: none (see above)
START=$SECONDS
STATUS=0

timeout_args() {
    if $PY -c "import pytest_timeout" 2>/dev/null; then
        echo "--timeout=$PER_TEST_TIMEOUT"
    else
        echo "# pytest-timeout is not installed: tests rely on their own timeouts only" >&2
    fi
}

environment() {
    {
        echo "# $(date -u +%FT%TZ) $(hostname)"
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 || true
        $PY - <<'EOF' 2>&1
import importlib, platform, sys
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
import torch.distributed as dist
print("gloo", dist.is_gloo_available(), "nccl", dist.is_nccl_available())
for name in ("triton", "transformers", "accelerate", "fairseq", "pytest", "pytest_timeout"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "installed"))
    except Exception as error:
        print(name, "missing:", type(error).__name__)
EOF
    } > "$OUT/env.txt"
    cat "$OUT/env.txt"
}

# run_logged SECONDS LOGFILE command...: run with a hard wall-clock limit, tee the output, record failure
run_logged() {
    local limit=$1 log=$2
    shift 2
    if [ "$limit" -le 10 ]; then
        echo "# skipped (no time left in this part): $*" | tee "$log"
        STATUS=1
        return
    fi
    echo "# $* (limit ${limit}s)" | tee "$log"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "# TIMED OUT after ${limit}s: $*" | tee -a "$log"
    fi
    echo "# exit code $rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || STATUS=1
}

left() { echo $((PART_BUDGET - (SECONDS - START))); }

tests_cuda() {
    local limit=${1:-$CUDA_TESTS_BUDGET}
    [ "$(left)" -lt "$limit" ] && limit=$(left)
    # shellcheck disable=SC2046
    run_logged "$limit" "$OUT/tests_cuda.log" $PY -m pytest -q -rs $(timeout_args) ${PYTEST_EXTRA:-} tests/test_cuda.py
}

tests_suite() {
    local ignores=(--ignore=tests/test_cuda.py)
    for f in "${FAIRSEQ_IGNORES[@]}"; do ignores+=("--ignore=$f"); done
    # shellcheck disable=SC2046
    run_logged "$(left)" "$OUT/tests.log" $PY -m pytest -q -m "not slow" --durations=15 $(timeout_args) \
        "${ignores[@]}" ${PYTEST_EXTRA:-} tests
}

bench() {
    local dtype=$1 limit=$2
    [ "$(left)" -lt "$limit" ] && limit=$(left)
    run_logged "$limit" "$OUT/bench_$dtype.log" $PY benchmarks/bench_optimizer_step.py --device cuda --dtype "$dtype" \
        --model "${BENCH_MODEL:-bert-base}" --repeats "${BENCH_REPEATS:-30}" --json "$OUT/step_$dtype.json" \
        --rows "${3:-${BENCH_ROWS:-bert}}" --require-compiled --budget $((limit - 20))
}

codec() {
    local limit=$1
    [ "$(left)" -lt "$limit" ] && limit=$(left)
    run_logged "$limit" "$OUT/codec.log" $PY benchmarks/bench_distributed.py --codec-only --codec-device cuda \
        --codec-elements 64000000 --rounds 30
}

fsdp2() {
    local limit=$1
    [ "$(left)" -lt "$limit" ] && limit=$(left)
    # new gradients before each step, as in training (zero_grad(set_to_none=True), a backward)
    run_logged "$limit" "$OUT/fsdp2.log" $PY benchmarks/bench_fsdp2_step.py --device cuda --world-size 1 --steps 20 \
        --fresh-grads --timeout $((limit - 15)) --json "$OUT/fsdp2.json"
}

# FSDP2's CPU offloading: shards, gradients and state in pinned host memory, the step on the CPU
fsdp2_offload() {
    local limit=$1
    [ "$(left)" -lt "$limit" ] && limit=$(left)
    run_logged "$limit" "$OUT/fsdp2_offload.log" $PY benchmarks/bench_fsdp2_step.py --device cuda --world-size 1 \
        --offload --steps 10 --rows adamw-fused,adamw-bagua,bertadam,bertadam-bagua,lamb,lamb-bagua \
        --timeout $((limit - 15)) --json "$OUT/fsdp2_offload.json"
}

# the rows of a lent session's fp32 run: every fused optimizer beside its strongest peers and its traffic floor
# (torch.compile(BertAdam.step) is left out: tracing its 201 per-tensor steps takes minutes of the lease)
LENT_ROWS="BertAdam fused (segmented),LAMB per-tensor,LAMB fused (segmented),pytorch-optimizer Lamb,\
torch AdamW foreach=True,torch AdamW fused by bagua,torch.compile(AdamW.step),traffic only"
HOST_ROWS="BertAdam fused (segmented),LAMB fused (segmented),pytorch-optimizer Lamb,torch AdamW foreach=True,torch AdamW fused by bagua"
RECHECK_ROWS="BertAdam fused (segmented),LAMB fused (segmented),pytorch-optimizer Lamb,torch AdamW foreach=True,\
torch AdamW fused by bagua,fused=True,traffic only: AdamW,LAMB minimum"
LENT_BF16_ROWS="BertAdam fused (segmented),LAMB fused (segmented),torch AdamW fused by bagua,traffic only: AdamW"

case "${1:-}" in
    tests) environment; tests_cuda; tests_suite ;;
    tests-cuda) environment; tests_cuda ;;
    tests-suite) environment; tests_suite ;;
    bench) environment; bench fp32 260; bench bf16 "$(left)" ;;
    bench-fp32) environment; bench fp32 "$PART_BUDGET" ;;
    bench-bf16) environment; bench bf16 "$PART_BUDGET" ;;
    codec) environment; codec "$PART_BUDGET" ;;
    fsdp2) environment; fsdp2 "$PART_BUDGET" ;;
    fsdp2-offload) environment; fsdp2_offload "$PART_BUDGET" ;;
    fsdp2-all) environment; tests_cuda; fsdp2 130; fsdp2_offload "$(left)" ;;
    host) environment  # the fused step's host overhead (201 tiny tensors) and BERT-base, after an overhead change
        run_logged 200 "$OUT/tests_segmented.log" $PY -m pytest -q -rs $(timeout_args) tests/test_cuda.py -k "compiled or (fp32 and (clipped or Lamb))"
        for model in tiny bert-base; do
            run_logged 120 "$OUT/bench_$model.log" $PY benchmarks/bench_optimizer_step.py --device cuda --model $model \
                --repeats $([ $model = tiny ] && echo 100 || echo 30) --rows "$HOST_ROWS" --json "$OUT/step_$model.json" --require-compiled
        done ;;
    profile) environment; tests_cuda
        run_logged 150 "$OUT/profile_tiny.log" $PY benchmarks/profile_step_host.py --device cuda --model tiny \
            --steps 100 --top 25 --out "$OUT/profile_tiny"
        tar czf "$OUT/profiles.tgz" -C "$OUT" profile_tiny && rm -rf "$OUT/profile_tiny"
        bench fp32 "$(left)" "$HOST_ROWS,fused=True" ;;
    recipe) environment
        for precision in ${RECIPE_PRECISIONS:-fp32 bf16}; do
            run_logged "$([ $precision = fp32 ] && echo 200 || left)" "$OUT/recipe_$precision.log" $PY -m recipes.bert_benchmark \
                --preset bert-base --epochs "${RECIPE_EPOCHS:-0.05}" --precision $precision --no-progress \
                --out-dir "$OUT/recipe_$precision"
        done ;;
    first-steps) environment
        run_logged "$PART_BUDGET" "$OUT/first_steps.log" $PY benchmarks/bench_first_steps.py --device cuda ;;
    recheck) environment; fsdp2 200; bench fp32 $(($(left) - 40)) "$RECHECK_ROWS"; codec "$(left)" ;;
    lent) environment; bench fp32 270 "$LENT_ROWS"; codec 70; fsdp2 120; bench bf16 "$(left)" "$LENT_BF16_ROWS" ;;
    *) echo "usage: bash scripts/gpu_checklist.sh {tests|bench|lent|recheck|first-steps|host|profile|recipe|tests-cuda|tests-suite|bench-fp32|bench-bf16|codec|fsdp2|fsdp2-offload|fsdp2-all}" >&2; exit 2 ;;
esac
echo "# part '${1}' done in $((SECONDS - START)) s, status $STATUS; logs in $OUT"
exit $STATUS
