"""fuse_optimizer over FSDP2 (``fully_shard``): the fused step on each rank's shards equals the
optimizer's own step on the DTensor parameters, across ranks, resumes and state dicts.

Every scenario builds the same model twice under FSDP2 (gloo, CPU), trains one copy with the
unfused optimizer and one with the fused one on the same data, and compares the whole parameters
(``full_tensor()``). Shard sizes are uneven on purpose (7 and 3 rows over 2 and 4 ranks: on 4
ranks one rank holds an empty shard of the last bias). Scenarios of one world size share one
process group (``run_scenarios``); a rank that fails or hangs is reported, never waited on.
"""

from __future__ import annotations

import copy
import functools
import shutil
import tempfile

import pytest
import torch

from _dist_utils import fsdp2_runs_on_cpu
from _fused_utils import PerParameterStep

if not torch.distributed.is_available() or not fsdp2_runs_on_cpu():
    pytest.skip("FSDP2 does not run on CPU with this torch (torch.cpu.Stream.record_event)", allow_module_level=True)

STEPS = 8
RTOL = 1e-5  # relative to the parameter's largest value: fp32 rounding of norms combined across ranks


def _plain_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _model(world: int, seed: int = 0, hsdp: bool = False, **fsdp_kwargs) -> torch.nn.Module:
    """``hsdp``: a 2 x (world / 2) mesh, replicated over its first dimension and sharded over its second."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _plain_model(seed)
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world,)))
    fully_shard(model[0], mesh=mesh, **fsdp_kwargs)
    fully_shard(model[2], mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def _make(name: str, params):
    from bagua_integrations.optim import BertAdam, Lamb

    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "bertadam":  # clips each parameter's gradient to norm 1 (its default): needs whole-parameter norms
        return BertAdam(params, lr=1e-2)
    if name == "lamb":  # trust ratio of two whole-parameter norms
        return Lamb(params, lr=1e-2, weight_decay=0.01)
    if name.startswith("pytorch_optimizer."):  # as people install them (their foreach paths)
        import pytorch_optimizer

        if name.endswith("LARS"):  # its trust coefficient (1e-3) scales each update down: a larger rate moves the weights
            return pytorch_optimizer.LARS(params, lr=1.0, weight_decay=0.01)
        return getattr(pytorch_optimizer, name.split(".", 1)[1])(params, lr=1e-2)
    raise ValueError(name)


def _batch(rank: int, i: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1000 * rank + i))


def _loss(model, x):
    return model(x).pow(2).sum() * 3  # large gradients: BertAdam's clipping is active


def _train(model, opt, steps: int, rank: int, start: int = 0, micro_batches: int = 1, set_to_none: bool = True) -> None:
    for i in range(start, start + steps):
        for m in range(micro_batches):  # FSDP2 adds each backward's gradient shard to the last
            _loss(model, _batch(rank + 97 * m, i)).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def _big_batch_reference(world: int, name: str, steps: int):
    """One unsharded model trained on every rank's batch (FSDP2 averages gradients over ranks)."""
    model = _plain_model()
    opt = _make(name, model.parameters())
    for i in range(steps):
        (sum(_loss(model, _batch(r, i)) for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _full(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _worst(a, b) -> float:
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))


def _offloaded(offload: bool) -> dict:
    """``fully_shard``'s arguments for CPU offloading (pinning needs an accelerator: test_cuda.py pins)."""
    if not offload:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=False)}


def _fused_vs_unfused(rank, world, name, compile="auto", hsdp=False, offload=False):
    from bagua_integrations import fuse_optimizer, fusion_report

    fsdp_kwargs = _offloaded(offload)
    reference = _model(world, hsdp=hsdp, **fsdp_kwargs)
    plain = _make(name, reference.parameters())
    _train(reference, plain, STEPS, rank)
    model = _model(world, hsdp=hsdp, **fsdp_kwargs)
    opt = fuse_optimizer(_make(name, model.parameters()), replace_step=True, compile=compile)
    _train(model, opt, STEPS, rank)
    report = fusion_report(opt)
    return _worst(_full(model), _full(reference)), report.group_paths, report.last_step_fused, report.compiled


def _verified(rank, world, name, broken=False):
    """verify=1: every fused step on shards also runs the optimizer's own DTensor step and compares.
    ``broken``: each rank's partial norms are not combined (the fused step alone is wrong), which
    verification must catch on every rank, with the unfused result put in place."""
    import torch.distributed as dist

    from bagua_integrations import FusionMismatchError, fuse_optimizer

    reference = _model(world)
    plain = _make(name, reference.parameters())
    model = _model(world)
    opt = fuse_optimizer(_make(name, model.parameters()), replace_step=True, verify=1)
    real = dist.all_reduce
    for i in range(STEPS):
        _train(reference, plain, 1, rank, start=i)
        if broken:
            dist.all_reduce = lambda *args, **kwargs: None
        try:
            _train(model, opt, 1, rank, start=i)
        except FusionMismatchError as exc:  # the unfused step's result is in place: equal to the reference
            return "FusionMismatchError", "differs from its unfused step" in str(exc), _worst(_full(model), _full(reference))
        finally:
            dist.all_reduce = real
    return "no error", opt._bagua_fusion.shard_fusion.stats.fused_steps, _worst(_full(model), _full(reference))


def _fused_vs_big_batch(rank, world, name):
    """Optimizers whose own step does not run on DTensors (pytorch-optimizer's foreach paths call ops
    DTensor has no rule for): fused on shards, against one unsharded model on the whole batch."""
    from bagua_integrations import fuse_optimizer, fusion_report

    model = _model(world)
    opt = fuse_optimizer(_make(name, model.parameters()), replace_step=True)
    _train(model, opt, STEPS, rank)
    worst = _worst(_full(model), _big_batch_reference(world, name, STEPS))
    return worst, fusion_report(opt).group_paths


def _accumulated_gradients(rank, world, name):
    """Two backward passes per step, gradients zeroed in place: FSDP2 accumulates into the flat buffer."""
    from bagua_integrations import fuse_optimizer

    reference = _model(world)
    plain = _make(name, reference.parameters())
    _train(reference, plain, STEPS, rank, micro_batches=2, set_to_none=False)
    model = _model(world)
    opt = fuse_optimizer(_make(name, model.parameters()), replace_step=True)
    _train(model, opt, STEPS, rank, micro_batches=2, set_to_none=False)
    return _worst(_full(model), _full(reference))


def _gradient_modes(rank, world, name):
    """Gradients set to None (3 steps), then kept: zeroed in place, two backwards a step (3), then set to
    None again (2). The fused step equals the unfused one throughout, its parameters and the gradients
    after each step (BertAdam's clipping writes them). Returned too, after each step: how many storages
    the gradients' local tensors are in: while the program keeps them, or the step wrote them, views of
    the flat gradient buffer (FSDP2 accumulates into it); else FSDP2's own (not rebuilt as views each
    step)."""
    from bagua_integrations import fuse_optimizer, fusion_report
    from bagua_integrations._torch_compat import local_shard

    reference, model = _model(world), _model(world)
    plain, opt = _make(name, reference.parameters()), fuse_optimizer(_make(name, model.parameters()), replace_step=True)
    storages, step, grads = [], 0, 0.0
    for steps, set_to_none, micro_batches in [(3, True, 1), (3, False, 2), (2, True, 1)]:
        for _ in range(steps):
            for m, o in ((reference, plain), (model, opt)):
                for micro in range(micro_batches):
                    _loss(m, _batch(rank + 97 * micro, step)).backward()
                o.step()
            storages.append(len({local_shard(p.grad).untyped_storage().data_ptr() for p in model.parameters()
                                 if p.grad is not None}))
            grads = max(grads, _worst([p.grad.full_tensor() for p in model.parameters()],
                                      [p.grad.full_tensor() for p in reference.parameters()]))
            for o in (plain, opt):
                o.zero_grad(set_to_none=set_to_none)
            step += 1
    report = fusion_report(opt)
    return _worst(_full(model), _full(reference)), grads, storages, report.flat_buffers, report.fused_steps


def _mixed_precision(rank, world, name):
    """bf16 forward/backward (FSDP2's MixedPrecisionPolicy), fp32 shards and reduction: the fused step
    equals the unfused one on the same policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from bagua_integrations import fuse_optimizer

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reference = _model(world, mp_policy=policy)
    plain = _make(name, reference.parameters())
    _train(reference, plain, STEPS, rank)
    model = _model(world, mp_policy=policy)
    opt = fuse_optimizer(_make(name, model.parameters()), replace_step=True)
    _train(model, opt, STEPS, rank)
    return _worst(_full(model), _full(reference)), str(next(model.parameters()).dtype)


def _norms_of_local_shards_only(rank, world, name):
    """A deliberately broken fused step: each rank's partial norms are not combined."""
    import torch.distributed as dist

    real = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: None
    try:
        if name.startswith("pytorch_optimizer."):
            return _fused_vs_big_batch(rank, world, name)
        return _fused_vs_unfused(rank, world, name)
    finally:
        dist.all_reduce = real


def _collectives_per_step(rank, world, name, compile=True):
    """All-reduces a (compiled) step over shards makes, counted over 3 steps after the first ones."""
    import torch.distributed as dist

    from bagua_integrations import fuse_optimizer, fusion_report

    model = _model(world)
    opt = fuse_optimizer(_make(name, model.parameters()), replace_step=True, compile=compile)
    _train(model, opt, 3, rank)
    real, calls = dist.all_reduce, []
    dist.all_reduce = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    try:
        _train(model, opt, 3, rank, start=3)
    finally:
        dist.all_reduce = real
    report = fusion_report(opt)
    return len(calls) / 3, report.compiled, report.flat_runs


def _state_dict_into_unfused(rank, world):
    """The fused optimizer's state_dict() loads into the unfused optimizer, which then trains on as the fused one."""
    from bagua_integrations import fuse_optimizer

    model = _model(world)
    opt = fuse_optimizer(_make("lamb", model.parameters()), replace_step=True)
    _train(model, opt, 3, rank)
    saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # (a state dict refers to the live state, fused or not)
    kinds = sorted({type(v).__name__ for entry in saved_opt["state"].values() for v in entry.values()})
    _train(model, opt, 3, rank, start=3)
    other = _model(world, seed=1)
    other.load_state_dict(saved_model)
    plain = _make("lamb", other.parameters())
    plain.load_state_dict(saved_opt)
    _train(other, plain, 3, rank, start=3)
    return _worst(_full(model), _full(other)), kinds


def _dcp_resume(rank, world, name, offload=False):
    """Save model and fused optimizer with torch.distributed.checkpoint after 3 steps, load them into
    a new model and fused optimizer, train on: equal to the uninterrupted fused run. ``offload``:
    under FSDP2's CPU offloading."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from bagua_integrations import fuse_optimizer

    uninterrupted = _model(world, **_offloaded(offload))
    opt = fuse_optimizer(_make(name, uninterrupted.parameters()), replace_step=True)
    _train(uninterrupted, opt, STEPS, rank)

    model = _model(world, **_offloaded(offload))
    opt = fuse_optimizer(_make(name, model.parameters()), replace_step=True)
    _train(model, opt, 3, rank)
    path = [tempfile.mkdtemp(prefix="fsdp2_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(path)
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path[0])

    resumed = _model(world, seed=1, **_offloaded(offload))
    opt = fuse_optimizer(_make(name, resumed.parameters()), replace_step=True)
    model_sd, opt_sd = get_state_dict(resumed, opt)
    loaded = {"model": model_sd, "optim": opt_sd}
    dcp.load(loaded, checkpoint_id=path[0])
    set_state_dict(resumed, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    _train(resumed, opt, STEPS - 3, rank, start=3)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path[0])
    return _worst(_full(resumed), _full(uninterrupted))


def _fsdp2_repoints_its_shards(rank, world):
    """``load_state_dict(assign=True)`` with swapped tensors (``torch.__future__``: parameters keep their
    identity, so the optimizer still holds them) gives FSDP2 new shard tensors mid-run, and FSDP2 re-points
    its padded shards at them: the next fused step copies them back into the flat buffer and points FSDP2
    at it again."""
    from bagua_integrations import fuse_optimizer

    uninterrupted = _model(world)
    opt = fuse_optimizer(_make("lamb", uninterrupted.parameters()), replace_step=True)
    _train(uninterrupted, opt, STEPS, rank)
    model = _model(world)
    opt = fuse_optimizer(_make("lamb", model.parameters()), replace_step=True)
    _train(model, opt, 3, rank)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = [id(p) for p in model.parameters()]
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(state, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert [id(p) for p in model.parameters()] == before
    _train(model, opt, STEPS - 3, rank, start=3)
    return _worst(_full(model), _full(uninterrupted))


def _unfused_again(rank, world):
    """``unfuse`` mid-run: the optimizer's own DTensor step carries on from the fused state."""
    from bagua_integrations import fuse_optimizer, unfuse

    reference = _model(world)
    plain = _make("bertadam", reference.parameters())
    _train(reference, plain, STEPS, rank)
    model = _model(world)
    opt = fuse_optimizer(_make("bertadam", model.parameters()), replace_step=True)
    _train(model, opt, 3, rank)
    unfuse(opt)
    _train(model, opt, STEPS - 3, rank, start=3)
    return _worst(_full(model), _full(reference))


def _clipping_switched_on(rank, world, kept=False):
    """BertAdam without clipping (elementwise) for 3 steps, then with it (segmented): the group is laid
    out anew in new flat buffers, and FSDP2 must all-gather from those. ``kept``: gradients zeroed in
    place and accumulated over two backwards, so FSDP2 must accumulate into the new gradient buffer."""
    from bagua_integrations import fuse_optimizer, fusion_report

    how = dict(micro_batches=2, set_to_none=False) if kept else {}

    def train(model, opt):
        _train(model, opt, 3, rank, **how)
        for group in opt.param_groups:
            group["max_grad_norm"] = 1.0
        _train(model, opt, STEPS - 3, rank, start=3, **how)

    reference = _model(world)
    plain = _make("bertadam", reference.parameters())
    for group in plain.param_groups:
        group["max_grad_norm"] = -1.0
    train(reference, plain)
    model = _model(world)
    opt = _make("bertadam", model.parameters())
    for group in opt.param_groups:
        group["max_grad_norm"] = -1.0
    fuse_optimizer(opt, replace_step=True)
    paths = [list(fusion_report(opt).group_paths)]
    train(model, opt)
    paths.append(list(fusion_report(opt).group_paths))
    return _worst(_full(model), _full(reference)), paths


SCENARIOS = {
    "clipping-switched-on": _clipping_switched_on,
    "clipping-switched-on-kept": functools.partial(_clipping_switched_on, kept=True),
    "hsdp-bertadam": functools.partial(_fused_vs_unfused, name="bertadam", hsdp=True),
    "assign-state": _fsdp2_repoints_its_shards,
    "unfuse": _unfused_again,
    **{f"fused-{name}": functools.partial(_fused_vs_unfused, name=name) for name in ("adamw", "sgd", "bertadam", "lamb")},
    **{f"compiled-{name}": functools.partial(_fused_vs_unfused, name=name, compile=True) for name in ("adamw", "lamb")},
    **{f"broken-{name}": functools.partial(_norms_of_local_shards_only, name=name)
       for name in ("bertadam", "lamb", "pytorch_optimizer.Lamb", "pytorch_optimizer.LARS")},
    "state-dict-into-unfused": _state_dict_into_unfused,
    **{f"collectives-{name}": functools.partial(_collectives_per_step, name=name) for name in ("bertadam", "lamb")},
    **{f"eager-collectives-{name}": functools.partial(_collectives_per_step, name=name, compile=False)
       for name in ("bertadam", "lamb")},
    **{f"verify-{name}": functools.partial(_verified, name=name) for name in ("adamw", "bertadam", "lamb")},
    "verify-broken-lamb": functools.partial(_verified, name="lamb", broken=True),
    **{f"big-batch-{name}": functools.partial(_fused_vs_big_batch, name=name)
       for name in ("lamb", "pytorch_optimizer.Lamb", "pytorch_optimizer.LARS", "pytorch_optimizer.AvaGrad",
                    "pytorch_optimizer.Adai", "pytorch_optimizer.Amos")},
    **{f"accumulated-{name}": functools.partial(_accumulated_gradients, name=name) for name in ("adamw", "bertadam")},
    **{f"gradient-modes-{name}": functools.partial(_gradient_modes, name=name) for name in ("adamw", "lamb", "bertadam")},
    **{f"mixed-precision-{name}": functools.partial(_mixed_precision, name=name) for name in ("adamw", "lamb")},
    **{f"offload-{name}": functools.partial(_fused_vs_unfused, name=name, offload=True) for name in ("adamw", "lamb")},
    **{f"dcp-{name}": functools.partial(_dcp_resume, name=name) for name in ("adamw", "bertadam", "lamb")},
    "dcp-offload-lamb": functools.partial(_dcp_resume, name="lamb", offload=True),
}
ON_FOUR_RANKS = ["fused-adamw", "fused-bertadam", "fused-lamb", "broken-lamb", "big-batch-pytorch_optimizer.Lamb",
                 "hsdp-bertadam", "compiled-lamb"]


def _scenarios(rank, world, names):
    from _dist_utils import run_scenarios

    return run_scenarios(rank, world, SCENARIOS, names)


@functools.lru_cache(maxsize=None)
def _results(world: int):
    from _dist_utils import run_ranks

    names = list(SCENARIOS) if world == 2 else ON_FOUR_RANKS
    return run_ranks(_scenarios, world, (names,), timeout=400, env={"OMP_NUM_THREADS": "1"})


def _value(world, name):
    from _dist_utils import scenario_value

    return scenario_value(_results(world), name)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["adamw", "sgd", "bertadam", "lamb"])
def test_fused_step_on_shards_equals_unfused(world, name):
    if world == 4 and f"fused-{name}" not in ON_FOUR_RANKS:
        pytest.skip("covered on 2 ranks")
    for worst, paths, fused, _ in _value(world, f"fused-{name}"):
        assert fused, "the last step was not fused"
        assert paths == (["elementwise"] if name in ("adamw", "sgd") else ["segmented"])
        assert worst < RTOL, f"{name} on {world} ranks: relative difference {worst:.2e}"


@pytest.mark.parametrize("name", ["adamw", "lamb"])
@pytest.mark.parametrize("world", [2, 4])
def test_compiled_fused_step_on_shards_equals_unfused(name, world):
    """(On 4 ranks: LAMB, whose norms of both runs travel in one all-reduce.)"""
    from bagua_integrations._compile import compile_unavailable_reason

    if compile_unavailable_reason("segmented" if name == "lamb" else "elementwise") is not None:
        pytest.skip("this torch does not compile fused steps")
    if world == 4 and f"compiled-{name}" not in ON_FOUR_RANKS:
        pytest.skip("covered on 2 ranks")
    for worst, _, fused, compiled in _value(world, f"compiled-{name}"):
        assert fused and compiled
        assert worst < 2e-5, f"{name} compiled: relative difference {worst:.2e} (beyond FMA rounding)"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["bertadam", "lamb", "pytorch_optimizer.Lamb", "pytorch_optimizer.LARS"])
def test_norms_of_the_local_shard_only_would_be_caught(world, name):
    if name.startswith("pytorch_optimizer."):
        pytest.importorskip("pytorch_optimizer")
    if world == 4 and f"broken-{name}" not in ON_FOUR_RANKS:
        pytest.skip("covered on 2 ranks")
    for worst, *_ in _value(world, f"broken-{name}"):
        assert worst > 1e-3, f"{name} with local norms only differs by {worst:.2e}: the test could not fail"


@pytest.mark.parametrize("name", ["bertadam", "lamb"])
def test_one_all_reduce_per_compiled_step_for_all_reductions(name):
    """The norms of every run are combined across ranks by one all-reduce per step, not one per
    reduction and run (LAMB: two norms x the runs of matrices and of vectors)."""
    from bagua_integrations._compile import post_grad_pass
    from bagua_integrations._compile import compile_unavailable_reason

    if compile_unavailable_reason() is not None or post_grad_pass() is None:
        pytest.skip("the compiled step (and Inductor's CustomGraphPass) is needed")
    for per_step, compiled, runs in _value(2, f"collectives-{name}"):
        assert compiled and runs == 2, (compiled, runs)
        assert per_step == 1, f"{per_step} all-reduces per step"


@pytest.mark.parametrize("name", ["bertadam", "lamb"])
def test_one_all_reduce_per_run_in_an_eager_step(name):
    """Eager, the reductions of a run that the step has not used yet travel together: LAMB's weight
    and update norms in one all-reduce per run (it made two), BertAdam's clipping norm in one. (The
    step takes a run's trust ratio before the next run's norms: only the compiled step, re-ordered,
    makes one per step.)"""
    for per_step, compiled, runs in _value(2, f"eager-collectives-{name}"):
        assert not compiled and runs == 2, (compiled, runs)
        assert per_step == runs, f"{per_step} all-reduces per step for {runs} runs"


def test_fused_state_dict_loads_into_the_unfused_optimizer():
    for worst, kinds in _value(2, "state-dict-into-unfused"):
        assert "DTensor" in kinds, kinds  # shard-shaped state is saved sharded, as the unfused optimizer's
        assert worst < RTOL, worst


@pytest.mark.parametrize("name", ["adamw", "bertadam", "lamb", "offload-lamb"])
def test_dcp_resume_equals_uninterrupted(name):
    for worst in _value(2, f"dcp-{name}"):
        assert worst < RTOL, worst


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["lamb", "pytorch_optimizer.Lamb", "pytorch_optimizer.LARS",
                                  # means over all parameters (Python lists over runs, counts of elements)
                                  "pytorch_optimizer.AvaGrad", "pytorch_optimizer.Adai"])
def test_fused_on_shards_equals_one_unsharded_model_on_the_whole_batch(world, name):
    pytest.importorskip("pytorch_optimizer")
    if world == 4 and f"big-batch-{name}" not in ON_FOUR_RANKS:
        pytest.skip("covered on 2 ranks")
    for worst, paths in _value(world, f"big-batch-{name}"):
        assert paths == ["segmented"], paths
        assert worst < RTOL, f"{name}: relative difference {worst:.2e} to the unsharded big-batch run"


def test_a_size_read_per_parameter_on_shards_keeps_the_exact_step():
    """Amos reads each parameter's fan-in (``p.size(1)``): a shard's sizes are not its parameter's,
    so over shards its step is its own, exact, against one unsharded model on the whole batch."""
    pytest.importorskip("pytorch_optimizer")
    for worst, paths in _value(2, "big-batch-pytorch_optimizer.Amos"):
        assert paths == ["per-tensor"], paths
        assert worst < RTOL, f"relative difference {worst:.2e} to the unsharded big-batch run"


@pytest.mark.parametrize("name", ["adamw", "bertadam", "lamb"])
def test_verification_mode_checks_each_fused_step_on_shards(name):
    for outcome, fused_steps, worst in _value(2, f"verify-{name}"):
        assert outcome == "no error" and fused_steps == STEPS, (outcome, fused_steps)
        assert worst < RTOL, f"{name}: relative difference {worst:.2e}"


def test_verification_mode_on_shards_catches_norms_of_the_local_shard_only():
    for outcome, named, worst in _value(2, "verify-broken-lamb"):
        assert outcome == "FusionMismatchError" and named, outcome
        assert worst < RTOL, f"the unfused result is not what the parameters hold: {worst:.2e}"


@pytest.mark.parametrize("name", ["adamw", "bertadam"])
def test_gradients_accumulated_in_place_by_fsdp2(name):
    for worst in _value(2, f"accumulated-{name}"):
        assert worst < RTOL, worst


@pytest.mark.parametrize("name", ["adamw", "lamb", "bertadam"])
def test_gradients_set_to_none_then_kept_then_set_to_none(name):
    for worst, grads, storages, flat_buffers, fused_steps in _value(2, f"gradient-modes-{name}"):
        assert worst < RTOL and grads < RTOL, (worst, grads)
        assert fused_steps == 8, fused_steps
        if name == "bertadam":  # its step clips the gradients in place: shown as the flat buffer's, always
            assert storages == [flat_buffers] * 8, (storages, flat_buffers)
            continue
        # views of the flat buffer (after the first step; while kept), or FSDP2's own gradients (one
        # reduce-scatter output per fully_shard module) while the program sets them to None
        own = storages[1]
        assert own > flat_buffers and storages == [flat_buffers, own, own, own, flat_buffers, flat_buffers,
                                                   flat_buffers, own], (storages, flat_buffers)


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_mixed_precision_policy(name):
    for worst, dtype in _value(2, f"mixed-precision-{name}"):
        assert dtype == "torch.float32"  # the shards the optimizer steps stay fp32
        assert worst < RTOL, worst


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_cpu_offload_policy(name):
    """FSDP2's CPUOffloadPolicy: shards, gradients and state in host memory, FSDP2 copying each shard to
    the device before its all-gather; the fused step on the host equals the unfused one (LAMB: norms
    combined across ranks). On a CPU-only machine the copies are no-ops; the bookkeeping is the same."""
    for worst, paths, fused, _ in _value(2, f"offload-{name}"):
        assert fused, "the last step was not fused"
        assert paths == (["elementwise"] if name == "adamw" else ["segmented"])
        assert worst < RTOL, f"{name} under CPU offloading: relative difference {worst:.2e}"


def test_shards_fsdp2_points_elsewhere_are_taken_back():
    for worst in _value(2, "assign-state"):
        assert worst < RTOL, worst


def test_unfuse_continues_with_the_optimizers_own_step():
    for worst in _value(2, "unfuse"):
        assert worst < RTOL, worst


@pytest.mark.parametrize("grads", ["set-to-none", "kept"])
def test_a_group_laid_out_anew_mid_run_stays_what_fsdp2_all_gathers(grads):
    for worst, paths in _value(2, "clipping-switched-on" + ("-kept" if grads == "kept" else "")):
        assert paths == [["elementwise"], ["segmented"]], paths
        assert worst < RTOL, worst


def test_hsdp_replicated_and_sharded_mesh():
    """HSDP (2 replicas x 2 shards): partial norms combine over the shard dimension only (BertAdam: its
    clipping sees the norm; a LAMB trust ratio would not, both of its norms scaling alike)."""
    for worst, paths, fused, _ in _value(4, "hsdp-bertadam"):
        assert fused and paths == ["segmented"]
        assert worst < RTOL, worst


def test_a_usual_steps_state_is_followed_for_all_parameters_at_once():
    """``_ShownAll``: the same state objects with new Python numbers are followed in one pass (the
    numbers copied into the shown entries); anything else (a replaced tensor, a new key, an edited
    or replaced shown entry, a number become a tensor, new state) leaves it to the pass over each
    parameter, changing nothing."""
    from bagua_integrations._sharded import _EMPTY, _ShownAll

    def fresh():
        shard_state = {"a": {"step": 1, "exp_avg": torch.zeros(3)}, "c": {"step": 1.0}}
        state = {"A": {"step": 1, "exp_avg": torch.zeros(3)}, "C": {"step": 1.0}}
        sources, entries = [shard_state["a"], _EMPTY, shard_state["c"]], [state["A"], _EMPTY, state["C"]]
        return shard_state, state, _ShownAll(shard_state, state, sources, entries)

    shard_state, state, followed = fresh()
    shard_state["a"]["step"], shard_state["c"]["step"] = 2, 2.5
    assert followed.follow(shard_state, state)
    assert state["A"]["step"] == 2 and state["C"]["step"] == 2.5 and _EMPTY == {}
    shard_state["a"]["step"] = 3
    assert followed.follow(shard_state, state) and state["A"]["step"] == 3  # and again, from the new values

    def refused(change):
        shard_state, state, followed = fresh()
        change(shard_state, state)
        before = {k: dict(e) for k, e in state.items()}
        assert not followed.follow(shard_state, state)
        assert all(before[k].keys() == e.keys() and all(before[k][n] is e[n] for n in e) for k, e in state.items())

    refused(lambda s, e: s["a"].__setitem__("exp_avg", torch.ones(3)))  # the step replaced a state tensor
    refused(lambda s, e: s["a"].__setitem__("exp_avg_sq", torch.ones(3)))  # a new key
    refused(lambda s, e: e["A"].__setitem__("exp_avg", torch.ones(3)))  # the program edited a shown entry
    refused(lambda s, e: s["c"].__setitem__("step", torch.tensor(2.0)))  # a number became a tensor
    refused(lambda s, e: s.__setitem__("b", {"step": 1}))  # a parameter got state
    refused(lambda s, e: e.__setitem__("A", dict(e["A"])))  # a shown entry replaced (load_state_dict)
    refused(lambda s, e: s.__setitem__("a", dict(s["a"])))  # the shard optimizer's entry replaced


class _Uneven(torch.nn.Module):
    """Shards whose lengths differ by rank: a layer used on every other step only, and parameters
    with fewer rows than ranks (an empty shard on some). On two ranks, rank 1's shard of ``sk.weight``
    (3, 3) and of ``small`` (2, 3) are both one row: runs of equal shape on that rank only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.sk = torch.nn.Linear(8, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 3)
        self.small = torch.nn.Parameter(torch.randn(2, 3))
        self.one = torch.nn.Parameter(torch.tensor([0.9]))

    def forward(self, x, step):
        out = (self.l2(torch.tanh(self.l1(x))) + x[:, :2] @ self.small) * self.one
        if step % 2:
            out = out + 0.1 * self.sk(out)
        return out.pow(2).sum()


class _CenteredSGD(PerParameterStep):
    """SGD on the gradient minus its mean over the whole parameter: a mean divides by the whole
    parameter's elements, which over shards only the segmentation knows."""

    def __init__(self, params, lr=1e-2, weight_decay=0.0):
        super().__init__(params, lr=lr, weight_decay=weight_decay)

    def update(self, p, state, group):
        p.add_(p.grad - p.grad.mean(), alpha=-group["lr"])


def _uneven_groups(model):
    """Weights with decay, the rest without (as BERT recipes split them): two groups."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0}]


def _uneven_shards(rank, world, name, compile, verify=None):
    """Fused on shards whose runs have equal shapes on some ranks only, against the optimizer's own
    step on the DTensors or (pytorch-optimizer's Lamb, whose foreach path DTensor cannot run) one
    unsharded model on the whole batch. Before, ranks split such runs into different calls of the
    step, so their all-reduces crossed: a hang (pytorch-optimizer Lamb) or gloo's 'collective
    mismatch' abort (compiled LAMB). ``verify``: verification mode, which compared each rank's shards
    and raised a bare RuntimeError (amax of no elements) on the rank whose shard of ``one`` is empty."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bagua_integrations import fuse_optimizer

    def sharded():
        model, mesh = _Uneven(), init_device_mesh("cpu", (world,))
        for layer in (model.l1, model.l2, model.sk):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def train(model, opt, ranks):
        for i in range(6):
            (sum(model(_batch(r, i), i) for r in ranks) / len(ranks)).backward()
            opt.step()
            opt.zero_grad()

    make = _CenteredSGD if name == "centered" else functools.partial(_make, name)
    model = sharded()
    opt = fuse_optimizer(make(_uneven_groups(model)), replace_step=True, compile=compile, verify=verify)
    train(model, opt, [rank])
    if name.startswith("pytorch_optimizer."):
        reference = _Uneven()
        train(reference, _make(name, _uneven_groups(reference)), range(world))
        expected = [p.detach() for p in reference.parameters()]
    else:
        reference = sharded()
        train(reference, make(_uneven_groups(reference)), [rank])
        expected = _full(reference)
    return _worst(_full(model), expected)


@pytest.mark.parametrize("name,compile,verify", [("pytorch_optimizer.Lamb", False, None), ("lamb", True, None),
                                                 ("lamb", False, 1), ("centered", False, None)],
                         ids=["foreach", "compiled", "verified", "mean"])
def test_shards_of_uneven_length_make_the_same_collectives_on_every_rank(name, compile, verify):
    from _dist_utils import run_ranks, values

    if name.startswith("pytorch_optimizer."):
        pytest.importorskip("pytorch_optimizer")
    results = run_ranks(_uneven_shards, 2, (name, compile, verify), timeout=180, env={"OMP_NUM_THREADS": "1"})
    for worst in values(results):
        assert worst < RTOL, f"{name}: relative difference {worst:.2e}"


PEER_STOPPED_TIMEOUT = 4.0  # seconds: the process groups' timeout once rank 1 has stopped, in the test below


def _a_peer_stops(rank, world, compile):
    """Three steps on both ranks, then rank 1 stops taking steps: rank 0's next step waits in the
    all-reduce of its norms until the process group's timeout. The three steps run under the default
    (long) timeout: a first compile on a loaded machine can keep one rank away from the collectives
    for longer than the short one, which is set only once both ranks are past them."""
    import datetime
    import time
    import warnings

    import torch.distributed as dist

    from bagua_integrations import CompileFallbackWarning, ShardCollectiveError, fuse_optimizer, fusion_report

    model = _model(world)
    opt = fuse_optimizer(_make("lamb", model.parameters()), replace_step=True, compile=compile)
    for i in range(3):
        _loss(model, _batch(rank, i)).backward()
        opt.step()
    dist.barrier()
    short = datetime.timedelta(seconds=PEER_STOPPED_TIMEOUT)
    for group in {dist.group.WORLD, model[0].weight.device_mesh.get_group()}:
        dist.distributed_c10d._set_pg_timeout(short, group)
    if rank == 1:
        time.sleep(PEER_STOPPED_TIMEOUT + 4)  # (then exits; no collective of its own)
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt.step()
            raised = None
        except ShardCollectiveError as exc:
            raised = str(exc)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
    return raised, fallbacks, fusion_report(opt).compiled


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_peer_that_stops_is_a_named_communication_error_not_a_compile_fallback(compile):
    """The shards' all-reduce failing (a rank crashed or stalled) raises ShardCollectiveError, which
    says what happened and what to do; a compiled step raises it as it is (it used to warn that the
    compile failed, fall back to eager and fail there again)."""
    from _dist_utils import run_ranks, values
    from bagua_integrations._compile import compile_unavailable_reason

    if compile and compile_unavailable_reason("segmented") is not None:
        pytest.skip("this torch does not compile fused steps")
    if not hasattr(torch.distributed.distributed_c10d, "_set_pg_timeout"):
        pytest.skip("this torch cannot shorten a process group's timeout")
    results = run_ranks(_a_peer_stops, 2, (compile,), timeout=180,
                        env={"OMP_NUM_THREADS": "1"})
    raised, fallbacks, compiled = values(results)[0]
    assert raised is not None and "another rank stopped, crashed or timed out" in raised, raised
    assert "restart every rank from the last checkpoint" in raised
    assert not fallbacks, fallbacks
    assert compiled == compile


def _compile_fails_on_one_rank(rank, world):
    """Rank 1's compiler crashes (as a compiler can on one machine: memory, a cache race); rank 0's works."""
    import warnings

    from bagua_integrations import CompileFallbackWarning, _compile

    if rank == 1:
        def crashing_backend(self, graph_module, example_inputs):
            raise RuntimeError("simulated compiler crash on rank 1 only")

        _compile.CompiledStep._backend = crashing_backend
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worst, paths, fused, compiled = _fused_vs_unfused(rank, world, "lamb", compile=True)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
    return worst, paths, compiled, fallbacks


def test_a_compile_that_fails_on_one_rank_sends_every_rank_to_the_eager_step():
    """The compiled step over shards makes one all-reduce per step, the eager step one per run: a rank
    whose compile failed alone went eager, and gloo aborted it ("Received data size doesn't match",
    SIGABRT; NCCL would hang or read wrong bytes). The ranks now agree before the first compiled step."""
    from _dist_utils import run_ranks, values
    from bagua_integrations._compile import compile_unavailable_reason

    if compile_unavailable_reason("segmented") is not None:
        pytest.skip("this torch does not compile fused steps")
    results = values(run_ranks(_compile_fails_on_one_rank, 2, timeout=240, pg_timeout=60,
                               env={"OMP_NUM_THREADS": "1"}))
    for rank, (worst, paths, compiled, fallbacks) in enumerate(results):
        assert paths == ["segmented"] and not compiled, (rank, paths, compiled)
        assert worst < RTOL, f"rank {rank}: relative difference {worst:.2e}"
        assert len(fallbacks) == 1, fallbacks
    assert "simulated compiler crash on rank 1 only" in results[1][3][0]
    assert "failed on rank 1" in results[0][3][0] and "simulated compiler crash" in results[0][3][0]
