"""bagua_init's setup checks on gloo ranks (found by review): a second wrapper over a model that is
still attached, a model on the meta device, and a process group without global rank 0."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist_models import MLP, flat_params, local_batches, loss_fn
from _dist_utils import run_ranks, values
from bagua_integrations.distributed import AlgorithmConfigError, bagua_init


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def sc_second_wrapper(rank, world):
    """The first wrapper's gradient hooks would still run: gradients averaged twice (halved)."""
    model = MLP()
    first, optimizer = bagua_init(model, _sgd(model), "gradient_allreduce")
    out = {}
    try:
        bagua_init(first.unwrap(), optimizer, "gradient_allreduce")
        out["refused"] = None
    except AlgorithmConfigError as error:
        out["refused"] = str(error)
    # after close(), the bare model can be wrapped again, and averages exactly once
    first.close()
    wrapped, optimizer = bagua_init(model, optimizer, "gradient_allreduce")
    reference = MLP()
    x, y = local_batches(1, 4, rank)[0]
    loss_fn(wrapped, x, y).backward()
    loss_fn(reference, x, y).backward()
    errors = []
    for p, q in zip(model.parameters(), reference.parameters()):
        dist.all_reduce(q.grad)
        errors.append((p.grad - q.grad / world).abs().max().item())
    out["grad_error"] = max(errors)
    return out


def sc_meta_model(rank, world):
    with torch.device("meta"):
        model = MLP()
    try:
        bagua_init(model, _sgd(model), "gradient_allreduce")
    except AlgorithmConfigError as error:
        return str(error)
    return None


def sc_group_without_rank_zero(rank, world):
    """Training on ranks [1, 2] of 3: broadcasts come from the group's first rank (global 1)."""
    group = dist.new_group([1, 2])
    if rank == 0:
        dist.barrier()  # rank 0 serves the store the others rendezvous through: stay until they finish
        return None
    model = MLP(seed=rank)  # different initial weights: bagua_init must make them equal
    wrapped, optimizer = bagua_init(model, _sgd(model), "gradient_allreduce", process_group=group)
    for x, y in local_batches(3, 4, rank):
        optimizer.zero_grad()
        loss_fn(wrapped, x, y).backward()
        optimizer.step()
    mine = flat_params(model)
    copies = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(copies, mine, group=group)
    dist.barrier()
    return (copies[0] - copies[1]).abs().max().item()


def _run(fn, world):
    return values(run_ranks(fn, world, timeout=180))


def test_a_model_still_attached_to_a_wrapper_is_refused_until_closed():
    for result in _run(sc_second_wrapper, 2):
        assert result["refused"] is not None and "close()" in result["refused"], result
        assert result["grad_error"] <= 1e-6, result


def test_a_model_on_the_meta_device_is_refused_by_name():
    for message in _run(sc_meta_model, 2):
        assert message is not None and "meta device" in message and "to_empty" in message


def test_a_process_group_without_global_rank_zero_trains_in_lockstep():
    spread = _run(sc_group_without_rank_zero, 3)
    assert spread[0] is None
    assert spread[1] == 0.0 and spread[2] == 0.0, spread


def sc_settings_differ(rank, world, what):
    """Each would fail in a collective of the wrong size (gloo aborts the process) if not caught."""
    from bagua_integrations.distributed import ModelMismatchError

    model = MLP()
    params = list(model.fc3.parameters()) if what == "optimizer" and rank == 1 else model.parameters()
    # (a learning rate of its own per rank: every collective matches, and the replicas drift apart)
    optimizer = torch.optim.SGD(params, lr=0.1 * (1 + rank) if what == "learning rate" else 0.1)
    algorithm = "decentralized" if what == "optimizer" else "gradient_allreduce"
    try:
        bagua_init(model, optimizer, algorithm, broadcast_buffers=(rank == 0) if what == "buffers" else True)
    except ModelMismatchError as error:
        return str(error)
    return None


@pytest.mark.parametrize("what", ["buffers", "optimizer", "learning rate"])
def test_ranks_that_disagree_on_buffers_or_the_optimizers_parameters_fail_by_name(what):
    for message in values(run_ranks(sc_settings_differ, 2, (what,), timeout=180)):
        assert message is not None, "bagua_init accepted ranks that disagree"
        if what == "learning rate":
            assert "lr=0.1" in message and "lr=0.2" in message, message
