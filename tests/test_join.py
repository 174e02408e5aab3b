"""Uneven inputs (issue 12 item 5): ``with model.join():`` on 2 gloo ranks, and the stall watchdog.

Under ``Join`` ranks with fewer batches shadow the others' collectives: gradients (and weights
under model averaging) are averaged over the ranks that still have data. Each algorithm is
compared with a reference written here in plain torch.distributed. A collective whose peer
does not come warns (``CollectiveStallWarning``, naming the collective and the missing rank)
after the stall interval and raises ``CommunicationError`` at the timeout, while a peer that is
merely slow is warned about but not aborted. Every run has hard process deadlines.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from _dist_models import MLP, flat_params, gather_flat, local_batches, loss_fn, max_param_diff
from _dist_utils import run_ranks, run_scenarios, scenario_value
from bagua_integrations.distributed import (
    CollectiveStallWarning,
    CommunicationError,
    JoinError,
    ModelAlgorithm,
    ModelSwitchWrapper,
    bagua_init,
    set_stall_warning,
    stall_warning_seconds,
)
from bagua_integrations.distributed import comm

WORLD = 2
TOL = 1e-6
SHORT, LONG = 3, 5  # batches of rank 0 and rank 1: rank 0 runs out first


def _batches(rank):
    return local_batches(SHORT if rank == 0 else LONG, 4, rank)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train_under_join(wrapped, optimizer, batches, **join_kwargs):
    with wrapped.join(**join_kwargs):
        for x, y in batches:
            optimizer.zero_grad()
            loss_fn(wrapped, x, y).backward()
            optimizer.step()


def _spread(model) -> float:
    copies = gather_flat(flat_params(model))
    return (copies[0] - copies[1]).abs().max().item()


def _have(i, batches) -> torch.Tensor:
    return torch.tensor([1.0 if i < len(batches) else 0.0])


def _count(flag: torch.Tensor) -> float:
    total = flag.clone()
    dist.all_reduce(total)
    return total.item()


# ---------------------------------------------------------------------- gradient algorithms
def _gradient_reference(rank, world, batches, steps, divide_by_initial_world_size=False):
    """Plain torch.distributed: every rank steps with sum(grads of ranks with data) / (#ranks with data)."""
    model = MLP()
    optimizer = _sgd(model)
    for i in range(steps):
        optimizer.zero_grad()
        have = _have(i, batches)
        if have.item():
            loss_fn(model, *batches[i]).backward()
        count = _count(have)
        for p in model.parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            p.grad = grad / (world if divide_by_initial_world_size else count)
        optimizer.step()
    return model


def _gradient(rank, world, algorithm="gradient_allreduce", **join_kwargs):
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, algorithm, message_size=256)
    batches = _batches(rank)
    _train_under_join(wrapped, optimizer, batches, **join_kwargs)
    metric = torch.tensor([float(len(batches))])
    dist.all_reduce(metric)  # a collective of the user's after the join context: everyone is there
    reference = _gradient_reference(rank, world, batches, LONG, **join_kwargs)
    return {"error": max_param_diff(model, reference), "spread": _spread(model), "metric": metric.item(),
            "buckets": len(wrapped.reducer.buckets)}


def sc_gradient_allreduce(rank, world):
    return _gradient(rank, world)


def sc_gradient_allreduce_divide_by_initial_world_size(rank, world):
    return _gradient(rank, world, divide_by_initial_world_size=True)


def sc_bytegrad(rank, world):
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, "bytegrad", message_size=256)
    _train_under_join(wrapped, optimizer, _batches(rank))
    return {"spread": _spread(model)}


class WithBuffer(torch.nn.Module):
    """An MLP with a BatchNorm: its buffers are broadcast every training forward."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.mlp(x))


def sc_buffers_and_no_sync(rank, world):
    """Buffers broadcast from a rank that still has data; no_sync micro-batches under Join."""
    model = WithBuffer()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, "gradient_allreduce", message_size=256)
    batches = _batches(rank)
    with wrapped.join():
        for x, y in batches:
            optimizer.zero_grad()
            with wrapped.no_sync():
                loss_fn(wrapped, x[:2], y[:2]).backward()
            loss_fn(wrapped, x[2:], y[2:]).backward()
            optimizer.step()
    buffers = torch.cat([b.float().reshape(-1) for b in model.buffers()])
    copies = gather_flat(buffers)
    return {"spread": _spread(model), "buffer_spread": (copies[0] - copies[1]).abs().max().item()}


class _OtherJoinable(Joinable):
    def __init__(self):
        super().__init__()

    def join_hook(self, **kwargs):
        return JoinHook()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD


def sc_model_must_be_first_joinable(rank, world):
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, "gradient_allreduce")
    try:
        with Join([_OtherJoinable(), wrapped]):
            loss_fn(wrapped, *_batches(rank)[0]).backward()
    except JoinError as error:
        return str(error)
    return None


def sc_model_switch_wrapper(rank, world):
    model = MLP()
    optimizer = _sgd(model)
    wrapper = ModelSwitchWrapper(model, optimizer).switch_to("decentralized")
    _train_under_join(wrapper, optimizer, _batches(rank))
    first = _spread(model)
    wrapper.switch_to("gradient_allreduce")
    _train_under_join(wrapper, optimizer, _batches(rank))
    return {"decentralized": first, "gradient_allreduce": _spread(model)}


def sc_switch_inside_join(rank, world):
    """Every rank switches algorithms after its first step, inside the join block: JoinError on every
    rank (it was a gloo abort on the rank that ran out of data, "Received data size doesn't match")."""
    model = MLP()
    optimizer = _sgd(model)
    wrapper = ModelSwitchWrapper(model, optimizer).switch_to("gradient_allreduce")
    message = None
    try:
        with wrapper.join():
            for x, y in _batches(rank):
                optimizer.zero_grad()
                loss_fn(wrapper, x, y).backward()
                optimizer.step()
                wrapper.switch_to("decentralized")
    except JoinError as error:
        message = str(error)
    wrapper.switch_to("gradient_allreduce")  # (outside the block: allowed, and the group still works)
    return message


class NoJoinAveraging(ModelAlgorithm):
    """A model algorithm written without an uneven-input form."""

    name = "no_join_averaging"

    def update(self, step, group):
        flats = self.pack.gather()
        self.run([comm.average(flat, group) for flat in flats], "averaging")
        self.pack.scatter()
        return True


def sc_model_algorithm_without_join_form(rank, world):
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, NoJoinAveraging())
    try:
        _train_under_join(wrapped, optimizer, _batches(rank))
    except JoinError as error:
        return str(error)
    return None


# ---------------------------------------------------------------------- model algorithms
def _local_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss_fn(model, *batch).backward()
    optimizer.step()


def _mean_over_active(tensor: torch.Tensor, have: torch.Tensor, count: float) -> torch.Tensor:
    total = tensor * have.item()
    dist.all_reduce(total)
    return total / count


def _decentralized_reference(rank, world, batches, steps, mode, interval):
    model = MLP()
    optimizer = _sgd(model)
    for i in range(steps):
        have = _have(i, batches)
        if have.item():
            _local_step(model, optimizer, batches[i])
        count = _count(have)
        if (i + 1) % interval:
            continue
        for p in model.parameters():
            if mode == "all":  # a rank without data takes the others' mean
                p.data = _mean_over_active(p.data, have, count)
            elif count == world:  # shift_one on 2 ranks: swap with the other rank while both have data
                other = [torch.empty_like(p.data) for _ in range(world)]
                dist.all_gather(other, p.data.contiguous())
                p.data = (other[0] + other[1]) / 2
    return model


def _decentralized(rank, world, mode, interval):
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, "decentralized", peer_selection_mode=mode,
                                    communication_interval=interval)
    batches = _batches(rank)
    _train_under_join(wrapped, optimizer, batches)
    reference = _decentralized_reference(rank, world, batches, LONG, mode, interval)
    return {"error": max_param_diff(model, reference), "spread": _spread(model),
            "updates": wrapped.session.num_updates, "rounds": wrapped.algorithm.rounds}


def sc_decentralized_all(rank, world):
    return _decentralized(rank, world, "all", 1)


def sc_decentralized_shift_one(rank, world):
    return _decentralized(rank, world, "shift_one", 1)


def sc_decentralized_next_epoch_stays_in_step(rank, world):
    """An uneven epoch under Join, then an even one without: the ranks' update counters agree."""
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, "decentralized", peer_selection_mode="all",
                                    communication_interval=2)
    _train_under_join(wrapped, optimizer, local_batches(3 + rank, 4, rank))  # 3 and 4 updates
    after_join = wrapped.session.num_updates
    for batch in local_batches(2, 4, rank, seed=99):  # updates 5 and 6: every rank averages after 6
        _local_step(wrapped, optimizer, batch)
    return {"after_join": after_join, "updates": wrapped.session.num_updates, "spread": _spread(model)}


BMUF = dict(block_lr=1.0, block_momentum=0.875, global_sync_iter=2, warmup_iterations=4)
BMUF_STEPS = (3, 6)  # rank 0 runs out before the warmup broadcast (update 4) and the block sync at 6


def _bmuf_reference(rank, world, batches, steps):
    """BMUF's math in plain torch.distributed, over the ranks with data; a rank without data contributes nothing."""
    model = MLP()
    optimizer = _sgd(model)
    initial_state = optimizer.state_dict()
    global_params = [p.detach().clone() for p in model.parameters()]
    smoothed = [torch.zeros_like(p) for p in model.parameters()]
    for step in range(1, steps + 1):
        have = _have(step - 1, batches)
        if have.item():
            _local_step(model, optimizer, batches[step - 1])
        count = _count(have)
        if step == BMUF["warmup_iterations"]:
            root = torch.tensor([float(rank) if have.item() else float(world)])
            dist.all_reduce(root, op=dist.ReduceOp.MIN)
            for p in model.parameters():
                dist.broadcast(p.data, int(root.item()))
            optimizer.load_state_dict(initial_state)
            global_params = [p.detach().clone() for p in model.parameters()]
            smoothed = [torch.zeros_like(p) for p in model.parameters()]
        elif step > BMUF["warmup_iterations"] and step % BMUF["global_sync_iter"] == 0:
            for index, p in enumerate(model.parameters()):
                grad = _mean_over_active(global_params[index] - p.data, have, count)
                smoothed[index] = BMUF["block_momentum"] * smoothed[index] + BMUF["block_lr"] * grad
                p.data.copy_(global_params[index] - smoothed[index])
                global_params[index] = p.data.clone()
    return model


def sc_bmuf(rank, world):
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, "bmuf", **BMUF)
    batches = local_batches(BMUF_STEPS[rank], 4, rank)
    _train_under_join(wrapped, optimizer, batches)
    reference = _bmuf_reference(rank, world, batches, BMUF_STEPS[-1])
    return {"error": max_param_diff(model, reference), "spread": _spread(model),
            "updates": wrapped.session.num_updates}


SCENARIOS = {
    "gradient_allreduce": sc_gradient_allreduce,
    "divide_by_initial_world_size": sc_gradient_allreduce_divide_by_initial_world_size,
    "bytegrad": sc_bytegrad,
    "buffers_and_no_sync": sc_buffers_and_no_sync,
    "first_joinable": sc_model_must_be_first_joinable,
    "model_switch_wrapper": sc_model_switch_wrapper,
    "switch_inside_join": sc_switch_inside_join,
    "without_join_form": sc_model_algorithm_without_join_form,
    "decentralized_all": sc_decentralized_all,
    "decentralized_shift_one": sc_decentralized_shift_one,
    "next_epoch": sc_decentralized_next_epoch_stays_in_step,
    "bmuf": sc_bmuf,
}


@pytest.fixture(scope="module")
def outcomes():
    # Join shadows everything, so no scenario breaks the group: one spawn for all of them.
    return run_ranks(run_scenarios, WORLD, (SCENARIOS, list(SCENARIOS)), timeout=240, pg_timeout=30)


@pytest.mark.parametrize("name", ["gradient_allreduce", "divide_by_initial_world_size"])
def test_gradient_allreduce_averages_over_the_ranks_that_still_have_data(outcomes, name):
    for result in scenario_value(outcomes, name):
        assert result["error"] < TOL, result  # equal to the plain torch.distributed reference
        assert result["spread"] == 0.0, result  # the rank that ran out got the last joiner's weights
        assert result["metric"] == SHORT + LONG and result["buckets"] > 1, result


def test_bytegrad_under_join_finishes_with_identical_replicas(outcomes):
    for result in scenario_value(outcomes, "bytegrad"):
        assert result["spread"] == 0.0, result


def test_buffers_and_no_sync_under_join(outcomes):
    for result in scenario_value(outcomes, "buffers_and_no_sync"):
        assert result["spread"] == 0.0 and result["buffer_spread"] == 0.0, result


def test_the_model_must_be_the_first_joinable_on_every_rank(outcomes):
    for message in scenario_value(outcomes, "first_joinable"):
        assert message is not None and "first joinable" in message


def test_model_switch_wrapper_joins_like_the_model_it_wraps(outcomes):
    for result in scenario_value(outcomes, "model_switch_wrapper"):
        assert result == {"decentralized": 0.0, "gradient_allreduce": 0.0}, result


def test_switch_to_inside_the_join_block_is_refused_on_every_rank(outcomes):
    for message in scenario_value(outcomes, "switch_inside_join"):
        assert message is not None and "switch between epochs, outside the join block" in message, message


def test_a_model_algorithm_without_a_join_form_refuses_on_every_rank(outcomes):
    for message in scenario_value(outcomes, "without_join_form"):
        assert message is not None and "no uneven-input (Join) form" in message


def test_decentralized_all_averages_over_ranks_with_data_and_the_others_follow(outcomes):
    for result in scenario_value(outcomes, "decentralized_all"):
        assert result["error"] < TOL, result
        assert result["spread"] == 0.0, result  # averaged at the last update: one model everywhere
        assert result["updates"] == LONG and result["rounds"] == LONG, result


def test_decentralized_shift_one_skips_partners_without_data(outcomes):
    results = scenario_value(outcomes, "decentralized_shift_one")
    for result in results:
        assert result["error"] < TOL, result
        assert result["updates"] == LONG and result["rounds"] == LONG, result
    assert results[0]["spread"] > 1e-4  # rank 1 trained on alone: replicas legitimately differ


def test_update_counters_agree_after_join_so_the_next_epoch_stays_in_step(outcomes):
    for result in scenario_value(outcomes, "next_epoch"):
        assert result["after_join"] == 4 and result["updates"] == 6, result
        assert result["spread"] == 0.0, result


def test_bmuf_block_sync_over_ranks_with_data(outcomes):
    for result in scenario_value(outcomes, "bmuf"):
        assert result["error"] < TOL, result
        assert result["spread"] == 0.0, result  # the last update was a block sync
        assert result["updates"] == BMUF_STEPS[-1], result


# ---------------------------------------------------------------------- 2 nodes x 2 ranks (hierarchical)
NODE_BATCHES = (2, 5, 3, 4)  # at update 5 only rank 1 has data: node 1 (ranks 2, 3) has none


def _hierarchical_reference(rank, world, batches, mode):
    """Node means over ranks with data, then (shift_one) the two node means averaged when both have data."""
    model = MLP()
    optimizer = _sgd(model)
    for i in range(max(NODE_BATCHES)):
        have = _have(i, batches)
        if have.item():
            _local_step(model, optimizer, batches[i])
        flags = [torch.empty(1) for _ in range(world)]
        dist.all_gather(flags, have)
        active = [f.item() > 0 for f in flags]
        for p in model.parameters():
            copies = [torch.empty_like(p.data) for _ in range(world)]
            dist.all_gather(copies, p.data.contiguous())
            if mode == "all":
                p.data = sum(c for c, a in zip(copies, active) if a) / sum(active)
                continue
            means = []
            for node in (0, 1):
                members = [r for r in (2 * node, 2 * node + 1) if active[r]]
                means.append(sum(copies[r] for r in members) / len(members) if members else None)
            mine = means[rank // 2]
            if mine is not None:
                other = means[1 - rank // 2]
                p.data = (mine + other) / 2 if other is not None else mine
    return model


def _hierarchical(rank, world, algorithm, **kwargs):
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, algorithm, hierarchical_reduce=True, message_size=256, **kwargs)
    assert wrapped.algorithm.nodes(None) is not None
    batches = local_batches(NODE_BATCHES[rank], 4, rank)
    _train_under_join(wrapped, optimizer, batches)
    if algorithm == "gradient_allreduce":
        reference = _gradient_reference(rank, world, batches, max(NODE_BATCHES))
    else:
        reference = _hierarchical_reference(rank, world, batches, kwargs["peer_selection_mode"])
    copies = gather_flat(flat_params(model))
    return {"error": max_param_diff(model, reference), "spread": max((c - copies[0]).abs().max().item() for c in copies)}


def sc_hierarchical_gradient_allreduce(rank, world):
    return _hierarchical(rank, world, "gradient_allreduce")


def sc_hierarchical_decentralized_all(rank, world):
    return _hierarchical(rank, world, "decentralized", peer_selection_mode="all")


def sc_hierarchical_decentralized_shift_one(rank, world):
    return _hierarchical(rank, world, "decentralized", peer_selection_mode="shift_one")


NODE_SCENARIOS = {
    "gradient_allreduce": sc_hierarchical_gradient_allreduce,
    "decentralized_all": sc_hierarchical_decentralized_all,
    "decentralized_shift_one": sc_hierarchical_decentralized_shift_one,
}


@pytest.fixture(scope="module")
def node_outcomes():
    return run_ranks(run_scenarios, 4, (NODE_SCENARIOS, list(NODE_SCENARIOS)), timeout=300, pg_timeout=30,
                     env={"LOCAL_WORLD_SIZE": 2})


@pytest.mark.parametrize("name", list(NODE_SCENARIOS))
def test_hierarchical_algorithms_under_join_on_two_nodes(node_outcomes, name):
    results = scenario_value(node_outcomes, name)
    for result in results:
        assert result["error"] < TOL, result
    if name != "decentralized_shift_one":
        assert results[0]["spread"] == 0.0, results
    else:
        assert results[0]["spread"] > 1e-4, results  # node 1 had no data at the end: it kept its weights


# ---------------------------------------------------------------------- stalled collectives
WARN, TIMEOUT = 1.0, 4.0


def _recording_warnings():
    """Record warnings with the step they came in (``start[1]``) and when (seconds after ``start[0]``)."""
    log = []
    start = [time.monotonic(), None]

    def show(message, category, *args, **kwargs):
        log.append({"category": category.__name__, "message": str(message), "at": time.monotonic() - start[0],
                    "step": start[1]})

    warnings.simplefilter("always")
    warnings.showwarning = show
    return log, start


def w_slow_then_stalled_peer(rank, world, algorithm="gradient_allreduce", options=None):
    """Rank 1 is slow once (2.5 s: warned about, not aborted), then stops coming (rank 0 raises)."""
    set_stall_warning(WARN)
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, algorithm, timeout=TIMEOUT, **(options or {}))
    log, start = _recording_warnings()
    for step, batch in enumerate(local_batches(3, 4, rank)):
        if rank == 1 and step == 1:
            time.sleep(2.5)  # e.g. compiling its first step
        if rank == 1 and step == 2:
            time.sleep(TIMEOUT + 2)  # stays alive (so no connection reset) but never joins the collective
            return {"log": log}
        start[:] = [time.monotonic(), step]
        try:
            _local_step(wrapped, optimizer, batch)
        except CommunicationError as error:
            return {"log": log, "step": step, "error": str(error), "elapsed": time.monotonic() - start[0]}
    return {"log": log, "step": None}


def w_extra_step_while_peer_in_barrier(rank, world):
    """The issue's report: one extra step on rank 0 while rank 1 waits in dist.barrier(), default timeout."""
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer, "gradient_allreduce")
    log, start = _recording_warnings()
    out = {"log": log, "interval": stall_warning_seconds()}
    try:
        for step, batch in enumerate(local_batches(2 + (rank == 0), 4, rank)):
            start[:] = [time.monotonic(), step]
            _local_step(wrapped, optimizer, batch)
        if rank == 1:
            dist.barrier()
    except Exception as error:  # noqa: BLE001 - the test inspects it
        out.update(error_type=type(error).__name__, error=str(error), elapsed=time.monotonic() - start[0])
    return out


def _stall_warnings(log, steps):
    """The stall warnings of ``steps`` (an earlier step may warn too on a heavily loaded machine)."""
    return [entry for entry in log if entry["category"] == CollectiveStallWarning.__name__ and entry["step"] in steps]


# What each algorithm waits on: a collective (allreduce), a send and receive with one peer, and a ring of
# sends and receives (3 ranks). gloo closes every connection when a wait on a send or receive times out,
# so the watchdog's short waits must not touch those: a peer 2.5 s late once failed the whole job.
SLOW_PEER_CASES = {
    "allreduce": ("gradient_allreduce", {}, WORLD, "gradient_allreduce gradient bucket"),
    "exchange": ("decentralized", {"peer_selection_mode": "shift_one"}, WORLD, "weight averaging"),
    "ring-exchange": ("low_precision_decentralized", {}, 3, "low-precision ring averaging"),
}


@pytest.mark.parametrize("case", list(SLOW_PEER_CASES))
def test_slow_peer_is_warned_about_but_not_aborted_and_a_stalled_one_raises_at_the_timeout(case):
    algorithm, options, world, what = SLOW_PEER_CASES[case]
    begin = time.monotonic()
    results = run_ranks(w_slow_then_stalled_peer, world, args=(algorithm, options), timeout=90, pg_timeout=30)
    took = time.monotonic() - begin
    survivor = results[0].value
    assert survivor is not None, results[0].describe()
    warned = _stall_warnings(survivor["log"], (1, 2))
    # step 1: rank 1 is 2.5 s late -> one warning after ~1 s, then the step completes
    # step 2: rank 1 never comes -> a warning after ~1 s, CommunicationError at the 4 s timeout
    assert survivor["step"] == 2, survivor
    assert [entry["step"] for entry in warned] == [1, 2], survivor["log"]
    for entry in warned:
        assert WARN * 0.8 <= entry["at"] < WARN + 1.5, entry
        assert what in entry["message"], entry
        assert f"rank(s) [1] of {list(range(world))} have not arrived" in entry["message"], entry
        assert "CommunicationError" in entry["message"] and f"{TIMEOUT:g}s" in entry["message"], entry
    assert TIMEOUT * 0.9 <= survivor["elapsed"] < TIMEOUT + 3, survivor
    assert "did not complete within 4s" in survivor["error"], survivor
    assert took < 60


def test_extra_step_while_the_peer_waits_in_a_barrier_warns_then_raises_at_the_process_group_timeout():
    pg_timeout = 5.0
    results = run_ranks(w_extra_step_while_peer_in_barrier, WORLD, timeout=90, pg_timeout=pg_timeout,
                        env={"BAGUA_STALL_WARNING_SECONDS": "1"})
    survivor = results[0].value
    assert survivor is not None, results[0].describe()
    assert survivor["interval"] == 1.0
    assert survivor.get("error_type") == "CommunicationError", survivor
    assert pg_timeout * 0.8 <= survivor["elapsed"] < pg_timeout + 3, survivor
    warned = _stall_warnings(survivor["log"], (2,))  # rank 0's extra step
    assert len(warned) == 1, survivor["log"]
    message = warned[0]["message"]
    assert "gradient bucket" in message and "rank(s) [1] of [0, 1] have not arrived" in message, message
    assert f"process group's timeout ({pg_timeout:g}s)" in message, message
    assert results[1].value is not None and results[1].value.get("error_type"), results[1].describe()


# ---------------------------------------------------------------------- one process
def test_join_without_a_process_group_is_a_no_op():
    model = MLP()
    optimizer = _sgd(model)
    wrapped, optimizer = bagua_init(model, optimizer)
    _train_under_join(wrapped, optimizer, local_batches(2, 4, 0))


def test_stall_warning_interval_is_configurable(monkeypatch):
    def from_env(value):  # the variable is read at the first wait, and again after set_stall_warning()
        if value is None:
            monkeypatch.delenv(comm.STALL_WARNING_ENV, raising=False)
        else:
            monkeypatch.setenv(comm.STALL_WARNING_ENV, value)
        set_stall_warning()
        return stall_warning_seconds()

    try:
        assert from_env(None) == comm.DEFAULT_STALL_WARNING_SECONDS == 60.0
        assert from_env("2.5") == 2.5
        assert from_env("0") is None
        with pytest.raises(Exception, match="BAGUA_STALL_WARNING_SECONDS"):
            from_env("soon")
        set_stall_warning(7)
        assert stall_warning_seconds() == 7.0
        set_stall_warning(0)
        assert stall_warning_seconds() is None
        with pytest.raises(Exception, match=">= 0"):
            set_stall_warning(-1)
    finally:
        monkeypatch.delenv(comm.STALL_WARNING_ENV, raising=False)
        set_stall_warning()
