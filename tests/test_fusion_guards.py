"""Cases that used to end in silently different numbers after fusing (issue 29), each against the
unfused optimizer, and each shown to fail with the guard switched off."""

from __future__ import annotations

import pytest
import torch

import bagua_integrations._layout as layout_module
from _fused_utils import TinyNet, assert_same_params, batches, train
from bagua_integrations import FusionFallbackWarning, fuse_optimizer, fusion_report
from bagua_integrations import fused_optimizer as fused_module
from bagua_integrations.fused_optimizer import _fusion
from bagua_integrations.optim import BertAdam


def _clipping_switched_on_after_two_steps(fuse, compile=False):
    model = TinyNet()
    opt = BertAdam(model.parameters(), lr=1e-2, max_grad_norm=0)  # elementwise: fused on plain flat runs
    if fuse:
        opt = fuse_optimizer(opt, compile=compile)
    data = batches(6)
    step = opt.fuse_step if fuse else None
    train(model, opt, data[:2], step=step)
    for group in opt.param_groups:
        group["max_grad_norm"] = 0.05  # now a per-parameter reduction: flat runs would clip them as one
    train(model, opt, data[2:], step=step)
    return model, opt


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_setting_changed_after_fusing_chooses_the_path_again(compile):
    plain, _ = _clipping_switched_on_after_two_steps(False)
    fused, opt = _clipping_switched_on_after_two_steps(True, compile)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def _late_reduction_check_off(monkeypatch):
    """Switch off the check for reductions that begin after the probes' window (_late_reductions.py),
    which would otherwise catch a change the settings check missed (tests/test_late_reductions.py)."""
    monkeypatch.setattr(fused_module.Fusion, "_runs_to_check", lambda self, plan: [])


def test_without_the_settings_check_the_change_is_silently_wrong(monkeypatch):
    monkeypatch.setattr(layout_module, "settings_signature", lambda group: ())
    _late_reduction_check_off(monkeypatch)
    plain, _ = _clipping_switched_on_after_two_steps(False)
    fused, opt = _clipping_switched_on_after_two_steps(True)
    assert fusion_report(opt).group_paths == ["elementwise"]
    assert max((a - b).abs().max().item() for a, b in zip(plain.parameters(), fused.parameters())) > 1e-3


def test_without_the_settings_check_the_late_reduction_check_catches_the_change(monkeypatch):
    """Defence in depth: the clipping a setting switched on is a reduction the probes did not see."""
    monkeypatch.setattr(layout_module, "settings_signature", lambda group: ())
    plain, _ = _clipping_switched_on_after_two_steps(False)
    with pytest.warns(FusionFallbackWarning, match="began to compute"):
        fused, opt = _clipping_switched_on_after_two_steps(True)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_a_scheduler_moving_lr_and_momentum_does_not_rebuild_anything():
    model = TinyNet()
    opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), compile=False)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=20)  # cycles momentum too
    generation = _fusion(opt).layout.generation
    for x, y in batches(10):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.fuse_step()
        scheduler.step()
    assert _fusion(opt).layout.generation == generation


# =========================================================================== verification mode
from bagua_integrations import FusionMismatchError  # noqa: E402


class _PerParameter(torch.optim.Optimizer):
    """A plain loop over parameters with gradients; subclasses write one parameter's update."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, group, self.state[p])


class ClipsAfterWarmup(_PerParameter):
    """SGD whose per-parameter clipping starts after a warm-up longer than the probes' window."""

    def __init__(self, params, lr=0.1, warmup=4, max_norm=0.01):
        super().__init__(params, dict(lr=lr, warmup=warmup, max_norm=max_norm))

    def update(self, p, group, state):
        state["step"] = state.get("step", 0) + 1
        if state["step"] > group["warmup"]:
            torch.nn.utils.clip_grad_norm_(p, group["max_norm"])
        p.add_(p.grad, alpha=-group["lr"])


class LrMultipliersOnSelf(_PerParameter):
    """Keeps per-parameter learning-rate multipliers on the optimizer, keyed by id(p), outside
    optimizer.state (as some layer-wise-lr optimizers do)."""

    def __init__(self, params, lr=0.1):
        params = list(params)
        super().__init__(params, dict(lr=lr))
        self.lr_multipliers = {id(p): 0.1 for p in params if p.dim() == 1}  # biases learn slower

    def update(self, p, group, state):
        p.add_(p.grad, alpha=-group["lr"] * self.lr_multipliers.get(id(p), 1.0))


class SkipsMarkedParameters(_PerParameter):
    """Reads a parameter attribute (``p.no_decay``) that synthetic probe tensors do not have."""

    def __init__(self, params, lr=0.1, weight_decay=0.5):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    def update(self, p, group, state):
        decay = 0.0 if getattr(p, "no_decay", False) else group["weight_decay"]
        p.add_(p.grad + decay * p, alpha=-group["lr"])


def _model_with_marked_biases():
    model = TinyNet()
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.no_decay = True
    return model


# What the probes cannot see. (A reduction that begins after their window was one of these; it is
# now caught before it runs, tests/test_late_reductions.py, and stays here with that check off, to
# show that verification catches it too.)
LATE = "a reduction after the probes' window (late-reduction check off)"
CASES = {
    LATE: (TinyNet, ClipsAfterWarmup),
    "state on the optimizer keyed by id(p)": (TinyNet, LrMultipliersOnSelf),
    "a parameter attribute": (_model_with_marked_biases, SkipsMarkedParameters),
}


@pytest.fixture
def case_setup(monkeypatch):
    def setup(case):
        if case == LATE:
            _late_reduction_check_off(monkeypatch)
    return setup


def _train_case(case, fuse, verify=None, steps=8):
    make_model, make_opt = CASES[case]
    model = make_model()
    opt = make_opt(model.parameters())
    if fuse:
        opt = fuse_optimizer(opt, compile=False, verify=verify)
    train(model, opt, batches(steps), step=opt.fuse_step if fuse else None)
    return model, opt


@pytest.mark.parametrize("case", list(CASES))
def test_these_cases_are_silently_wrong_without_verification(case, case_setup):
    """What the probes cannot see: the reason verification mode exists."""
    case_setup(case)
    plain, _ = _train_case(case, False)
    fused, _ = _train_case(case, True)
    assert max((a - b).abs().max().item() for a, b in zip(plain.parameters(), fused.parameters())) > 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_verification_catches_them_and_keeps_the_unfused_result(case, case_setup):
    case_setup(case)
    make_model, make_opt = CASES[case]
    plain, fused = make_model(), make_model()
    plain_opt = make_opt(plain.parameters())
    opt = fuse_optimizer(make_opt(fused.parameters()), compile=False, verify=1)
    for step, (x, y) in enumerate(batches(8)):
        for model, o in ((plain, plain_opt), (fused, opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        plain_opt.step()
        try:
            opt.fuse_step()
        except FusionMismatchError as error:
            assert "param_groups[0]['params'][" in str(error) and "unfused update" in str(error), error
            break
    else:
        pytest.fail(f"{case}: verification did not catch the difference")
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)  # no wrong update stayed in the model


def test_the_settings_case_is_caught_by_verification_with_the_guard_off(monkeypatch):
    monkeypatch.setattr(layout_module, "settings_signature", lambda group: ())
    _late_reduction_check_off(monkeypatch)
    with pytest.raises(FusionMismatchError, match="max_grad_norm|unfused update"):
        _clipping_switched_on_after_two_steps_verified()


def _clipping_switched_on_after_two_steps_verified():
    model = TinyNet()
    opt = fuse_optimizer(BertAdam(model.parameters(), lr=1e-2, max_grad_norm=0), compile=False, verify=1)
    data = batches(6)
    train(model, opt, data[:2], step=opt.fuse_step)
    for group in opt.param_groups:
        group["max_grad_norm"] = 0.05
    train(model, opt, data[2:], step=opt.fuse_step)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_verification_passes_exact_fusions_and_leaves_them_exact(compile):
    """Verified steps of optimizers that fuse exactly (elementwise, segmented, compiled) raise nothing
    and train exactly like unfused ones: the reference step leaves no trace."""
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: BertAdam(ps, lr=1e-2, max_grad_norm=0.05),
                 lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)):
        plain, fused = TinyNet(), TinyNet()
        plain_opt, opt = make(plain.parameters()), fuse_optimizer(make(fused.parameters()), compile=compile, verify=2)
        train(plain, plain_opt, batches(7))
        train(fused, opt, batches(7), step=opt.fuse_step)
        # compiled kernels round like fused multiply-adds; over 7 steps that compounds to ~1e-5
        assert_same_params(plain, fused, rtol=1e-4 if compile else 1e-6, atol=1e-6 if compile else 1e-7)


def test_verification_takes_a_compiled_steps_rounding_for_rounding_where_updates_vanish():
    """Under a constant gradient Adam's first moment moves by 0.9 ** step of itself: by step 65 its
    update is ~1e-3 of the value, and the compiled step's fused multiply-adds differ from the eager
    step by an ulp or two, 0.001x of that update. Verification took that for a wrong step (and told
    the user to train unfused) until a few units in the last place of the values counted as rounding."""
    from bagua_integrations._torch_compat import compiled_steps_unsupported

    unsupported = compiled_steps_unsupported("segmented")
    if unsupported is not None:
        pytest.skip(unsupported)  # the eager fused step is exact: nothing to round differently
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02) for shape in [(8,), (4, 8), (3,), (8,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt = fuse_optimizer(BertAdam(params, lr=1e-4, weight_decay=0.01), compile=True, verify=1)
    for _ in range(80):
        opt.fuse_step()
    assert fusion_report(opt).compiled


def test_the_rounding_allowance_is_a_few_ulps_of_the_values_not_of_a_wrong_update():
    from bagua_integrations._verify import ROUNDING_ULPS, _relative_difference

    before = torch.full((6,), 1e-3)
    expected = before + 1e-9  # an update at the values' rounding: ~9 ulps of 1e-3
    ulp = torch.finfo(torch.float32).eps * 1e-3
    assert _relative_difference(expected + 2 * ulp, expected, before, allowed=1e-3) <= 1e-3
    assert _relative_difference(expected + 4 * ROUNDING_ULPS * ulp, expected, before, allowed=1e-3) > 1e-3
    # an update of normal size: a 1% error of it is far beyond the tolerance, ulps or not
    expected = before * 0.9
    assert _relative_difference(expected + 1e-6, expected, before, allowed=1e-3) > 1e-3


def test_complex_values_are_compared_like_their_real_and_imaginary_parts():
    """Verification compared complex tensors bit for bit (as integers): a compiled step's rounding on a
    complex parameter, and a NaN both steps wrote, raised FusionMismatchError on every verified step
    (found by a fuzzing helper). A wrong complex update is still a difference."""
    from bagua_integrations._verify import _relative_difference

    gen = torch.Generator().manual_seed(0)
    before = torch.randn(64, generator=gen, dtype=torch.cfloat)
    expected = before * 0.99
    ulp = torch.finfo(torch.float32).eps
    assert _relative_difference(expected * (1 + ulp), expected, before, allowed=1e-3) <= 1e-3
    nan = expected.clone()
    nan[3] = complex(float("nan"), 0.0)
    assert _relative_difference(nan.clone(), nan, before, allowed=1e-3) == 0.0
    assert _relative_difference(expected, nan, before, allowed=1e-3) > 1e-3  # a NaN on one side only
    assert _relative_difference(expected * 1.001, expected, before, allowed=1e-3) > 1e-3
    assert _relative_difference(expected.conj().resolve_conj(), expected, before, allowed=1e-3) > 1e-3


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_verified_steps_on_complex_parameters_pass_and_stay_exact(compile):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(16, 9, generator=gen, dtype=torch.cfloat)
    plain, fused = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    plain_opt = torch.optim.AdamW([plain], lr=1e-2)
    opt = fuse_optimizer(torch.optim.AdamW([fused], lr=1e-2), compile=compile, verify=1)
    for _ in range(5):
        x = torch.randn(4, 9, generator=gen, dtype=torch.cfloat)
        for p, o, step in ((plain, plain_opt, plain_opt.step), (fused, opt, opt.fuse_step)):
            o.zero_grad()
            ((x @ p.T).abs() ** 2).mean().backward()
            step()
    torch.testing.assert_close(torch.view_as_real(fused.detach()), torch.view_as_real(plain.detach()),
                               rtol=1e-5 if compile else 1e-6, atol=1e-7)


def test_a_reference_step_that_fails_leaves_nothing_applied_and_is_named(monkeypatch):
    """Verification's unfused step raises half-way (after updating the parameters in place): the
    step raises FusionError, and parameters, gradients and state are as they were before it."""
    from bagua_integrations import FusionError

    model = TinyNet()
    opt = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), compile=False, verify=2)
    train(model, opt, batches(2), step=opt.fuse_step)
    real = fused_module.Fusion._run_own_step

    def fails_half_way(self):
        real(self)
        raise RuntimeError("no sharding rule")

    monkeypatch.setattr(fused_module.Fusion, "_run_own_step", fails_half_way)
    x, y = batches(3)[2]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    state = {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    assert grads and any(state.values())
    with pytest.raises(FusionError, match="own unfused step fails here.*no sharding rule"):
        opt.fuse_step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and (name not in grads or torch.equal(p.grad, grads[name])), name
        for key, value in state[name].items():
            assert torch.equal(opt.state[p][key], value), (name, key)


def test_the_environment_variable_turns_verification_on(monkeypatch):
    monkeypatch.setenv("BAGUA_VERIFY_FUSED", "3")
    opt = fuse_optimizer(torch.optim.SGD(TinyNet().parameters(), lr=0.1), compile=False)
    assert _fusion(opt).config.verify == 3
    monkeypatch.setenv("BAGUA_VERIFY_FUSED", "often")
    with pytest.raises(ValueError, match="BAGUA_VERIFY_FUSED"):
        fuse_optimizer(torch.optim.SGD(TinyNet().parameters(), lr=0.1), compile=False)


# =========================================================================== named errors
def _fuse_unsupported_dtensors(rank, world):
    """DTensors that fuse_optimizer does not fuse: replicated ones (tensor parallelism's layouts), and
    an optimizer mixing FSDP2 shards with plain parameters. (FSDP2's shards fuse: test_fsdp2_fused.py.)"""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 keeps it private
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from bagua_integrations import ShardedParameterError

    mesh = init_device_mesh("cpu", (world,))
    messages = []
    replicated = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
    sharded = torch.nn.Linear(8, 6)
    fully_shard(sharded, mesh=mesh)
    for params in ([replicated], list(sharded.parameters()) + [torch.nn.Parameter(torch.randn(3))]):
        opt = torch.optim.AdamW(params, lr=1e-3)
        try:
            fuse_optimizer(opt)
            messages.append(None)
        except ShardedParameterError as error:
            messages.append(str(error))
    return messages


def test_dtensors_that_cannot_be_fused_get_a_named_error():
    from _dist_utils import run_ranks, values

    for replicated, mixed in values(run_ranks(_fuse_unsupported_dtensors, 2, timeout=120)):
        assert replicated is not None and "placements" in replicated, replicated
        assert mixed is not None and "plain" in mixed and "fully_shard" in mixed, mixed


class RunningSumInGroup(torch.optim.Optimizer):
    """Keeps a tensor in its param group, updated in place every step (as D-Adaptation does)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr, total=0.0, nesterov=False))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not torch.is_tensor(group["total"]):
                group["total"] = torch.zeros(())
            for p in group["params"]:
                if p.grad is not None:
                    group["total"].add_(1.0)
                    p.add_(p.grad, alpha=-group["lr"] / group["total"].item() ** 0.5)


def test_a_re_probe_never_touches_tensors_kept_in_param_groups():
    """Choosing the path again after a setting changed probes copies of the group (found by the
    pytorch-optimizer sweep: DAdaptAdam's running sums were advanced by the probe, 1e-2 off)."""
    runs = []
    for fuse in (False, True):
        model = TinyNet()
        opt = RunningSumInGroup(model.parameters())
        if fuse:
            opt = fuse_optimizer(opt, compile=False)
        data = batches(6)
        train(model, opt, data[:3], step=opt.fuse_step if fuse else None)
        for group in opt.param_groups:
            group["nesterov"] = True  # a flag: the path is chosen again
        train(model, opt, data[3:], step=opt.fuse_step if fuse else None)
        runs.append(model)
    assert_same_params(*runs, rtol=1e-6, atol=1e-7)
