"""Faults end in a named error on every rank, quickly, never in a hang."""

from __future__ import annotations

import time

import pytest
import torch

from _dist_models import MLP, global_batches, loss_fn, shard
from _dist_utils import run_ranks, run_scenarios, scenario_value
from bagua_integrations import fuse_optimizer
from bagua_integrations.distributed import ModelSwitchWrapper, bagua_init

WORLD = 2
TIMEOUT = 3.0  # seconds bagua_init waits for a peer
PREFIX = "bagua_integrations.distributed.errors."


def _init_and_report(build):
    """Run ``build()``; return which error it raised and how long it took."""
    start = time.monotonic()
    try:
        build()
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return {"error": type(error).__name__, "message": str(error), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def w_different_models(rank, world):
    model = MLP() if rank == 0 else torch.nn.Sequential(torch.nn.Linear(8, 4))
    return _init_and_report(lambda: bagua_init(model, torch.optim.SGD(model.parameters(), lr=0.1), timeout=TIMEOUT))


def w_different_algorithm_settings(rank, world):
    model = MLP()
    interval = 1 if rank == 0 else 2
    return _init_and_report(lambda: bagua_init(model, torch.optim.SGD(model.parameters(), lr=0.1), "decentralized",
                                               communication_interval=interval, timeout=TIMEOUT))


def w_fused_on_one_rank(rank, world):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        fuse_optimizer(optimizer)
    return _init_and_report(lambda: bagua_init(model, optimizer, message_size=256, timeout=TIMEOUT))


def w_switch_to_different_algorithms(rank, world):
    model = MLP()
    wrapper = ModelSwitchWrapper(model, torch.optim.SGD(model.parameters(), lr=0.1), timeout=TIMEOUT)
    wrapper.switch_to("gradient_allreduce")
    return _init_and_report(lambda: wrapper.switch_to("decentralized" if rank == 0 else "bytegrad"))


def _train_until_failure(rank, world, algorithm, fail):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, optimizer = bagua_init(model, optimizer, algorithm, message_size=256, timeout=TIMEOUT)
    for step, (x, y) in enumerate(global_batches(6, 4, world)):
        if rank == 1 and step == 2:
            fail()
        start = time.monotonic()
        try:
            optimizer.zero_grad()
            loss_fn(wrapped, shard(x, rank, world), shard(y, rank, world)).backward()
            optimizer.step()
        except Exception as error:  # noqa: BLE001
            return {"error": type(error).__name__, "message": str(error), "elapsed": time.monotonic() - start, "step": step}
    return {"error": None}


def _raise():
    raise RuntimeError("simulated failure on rank 1")


def _stall():
    time.sleep(2 * TIMEOUT)
    raise RuntimeError("rank 1 woke up after stalling")


def w_gradient_rank_raises(rank, world):
    return _train_until_failure(rank, world, "gradient_allreduce", _raise)


def w_gradient_rank_stalls(rank, world):
    return _train_until_failure(rank, world, "gradient_allreduce", _stall)


def w_model_algorithm_rank_stalls(rank, world):
    return _train_until_failure(rank, world, "decentralized", _stall)


def _run(worker):
    start = time.monotonic()
    results = run_ranks(worker, WORLD, timeout=120)
    return results, time.monotonic() - start


MISMATCHES = {
    "different_models": w_different_models,
    "different_algorithm_settings": w_different_algorithm_settings,
    "fused_on_one_rank": w_fused_on_one_rank,
    "switch_to_different_algorithms": w_switch_to_different_algorithms,
}


@pytest.fixture(scope="module")
def mismatches():
    # A mismatch is detected before any other collective, so the group stays usable: one spawn for all.
    return run_ranks(run_scenarios, WORLD, (MISMATCHES, list(MISMATCHES)), timeout=180)


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatched_ranks_raise_model_mismatch_on_every_rank(mismatches, name):
    for result in scenario_value(mismatches, name):
        assert result["error"] == "ModelMismatchError", result
        assert result["elapsed"] < TIMEOUT + 10, result
        assert "differs between ranks" in result["message"] and "on every rank" in result["message"]


def test_mismatch_message_names_what_differs(mismatches):
    message = scenario_value(mismatches, "different_models")[0]["message"]
    assert "fc1.weight" in message and "rank 1" in message


def test_a_rank_that_raises_makes_the_others_fail_fast():
    results, _ = _run(w_gradient_rank_raises)
    assert results[1].error_type == "builtins.RuntimeError" and "simulated failure" in results[1].error
    survivor = results[0].value
    assert survivor["error"] == "CommunicationError", survivor
    assert survivor["step"] == 2 and survivor["elapsed"] < TIMEOUT + 5, survivor


@pytest.mark.parametrize("worker", [w_gradient_rank_stalls, w_model_algorithm_rank_stalls])
def test_a_stalled_rank_makes_the_others_fail_after_the_timeout(worker):
    results, took = _run(worker)
    survivor = results[0].value
    assert survivor is not None, results[0].describe()
    assert survivor["error"] == "CommunicationError", survivor
    assert TIMEOUT * 0.8 <= survivor["elapsed"] < TIMEOUT + 5, survivor
    assert "timeout" in survivor["message"]
    assert took < 90
