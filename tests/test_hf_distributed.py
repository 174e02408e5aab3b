"""Two processes over gloo (torchrun): Trainer and Accelerate with Bagua algorithms on the fused optimizer.

One ``torchrun --standalone --nproc_per_node 2`` launch runs every case of ``_hf_dist_worker.py``
(startup dominates, so they share it); each test below checks one case's JSON. References are
the same runs with Trainer's / Accelerate's plain DDP and unfused optimizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _dist_utils import case_result, run_torchrun_cases

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("bagua_integrations.distributed")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

HERE = Path(__file__).resolve().parent
STEPS = 12  # as in the worker
TOL = dict(rtol=1e-6, atol=1e-6)
CASES = [
    "trainer-ddp",
    "trainer-fused",
    "trainer-gradient_allreduce",
    "trainer-bytegrad",
    "trainer-ddp@sgd",
    "trainer-decentralized@sgd",
    "trainer-bmuf",
    "trainer-async@sgd",
    "trainer-decentralized+autotune",
    "trainer-ddp@ga",
    "trainer-gradient_allreduce@ga",
    "trainer-ddp@qadam",
    "trainer-qadam@qadam",
    "accelerate-ddp",
    "accelerate-gradient_allreduce",
    "accelerate-bytegrad",
    "accelerate-decentralized",
    "accelerate-bmuf",
    "accelerate-qadam+clip",
    "mismatch",  # last: it leaves a half-initialised Trainer behind
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_dist")
    return run_torchrun_cases(HERE / "_hf_dist_worker.py", out, CASES, timeout=420)


def assert_same_numbers(got, ref, tol=TOL):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **tol)
    torch.testing.assert_close(torch.tensor(got["final0"]), torch.tensor(ref["final0"]), **tol)


def assert_fused_to_the_end(result):
    report = result["report"]
    assert report is not None, "the optimizer is not fused"
    assert report["fused_steps"] == STEPS and report["last_step_fused"]
    assert report["fused_params"] > 0 and report["unfused_params"] == 0
    assert report["flat_views"], "DDP / Accelerate wrapping moved parameters out of the flat buffers"


def test_ranks_really_train_on_different_data(results):
    ref = case_result(results, "trainer-ddp")
    assert ref["world"] == 2 and ref["wrapped"] == "DistributedDataParallel"
    assert ref["losses"][0] != ref["losses"][1]  # so agreement below is the communication's doing
    assert ref["rank_spread"] == 0.0 and ref["moved"] > 1e-3


def test_trainer_fused_matches_plain_ddp(results):
    got, ref = case_result(results, "trainer-fused"), case_result(results, "trainer-ddp")
    assert_same_numbers(got, ref)
    assert got["rank_spread"] == 0.0
    assert_fused_to_the_end(got)


def test_trainer_gradient_allreduce_matches_plain_ddp(results):
    got, ref = case_result(results, "trainer-gradient_allreduce"), case_result(results, "trainer-ddp")
    assert_same_numbers(got, ref)
    assert got["rank_spread"] == 0.0  # identical weights on both ranks
    assert got["collectives"].get("all_reduce", 0) >= STEPS  # the Bagua hook, not DDP's own, reduced
    assert_fused_to_the_end(got)


def test_trainer_gradient_allreduce_with_accumulation(results):
    """gradient_accumulation_steps=2: the hook runs once per update (no_sync on the first micro-batch)."""
    got, ref = case_result(results, "trainer-gradient_allreduce@ga"), case_result(results, "trainer-ddp@ga")
    assert len(got["losses"][0]) == 2 * STEPS
    assert_same_numbers(got, ref)
    assert got["rank_spread"] == 0.0
    assert STEPS <= got["collectives"].get("all_reduce", 0) < 2 * STEPS
    assert_fused_to_the_end(got)


def test_trainer_qadam(results):
    """BaguaTrainer(bagua_algorithm="qadam") with a QAdam optimizer, against plain DDP with the same
    optimizer: the warm-up is the same training; then momentum travels as uint8 (all-to-all +
    all-gather, no float allreduce of gradients) and every rank keeps the same weights."""
    got, ref = case_result(results, "trainer-qadam@qadam"), case_result(results, "trainer-ddp@qadam")
    assert got["rank_spread"] == 0.0
    warmup = 4
    torch.testing.assert_close(torch.tensor(got["losses"])[:, : warmup + 1], torch.tensor(ref["losses"])[:, : warmup + 1], **TOL)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=2e-2)
    assert got["collectives"].get("all_to_all", 0) >= STEPS - warmup
    assert got["losses"] != ref["losses"]  # the compressed path really ran
    assert_fused_to_the_end(got)


def test_trainer_async_averages_in_the_background_and_abort_equalizes(results):
    got = case_result(results, "trainer-async@sgd")
    assert min(got["async_rounds"]) >= 1  # rounds were applied while Trainer trained
    assert got["async_aborted"]  # on_train_end: abort(), one synchronous average
    assert got["rank_spread"] == 0.0 and got["moved"] > 1e-3
    assert got["after_step_calls"] == STEPS


def test_trainer_bytegrad(results):
    got, ref = case_result(results, "trainer-bytegrad"), case_result(results, "trainer-ddp")
    assert got["rank_spread"] == 0.0  # every rank decodes the same averaged gradient
    assert got["collectives"].get("all_to_all", 0) >= STEPS and got["collectives"].get("all_gather", 0) >= STEPS
    # uint8 gradients: close to exact DDP, but not equal (the compressed path really ran)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=2e-2)
    assert max(abs(a - b) for a, b in zip(got["final0"], ref["final0"])) > 1e-7
    assert_fused_to_the_end(got)


def test_trainer_decentralized_keeps_gradients_local_and_averages_weights(results):
    """SGD is linear: a local step on each rank then averaging the weights == one step on averaged gradients."""
    got, ref = case_result(results, "trainer-decentralized@sgd"), case_result(results, "trainer-ddp@sgd")
    assert_same_numbers(got, ref, dict(rtol=1e-5, atol=1e-6))
    assert got["after_step_calls"] == STEPS and got["collectives"].get("all_reduce", 0) == STEPS
    assert got["rank_spread"] < 1e-6
    assert ref["moved"] > 1e-2
    assert_fused_to_the_end(got)


def test_trainer_bmuf_block_syncs(results):
    got = case_result(results, "trainer-bmuf")
    assert got["after_step_calls"] == STEPS
    assert got["collectives"].get("all_reduce", 0) == STEPS // 4  # global_sync_iter=4
    assert got["rank_spread"] < 1e-6  # step 12 is a block sync: ranks agree again
    assert_fused_to_the_end(got)


def test_accelerate_gradient_allreduce_matches_plain_ddp(results):
    got, ref = case_result(results, "accelerate-gradient_allreduce"), case_result(results, "accelerate-ddp")
    assert ref["report"] is None and got["wrapped"] == "DistributedDataParallel"
    assert_same_numbers(got, ref)
    assert got["rank_spread"] == 0.0 and ref["moved"] > 1e-3
    assert got["collectives"].get("all_reduce", 0) >= STEPS
    assert_fused_to_the_end(got)


@pytest.mark.parametrize("name", ["accelerate-bytegrad", "accelerate-decentralized", "accelerate-bmuf"])
def test_accelerate_algorithms_keep_ranks_identical(results, name):
    got = case_result(results, name)
    assert got["rank_spread"] < 1e-6
    assert got["after_step_calls"] == (STEPS if "bytegrad" not in name else 0)
    assert_fused_to_the_end(got)


def test_accelerate_qadam_refuses_the_loops_clipping(results):
    """A custom loop's accelerator.clip_grad_norm_ under qadam would clip the momentum it exchanges."""
    got = case_result(results, "accelerate-qadam+clip")
    assert got["error"] == "AlgorithmSetupError", got
    assert "clip_grad_norm_" in got["message"]


def test_mismatched_algorithms_fail_by_name_not_hang(results):
    got = results["mismatch"]
    assert got.get("error") == "ModelMismatchError", got
    assert "bytegrad" in got["message"] and "gradient_allreduce" in got["message"]


def test_trainer_autotunes_decentralized_interval_and_ranks_agree(results):
    pytest.importorskip("optuna")
    got = case_result(results, "trainer-decentralized+autotune")
    assert got["autotune_trials"] == 3 and got["autotune_done"]
    assert len(set(got["intervals"])) == 1, got["intervals"]  # every rank applied the same setting
