"""End-to-end: ``fairseq-train --user-dir fairseq_plugin --optimizer bagua_fused`` on CPU.

Each comparison runs the same command twice, once with the stock fairseq optimizer and once
with ``bagua_fused`` around it, same seed, one thread: the per-update losses must be equal and
the final weights (from ``checkpoint_last.pt``) equal to float32 round-off.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from _fairseq_utils import (
    PLUGIN_DIR,
    REPO,
    ROBERTA_ARGS,
    assert_same_losses,
    env,
    fairseq_train,
    fused_counts,
    load_model,
    max_param_diff,
    plugin_args,
    requires_fairseq,
    shared_corpus,
    train_pair,
)

pytestmark = requires_fairseq

UPDATES = 30
# Elementwise math on flat buffers is bitwise identical here; allow float32 round-off only.
WEIGHT_TOL = 1e-6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return shared_corpus(tmp_path_factory)


@pytest.fixture(scope="module")
def adam_runs(corpus, tmp_path_factory):
    """30 updates of --optimizer adam and of bagua_fused around adam (warmup schedule, clipping)."""
    root = tmp_path_factory.mktemp("adam")
    args = [
        "--lr", "0.003", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
        "--warmup-init-lr", "1e-4", "--clip-norm", "0.5", "--adam-betas", "(0.9, 0.98)",
        "--weight-decay", "0.01", "--max-update", str(UPDATES),
    ]
    reference, fused = train_pair(corpus, root, ["--optimizer", "adam", *args], [*plugin_args("adam"), *args])
    return {"args": args, "reference": reference, "fused": fused, "root": root}


def test_python_m_prints_user_dir():
    out = subprocess.run(
        [sys.executable, "-m", "fairseq_plugin"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(PLUGIN_DIR)


def test_adam_same_losses_and_weights(adam_runs):
    reference, fused = adam_runs["reference"], adam_runs["fused"]
    assert_same_losses(reference, fused, UPDATES)
    assert fused.column("lr") == reference.column("lr")
    assert fused.column("gnorm") == reference.column("gnorm")
    diff = max_param_diff(
        load_model(reference.save_dir / "checkpoint_last.pt"), load_model(fused.save_dir / "checkpoint_last.pt")
    )
    assert diff <= WEIGHT_TOL, diff
    counts = fused_counts(fused)
    assert counts["fused"] > 10 and counts["unfused"] == 0 and counts["runs"] == 1, counts
    # the base optimizer's own flags reached it
    assert '"adam_betas": "(0.9, 0.98)"' in fused.log and '"weight_decay": 0.01' in fused.log


@pytest.mark.parametrize(
    "base, flags",
    [
        ("sgd", ["--lr", "0.5", "--momentum", "0.9", "--weight-decay", "0.01", "--clip-norm", "1.0"]),
        ("nag", ["--lr", "0.3", "--momentum", "0.95"]),
    ],
)
def test_sgd_nag_same_losses(corpus, tmp_path, base, flags):
    updates = 15
    args = [*flags, "--max-update", str(updates)]
    reference, fused = train_pair(corpus, tmp_path, ["--optimizer", base, *args], [*plugin_args(base), *args])
    assert_same_losses(reference, fused, updates)
    diff = max_param_diff(
        load_model(reference.save_dir / "checkpoint_last.pt"), load_model(fused.save_dir / "checkpoint_last.pt")
    )
    assert diff <= WEIGHT_TOL, diff
    assert fused_counts(fused)["unfused"] == 0
    # the run actually trained (a flat loss curve would make the comparison meaningless)
    losses = reference.losses()
    assert losses[updates] < losses[1] - 0.05, losses


def test_adafactor_is_refused_with_a_clear_error(corpus, tmp_path):
    run = fairseq_train(corpus, None, [*plugin_args("adafactor"), "--lr", "0.01", "--max-update", "2",
                                       "--bagua-on-unsupported", "raise"])
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "NotElementwiseError" in last and "--bagua-base-optimizer adafactor" in last, last
    assert "--bagua-on-unsupported fallback" in last, last


@pytest.mark.slow  # the in-process test_non_elementwise_base checks the same exactness quickly
def test_adafactor_fallback_is_exact(corpus, tmp_path):
    updates = 10
    args = ["--lr", "0.01", "--max-update", str(updates)]
    reference, fused = train_pair(
        corpus,
        tmp_path,
        ["--optimizer", "adafactor", *args],
        [*plugin_args("adafactor", "--bagua-on-unsupported", "fallback"), *args],
    )
    assert_same_losses(reference, fused, updates)
    diff = max_param_diff(
        load_model(reference.save_dir / "checkpoint_last.pt"), load_model(fused.save_dir / "checkpoint_last.pt")
    )
    assert diff == 0.0, diff
    assert "FusionFallbackWarning" in fused.log
    counts = fused_counts(fused)
    assert counts["fused"] == 0 and counts["unfused"] > 0, counts


def test_unknown_base_lists_choices(corpus):
    run = fairseq_train(corpus, None, [*plugin_args("adamw"), "--max-update", "1"], timeout=120)
    assert run.returncode == 2, run.log[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert "argument --bagua-base-optimizer: invalid choice: 'adamw' (choose from" in last, last
    for name in ("'adam'", "'sgd'", "'nag'", "'adafactor'"):
        assert name in last
    assert "'bagua_fused'" not in last and "'composite'" not in last


def test_resume_from_checkpoint_last(adam_runs, corpus, tmp_path):
    """Stop at update 15, resume from checkpoint_last.pt: updates 16-30 and the weights match."""
    args = [a for a in adam_runs["args"]]
    index = args.index("--max-update")
    first = list(args)
    first[index + 1] = "15"
    save = tmp_path / "resumed"
    part1 = fairseq_train(corpus, save, [*plugin_args("adam"), *first]).check()
    assert sorted(part1.losses()) == list(range(1, 16))
    part2 = fairseq_train(corpus, save, [*plugin_args("adam"), *args]).check()
    assert "Loaded checkpoint" in part2.log and "@ 15 updates" in part2.log
    whole = adam_runs["fused"].losses()
    resumed = part2.losses()
    assert sorted(resumed) == list(range(16, UPDATES + 1))
    assert all(resumed[u] == whole[u] for u in resumed), (resumed, whole)
    assert part2.column("lr") == {u: v for u, v in adam_runs["fused"].column("lr").items() if u > 15}
    diff = max_param_diff(
        load_model(adam_runs["fused"].save_dir / "checkpoint_last.pt"), load_model(save / "checkpoint_last.pt")
    )
    assert diff <= WEIGHT_TOL, diff


@pytest.mark.slow  # in process: test_state_dict_resume_and_overrides
def test_resume_with_another_base_is_refused(adam_runs, corpus, tmp_path):
    import shutil

    save = tmp_path / "switch"
    shutil.copytree(adam_runs["fused"].save_dir, save)
    run = fairseq_train(corpus, save, [*plugin_args("sgd"), "--lr", "0.1", "--max-update", str(UPDATES + 2)])
    assert run.returncode != 0
    assert "--bagua-base-optimizer adam, not sgd" in run.stderr and "--reset-optimizer" in run.stderr


@pytest.mark.parametrize(
    "precision",
    [
        ["--memory-efficient-fp16"],
        pytest.param(["--fp16", "--fp16-no-flatten-grads"], marks=pytest.mark.slow),  # in process: FP16Optimizer
    ],
)
def test_fp16_on_cpu(corpus, tmp_path, precision):
    """The fp16 wrappers that run on CPU (flat --fp16 and --bf16 need CUDA / a TPU in fairseq)."""
    updates = 10
    args = [*precision, "--lr", "0.003", "--max-update", str(updates)]
    reference, fused = train_pair(corpus, tmp_path, ["--optimizer", "adam", *args], [*plugin_args("adam"), *args])
    assert_same_losses(reference, fused, updates)
    assert fused.column("loss_scale") == reference.column("loss_scale")
    diff = max_param_diff(
        load_model(reference.save_dir / "checkpoint_last.pt"), load_model(fused.save_dir / "checkpoint_last.pt")
    )
    assert diff <= 1e-3, diff  # fp16 weights: equal up to half-precision round-off
    assert fused_counts(fused)["unfused"] == 0


def test_roberta_masked_lm(corpus, tmp_path):
    """The BERT recipe's setup: a tiny RoBERTa masked LM, adam with its usual flags."""
    updates = 20
    args = [
        "--lr", "0.001", "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-6", "--weight-decay", "0.01",
        "--clip-norm", "1.0", "--lr-scheduler", "polynomial_decay", "--warmup-updates", "5",
        "--total-num-update", str(updates), "--max-update", str(updates),
    ]
    reference, fused = train_pair(
        corpus, tmp_path, ["--optimizer", "adam", *args], [*plugin_args("adam"), *args], model=ROBERTA_ARGS
    )
    assert_same_losses(reference, fused, updates)
    diff = max_param_diff(
        load_model(reference.save_dir / "checkpoint_last.pt"), load_model(fused.save_dir / "checkpoint_last.pt")
    )
    assert diff <= WEIGHT_TOL, diff
    counts = fused_counts(fused)
    assert counts["fused"] > 10 and counts["unfused"] == 0, counts
