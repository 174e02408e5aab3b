"""Issue 29, case 3: a step planned elementwise whose per-parameter reduction begins only after the
probes' three steps (clipping after a warm-up). Each test against the unfused optimizer. With the
check switched off (``_runs_to_check`` returning nothing) the same training is silently wrong
(``test_without_the_check_*``); the tests of what the check relies on (seeding the probes with the
run's state, the dry run's copies, accepting what the probes saw) each have a broken variant that
fails them (in the test itself, or noted in its docstring)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from _fused_utils import TinyNet, assert_same_params, assert_same_state, batches, count_replans, train, two_groups
from bagua_integrations import FusionFallbackWarning, LateReductionError, fuse_optimizer, fusion_report
from bagua_integrations import fused_optimizer as fused_module
from bagua_integrations._late_reductions import KEEPS, MIXES, POINTWISE, function_kind
from bagua_integrations._torch_compat import compiled_steps_unsupported
from bagua_integrations.fused_optimizer import _fusion

WARMUP = 5
STEPS = WARMUP + 5
COMPILES = compiled_steps_unsupported() is None
# the re-planned group's steps are compiled too where segmented steps compile (torch >= 2.11)
COMPILES_SEGMENTED = compiled_steps_unsupported("segmented") is None
needs_compile = pytest.mark.skipif(not COMPILES, reason="compiled steps need torch >= 2.6")


def _clip_norm(p, grad, limit):
    return grad * (limit / grad.norm().clamp(min=limit))


def _clip_grad_norm_(p, grad, limit):
    torch.nn.utils.clip_grad_norm_(p, limit)
    return p.grad


def _clip_amax(p, grad, limit):
    return grad * (limit / grad.abs().amax().clamp(min=limit))


def _centralize(p, grad, limit):
    return grad - grad.mean()


def _clip_read_into_python(p, grad, limit):  # not segmentable either: only the per-tensor step is exact
    norm = float(grad.norm())
    return grad * (limit / max(norm, limit))


LATE = {"norm": _clip_norm, "clip_grad_norm_": _clip_grad_norm_, "amax": _clip_amax, "mean": _centralize,
        "float(norm)": _clip_read_into_python}


class ClipsAfterWarmup(torch.optim.Optimizer):
    """SGD whose per-parameter reduction (``how``) begins after a warm-up longer than the probes'
    three steps. The step count is a Python int per parameter (as many third-party optimizers keep
    it), or a 0-dim tensor (``tensor_step``, as torch's optimizers keep it); or it is counted per
    param group (``counter="group"``, as timm's LAMB does) or on the optimizer (``"optimizer"``)."""

    def __init__(self, params, lr=0.1, warmup=WARMUP, limit=0.01, how="norm", tensor_step=False, counter="state"):
        super().__init__(params, dict(lr=lr, warmup=warmup, limit=limit, how=how, tensor_step=tensor_step,
                                      counter=counter))

    @torch.no_grad()
    def step(self, closure=None):
        if self.param_groups[0]["counter"] == "optimizer":
            self.state["k"] = self.state.get("k", 0) + 1
        for group in self.param_groups:
            if group["counter"] == "group":
                group["k"] = group.get("k", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros(()) if group["tensor_step"] else 0
                state["step"] += 1
                count = {"state": state["step"], "group": group.get("k"), "optimizer": self.state.get("k")}
                grad = p.grad
                if count[group["counter"]] > group["warmup"]:
                    grad = LATE[group["how"]](p, grad, group["limit"])
                p.add_(grad, alpha=-group["lr"])


def _run(fuse, compile=False, steps=STEPS, groups=False, **kwargs):
    model = TinyNet()
    params = two_groups(model, warmup=1000) if groups else model.parameters()
    opt = ClipsAfterWarmup(params, **kwargs)
    if fuse:
        opt = fuse_optimizer(opt, compile=compile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, batches(steps), step=opt.fuse_step if fuse else None)
    return model, opt


def _differs(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("how", ["norm", "clip_grad_norm_", "amax", "mean"])
def test_a_reduction_after_the_probes_window_is_exact_eager(how):
    plain, plain_opt = _run(False, how=how)
    fused, opt = _run(True, how=how)
    assert_same_params(plain, fused)
    assert_same_state(plain_opt, opt)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert "probed again with its state" in fusion_report(opt).group_why[0]


@needs_compile
@pytest.mark.parametrize("how", ["norm", "clip_grad_norm_"])
def test_a_reduction_after_the_probes_window_is_exact_compiled(how):
    """Dynamo guards the Python-int branch: the step that takes it compiles a new graph, refused
    by the backend before it ran; the group is re-planned and that very step runs segmented."""
    plain, plain_opt = _run(False, how=how)
    fused, opt = _run(True, compile=True, how=how)
    report = fusion_report(opt)
    assert report.group_paths == ["segmented"] and (report.compiled or not COMPILES_SEGMENTED), report
    # compiled kernels round like fused multiply-adds (as in tests/test_compiled_step.py)
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-6)
    assert_same_state(plain_opt, opt, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=needs_compile)], ids=["eager", "compiled"])
@pytest.mark.parametrize("counter", ["group", "optimizer"])
def test_a_step_count_kept_on_the_group_or_the_optimizer_is_followed_too(compile, counter):
    """The probes that choose the path again copy the group's settings and the optimizer-level state
    as they are: they see the count past the warm-up, and so the reduction."""
    plain, plain_opt = _run(False, counter=counter)
    fused, opt = _run(True, compile=compile, counter=counter)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=needs_compile)], ids=["eager", "compiled"])
def test_a_tensor_step_count_is_caught_too(compile):
    """A 0-dim tensor step (``if state["step"] > warmup``): the compiled step cannot trace the
    branch (it falls back to the eager fused step, with its warning), the eager step's dry run sees
    the reduction begin."""
    plain, plain_opt = _run(False, tensor_step=True)
    fused, opt = _run(True, compile=compile, tensor_step=True)
    assert_same_params(plain, fused)
    assert_same_state(plain_opt, opt)
    # a branch on each parameter's tensor step count: its own step (_paths.SEGMENT_VALUE_READS)
    assert fusion_report(opt).group_paths == ["per-tensor"]


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=needs_compile)], ids=["eager", "compiled"])
def test_only_the_group_whose_step_began_reducing_is_planned_again(compile):
    plain, plain_opt = _run(False, groups=True)
    fused, opt = _run(True, compile=compile, groups=True)
    report = fusion_report(opt)
    assert report.group_paths == ["segmented", "elementwise"], report
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-6)
    assert_same_state(plain_opt, opt, rtol=1e-5, atol=1e-6)
    if compile and COMPILES_SEGMENTED:
        assert report.compiled


def _train_with_fc1_frozen_for(model, opt, data, frozen, step=None):
    """The plain loop, with fc1's gradients dropped for the first ``frozen`` steps: its step count
    lags behind fc2's, so fc2's run is past the warm-up first (and fc1's still in it)."""
    for n, (x, y) in enumerate(data):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if n < frozen:
            model.fc1.weight.grad = model.fc1.bias.grad = None
        (step or opt.step)()


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded-with-that-run", "seeded-with-the-largest"])
def test_the_probes_are_seeded_with_the_state_of_the_run_that_began_reducing(monkeypatch, seeded):
    """fc1 (the largest parameter) lags four steps behind fc2: at fc2's step 6 its run begins clipping,
    and the probes must be seeded with fc2's step count, not fc1's (2: the probes' three steps from
    there stay in the warm-up)."""
    if not seeded:  # the deliberately broken implementation: the template is ignored
        from bagua_integrations._paths import PathChooser

        original = PathChooser.choose_again
        monkeypatch.setattr(PathChooser, "choose_again",
                            lambda self, group, device, because, template=None: original(self, group, device, because))
    runs = []
    for fuse in (False, True):
        model = TinyNet()
        opt = ClipsAfterWarmup(model.parameters())
        if fuse:
            opt = fuse_optimizer(opt, compile=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train_with_fc1_frozen_for(model, opt, batches(STEPS), 4, step=opt.fuse_step if fuse else None)
        runs.append((model, opt))
    (plain, _), (fused, opt) = runs
    if seeded:
        assert fusion_report(opt).group_paths == ["segmented"]
        assert_same_params(plain, fused)
    else:
        assert fusion_report(opt).group_paths == ["elementwise"] and _differs(plain, fused) > 1e-4


def test_the_switch_warns_once_and_says_what_began():
    model = TinyNet()
    opt = fuse_optimizer(ClipsAfterWarmup(model.parameters()), compile=False)
    with pytest.warns(FusionFallbackWarning, match=r"began to compute norm over a whole flat run at "
                                                   rf"step {WARMUP + 1}.*segmented path") as caught:
        train(model, opt, batches(STEPS), step=opt.fuse_step)
    assert sum("began to" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=needs_compile)], ids=["eager", "compiled"])
def test_a_reduction_that_cannot_be_segmented_falls_back_to_the_exact_step(compile):
    """After the warm-up the step reads a norm into Python: the probes, seeded with the group's
    state, see that the segmented path cannot follow it either; the group keeps its own step."""
    plain, plain_opt = _run(False, how="float(norm)")
    fused, opt = _run(True, compile=compile, how="float(norm)")
    assert fusion_report(opt).group_paths == ["per-tensor"]
    assert_same_params(plain, fused)
    assert_same_state(plain_opt, opt)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=needs_compile)], ids=["eager", "compiled"])
@pytest.mark.parametrize("how", ["norm", "float(norm)"])
def test_on_unsupported_raise_refuses_before_the_step_changes_anything(compile, how):
    """on_unsupported="raise" and a group that would need its unfused step: LateReductionError at
    the step that begins reducing, before any parameter or state entry is touched."""
    plain, plain_opt = _run(False, steps=WARMUP, how=how)  # the unfused optimizer up to the warm-up
    model = TinyNet()
    opt = fuse_optimizer(ClipsAfterWarmup(model.parameters(), how=how), compile=compile, on_unsupported="raise")
    data = batches(STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, data[:WARMUP], step=opt.fuse_step)
    x, y = data[WARMUP]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    if how == "norm":  # segmented is exact: no refusal
        opt.fuse_step()
        assert fusion_report(opt).group_paths == ["segmented"]
        return
    with pytest.raises(LateReductionError, match=r"began to compute .* over a whole flat run at step 6.*Nothing of this "
                                                 r"step was applied.*on_unsupported='fallback'"):
        opt.fuse_step()
    for before, p in zip(params, model.parameters()):
        assert torch.equal(before, p.detach())
    after = opt.state_dict()
    assert after["state"].keys() == state["state"].keys()
    for index, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["state"][index][key])), (index, key)
    assert_same_params(plain, model)  # ... and that is the unfused optimizer after the warm-up


def test_a_group_that_cannot_be_laid_out_again_is_refused_and_left_as_it_was(monkeypatch):
    """Where the new path cannot be laid out (refused while building it): LateReductionError, with
    nothing of the step applied and the group still on its flat buffers."""
    from bagua_integrations import NotElementwiseError
    from bagua_integrations._layout import FlatLayout

    model = TinyNet()
    opt = fuse_optimizer(ClipsAfterWarmup(model.parameters()), compile=False)
    data = batches(STEPS)
    train(model, opt, data[:WARMUP], step=opt.fuse_step)

    def refused(self, index, group):
        raise NotElementwiseError("refused here for the test")

    monkeypatch.setattr(FlatLayout, "_build_group", refused)
    x, y = data[WARMUP]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LateReductionError, match="cannot be laid out again.*refused here for the test"):
        opt.fuse_step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(params, model.parameters()))
    layout = _fusion(opt).layout
    assert fusion_report(opt).group_paths == ["elementwise"]
    assert len(layout.hooks.handles) == sum(p.requires_grad for b in layout.buffers() for p in (s.param for s in b.slots))


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=needs_compile)], ids=["eager", "compiled"])
def test_without_the_check_the_reduction_is_silently_wrong(monkeypatch, compile):
    """The deliberately broken implementation: nothing checked, the flat runs are clipped as one."""
    monkeypatch.setattr(fused_module.Fusion, "_runs_to_check", lambda self, plan: [])
    plain, _ = _run(False)
    fused, opt = _run(True, compile=compile)
    assert fusion_report(opt).group_paths == ["elementwise"]
    assert _differs(plain, fused) > 1e-4  # (each update is at most lr * limit = 1e-3)


def test_assume_elementwise_is_not_checked():
    """assume_elementwise=True: the user vouched for the update, and nothing is probed or checked."""
    plain, _ = _run(False)
    model = TinyNet()
    opt = fuse_optimizer(ClipsAfterWarmup(model.parameters()), compile=False, assume_elementwise=True)
    train(model, opt, batches(STEPS), step=opt.fuse_step)
    assert fusion_report(opt).group_paths == ["elementwise"] and _differs(plain, model) > 1e-4


# =========================================================================== no false positives
TORCH_CASES = {
    "SGD": (torch.optim.SGD, dict(lr=0.1)),
    "SGD momentum nesterov wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "Adam amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2)),
    "AdamW foreach": (torch.optim.AdamW, dict(lr=1e-2, foreach=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "Adadelta": (torch.optim.Adadelta, dict(lr=1.0)),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "ASGD": (torch.optim.ASGD, dict(lr=1e-2, t0=3)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-2)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-2)),  # rectified from step 6 on (rho_t > 5): elementwise both ways
    "RMSprop centered": (torch.optim.RMSprop, dict(lr=1e-2, centered=True, momentum=0.5)),
    "Rprop": (torch.optim.Rprop, dict(lr=1e-2)),
}


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_torch_optimizers_never_begin_reducing(monkeypatch, name):
    """Why the eager dry run may skip torch.optim's own optimizers (``TORCH_ELEMENTWISE``): run on
    every step here, it finds nothing the probes did not see, over 12 steps of each."""
    cls, kwargs = TORCH_CASES[name]
    assert cls in fused_module.TORCH_ELEMENTWISE
    replans = count_replans(monkeypatch)
    dry_runs = []
    original = fused_module.Fusion._check_dry

    def always(self, raw_step, checked, always=False):
        dry_runs.append(1)
        return original(self, raw_step, checked, always=True)

    monkeypatch.setattr(fused_module.Fusion, "_check_dry", always)
    plain, fused = TinyNet(), TinyNet()
    plain_opt = cls(two_groups(plain, lr=3e-3), **kwargs)
    opt = fuse_optimizer(cls(two_groups(fused, lr=3e-3), **kwargs), compile=False)
    train(plain, plain_opt, batches(12))
    train(fused, opt, batches(12), step=opt.fuse_step)
    assert dry_runs and not replans, replans
    assert fusion_report(opt).group_paths == ["elementwise", "elementwise"]
    assert_same_params(plain, fused)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)],
                         ids=["AdamW", "SGD"])
def test_compiled_torch_optimizers_compile_the_same_graphs_with_the_check(monkeypatch, make):
    if compiled_steps_unsupported() is not None:
        pytest.skip(compiled_steps_unsupported())
    replans = count_replans(monkeypatch)
    graphs = []
    for check in (True, False):
        if not check:
            monkeypatch.setattr(fused_module.Fusion, "_runs_to_check", lambda self, plan: [])
        model = TinyNet()
        opt = fuse_optimizer(make(two_groups(model, lr=3e-3)), compile=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
        for x, y in batches(8):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.fuse_step()
            scheduler.step()
        report = fusion_report(opt)
        assert report.compiled, report.compile_disabled_reason
        graphs.append(report.compile_graphs)
    assert not replans and graphs[0] == graphs[1], graphs


class GlobalClipSGD(torch.optim.Optimizer):
    """SGD with momentum and the group's gradients clipped to one global norm from the first step
    on: a reduction over every parameter, exact on flat runs (what D-Adaptation's sums are too)."""

    def __init__(self, params, lr=0.1, max_norm=0.01):
        super().__init__(params, dict(lr=lr, max_norm=max_norm))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, group["max_norm"])
            for p in params:
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=needs_compile)], ids=["eager", "compiled"])
def test_a_reduction_the_probes_saw_and_found_exact_is_accepted(monkeypatch, compile):
    """The global norm mixes every flat run from the first step on; the elementwise probe saw it on
    its flat tensor and found the step exact, so neither the dry run nor a compiled graph that
    contains it re-plans anything (the graph is refused once, the dry run finds nothing new, and the
    same graph is compiled: no extra graph)."""
    replans = count_replans(monkeypatch)
    plain = TinyNet()
    plain_opt = GlobalClipSGD(two_groups(plain, lr=0.05))
    train(plain, plain_opt, batches(8))
    graphs = []
    for check in (True, False):
        if not check:
            monkeypatch.setattr(fused_module.Fusion, "_runs_to_check", lambda self, plan: [])
        fused = TinyNet()
        opt = fuse_optimizer(GlobalClipSGD(two_groups(fused, lr=0.05)), compile=compile)
        train(fused, opt, batches(8), step=opt.fuse_step)
        report = fusion_report(opt)
        assert report.group_paths == ["elementwise", "elementwise"]
        assert_same_params(plain, fused, rtol=1e-5, atol=1e-6)
        graphs.append(report.compile_graphs)
        if compile and check:
            assert report.compiled, report.compile_disabled_reason
    assert not replans and graphs[0] == graphs[1], (replans, graphs)


# =========================================================================== the dry run changes nothing
class RandomNumbersAndCounters(torch.optim.Optimizer):
    """Elementwise, and everything a dry run could disturb: a random number drawn per group and step
    (it decides nothing here, or the probes would refuse the step), a group-level counter, an
    optimizer-level counter, a public dict on the optimizer and a tensor in the group settings
    updated in place."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr, seen=torch.zeros(())))
        self.history = {"steps": 0}

    @torch.no_grad()
    def step(self, closure=None):
        self.history["steps"] += 1
        self.state["calls"] = self.state.get("calls", 0) + 1
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
            group["seen"].add_(1)
            scale = 1.0 if float(torch.rand(())) < 2 else 0.0
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-group["lr"] * scale / group["k"] ** 0.5)


def test_the_dry_run_leaves_random_numbers_counters_and_attributes_as_they_were():
    """(Fails with the random number generators not forked around the dry run, with the optimizer's
    public containers not deep-copied, or with the group settings not copied.)"""
    runs = []
    for fuse in (False, True):
        torch.manual_seed(7)
        model = TinyNet()
        opt = RandomNumbersAndCounters(two_groups(model, lr=0.05))
        if fuse:
            opt = fuse_optimizer(opt, compile=False)
            assert fusion_report(opt).group_paths == ["elementwise", "elementwise"]
        train(model, opt, batches(6), step=opt.fuse_step if fuse else None)
        runs.append((model, opt, torch.rand(())))
    (plain, plain_opt, plain_next), (fused, opt, fused_next) = runs
    assert_same_params(plain, fused)
    for a, b in zip(plain.parameters(), fused.parameters()):
        if a in plain_opt.state:
            torch.testing.assert_close(plain_opt.state[a]["buf"], opt.state[b]["buf"], rtol=1e-6, atol=1e-7)
    assert opt.history == plain_opt.history == {"steps": 6} and opt.state["calls"] == 6
    assert [g["k"] for g in opt.param_groups] == [6, 6]
    # (both groups hold the defaults' one tensor: two in-place additions per step)
    assert [float(g["seen"]) for g in opt.param_groups] == [float(g["seen"]) for g in plain_opt.param_groups] == [12, 12]
    assert torch.equal(plain_next, fused_next)  # the same random stream after six steps


def test_the_dry_run_checks_one_run_per_group_and_scalar_state():
    """What the eager check costs: one pass of the step over a few elements per group (one run per
    group and scalar state)."""
    seen = []
    model = TinyNet()
    opt = fuse_optimizer(ClipsAfterWarmup(two_groups(model, warmup=1000)), compile=False)
    original = _fusion(opt).dry_run.findings

    def spy(optimizer, raw_step, runs, replay=None):
        seen.append([(index, run.proxy.numel()) for index, run in runs])
        return original(optimizer, raw_step, runs, replay)

    _fusion(opt).dry_run.findings = spy
    train(model, opt, batches(3), step=opt.fuse_step)
    assert seen and all(sorted(index for index, _ in runs) == [0, 1] for runs in seen), seen


# =========================================================================== what mixes elements
@pytest.mark.parametrize("func, kind", [
    (torch.Tensor.add_, POINTWISE), (torch.Tensor.addcdiv_, POINTWISE), (torch.lerp, POINTWISE),
    (torch._foreach_mul_, POINTWISE), (torch.Tensor.__mul__, POINTWISE), (torch.where, POINTWISE),
    (torch.Tensor.max, POINTWISE),  # pointwise-named: a reduction only by its result's size (checked)
    (torch.Tensor.copy_, KEEPS), (torch.zeros_like, KEEPS), (torch.Tensor.view, KEEPS),
    (torch.Tensor.grad.__get__, KEEPS),
    (torch.Tensor.norm, MIXES), (torch.linalg.vector_norm, MIXES), (torch.Tensor.sum, MIXES), (torch.mean, MIXES),
    (torch.Tensor.amax, MIXES), (torch.Tensor.any, MIXES), (torch.dot, MIXES), (torch._foreach_norm, MIXES),
    (torch.cumsum, MIXES), (torch.sort, MIXES), (torch.nn.functional.normalize, MIXES), (torch.cat, MIXES),
    (torch.Tensor.__getitem__, MIXES), (torch.Tensor.item, MIXES), (torch.Tensor.T.__get__, MIXES),
    (torch.Tensor.std, MIXES), (torch.Tensor.var, MIXES), (torch.Tensor.prod, MIXES), (torch.Tensor.all, MIXES),
])
def test_what_mixes_the_elements_of_a_run(func, kind):
    assert function_kind(func)[0] == kind


def test_a_reduction_by_a_pointwise_named_overload_is_seen(monkeypatch):
    """``Tensor.max()`` (aten.max has a pointwise overload too) reduces: seen by its result's size."""
    monkeypatch.setitem(LATE, "max", lambda p, grad, limit: grad * (limit / grad.abs().max().clamp(min=limit)))
    plain, _ = _run(False, how="max")
    fused, opt = _run(True, how="max")
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused)
