""""Any optimizer" as people install it: pytorch-optimizer's whole collection, fused, against its own
unfused step; and reference tests, written here, for each mechanism that makes that work.

* a ``_foreach_*`` call over several runs is a loop over them; ``torch.stack`` of its result is a
  list over runs (trust ratios, a global gradient norm);
* the user's closure is called once and its loss replayed to the optimizer's own step;
* probing an optimizer does not move the random number generators;
* what cannot be fused keeps its exact step by default (one warning), or raises on request;
* a wrapper whose ``param_groups``/``state`` are read-only properties keeps its own step.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch

from bagua_integrations import (
    FusionError,
    FusionFallbackWarning,
    NotElementwiseError,
    fuse_optimizer,
    fusion_report,
)
from bagua_integrations import _probe, _segmented
from bagua_integrations import fused_optimizer as fused_module
from bagua_integrations.report import main as report_main

from _fused_utils import PerParameterStep, TinyNet, assert_same_params, assert_same_state, batches, train


# =========================================================================== the real collection
# a regression floor per collection (pytorch-optimizer 4.1.0, torch-optimizer 0.3.0): (segmented,
# through flat buffers, dry-run optimizers); a mechanism that breaks drops these counts
_FLOORS = {"pytorch_optimizer": (24, 85, 50), "torch_optimizer": (1, 17, 12)}


@pytest.mark.parametrize("collection", sorted(_FLOORS))
def test_optimizer_collection_is_fused_exactly_or_runs_its_own_step(monkeypatch, collection):
    pytest.importorskip(collection)
    from _optimizer_sweep import sweep
    from _fused_utils import count_replans

    # every fused step here is eager (a small model, a closure) and checked by the late-reduction
    # dry run (_late_reductions.py): it must never trip (D-Adaptation's and Prodigy's sums over the
    # whole group are what their probes saw and found exact)
    replans, dry_runs = count_replans(monkeypatch), set()
    check_dry = fused_module.Fusion._check_dry
    monkeypatch.setattr(fused_module.Fusion, "_check_dry", lambda self, *args, **kwargs: (
        dry_runs.add(type(self.optimizer).__name__), check_dry(self, *args, **kwargs))[1])
    outcomes = sweep(collection=collection)
    counts = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    print(collection, "paths:", counts)
    bad = [f"{o.name}: {o.kind}: {o.detail}" for o in outcomes if o.kind in ("mismatch", "bare-error", "refused")]
    assert not bad, "\n".join(bad)  # never different from unfused, never refused by default, no bare error
    runs = len(outcomes) - counts.get("does-not-run", 0)
    through_buffers = counts.get("elementwise", 0) + counts.get("segmented", 0)
    print(f"{through_buffers} of {runs} optimizers that run go through flat buffers")
    segmented, buffers, dry = _FLOORS[collection]
    assert counts.get("segmented", 0) >= segmented, counts
    assert through_buffers >= buffers, counts
    assert not replans and len(dry_runs) >= dry, (replans, len(dry_runs))  # (fails with the probes' findings
    # not accepted: ASGD, DAdapt* and Prodigy are probed again, and DAdaptSGD's second group keeps its own step)


# Compiled per-tensor steps round as torch.compile(opt.step) does, which these amplify beyond the
# sweep's 1e-4 (docs/fused_optimizer.md, known limits); any other mismatch fails the sweep below.
_COMPILED_ROUNDING_KNOWN = {"adafactor", "flashadamw", "scion", "muon", "normuon", "adago", "muonclip", "adamuon"}


@pytest.mark.slow
def test_the_collection_compiled_under_a_schedule_matches_unfused():
    """Every optimizer of pytorch-optimizer, fused with ``compile=True`` under OneCycleLR (momentum or
    beta1 cycled with the rate), against its own unfused step (``python tests/_optimizer_sweep.py
    --compiled``; 6 min on 2 cores). Such a sweep
    found the compiled LARS / AdaNorm / FAdam errors; their cause has its own test
    (test_compiled_step.py, early stores in block loops), as this model does not reach it."""
    pytest.importorskip("pytorch_optimizer")
    from _optimizer_sweep import sweep

    from bagua_integrations import _compile

    if _compile.compile_unavailable_reason("segmented") is not None:
        pytest.skip(str(_compile.compile_unavailable_reason("segmented")))
    outcomes = sweep(compiled=True)
    counts = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    print("compiled paths:", counts)
    bad = [f"{o.name}: {o.kind}: {o.detail}" for o in outcomes if o.kind in ("refused", "bare-error")
           or (o.kind == "mismatch" and o.name not in _COMPILED_ROUNDING_KNOWN)]
    assert not bad, "\n".join(bad)
    segmented, through_buffers, _ = _FLOORS["pytorch_optimizer"]
    assert counts.get("segmented", 0) >= segmented, counts
    assert counts.get("segmented", 0) + counts.get("elementwise", 0) >= through_buffers, counts
    # compiled to the last step, following the cycled rate and momentum (torch 2.13: 73; 2.11: 67 and
    # 2.14.1: 74 at twice the rate; 16 when a changing momentum switched compiled steps off outside
    # torch's Adam family)
    compiled = sum(o.detail.startswith("compiled,") for o in outcomes)
    assert compiled >= 65, f"{compiled} optimizers ran compiled to the end"


@pytest.mark.parametrize("name", ["lamb", "lars", "novograd", "stableadamw",
                                  # Python lists over runs, counts of elements, (1,)-shaped state
                                  "avagrad", "adai", "adams", "adanorm", "a2grad", "adagc", "adamwsn",
                                  # a parameter's size read per parameter (Amos's p.size(1))
                                  "amos"])
def test_pytorch_optimizer_norm_based_optimizers_are_segmented(name):
    pytest.importorskip("pytorch_optimizer")
    from _optimizer_sweep import optimizer_classes, sweep_one

    ((_, cls),) = optimizer_classes([name])
    outcome = sweep_one(name, cls)
    assert outcome.kind == "segmented", outcome

def _norms_summed_in_another_order(monkeypatch, relative: float):
    """Each parameter's norm on the probe's segmented side moved by ``relative``, up and down in
    turn: what another summation order gives (on a GPU, ``torch._foreach_norm`` of the per-tensor
    step against one ``vector_norm`` per parameter; one float32 rounding is 6e-8)."""
    each_segment, calls = _segmented.SegmentedMode._each_segment, [0]

    def moved(self, func, seg, args, kwargs):
        values = each_segment(self, func, seg, args, kwargs)
        if func is not torch.linalg.vector_norm:
            return values
        calls[0] += 1
        with torch._C.DisableTorchFunction():
            return [v * (1 + relative * (-1) ** calls[0]) for v in values]

    monkeypatch.setattr(_segmented.SegmentedMode, "_each_segment", moved)


@pytest.mark.parametrize("momentum", [0.99, 0.999])
def test_lars_is_segmented_where_norms_round_differently_and_its_momentum_cancels(monkeypatch, momentum):
    """pytorch-optimizer's LARS kept its unfused step on an H200 (the probe: ``momentum_buffer``
    1.03e-5 off per-tensor): where this step's update cancels most of the momentum, a norm one or
    two roundings off is a large part of a tiny value. Such a state differs within 1e-5 of how far
    it moved, as a parameter may; a trust ratio 1e-4 off (80 roundings, not a summation order)
    must still be refused."""
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

    def probe(relative):
        _norms_summed_in_another_order(monkeypatch, relative)
        optimizer = pytorch_optimizer.LARS([torch.nn.Parameter(torch.randn(4, 6))], lr=1e-2, momentum=momentum,
                                           dampening=0.9, weight_decay=1e-4)
        return _probe.probe_segmented(optimizer, optimizer.param_groups[0], torch.device("cpu"))

    assert probe(2.4e-7) is None  # (refused before: "relative error 1.5e-05 at a value of -2.1e-09")
    reason = probe(1e-4)
    assert reason is not None and "momentum_buffer" in reason, reason



@pytest.mark.parametrize("weight_decay", [0.01, 0.0])
def test_pytorch_optimizer_lamb_compiled_follows_a_schedule(weight_decay):
    """The LAMB people install, compiled on segmented runs under LambdaLR, against itself unfused.
    Its rate reaches ``torch._foreach_add_(params, updates, alpha=-step_size)``; with decoupled
    weight decay the compiled step kept the first symbolic graph's rate from then on, with no
    recompile and no warning (1e-3 off after 6 steps)."""
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    from bagua_integrations import _compile

    if _compile.compile_unavailable_reason("segmented") is not None:
        pytest.skip(str(_compile.compile_unavailable_reason("segmented")))
    data = batches(8)
    models = [TinyNet() for _ in range(2)]
    plain = pytorch_optimizer.Lamb(models[0].parameters(), lr=1e-2, weight_decay=weight_decay)
    fused = fuse_optimizer(pytorch_optimizer.Lamb(models[1].parameters(), lr=1e-2, weight_decay=weight_decay),
                           compile=True)
    for model, opt in zip(models, (plain, fused)):
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            (opt.fuse_step if opt is fused else opt.step)()
            scheduler.step()
    report = fusion_report(fused)
    assert report.group_paths == ["segmented"] and report.compiled, report  # the compiled kernel ran
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)
    # and each parameter's own values written back from the run (its weight_norm, adam_norm, trust_ratio)
    assert_same_state(plain, fused, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ScheduleFreeAdamW", "ScheduleFreeSGD"])
def test_pytorch_optimizer_schedule_free_compiled_matches_unfused(name):
    """Schedule-free optimizers keep running sums in their param groups (``weight_sum``, ``lr_max``):
    Python floats that each step reads, updates and writes back. Compiled, they were written back
    wrong from the third step on (torch 2.13: 9e-2 relative off after 8 steps, no warning); the
    compiled step now switches itself off after its first graph, and the numbers are the unfused ones."""
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    from bagua_integrations import _compile

    if _compile.compile_unavailable_reason() is not None:
        pytest.skip(str(_compile.compile_unavailable_reason()))
    cls = getattr(pytorch_optimizer, name)
    data = batches(8)
    models = [TinyNet() for _ in range(2)]
    plain = cls(models[0].parameters(), lr=1e-2)
    fused = fuse_optimizer(cls(models[1].parameters(), lr=1e-2), compile=True)
    for model, opt in zip(models, (plain, fused)):
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            (opt.fuse_step if opt is fused else opt.step)()
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)
    assert fused.param_groups[0]["weight_sum"] == plain.param_groups[0]["weight_sum"]
    report = fusion_report(fused)
    assert "writes Python floats" in (report.compile_disabled_reason or ""), report


# =========================================================================== foreach over runs
class ForeachLamb(torch.optim.Optimizer):
    """LAMB written the way foreach implementations write it: one ``_foreach_*`` call per op over
    the whole group, trust ratios from ``torch.stack`` of per-tensor norms, written into state,
    and (``global_clip``) the gradients scaled by one global norm over every parameter."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, global_clip=None, floor=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, global_clip=global_clip, floor=floor))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            for p in params:
                if not self.state[p]:
                    self.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            if group["global_clip"] is not None:
                total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
                torch._foreach_mul_(grads, torch.clamp(group["global_clip"] / (total + 1e-6), max=1.0))
            beta1, beta2 = group["betas"]
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            updates = torch._foreach_sqrt(exp_avg_sqs)
            if group["floor"] is not None:  # in place, with a number: a clamp per tensor
                torch._foreach_maximum_(updates, group["floor"])
            torch._foreach_add_(updates, group["eps"])
            torch._foreach_reciprocal_(updates)
            torch._foreach_mul_(updates, exp_avgs)
            weight_norms = torch.stack(torch._foreach_norm(params))
            update_norms = torch.stack(torch._foreach_norm(updates))
            ratios = torch.where((weight_norms > 0) & (update_norms > 0), weight_norms / update_norms, 1.0)
            for p, ratio in zip(params, ratios.unbind()):
                self.state[p]["trust_ratio"] = ratio
            torch._foreach_mul_(updates, ratios.unbind())
            torch._foreach_add_(params, updates, alpha=-group["lr"])
        return None


class RankedNet(torch.nn.Module):
    """Parameters of ranks 1, 2 and 3, so a fused step has several segmented runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(2, 3, 2)
        self.fc = torch.nn.Linear(9, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.conv(x)).flatten(1))))


class _TwoLayers(torch.nn.Module):
    """Two linear layers of two parameters each: two param groups (or two dtypes) of as many
    parameters, whose per-parameter values stack into lists of one shape."""

    def __init__(self, second_dtype=torch.float32, complex_scale=False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3).to(second_dtype)
        self.scale = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64)) if complex_scale else None

    def forward(self, x):
        out = self.b(self.a(x).to(self.b.weight.dtype)).float()
        return out if self.scale is None else out * (self.scale * self.scale.conj()).real


def _two_layer_run(cls, case, fused, steps=6, **kwargs):
    """``cls`` on :class:`_TwoLayers` arranged as ``case`` says, trained ``steps`` steps; (model, optimizer)."""
    model = _TwoLayers(torch.float64 if case == "two-dtypes" else torch.float32,
                       complex_scale=case == "a-complex-parameter")
    first, second = list(model.a.parameters()), list(model.b.parameters())
    if case == "two-groups":
        groups = [{"params": first}, {"params": second}]
    elif case == "a-group-added-later":
        groups = first
    else:
        groups = first + second + ([model.scale] if model.scale is not None else [])
    opt = cls(groups, **kwargs)
    if fused:
        fuse_optimizer(opt, compile=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if case == "a-group-added-later" and step == 2:
            opt.add_param_group({"params": second, "lr": 2e-2})
        opt.zero_grad()
        model(torch.randn(3, 4, generator=gen)).square().sum().backward()
        (opt.fuse_step if fused else opt.step)()
    return model, opt


# pytorch-optimizer's optimizers that stack per-parameter values of each group (each dtype) in one step
_STACKING = ["a2grad", "adai", "adams", "adanorm", "avagrad", "fromage", "lamb", "lars"]


@pytest.mark.parametrize("name,case", [(name, case) for name in _STACKING
                                       for case in ("two-groups", "two-dtypes", "a-group-added-later")]
                         + [("lamb", "a-complex-parameter")])  # (the others refuse complex parameters)
def test_pytorch_optimizer_on_groups_dtypes_and_complex_parameters(name, case):
    """Each as BERT recipes build it: two groups of as many parameters (decay and no decay), a float64
    layer in one group, a group added after fusing, a complex parameter. Their steps stack each
    group's (each dtype's) per-parameter values: two such lists had one shape, and the second step
    raised FusionError ("two different lists over runs of one shape") with the first group already
    updated. A complex parameter can take another code path (Lamb's per-parameter loop, whose Python
    scalar ``alpha`` a segmented run cannot give: a bare TypeError mid-step): it is stepped on its own."""
    pytest.importorskip("pytorch_optimizer")
    from _optimizer_sweep import optimizer_classes

    ((_, cls),) = optimizer_classes([name])
    plain, _ = _two_layer_run(cls, case, fused=False, lr=1e-2)
    fused, opt = _two_layer_run(cls, case, fused=True, lr=1e-2)
    report = fusion_report(opt)
    assert set(report.group_paths) == {"segmented"}, report
    assert report.fused_params == 4, report  # every real parameter went through the buffers
    for (param_name, a), b in zip(plain.named_parameters(), fused.parameters()):
        real = (lambda t: torch.view_as_real(t.detach())) if a.is_complex() else (lambda t: t.detach())
        torch.testing.assert_close(real(a), real(b), rtol=1e-5, atol=1e-7, msg=lambda m: f"{param_name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["two-groups", "two-dtypes"])
def test_every_pytorch_optimizer_on_two_groups_or_two_dtypes_of_as_many_parameters(case):
    """The whole collection in the arrangement that hid the stacking bug above from the sweep (its two
    groups differ in size): fused == unfused over 6 steps, or the optimizer does not run unfused."""
    pytest.importorskip("pytorch_optimizer")
    import inspect

    from _optimizer_sweep import _KWARGS, optimizer_classes

    checked, wrong = 0, []
    for name, cls in optimizer_classes():
        kwargs = dict(_KWARGS.get(name, {}))
        if "lr" in inspect.signature(cls).parameters:
            kwargs.setdefault("lr", 1e-2)
        try:
            plain, _ = _two_layer_run(cls, case, fused=False, **kwargs)
        except Exception:  # needs a closure, a second backward, other param groups...: not this test's
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                fused, _ = _two_layer_run(cls, case, fused=True, **kwargs)
            except Exception as exc:
                wrong.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
        checked += 1
        worst = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
                    for a, b in zip(plain.parameters(), fused.parameters()))
        if worst > 1e-5:
            wrong.append(f"{name}: {worst:.1e} relative")
    assert checked >= 100 and not wrong, (checked, wrong)


def _ranked_batches(steps):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(5, 2, 4, generator=gen) * 4, torch.randn(5, 2, generator=gen)) for _ in range(steps)]


def _ranked_run(make, fused, steps=8, closure=False, model_arg=False, net=None, **fuse_kwargs):
    model = (net or RankedNet)()
    opt = make(model) if model_arg else make(model.parameters())
    if fused:
        fuse_optimizer(opt, compile=False, **fuse_kwargs)
    step = opt.fuse_step if fused else opt.step
    for x, y in _ranked_batches(steps):
        def loss_fn():
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if closure:
            step(loss_fn)
        else:
            loss_fn()
            step()
    return model, opt


@pytest.mark.parametrize("global_clip", [None, 0.05])
def test_foreach_lamb_over_several_runs_is_segmented_and_exact(global_clip):
    make = lambda ps: ForeachLamb(ps, global_clip=global_clip)  # noqa: E731
    plain, _ = _ranked_run(make, fused=False)
    fused, opt = _ranked_run(make, fused=True)
    report = fusion_report(opt)
    assert report.group_paths == ["segmented"], report
    assert report.fused_params == 6, report
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)
    # the per-parameter values written into state are each parameter's own (0-D, as unfused)
    for p in fused.parameters():
        assert opt.state[p]["trust_ratio"].shape == ()


def test_foreach_maximum_with_a_number_is_a_clamp_on_segmented_runs():
    """``torch._foreach_maximum_(tensors, number)`` has no ``Tensor.maximum_`` to run per element:
    the segmented step runs each element as ``clamp_min_`` (it kept the optimizer's own step)."""
    make = lambda ps: ForeachLamb(ps, floor=3e-3)  # noqa: E731
    plain, _ = _ranked_run(make, fused=False)
    fused, opt = _ranked_run(make, fused=True)
    assert fusion_report(opt).group_paths == ["segmented"], fusion_report(opt)
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_global_norm_over_a_list_of_runs_must_cover_every_run(monkeypatch):
    """Deliberately broken: the global norm taken over the first run only. The probe must refuse it."""
    monkeypatch.setattr(_segmented._Stacked, "valid", lambda self, t: self.rows(t)[0].reshape(-1))
    with pytest.raises(NotElementwiseError, match="ForeachLamb.*differs"):
        fuse_optimizer(ForeachLamb(RankedNet().parameters(), global_clip=0.05), compile=False, on_unsupported="raise")


def test_unbound_list_over_runs_must_map_each_run_to_its_own_values(monkeypatch):
    """Deliberately broken: every run gets the first run's trust ratios back. The probe refuses it."""
    real_rows = _segmented._Stacked.rows

    def first_rows(self, t):
        rows = real_rows(self, t)
        return [rows[0].reshape(-1)[: seg.segments].reshape(seg.scalar_shape)
                if rows[0].numel() >= seg.segments else row for row, seg in zip(rows, self.segs)]

    monkeypatch.setattr(_segmented._Stacked, "rows", first_rows)
    with pytest.raises(NotElementwiseError, match="ForeachLamb"):
        fuse_optimizer(ForeachLamb(RankedNet().parameters()), compile=False, on_unsupported="raise")


class TwoLinearNet(torch.nn.Module):
    """Two weights and two biases: a 2-D run and a 1-D run of two segments each."""

    def __init__(self, widths=(4, 3, 2)):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(widths[0], widths[1])
        self.b = torch.nn.Linear(widths[1], widths[2])

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _two_linear_run(groups, fused, steps=6, widths=(4, 3, 2), make=None, **fuse_kwargs):
    model = TwoLinearNet(widths)
    opt = make(model) if make else ForeachLamb(groups(model), global_clip=0.05)
    if fused:
        fuse_optimizer(opt, compile=False, **fuse_kwargs)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(5, widths[0], generator=gen), torch.randn(5, widths[2], generator=gen)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        (opt.fuse_step if fused else opt.step)()
    return model, opt


def test_runs_of_equal_segment_count_share_one_call_of_a_global_norm(monkeypatch):
    """Two runs of two segments each: their segment scalars differ in rank (a tag), so one call of
    the step holds both and the group's global norm covers all four parameters, fused."""
    plain, _ = _two_linear_run(lambda m: m.parameters(), fused=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionFallbackWarning)  # no step is taken unfused
        fused, opt = _two_linear_run(lambda m: m.parameters(), fused=True)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_runs_of_equal_segment_count_without_tags_go_in_calls_of_their_own(monkeypatch):
    """Deliberately broken: no tags. The two runs then need a call each; the step is taken unfused."""
    from bagua_integrations import _planner

    monkeypatch.setattr(_planner, "_MAX_TAG", 0)
    with pytest.warns(FusionFallbackWarning, match="unfused"):
        _two_linear_run(lambda m: m.parameters(), fused=True)


def _split_groups(m):
    # group 1: a 2-D run and a 1-D run; group 2: a 2-D run of the shape of group 1's (so it cannot
    # share group 1's call) and a 1-D run that can: group 2's step would span two calls
    return [{"params": [m.a.weight, m.b.bias]}, {"params": [m.a.bias, m.b.weight]}]


def test_a_global_norm_over_runs_split_over_calls_takes_its_step_unfused():
    plain, _ = _two_linear_run(_split_groups, fused=False, widths=(4, 3, 4))
    with pytest.warns(FusionFallbackWarning, match="reduces over all of its parameters at once.*taken unfused"):
        fused, opt = _two_linear_run(_split_groups, fused=True, widths=(4, 3, 4))
    assert fusion_report(opt).group_paths == ["segmented", "segmented"]
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_a_step_that_fails_on_a_group_without_gradients_is_not_split_over_calls():
    """Without a global norm the split is exact, but ForeachLamb's ``torch.stack`` of no norms fails
    on a call that holds none of a group's parameters: the step is taken unfused instead."""
    make = lambda m: ForeachLamb(_split_groups(m))  # noqa: E731
    plain, _ = _two_linear_run(_split_groups, fused=False, widths=(4, 3, 4), make=make)
    with pytest.warns(FusionFallbackWarning, match="fails on a group whose parameters have no gradient"):
        fused, _ = _two_linear_run(_split_groups, fused=True, widths=(4, 3, 4), make=make)
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_a_global_norm_split_over_calls_must_not_be_fused(monkeypatch):
    """Deliberately broken: the split step fused anyway. Each call's global norm covers its own
    runs only, and the parameters differ from the unfused run (silently, without the check)."""
    from bagua_integrations import _planner

    monkeypatch.setattr(_planner.StepPlanner, "_not_splittable", lambda self, plan: None)
    plain, _ = _two_linear_run(_split_groups, fused=False, widths=(4, 3, 4))
    with pytest.raises((AssertionError, RuntimeError)):  # differs, or a call without a group's runs fails
        fused, _ = _two_linear_run(_split_groups, fused=True, widths=(4, 3, 4))
        assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


# =========================================================================== lists over runs in Python
class GlobalRmsSGD(torch.optim.Optimizer):
    """Scales every update by the RMS of all of the group's gradients, as AvaGrad and Adai do: a
    Python list of per-parameter sums, stacked and summed, over a count of the group's elements."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            total = torch.stack([p.grad.pow(2).sum() for p in params]).sum()
            count = sum(p.numel() for p in params)
            rms = (total / count).sqrt()
            for p in params:
                p.add_(p.grad / (rms + 1e-8), alpha=-group["lr"])
        return None


class PerParameterRule(torch.optim.Optimizer):
    """The skeleton of the optimizers below: :meth:`update` for each parameter with a gradient, in
    the group's order, after :meth:`start_group`."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    def start_group(self, group) -> None:
        """Group-level bookkeeping before the group's parameters (none by default)."""

    def update(self, p, group) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            self.start_group(group)
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, group)
        return None


class RangeScaledSGD(PerParameterRule):
    """Each gradient over its range (ROSE's 1-D rule: ``aminmax`` of the whole parameter), the
    quotient written with ``out=`` into a state buffer shaped like the parameter."""

    def update(self, p, group):
        state = self.state[p]
        if not state:
            state["scaled"] = torch.zeros_like(p)
        g_min, g_max = p.grad.aminmax()
        torch.div(p.grad, (g_max - g_min) + 1e-8, out=state["scaled"])
        p.add_(state["scaled"], alpha=-group["lr"])


def _one_run_groups(model):
    # group 2 holds the biases only: one 1-D run of three parameters, whose list over runs has one entry
    return [{"params": [model.conv.weight, model.fc.weight, model.out.weight]},
            {"params": [model.conv.bias, model.fc.bias, model.out.bias]}]


@pytest.mark.parametrize("groups", [None, _one_run_groups], ids=["several-runs", "a-group-of-one-run"])
def test_a_python_list_over_runs_reduces_over_every_parameter(groups):
    make = lambda m: GlobalRmsSGD(groups(m) if groups else m.parameters())  # noqa: E731
    plain, _ = _ranked_run(make, fused=False, model_arg=True)
    fused, opt = _ranked_run(make, fused=True, model_arg=True)
    assert set(fusion_report(opt).group_paths) == {"segmented"}, fusion_report(opt)
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_a_count_of_elements_must_leave_the_padding_out(monkeypatch):
    """Deliberately broken: a run's count of elements counts its alignment padding. The probe refuses it."""
    monkeypatch.setattr(_segmented.Segmentation, "numel", property(lambda self: self.length))
    with pytest.raises(NotElementwiseError, match="GlobalRmsSGD"):
        fuse_optimizer(GlobalRmsSGD(RankedNet().parameters()), compile=False, on_unsupported="raise")


def test_a_lone_list_must_be_taken_as_the_group_list_where_the_probes_say_so(monkeypatch):
    """Deliberately broken: a one-entry list is always one run's own values. On a group of one run
    the global RMS becomes one RMS per parameter: the probe of one run refuses it."""
    real = _segmented.SegmentedMode._is_list_over_runs
    monkeypatch.setattr(_segmented.SegmentedMode, "_is_list_over_runs",
                        lambda self, values: real(self, values) and not (isinstance(values, list) and len(values) == 1))
    with pytest.raises(NotElementwiseError, match="GlobalRmsSGD.*a group of one run"):
        fuse_optimizer(GlobalRmsSGD(RankedNet().parameters()), compile=False, on_unsupported="raise")


def test_a_clip_of_each_run_keeps_lone_lists_per_parameter():
    """BertAdam clips each parameter with ``clip_grad_norm_(p)``, whose list holds one run: per parameter."""
    from bagua_integrations.optim import BertAdam

    make = lambda ps: BertAdam(ps, lr=1e-2, max_grad_norm=0.5)  # noqa: E731
    plain, _ = _ranked_run(make, fused=False)
    fused, opt = _ranked_run(make, fused=True)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert not opt._bagua_fusion.layout.groups[0].lone_lists_over_runs
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_aminmax_and_out_on_runs_are_per_parameter():
    make = lambda ps: RangeScaledSGD(ps)  # noqa: E731
    plain, _ = _ranked_run(make, fused=False)
    fused, opt = _ranked_run(make, fused=True)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_aminmax_over_a_whole_run_must_be_refused(monkeypatch):
    """Deliberately broken: aminmax of the whole run (the padding and every parameter at once)."""
    real = _segmented.SegmentedMode._on_runs

    def whole_run(self, func, seg, args, kwargs):
        if func in (torch.aminmax, torch.Tensor.aminmax):
            return func(*args, **kwargs)
        return real(self, func, seg, args, kwargs)

    monkeypatch.setattr(_segmented.SegmentedMode, "_on_runs", whole_run)
    with pytest.raises(NotElementwiseError, match="RangeScaledSGD"):
        fuse_optimizer(RangeScaledSGD(RankedNet().parameters()), compile=False, on_unsupported="raise")


class ChannelScaledSGD(PerParameterRule):
    """Reductions along dimensions of each parameter, as TAM, Ranger and ROSE make them: the gradient
    centralised per output channel (a mean over dimensions 1.., ``keepdim``), scaled by the spread of
    its channels' ranges (``std_mean`` of a ``keepdim`` result), each column normalised
    (``F.normalize(dim=0)``) and weighted by its largest entry (``max(dim=0)``'s values)."""

    def update(self, p, group):
        g = p.grad
        if g.dim() > 1:
            dims = tuple(range(1, g.dim()))
            g = g - g.mean(dim=dims, keepdim=True)
            ranges = g.amax(dim=dims, keepdim=True) - g.amin(dim=dims, keepdim=True)
            std, mean = torch.std_mean(ranges, correction=0)
            g = g / (mean + std + 1e-8)
        top = g.abs().max(dim=0, keepdim=True)
        p.add_(torch.nn.functional.normalize(g, dim=0) * top.values, alpha=-group["lr"])


class NeuronNormSGD(PerParameterRule):
    """Nero's per-neuron norm: ``norm(dim=1)`` without ``keepdim``, viewed back to ``(rows, 1)``. A
    run has no rows to view: refused, with the reason."""

    def update(self, p, group):
        g = p.grad.reshape(p.shape[0], -1) if p.dim() > 1 else p.grad.reshape(1, -1)
        norms = g.norm(dim=1).view(-1, *([1] * (p.dim() - 1)))
        p.sub_(p.grad / (norms + 1e-8) if p.dim() > 1 else p.grad, alpha=group["lr"])


def test_reductions_along_a_dimension_are_per_parameter():
    plain, _ = _ranked_run(ChannelScaledSGD, fused=False)
    fused, opt = _ranked_run(ChannelScaledSGD, fused=True)
    assert fusion_report(opt).group_paths == ["segmented"], fusion_report(opt)
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


def test_reductions_along_a_dimension_of_a_whole_run_must_be_refused(monkeypatch):
    """Deliberately broken: a ``dim=`` call on a run taken as elementwise (``F.normalize(dim=0)`` of a
    run of shape ``(1, length)`` divides each element by itself)."""
    monkeypatch.setattr(_segmented, "_along_dims", lambda func, kwargs: False)
    with pytest.raises(NotElementwiseError, match="ChannelScaledSGD"):
        fuse_optimizer(ChannelScaledSGD(RankedNet().parameters()), compile=False, on_unsupported="raise")


def test_a_reduction_along_a_dimension_that_drops_it_keeps_the_exact_step():
    plain, _ = _ranked_run(NeuronNormSGD, fused=False)
    with pytest.warns(FusionFallbackWarning):
        fused, opt = _ranked_run(NeuronNormSGD, fused=True)
    assert fusion_report(opt).group_paths == ["per-tensor"]
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


class RandomStartSGD(PerParameterRule):
    """Gravity's rule: a random initial velocity per parameter, drawn on its first step, and an
    update scaled by the gradient's largest entry (a whole-parameter reduction: segmented)."""

    def update(self, p, group):
        state = self.state[p]
        if not state:
            state["v"] = torch.randn_like(p)
        state["v"].mul_(0.9).add_(p.grad / p.grad.abs().max())
        p.add_(state["v"], alpha=-group["lr"])


def _random_start_run(fused):
    torch.manual_seed(5)
    return _ranked_run(RandomStartSGD, fused=fused)


def test_random_initial_state_is_drawn_in_the_unfused_order():
    """The first step takes each parameter on its own, in the group's order, so the draws match."""
    plain, _ = _random_start_run(fused=False)
    fused, opt = _random_start_run(fused=True)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


def test_random_initial_state_drawn_in_buffer_order_must_differ(monkeypatch):
    """Deliberately broken: parameters stepped on their own in the flat buffers' order."""
    from bagua_integrations._planner import StepPlanner

    monkeypatch.setattr(StepPlanner, "_in_group_order", lambda self, index, params: params)
    plain, _ = _random_start_run(fused=False)
    fused, _ = _random_start_run(fused=True)
    with pytest.raises(AssertionError):
        assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


@pytest.fixture
def segment_value_reads(monkeypatch):
    """Groups whose step reads per-parameter values into Python take segmented runs (by default they
    keep their own step: eager segmented runs measured slower on a CPU; ``_paths.SEGMENT_VALUE_READS``)."""
    from bagua_integrations import _paths

    monkeypatch.setattr(_paths, "SEGMENT_VALUE_READS", True)


class FirstNormSGD(PerParameterRule):
    """NovoGrad's Python branch on a per-parameter value: the second moment is one value per
    parameter, set to the first gradient norm it sees (``if v == 0:``), averaged afterwards. A
    momentum buffer, the group's step count and the parameter (through ``p.data``, then ``p``: two
    objects for one memory) are written before the branch, so a step undone there undoes them."""

    def start_group(self, group):
        group["step"] = group.get("step", 0) + 1

    def update(self, p, group):
        state = self.state[p]
        if not state:
            state["v"] = torch.zeros(())
            state["m"] = torch.zeros_like(p)
        state["m"].mul_(0.9).add_(p.grad)
        p.data.mul_(1 - 1e-3)  # decoupled weight decay, as older optimizers write it
        p.add_(state["m"], alpha=-1e-3)
        norm = p.grad.pow(2).sum()
        if state["v"] == 0:
            state["v"].copy_(norm)
        else:
            state["v"].mul_(0.9).add_(norm, alpha=0.1)
        p.sub_(state["m"] / (state["v"].sqrt() + 1e-8), alpha=group["lr"] / group["step"] ** 0.5)


class DeadWeightNet(RankedNet):
    """A weight that never gets a non-zero gradient, next to live ones of its rank (one run): it
    alone goes one way at ``if v == 0:`` (``v``: its gradient norms) or ``if torch.equal(grad, 0):``."""

    def __init__(self):
        super().__init__()
        self.dead = torch.nn.Parameter(torch.full((3, 4), 0.5))

    def forward(self, x):
        return super().forward(x) + 0 * self.dead.sum()

    def groups(self):
        return [{"params": [self.conv.weight, self.fc.weight, self.dead, self.out.weight]},
                {"params": [self.conv.bias, self.fc.bias, self.out.bias]}]


def _dead_weight_run(fused, make=FirstNormSGD, steps=8):
    return _ranked_run(lambda model: make(model.groups()), fused, steps=steps, model_arg=True, net=DeadWeightNet)


def test_a_branch_every_parameter_takes_alike_is_segmented(segment_value_reads):
    plain, _ = _ranked_run(FirstNormSGD, fused=False)
    fused, opt = _ranked_run(FirstNormSGD, fused=True)
    report = fusion_report(opt)
    assert report.group_paths == ["segmented"] and report.branch_fallback_steps == 0, report
    assert "branches on per-parameter values" in report.group_why[0]
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


def test_a_branch_parameters_take_differently_is_undone_and_the_run_cut(segment_value_reads):
    plain, plain_opt = _dead_weight_run(fused=False)
    with pytest.warns(FusionFallbackWarning, match="goes one way for 1 of 3 parameters"):
        fused, opt = _dead_weight_run(fused=True)
    report = fusion_report(opt)
    assert report.group_paths == ["segmented", "segmented"]
    # the second step (the first is per parameter: lazy state) is undone and taken per parameter;
    # the run is cut there, and every later step is segmented again
    assert report.branch_fallback_steps == 1 and report.fused_params == 7, report
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)
    assert_same_state(plain_opt, opt)
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in plain_opt.param_groups] == [8, 8]


def _undo_dropped(mode):
    mode.journal.clear()


def _undo_in_recording_order(mode):
    with torch.no_grad():
        for tensor, copy in mode.journal.values():
            tensor.copy_(copy)
    mode.journal.clear()


@pytest.mark.parametrize("broken_undo", [_undo_dropped, _undo_in_recording_order], ids=["dropped", "in-order"])
def test_a_step_undone_at_a_branch_must_restore_what_it_wrote(segment_value_reads, monkeypatch, broken_undo):
    """Deliberately broken: the journal dropped instead of put back (the momentum buffers the step
    wrote before the branch are then written twice), or put back in the order it was recorded
    (``p`` after ``p.data``: ``p`` was recorded after the weight decay through ``p.data``)."""
    monkeypatch.setattr(_segmented.SegmentedMode, "undo", broken_undo)
    plain, _ = _dead_weight_run(fused=False)
    with pytest.warns(FusionFallbackWarning):
        fused, _ = _dead_weight_run(fused=True)
    with pytest.raises(AssertionError):
        assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


def test_without_cutting_the_run_every_step_is_taken_per_parameter(segment_value_reads, monkeypatch):
    from bagua_integrations._planner import StepPlanner

    monkeypatch.setattr(StepPlanner, "split_where_branches_differ", lambda self, plan, seg, taken: None)
    plain, _ = _dead_weight_run(fused=False)
    with pytest.warns(FusionFallbackWarning):
        fused, opt = _dead_weight_run(fused=True)
    assert fusion_report(opt).branch_fallback_steps == 7  # still exact, never fused
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


class SkipZeroGradSGD(PerParameterRule):
    """A branch on a Python bool computed from each parameter's values (``torch.equal``): a
    parameter whose gradient is all zeros is skipped (no weight decay either). On a flat tensor or
    a run, ``torch.equal`` would answer for every parameter at once."""

    def update(self, p, group):
        if torch.equal(p.grad, torch.zeros_like(p.grad)):
            return
        p.mul_(1 - 0.1 * group["lr"])
        p.sub_(p.grad, alpha=group["lr"])


class CountedSGD(PerParameterRule):
    """A per-parameter step count kept as a tensor and read with ``.item()``: one value for every
    parameter of a run, so the step is followed on runs."""

    def update(self, p, group):
        state = self.state[p]
        if not state:
            state["t"] = torch.zeros(())
        state["t"] += 1
        p.sub_(p.grad / p.grad.norm(), alpha=group["lr"] / state["t"].item() ** 0.5)


def test_a_python_bool_from_each_parameters_values_is_per_parameter(segment_value_reads):
    plain, _ = _dead_weight_run(False, SkipZeroGradSGD, 6)
    with pytest.warns(FusionFallbackWarning, match=r"\(equal\) goes one way for 1 of 3 parameters"):
        fused, opt = _dead_weight_run(True, SkipZeroGradSGD, 6)
    assert fusion_report(opt).group_paths == ["segmented", "segmented"]
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


def test_a_python_bool_over_a_whole_run_must_differ(segment_value_reads, monkeypatch):
    """Deliberately broken: ``torch.equal`` of the whole run, one answer for all its parameters."""
    monkeypatch.setattr(_segmented, "_PYTHON_VALUES", set())
    monkeypatch.setattr(_segmented, "_SCALAR_READS", set())
    plain, _ = _dead_weight_run(False, SkipZeroGradSGD, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused, opt = _dead_weight_run(True, SkipZeroGradSGD, 6)
    assert fusion_report(opt).group_paths == ["segmented", "segmented"]  # the probes did not see it
    with pytest.raises(AssertionError):
        assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


def test_a_per_parameter_predicate_is_not_elementwise(monkeypatch):
    """The elementwise probe counts the values a step reads from reductions of each parameter
    (here ``torch.equal`` of each gradient): per tensor once per parameter, flat once. Broken: not
    counted, the step is taken elementwise, and the flat tensor answers for every parameter."""
    from bagua_integrations import _probe

    assert "reads into Python values it reduces from each parameter" in fusion_report(
        fuse_optimizer(SkipZeroGradSGD(DeadWeightNet().parameters()), compile=False)).group_why[0]
    monkeypatch.setattr(_probe, "_PREDICATES", set())
    plain, _ = _dead_weight_run(False, SkipZeroGradSGD, 6)
    fused, opt = _dead_weight_run(True, SkipZeroGradSGD, 6)
    assert fusion_report(opt).group_paths == ["elementwise", "elementwise"]
    with pytest.raises(AssertionError):
        assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


def test_a_value_every_parameter_of_a_run_shares_is_read_on_runs(segment_value_reads):
    plain, _ = _ranked_run(CountedSGD, fused=False)
    fused, opt = _ranked_run(CountedSGD, fused=True)
    report = fusion_report(opt)
    assert report.group_paths == ["segmented"] and report.branch_fallback_steps == 0, report
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


class LateTransposeSGD(FirstNormSGD):
    """FirstNormSGD that, from its 5th step on (after the probes' window), transposes 2-D gradients
    there and back: the identity per parameter, a reshape of a run that segmented runs refuse."""

    def update(self, p, group):
        if group["step"] >= 5 and p.grad.dim() == 2:
            p.grad.copy_(p.grad.t().t())
        super().update(p, group)


def test_what_a_run_cannot_follow_after_the_probes_is_undone_and_taken_per_parameter(segment_value_reads):
    """A step whose branches the probes saw keeps a journal: whatever a run cannot follow later
    (a transpose from step 5 on) is undone and taken per parameter, exact, instead of failing."""
    plain, _ = _ranked_run(LateTransposeSGD, fused=False)
    with pytest.warns(FusionFallbackWarning, match="transpose|t turns a run"):
        fused, opt = _ranked_run(LateTransposeSGD, fused=True)
    assert fusion_report(opt).branch_fallback_steps == 4  # steps 5 to 8
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


class ProjectedSGD(PerParameterRule):
    """SWATS's flattened dot products (``p.view(-1).dot(g.view(-1))``): a number per parameter."""

    def update(self, p, group):
        g, w = p.grad.view(-1), p.view(-1)
        p.sub_(p.grad * (g.dot(g) / (g.dot(g) + w.dot(w) + 1e-8)), alpha=group["lr"])


def test_a_flattened_run_flattens_each_parameter():
    plain, _ = _ranked_run(ProjectedSGD, fused=False)
    fused, opt = _ranked_run(ProjectedSGD, fused=True)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("order", ["kept", "reversed"])
def test_a_flattened_run_must_keep_each_parameters_segment(monkeypatch, order):
    """Deliberately broken: the flattened run's segments in reverse order (each parameter's dot
    products land on another parameter). The same flattening with the order kept fuses."""
    from functools import cached_property

    def flattened(self):
        if len(self.shape) == 1:
            return self
        pieces = [(start, end, torch.Size([end - start])) for start, end, _ in self.pieces]
        if order == "reversed":
            pieces.reverse()
        return _segmented.Segmentation((self.length,), pieces, self.shard_group, self.shard_numels, self.tag,
                                       parent=self)

    replaced = cached_property(flattened)
    replaced.__set_name__(_segmented.Segmentation, "flattened")
    monkeypatch.setattr(_segmented.Segmentation, "flattened", replaced)
    opt = ProjectedSGD(RankedNet().parameters())
    if order == "kept":
        assert fusion_report(fuse_optimizer(opt, compile=False, on_unsupported="raise")).group_paths == ["segmented"]
    else:
        with pytest.raises(NotElementwiseError, match="with per-parameter reductions: the parameter update differs"):
            fuse_optimizer(opt, compile=False, on_unsupported="raise")


def test_torch_optimizer_novograd_branches_and_is_segmented(segment_value_reads):
    """torch-optimizer's NovoGrad: ``if exp_avg_sq == 0:`` on its per-parameter second moment."""
    torch_optimizer = pytest.importorskip("torch_optimizer")
    make = lambda params: torch_optimizer.NovoGrad(params, lr=1e-2)  # noqa: E731
    plain, _ = _ranked_run(make, fused=False)
    fused, opt = _ranked_run(make, fused=True)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_madgrads_dual_averaging_is_elementwise():
    """MADGRAD computes a parameter as ``x0 - s / rms``, a difference of far larger terms: the
    probes take rounding relative to how far a value moved, so it fuses, and equals its own step."""
    pytest.importorskip("pytorch_optimizer")
    from _optimizer_sweep import optimizer_classes, sweep_one

    ((_, cls),) = optimizer_classes(["madgrad"])
    assert sweep_one("madgrad", cls).kind == "elementwise"


def test_rounding_is_measured_against_how_far_a_value_moved():
    from bagua_integrations._probe import _mismatch

    before = torch.tensor([4.4e-5, 1.0])
    after = torch.tensor([-7.9e-8, 0.99])
    assert _mismatch("p", after, after + torch.tensor([4e-11, 0.0]), before) is None  # MADGRAD's rounding
    assert _mismatch("p", after, after + torch.tensor([4e-11, 0.0])) is not None  # relative to |p| alone
    assert _mismatch("p", after, after + 1e-3 * (after - before), before) is not None  # a changed update


def test_a_one_element_parameter_alone_in_its_run_joins_a_list_over_runs(monkeypatch):
    """AdaNorm keeps a ``(1,)`` norm per parameter; for a ``(1,)`` parameter that is shaped like it,
    so the parameter gets a run of its own. Broken: such a run is not taken as one value."""
    pytest.importorskip("pytorch_optimizer")
    from _optimizer_sweep import optimizer_classes, sweep_one

    ((_, cls),) = optimizer_classes(["adanorm"])
    assert sweep_one("adanorm", cls).kind == "segmented"
    monkeypatch.setattr(_segmented, "_one_value_run", lambda kind, seg: False)
    assert sweep_one("adanorm", cls).kind == "refused"


@pytest.mark.parametrize("name", ["AdaNorm", "Adai"])
def test_python_lists_over_runs_compile_exactly(name):
    """AdaNorm (``torch.cat`` of per-parameter state, ``split(1)`` back) and Adai (one mean over both
    groups' parameters) as compiled steps, without a closure."""
    pytest.importorskip("pytorch_optimizer")
    import pytorch_optimizer
    from _optimizer_sweep import SweepNet, _data
    from bagua_integrations._compile import compile_unavailable_reason

    if compile_unavailable_reason("segmented") is not None:
        pytest.skip(compile_unavailable_reason("segmented"))

    def run(fused):
        model = SweepNet()
        opt = getattr(pytorch_optimizer, name)(model.groups(), lr=1e-2)
        if fused:
            fuse_optimizer(opt, compile=True)
        for x, y in _data():
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            (opt.fuse_step if fused else opt.step)()
        return model, opt

    plain, _ = run(False)
    fused, opt = run(True)
    assert opt._bagua_fusion.stats.last_step_compiled
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


# =========================================================================== closures
class LossScaledSGD(torch.optim.Optimizer):
    """Scales its step by the loss its closure returns (as EmoNavi-style optimizers do)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        loss = 1.0
        if closure is not None:
            with torch.enable_grad():
                loss = float(closure())
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * loss)
        return loss


class TwoEvaluationSGD(torch.optim.Optimizer):
    """SAM-style: steps to a perturbed point, re-evaluates the model there through the closure."""

    def __init__(self, params, lr=0.1, rho=0.05):
        super().__init__(params, dict(lr=lr, rho=rho))

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            closure()
        saved = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    e = p.grad * group["rho"]
                    p.add_(e)
                    saved.append((p, e))
        with torch.enable_grad():
            loss = closure()
        for p, e in saved:
            p.sub_(e)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


def test_the_optimizer_sees_the_loss_of_the_closure():
    plain, _ = _ranked_run(LossScaledSGD, fused=False, closure=True)
    fused, opt = _ranked_run(LossScaledSGD, fused=True, closure=True)
    assert fusion_report(opt).group_paths == ["elementwise"]
    assert_same_params(plain, fused)


def test_a_step_without_the_loss_of_the_closure_must_differ(monkeypatch):
    """Deliberately broken: the optimizer's own step called without the replayed closure."""
    plain, _ = _ranked_run(LossScaledSGD, fused=False, closure=True)
    monkeypatch.setattr(fused_module.Fusion, "_call_raw", lambda self, raw_step: raw_step(self.optimizer))
    fused, _ = _ranked_run(LossScaledSGD, fused=True, closure=True)
    with pytest.raises(AssertionError):
        assert_same_params(plain, fused)


class PolyakSGD(torch.optim.Optimizer):
    """AliG-style: needs the loss from its closure (``step(lambda: float(loss))``), and refuses to
    step without one; its step size is the loss, clipped to ``max_lr``."""

    def __init__(self, params, max_lr=0.1):
        super().__init__(params, dict(max_lr=max_lr))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None:
            raise RuntimeError("PolyakSGD requires a closure that returns the loss")
        with torch.enable_grad():
            loss = float(closure())
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-min(group["max_lr"], loss))
        return loss


def test_an_optimizer_that_needs_the_loss_of_its_closure_is_fused(monkeypatch):
    """Its probes give it a closure when its first step fails without one (a deliberately broken
    probe that never does keeps it on its own step)."""
    plain, _ = _ranked_run(PolyakSGD, fused=False, closure=True)
    fused, opt = _ranked_run(PolyakSGD, fused=True, closure=True)
    assert fusion_report(opt).group_paths == ["elementwise"], fusion_report(opt).group_why
    assert_same_params(plain, fused)
    monkeypatch.setattr(_probe._Closure, "step", lambda self, step, optimizer, n: (
        step(optimizer, self) if n > 0 else step(optimizer)))
    with pytest.warns(FusionFallbackWarning, match="requires a closure"):
        _, broken = _ranked_run(PolyakSGD, fused=True, closure=True)
    assert fusion_report(broken).group_paths == ["per-tensor"]


def test_an_optimizer_that_re_evaluates_through_its_closure_keeps_its_own_step():
    plain, _ = _ranked_run(TwoEvaluationSGD, fused=False, closure=True)
    with pytest.warns(FusionFallbackWarning, match="TwoEvaluationSGD"):
        fused, opt = _ranked_run(TwoEvaluationSGD, fused=True, closure=True)
    assert fusion_report(opt).group_paths == ["per-tensor"]
    assert_same_params(plain, fused, rtol=0, atol=0)


# =========================================================================== random numbers
class NoisySGD(torch.optim.Optimizer):
    """Adds Gaussian noise to each update (Langevin-style): it draws from the global generator."""

    def __init__(self, params, lr=0.05, noise=1e-2):
        super().__init__(params, dict(lr=lr, noise=noise))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"]).add_(torch.randn_like(p), alpha=group["noise"])


def test_fusing_leaves_the_random_number_stream_alone():
    torch.manual_seed(7)
    expected = torch.rand(4)
    model = TinyNet()
    torch.manual_seed(7)
    with pytest.warns(FusionFallbackWarning):  # noise drawn over a flat tensor is not per-tensor noise
        fuse_optimizer(NoisySGD(model.parameters()), compile=False)
    assert torch.equal(torch.rand(4), expected)


def test_an_optimizer_that_draws_random_numbers_is_exact_when_fused():
    a, b = TinyNet(), TinyNet()
    plain = NoisySGD(a.parameters())
    with pytest.warns(FusionFallbackWarning):
        fused = fuse_optimizer(NoisySGD(b.parameters()), compile=False)
    data = batches(5)
    torch.manual_seed(11)
    train(a, plain, data)
    torch.manual_seed(11)
    train(b, fused, data, step=fused.fuse_step)
    assert_same_params(a, b, rtol=0, atol=0)


# =========================================================================== the default: never refused
def test_what_cannot_be_fused_keeps_its_exact_step_by_default_and_raises_on_request():
    a, b = TinyNet(), TinyNet()
    plain = torch.optim.Adafactor(a.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = fuse_optimizer(torch.optim.Adafactor(b.parameters(), lr=1e-2))
    assert [w.category for w in caught] == [FusionFallbackWarning], [str(w.message) for w in caught]
    assert "Adafactor" in str(caught[0].message)
    data = batches(6)
    train(a, plain, data)
    train(b, fused, data, step=fused.fuse_step)
    assert_same_params(a, b, rtol=0, atol=0)
    report = fusion_report(fused)
    assert report.group_paths == ["per-tensor"] and "size" in report.group_reasons[0], report
    with pytest.raises(NotElementwiseError, match="on_unsupported='raise'"):
        fuse_optimizer(torch.optim.Adafactor(TinyNet().parameters(), lr=1e-2), on_unsupported="raise")


class ReadOnlyWrapper(torch.optim.Optimizer):
    """A Lookahead/Magma-style wrapper: ``param_groups`` and ``state`` are its inner optimizer's."""

    def __init__(self, inner):
        self.inner = inner
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self.steps = 0

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, closure=None):
        self.steps += 1
        return self.inner.step(closure)


@pytest.mark.parametrize("compile", ["auto", True])
def test_a_wrapper_with_read_only_state_runs_its_own_step(compile):
    """``compile=True`` too: the compiled per-parameter step is not tried on a wrapper (its probe
    copied the wrapper and failed with a bare ``AttributeError``: pytorch-optimizer's Magma)."""
    a, b = TinyNet(), TinyNet()
    plain = ReadOnlyWrapper(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9))
    with pytest.warns(FusionFallbackWarning, match="wrapper"):
        fused = fuse_optimizer(ReadOnlyWrapper(torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)), compile=compile)
    data = batches(4)
    train(a, plain, data)
    train(b, fused, data, step=fused.fuse_step)
    assert_same_params(a, b, rtol=0, atol=0)
    assert fused.steps == 4
    with pytest.raises(NotElementwiseError, match="fuse the inner optimizer"):
        fuse_optimizer(ReadOnlyWrapper(torch.optim.SGD(TinyNet().parameters(), lr=0.1)), on_unsupported="raise")


# =========================================================================== the report command
def test_report_command_says_which_path_each_group_takes(capsys):
    assert report_main(["torch.optim:AdamW"]) == 0
    out = capsys.readouterr().out
    assert "param group 0: elementwise" in out and "difference from the unfused optimizer" in out
    assert report_main(["torch.optim:Adafactor", "--kwargs", '{"lr": 0.01}']) == 0
    assert "param group 0: per-tensor -- " in capsys.readouterr().out
    assert report_main(["no_such_module:Optim"]) == 2
    assert "cannot import 'no_such_module'" in capsys.readouterr().err


def test_report_command_compares_an_optimizer_that_draws_random_numbers_from_the_same_draws(capsys):
    """pytorch-optimizer's Gravity draws its initial state at random: fused and unfused take the
    same draws when they start from the same random state (the report said 1.2e+01 apart)."""
    pytest.importorskip("pytorch_optimizer")
    assert report_main(["pytorch_optimizer:Gravity"]) == 0
    assert "after 3 steps: 0.0e+00" in capsys.readouterr().out


# =========================================================================== (1,)-shaped per-parameter state
class WeightedMomentum(torch.optim.Optimizer):
    """QHAdam-style: a ``(1,)``-shaped running weight per parameter, read back as a 0-D value with
    ``reshape(())``, and a per-parameter norm scaling the update."""

    def __init__(self, params, lr=0.05, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p].update(weight=torch.zeros((1,)), momentum=torch.zeros_like(p))
            weights = [self.state[p]["weight"] for p in params]
            torch._foreach_mul_(weights, group["beta"])
            torch._foreach_add_(weights, 1.0)
            for p, w in zip(params, torch._foreach_reciprocal(weights)):
                m = self.state[p]["momentum"]
                m.mul_(group["beta"]).add_(p.grad)
                p.add_(m * w.reshape(()) / (m.norm() + 1e-3), alpha=-group["lr"])


def test_one_element_state_reshaped_to_a_value_stays_one_value_per_parameter():
    plain, _ = _ranked_run(WeightedMomentum, fused=False)
    fused, opt = _ranked_run(WeightedMomentum, fused=True, on_unsupported="raise")
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)
    for p in fused.parameters():
        assert opt.state[p]["weight"].shape == (1,)  # the layout of the unfused optimizer's state


def test_one_element_state_reshape_must_be_handled(monkeypatch):
    """Deliberately broken: reshapes of one value per parameter treated as ordinary ops. Refused by the probe."""
    monkeypatch.setattr(_segmented, "_RESHAPES", set())
    with pytest.raises(NotElementwiseError, match="WeightedMomentum"):
        fuse_optimizer(WeightedMomentum(RankedNet().parameters()), compile=False, on_unsupported="raise")


# =========================================================================== compiled: an int step count in the group
class GroupCountedLamb(torch.optim.Optimizer):
    """pytorch-optimizer's way of counting: ``group["step"]`` a Python int, bias correction by
    ``math.pow``; LAMB's per-parameter trust ratio makes it segmented."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        import math

        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            correction = math.sqrt(1.0 - math.pow(beta2, group["step"])) / (1.0 - math.pow(beta1, group["step"]))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"]) * correction
                ratio = torch.where(update.norm() > 0, p.norm() / update.norm(), 1.0)
                p.sub_(update * ratio, alpha=group["lr"])


def _compiled_counted(steps=6):
    def make():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s)) for s in [(256, 256), (256,), (512, 256), (512,)]]

    plain, fused = make(), make()
    opt_plain = GroupCountedLamb(plain)
    opt = fuse_optimizer(GroupCountedLamb(fused), compile=True)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            for a, b in zip(plain, fused):
                a.grad = torch.randn(a.shape, generator=gen)
                b.grad = a.grad.clone()
            opt_plain.step()
            opt.fuse_step()
    return plain, fused, opt, caught


def test_an_int_step_count_in_the_group_keeps_the_compiled_step():
    from bagua_integrations._compile import compile_unavailable_reason

    if compile_unavailable_reason("segmented") is not None:
        pytest.skip(compile_unavailable_reason("segmented"))
    plain, fused, opt, caught = _compiled_counted()
    report = fusion_report(opt)
    assert report.group_paths == ["segmented"] and report.compiled, report
    assert report.compile_disabled_reason is None and not caught, [str(w.message) for w in caught]
    for a, b in zip(plain, fused):  # fp32 rounding of a compiled kernel (FMA), not different math
        assert float((a - b).norm() / a.norm()) < 1e-6


def test_a_specialized_step_count_switches_the_compiled_step_off(monkeypatch):
    """Deliberately broken: math.pow left as Dynamo sees it. The compiled step recompiles and gives up."""
    import contextlib

    from bagua_integrations import _compile

    if _compile.compile_unavailable_reason("segmented") is not None:
        pytest.skip(_compile.compile_unavailable_reason("segmented"))
    monkeypatch.setattr(_compile, "math_pow_kept_symbolic", contextlib.nullcontext)
    _, _, opt, _ = _compiled_counted()
    assert "recompiled" in (fusion_report(opt).compile_disabled_reason or "")


def test_a_flag_flipped_mid_run_whose_old_state_a_run_cannot_read_takes_one_step_per_parameter():
    """pytorch-optimizer's FlashAdamW keeps its unfused step under ``quantize=True`` (the default):
    its state is stored quantized. With ``quantize`` flipped off after 3 steps the group is laid
    out anew, segmented, and its first step dequantizes the old state per parameter (``numel``),
    which a run cannot give: that raised a FusionError half-way through the step ("some
    parameters may already be updated"), while the unfused optimizer takes the flip. A segmented
    call's first eager step now keeps a journal: undone, taken per parameter once (one warning),
    segmented from then on; the same numbers as unfused."""
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    make = getattr(pytorch_optimizer, "FlashAdamW", None)
    if make is None:
        pytest.skip("this pytorch-optimizer has no FlashAdamW")

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    plain_model, fused_model = model(), model()
    plain = make(plain_model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = fuse_optimizer(make(fused_model.parameters(), lr=1e-3), compile=False)
        for step in range(8):
            if step == 3:
                for optimizer in (plain, fused):
                    optimizer.param_groups[0]["quantize"] = not optimizer.param_groups[0]["quantize"]
            for net, optimizer in ((plain_model, plain), (fused_model, fused)):
                optimizer.zero_grad()
                net(x).pow(2).mean().backward()
            plain.step()
            fused.fuse_step()
    assert_same_params(plain_model, fused_model)
    report = fusion_report(fused)
    assert report.group_paths == ["segmented"] and report.branch_fallback_steps == 1, report
    assert any("took that step per parameter" in str(w.message) for w in caught)


class LateCountNorm(PerParameterStep):
    """Normalized SGD that, from step 5 (after the probes' 3), also scales each parameter by its
    count of elements: before it writes anything (``count_first``) or after it updated ``p``."""

    def __init__(self, params, lr=0.1, count_first=True):
        super().__init__(params, lr=lr, count_first=count_first)

    def update(self, p, state, group):
        state["step"] = state.get("step", 0) + 1
        late = state["step"] >= 5
        scale = 1.0 + 1.0 / p.numel() if late and group["count_first"] else 1.0
        p.sub_(p.grad / (p.grad.norm() + 1e-3), alpha=group["lr"] * scale)
        if late and not group["count_first"]:
            p.mul_(1.0 - 1e-3 / p.numel())


@pytest.mark.parametrize("count_first", [True, False], ids=["before-any-write", "after-a-write"])
def test_a_step_that_stops_on_runs_is_taken_per_parameter_only_if_it_wrote_nothing(count_first):
    """A segmented step that does what a run cannot give (a parameter's count of elements used
    otherwise than summed), unseen by the probes, before it wrote into a run, its gradient or its
    state: nothing to undo, so the step is taken per parameter (one warning), the same numbers as
    unfused. After a write it cannot be undone without a journal: a FusionError that says so.
    (Both were silently wrong before, 9e-3 and 6e-5 off: ``1.0 / p.numel()`` with a float on the
    left never asked the run's count, an ``int`` subclass, and divided by the whole run's.)"""
    make = lambda ps: LateCountNorm(ps, count_first=count_first)  # noqa: E731
    plain_model, fused_model = TinyNet(), TinyNet()
    plain = make(plain_model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = fuse_optimizer(make(fused_model.parameters()), compile=False)
    assert fusion_report(fused).group_paths == ["segmented"]
    data = batches(6)
    train(plain_model, plain, data)
    if not count_first:
        with pytest.raises(FusionError, match="may already be updated"):
            train(fused_model, fused, data, step=fused.fuse_step)
        return
    with pytest.warns(UserWarning, match="took that step per parameter"):
        train(fused_model, fused, data, step=fused.fuse_step)
    assert_same_params(plain_model, fused_model)
    assert fusion_report(fused).branch_fallback_steps == 2
