"""Model algorithms on 2 gloo ranks: decentralized against a plain torch.distributed reference,
bmuf against fairseq's FairseqBMUF step for step, and switching algorithms mid-training."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
import torch.distributed as dist

from _dist_models import MLP, gather_flat, flat_params, global_batches, local_batches, loss_fn, max_param_diff, shard
from _dist_utils import run_ranks, run_scenarios, scenario_value
from bagua_integrations import fuse_optimizer
from bagua_integrations.distributed import ModelSwitchWrapper, bagua_init, get_algorithm

WORLD = 2
TOL = 1e-6


def _sgd(model, lr=0.1):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


# ---------------------------------------------------------------------- decentralized
def _reference_average(model, mode, world, rank):
    """Plain torch.distributed: all -> allreduce mean; shift_one on 2 ranks -> swap with the other rank."""
    for p in model.parameters():
        if mode == "all":
            dist.all_reduce(p.data)
            p.data /= world
        else:
            other = torch.empty_like(p.data)
            peer = 1 - rank
            if rank < peer:
                dist.send(p.data.contiguous(), peer)
                dist.recv(other, peer)
            else:
                dist.recv(other, peer)
                dist.send(p.data.contiguous(), peer)
            p.data = (p.data + other) / 2


def _decentralized(rank, world, mode, interval, entry_point, fuse=False):
    model, reference = MLP(), MLP()
    optimizer, ref_opt = _sgd(model), _sgd(reference)
    if fuse:
        fuse_optimizer(optimizer, replace_step=True)
    kwargs = dict(peer_selection_mode=mode, communication_interval=interval)
    if entry_point == "bagua_init":
        wrapped, optimizer = bagua_init(model, optimizer, "decentralized", **kwargs)
        algorithm = None
    else:  # a framework that owns its loop calls after_step itself
        wrapped, algorithm = model, get_algorithm("decentralized", **kwargs)
    errors, spread = [], []
    for step, (x, y) in enumerate(local_batches(6, 4, rank), 1):
        optimizer.zero_grad()
        loss_fn(wrapped, x, y).backward()
        optimizer.step()
        if algorithm is not None:
            algorithm.after_step(model.parameters(), step=step)
        ref_opt.zero_grad()
        loss_fn(reference, x, y).backward()
        ref_opt.step()
        if step % interval == 0:
            _reference_average(reference, mode, world, rank)
        errors.append(max_param_diff(model, reference))
        copies = gather_flat(flat_params(model))
        spread.append((copies[0] - copies[1]).abs().max().item())
    return {"errors": errors, "spread": spread}


def sc_decentralized_all(rank, world):
    return _decentralized(rank, world, "all", 1, "bagua_init")


def sc_decentralized_all_interval(rank, world):
    return _decentralized(rank, world, "all", 2, "bagua_init", fuse=True)


def sc_decentralized_shift_one(rank, world):
    return _decentralized(rank, world, "shift_one", 1, "bagua_init")


def sc_decentralized_after_step(rank, world):
    return _decentralized(rank, world, "shift_one", 3, "after_step")


# ---------------------------------------------------------------------- bmuf vs fairseq
BMUF_CONFIGS = {
    # fairseq's own test setting: no warmup, sync every update, Nesterov block momentum, averaged Adam state
    "nbm_average_sync_adam": dict(block_lr=0.5, block_momentum=0.875, global_sync_iter=1, warmup_iterations=0,
                                  use_nbm=True, average_sync=True, optimizer="adam", steps=6),
    # warmup broadcast + optimizer state reset, then block syncs every 2 updates
    "warmup_reset_sgd": dict(block_lr=1.0, block_momentum=0.875, global_sync_iter=2, warmup_iterations=3,
                             use_nbm=False, average_sync=False, optimizer="sgd", steps=9),
    # block_momentum 0: plain model averaging every 3 updates after a warmup of 2
    "plain_averaging_adam": dict(block_lr=1.0, block_momentum=0.0, global_sync_iter=3, warmup_iterations=2,
                                 use_nbm=False, average_sync=True, optimizer="adam", steps=8),
}


def _fairseq_pair(model_f, model_o, config):
    from fairseq.optim.adam import Adam as FairseqAdamImpl
    from fairseq.optim.adam import FairseqAdam
    from fairseq.optim.sgd import SGD as FairseqSGD
    from omegaconf import OmegaConf

    if config["optimizer"] == "sgd":
        fairseq_opt = FairseqSGD(Namespace(lr=[0.1], momentum=0.9, weight_decay=0.0), model_f.parameters())
        ours = torch.optim.SGD(model_o.parameters(), lr=0.1, momentum=0.9, weight_decay=0.0)
    else:
        cfg = OmegaConf.create(dict(lr=[0.01], adam_betas="(0.9, 0.999)", adam_eps=1e-8, weight_decay=0.0,
                                    use_old_adam=False, fp16_adam_stats=False, tpu=False))
        fairseq_opt = FairseqAdam(cfg, model_f.parameters())
        ours = FairseqAdamImpl(model_o.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    return fairseq_opt, ours


def _bmuf_vs_fairseq(rank, world, name, entry_point="bagua_init", fuse=False):
    from fairseq.optim.bmuf import FairseqBMUF
    from omegaconf import OmegaConf

    config = BMUF_CONFIGS[name]
    hyper = {k: v for k, v in config.items() if k not in ("optimizer", "steps")}
    model_f, model_o = MLP(), MLP()
    fairseq_opt, optimizer = _fairseq_pair(model_f, model_o, config)
    bmuf = FairseqBMUF(OmegaConf.create(dict(hyper, distributed_world_size=world)), fairseq_opt)
    if fuse:
        fuse_optimizer(optimizer)
    if entry_point == "bagua_init":
        wrapped, optimizer = bagua_init(model_o, optimizer, "bmuf", **hyper)
        algorithm = None
    else:
        wrapped = model_o
        algorithm = get_algorithm("bmuf", **hyper).attach(list(model_o.parameters()), optimizer)
    step_fn = optimizer.fuse_step if fuse else optimizer.step
    errors, state_errors, synced = [], [], []
    for step, (x, y) in enumerate(local_batches(config["steps"], 4, rank), 1):
        bmuf.zero_grad()
        bmuf.backward(loss_fn(model_f, x, y))
        bmuf.step()
        optimizer.zero_grad()
        loss_fn(wrapped, x, y).backward()
        step_fn()
        if algorithm is not None:
            algorithm.after_step(step=step)
        errors.append(max_param_diff(model_f, model_o))
        state_errors.append(_state_diff(fairseq_opt.optimizer, optimizer))
        copies = gather_flat(flat_params(model_o))
        synced.append(torch.equal(copies[0], copies[1]))
    return {"errors": errors, "state_errors": state_errors, "synced": synced}


def _state_diff(a, b) -> float:
    worst = 0.0
    for pa, pb in zip([p for g in a.param_groups for p in g["params"]], [p for g in b.param_groups for p in g["params"]]):
        sa, sb = a.state.get(pa, {}), b.state.get(pb, {})
        assert sa.keys() == sb.keys(), (sa.keys(), sb.keys())
        for key, value in sa.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                worst = max(worst, (value - sb[key]).abs().max().item())
    return worst


def sc_bmuf_nbm_average_sync_adam(rank, world):
    return _bmuf_vs_fairseq(rank, world, "nbm_average_sync_adam")


def sc_bmuf_warmup_reset_sgd(rank, world):
    return _bmuf_vs_fairseq(rank, world, "warmup_reset_sgd")


def sc_bmuf_plain_averaging_adam(rank, world):
    return _bmuf_vs_fairseq(rank, world, "plain_averaging_adam")


def sc_bmuf_warmup_reset_sgd_fused(rank, world):
    return _bmuf_vs_fairseq(rank, world, "warmup_reset_sgd", fuse=True)


def sc_bmuf_after_step_entry_point(rank, world):
    return _bmuf_vs_fairseq(rank, world, "nbm_average_sync_adam", entry_point="after_step")


# ---------------------------------------------------------------------- switching
def _reference_bmuf_sync(model, state, world, block_lr, block_momentum):
    """BMUF's block sync transcribed from the math (no Nesterov, no state averaging)."""
    for i, p in enumerate(model.parameters()):
        grad = state["global"][i] - p.data
        dist.all_reduce(grad)
        grad /= world
        state["smoothed"][i] = block_momentum * state["smoothed"][i] + block_lr * grad
        p.data.copy_(state["global"][i] - state["smoothed"][i])
        state["global"][i] = p.data.clone()


def _average_params(model, world, optimizer=None):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= world
        if optimizer is not None and "momentum_buffer" in optimizer.state[p]:
            buf = optimizer.state[p]["momentum_buffer"]
            dist.all_reduce(buf)
            buf /= world


def sc_switch_algorithms(rank, world):
    """gradient_allreduce -> decentralized -> bmuf -> gradient_allreduce, against a plain reference."""
    model, reference = MLP(), MLP()
    optimizer, ref_opt = _sgd(model, 0.05), _sgd(reference, 0.05)
    wrapper = ModelSwitchWrapper(model, optimizer, message_size=256).switch_to("gradient_allreduce")
    schedule = (
        [("gradient_allreduce", {})] * 3
        + [("decentralized", dict(peer_selection_mode="all", communication_interval=2))] * 4
        + [("bmuf", dict(warmup_iterations=0, global_sync_iter=2, block_lr=1.0, block_momentum=0.5))] * 4
        + [("gradient_allreduce", {})] * 3
    )
    errors, spread, current = [], [], "gradient_allreduce"
    bmuf_state, phase_step = None, 0
    data = global_batches(len(schedule), 4, world)
    for step, ((name, kwargs), (x, y)) in enumerate(zip(schedule, data)):
        if name != current:
            wrapper.switch_to(name, **kwargs)
            _average_params(reference, world, ref_opt)
            current, phase_step = name, 0
            if name == "bmuf":
                bmuf_state = {"global": [p.data.clone() for p in reference.parameters()],
                              "smoothed": [torch.zeros_like(p) for p in reference.parameters()]}
        phase_step += 1
        # gradient_allreduce trains on shards of one batch; the others on local data
        xs, ys = (shard(x, rank, world), shard(y, rank, world)) if name == "gradient_allreduce" else local_batches(1, 4, rank, seed=step)[0]
        optimizer.zero_grad()
        loss_fn(wrapper, xs, ys).backward()
        optimizer.step()
        ref_opt.zero_grad()
        loss_fn(reference, xs, ys).backward()
        if name == "gradient_allreduce":
            for p in reference.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        ref_opt.step()
        if name == "decentralized" and phase_step % 2 == 0:
            _average_params(reference, world)
        if name == "bmuf" and phase_step % 2 == 0:
            _reference_bmuf_sync(reference, bmuf_state, world, 1.0, 0.5)
        errors.append(max_param_diff(model, reference))
        copies = gather_flat(flat_params(model))
        spread.append((copies[0] - copies[1]).abs().max().item())
    return {"errors": errors, "spread": spread, "keys": sorted(wrapper.state_dict())}


def sc_bmuf_warmup_keeps_the_schedulers_lr(rank, world):
    """The warm-up sync resets the optimizer's state (as fairseq's BMUF), not its lr: StepLR builds
    on the current lr and would lose its decay."""
    model = MLP()
    optimizer = _sgd(model, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    wrapped, optimizer = bagua_init(model, optimizer, "bmuf", warmup_iterations=3, global_sync_iter=2)
    lrs = []
    for x, y in local_batches(5, 8, rank):
        optimizer.zero_grad()
        loss_fn(wrapped, x, y).backward()
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return {"lrs": lrs}


SCENARIOS = {name[3:]: fn for name, fn in dict(globals()).items() if name.startswith("sc_") and callable(fn)}


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(run_scenarios, WORLD, (SCENARIOS, list(SCENARIOS)), timeout=420)


@pytest.mark.parametrize("name", ["decentralized_all", "decentralized_all_interval", "decentralized_shift_one", "decentralized_after_step"])
def test_decentralized_equals_plain_reference(outcomes, name):
    for result in scenario_value(outcomes, name):
        assert max(result["errors"]) <= TOL, result["errors"]


def test_decentralized_replicas_drift_between_rounds_and_meet_at_rounds(outcomes):
    spread = scenario_value(outcomes, "decentralized_all_interval")[0]["spread"]
    assert all(s > 1e-4 for s in spread[0::2]), spread  # steps 1, 3, 5: no communication
    assert all(s == 0 for s in spread[1::2]), spread  # steps 2, 4, 6: averaged with everyone


@pytest.mark.parametrize("name", ["nbm_average_sync_adam", "warmup_reset_sgd", "plain_averaging_adam", "warmup_reset_sgd_fused", "after_step_entry_point"])
def test_bmuf_equals_fairseq_step_for_step(outcomes, name):
    pytest.importorskip("fairseq")
    for result in scenario_value(outcomes, f"bmuf_{name}"):
        assert max(result["errors"]) <= TOL, result["errors"]
        assert max(result["state_errors"]) <= TOL, result["state_errors"]


def test_bmuf_syncs_exactly_at_block_boundaries(outcomes):
    pytest.importorskip("fairseq")
    synced = scenario_value(outcomes, "bmuf_warmup_reset_sgd")[0]["synced"]
    # warmup ends at update 3, then block syncs at 4, 6, 8
    assert synced == [False, False, True, True, False, True, False, True, False], synced


def test_switching_algorithms_mid_training(outcomes):
    for result in scenario_value(outcomes, "switch_algorithms"):
        assert max(result["errors"]) <= TOL, result["errors"]
        spread = result["spread"]
        assert max(spread[:3]) == 0 and max(spread[-3:]) == 0  # gradient_allreduce phases stay in lockstep
        assert max(spread[3:11]) > 1e-4  # the model-averaging phases let replicas drift between syncs
        assert result["keys"] == sorted(MLP().state_dict())


def test_bmuf_warmup_sync_keeps_the_schedulers_lr(outcomes):
    for result in scenario_value(outcomes, "bmuf_warmup_keeps_the_schedulers_lr"):
        assert result["lrs"] == [0.1 * 0.5**k for k in range(1, 6)], result["lrs"]
