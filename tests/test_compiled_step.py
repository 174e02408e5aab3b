"""The compiled fused step: same numbers as eager, few recompiles, safe fallback, no big temporaries."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from _fused_utils import ForeachScalarsAdam, TinyNet, assert_same_params, assert_same_state, batches, two_groups
from bagua_integrations import CompileFallbackWarning, fuse_optimizer, fusion_report
from bagua_integrations import _compile
from bagua_integrations import fused_optimizer as fused_optimizer_module
from bagua_integrations.optim import BertAdam, Lamb

O = torch.optim
pytestmark = pytest.mark.skipif(_compile.compile_unavailable_reason() is not None,
                                reason=str(_compile.compile_unavailable_reason()))

CASES = {
    "AdamW": (O.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adam-amsgrad": (O.Adam, dict(lr=1e-2, amsgrad=True)),
    "SGD-nesterov": (O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "RMSprop-centered": (O.RMSprop, dict(lr=1e-2, centered=True, momentum=0.5)),
    "Adagrad": (O.Adagrad, dict(lr=0.1)),
    "Adamax": (O.Adamax, dict(lr=1e-2)),
    "NAdam": (O.NAdam, dict(lr=1e-2)),
    "Adadelta": (O.Adadelta, dict(lr=1.0)),
    "Rprop": (O.Rprop, dict(lr=1e-2)),
    "ASGD": (O.ASGD, dict(lr=1e-2, t0=3)),
    "BertAdam": (BertAdam, dict(lr=1e-2, max_grad_norm=-1.0)),
}


def _run(model, optimizer, data, scheduler=None, after_step=None):
    """``after_step(i)``, if given, runs after step ``i`` (and the scheduler's step): a setting
    changed there is what step ``i + 1`` sees."""
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.fuse_step() if hasattr(optimizer, "fuse_step") else optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if after_step is not None:
            after_step(i)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_matches_eager_fused_and_unfused(name):
    cls, kwargs = CASES[name]
    data = batches(10)
    models = [TinyNet() for _ in range(3)]
    plain = cls(two_groups(models[0], lr=3e-3), **kwargs)
    eager = fuse_optimizer(cls(two_groups(models[1], lr=3e-3), **kwargs), compile=False)
    compiled = fuse_optimizer(cls(two_groups(models[2], lr=3e-3), **kwargs), compile=True)
    for model, opt in zip(models, (plain, eager, compiled)):
        _run(model, opt, data, O.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
    assert_same_params(models[0], models[1])
    # Inductor may contract a*b+c into one FMA: last-bit differences, compounding over steps
    assert_same_params(models[1], models[2], rtol=2e-5, atol=1e-6)
    report = fusion_report(compiled)
    assert report.compiled and report.compile_disabled_reason is None
    assert report.compile_graphs <= 3


class BoundedStepSGD(torch.optim.Optimizer):
    """A step whose learning rate reaches a fill value and clamp bounds, written in each form torch
    takes them (AdaBound's and AdaMod's pattern: ``torch.full((), lr * c)``, then ``clamp_(min=lower,
    max=upper)`` of bounds computed from the rate)."""

    FORMS = ("full", "full_like", "fill_", "clamp_ keywords", "clamp positional", "clamp_min_ clamp_max_")

    def __init__(self, params, lr, form):
        self.form = form
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr = group["lr"]
            lower, upper = 0.5 * lr, 2.0 * lr
            for p in group["params"]:
                if p.grad is None:
                    continue
                size = p.grad.abs().add(1.0)
                if self.form == "full":
                    size = torch.div(torch.full((), fill_value=lr, dtype=p.dtype), size)
                elif self.form == "full_like":
                    size = torch.full_like(size, lr) / size
                elif self.form == "fill_":
                    size = torch.empty_like(size).fill_(lr) / size
                elif self.form == "clamp_ keywords":
                    size = size.mul(lr).clamp_(min=lower, max=upper)
                elif self.form == "clamp positional":
                    size = torch.clamp(size.mul(lr), lower, upper)
                else:
                    size = size.mul(lr).clamp_min_(lower).clamp_max_(upper)
                state = self.state[p]
                if "update" not in state:  # (compiled steps start once every run has state)
                    state["update"] = torch.zeros_like(p)
                p.sub_(state["update"].mul_(0.5).add_(p.grad.sign() * size))


@pytest.mark.parametrize("form", BoundedStepSGD.FORMS)
def test_a_scheduled_rate_in_a_fill_value_or_clamp_bound_is_followed(form):
    """A float that is a Scalar argument (a fill value, a clamp bound) cannot become a graph input
    as one: torch 2.13 and 2.14 recompiled the step for each new rate (AdaBound's compiled step
    switched itself off), and torch 2.11 compiled the rate it had when traced into the kernel, with
    no guard (AdaBound under LambdaLR: 2e-1 from unfused, silently). They enter as 0-dim tensors."""
    data = batches(8)
    models = [TinyNet() for _ in range(2)]
    plain = BoundedStepSGD(two_groups(models[0], lr=3e-3), lr=1e-2, form=form)
    compiled = fuse_optimizer(BoundedStepSGD(two_groups(models[1], lr=3e-3), lr=1e-2, form=form), compile=True)
    for model, opt in zip(models, (plain, compiled)):
        _run(model, opt, data, O.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
    assert_same_params(models[0], models[1], rtol=2e-6, atol=1e-7)
    report = fusion_report(compiled)
    assert report.compiled and report.compile_disabled_reason is None, report
    assert report.compile_graphs <= 2, report


@pytest.mark.parametrize("name", ["AdaBound", "AdaMod"])
def test_pytorch_optimizers_bounded_steps_compiled_follow_a_schedule(name):
    """The real package's AdaBound and AdaMod (the optimizers that showed it) under LambdaLR."""
    po = pytest.importorskip("pytorch_optimizer")
    data = batches(10)
    models = [TinyNet() for _ in range(2)]
    plain = getattr(po, name)(two_groups(models[0], lr=3e-3), lr=1e-2)
    compiled = fuse_optimizer(getattr(po, name)(two_groups(models[1], lr=3e-3), lr=1e-2), compile=True)
    for model, opt in zip(models, (plain, compiled)):
        _run(model, opt, data, O.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)
    report = fusion_report(compiled)
    assert report.compiled and report.compile_graphs <= 2, report


@pytest.mark.parametrize("size", ["small", "large"])
def test_compiled_radam_rectifies_as_eager_does(size):
    """RAdam rectifies its update from step 6 on (beta2 = 0.999), by a term of the length of the
    approximated SMA, ``rho_t = rho_inf - 2 step beta2^step / (1 - beta2^step)``: about 6 there, a
    difference of two numbers near 2000. Compiled, that was float32 math on the 0-dim step count
    (eager: Python floats), 0.6% off, and the parameters 1.7e-4 relative off unfused after the first
    rectified step, 8.6e-4 after 12, silently (``torch.compile(opt.step)`` gives the same). The
    scalar prologue now replays it in double precision, from kernels of any size. Constant rate: a
    decaying one hides the difference."""
    data = batches(12)
    models = [TinyNet() for _ in range(2)]
    if size == "large":  # (a kernel of 2^18 elements, where the prologue always ran)
        for model in models:
            model.extra = torch.nn.Parameter(torch.linspace(-1, 1, 1 << 18))
    plain = O.RAdam(models[0].parameters(), lr=1e-2)
    compiled = fuse_optimizer(O.RAdam(models[1].parameters(), lr=1e-2), compile=True)
    for model, opt in zip(models, (plain, compiled)):
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if size == "large":
                loss = loss + (model.extra ** 2).mean()
            loss.backward()
            opt.fuse_step() if hasattr(opt, "fuse_step") else opt.step()
    assert plain.state[next(models[0].parameters())]["step"] >= 6  # rectified steps ran
    assert_same_params(models[0], models[1], rtol=2e-6, atol=1e-7)
    assert fusion_report(compiled).compiled


def _momentum_cases():
    cases = {name: CASES[name] for name in ("AdamW", "Adam-amsgrad", "Adamax", "NAdam")}
    cases.update({"SGD-nesterov": (O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
             "RMSprop-momentum": (O.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True, weight_decay=1e-3)),
             "RAdam": (O.RAdam, dict(lr=1e-2, weight_decay=0.1)),
             "BertAdam": (BertAdam, dict(lr=1e-2, weight_decay=0.1)),
             "LAMB": (Lamb, dict(lr=1e-2, weight_decay=0.01))})
    try:
        import pytorch_optimizer as po
    except ImportError:
        return cases
    return {**cases, "po.AdaBelief": (po.AdaBelief, dict(lr=1e-2, weight_decay=1e-2)),
            "po.Adan": (po.Adan, dict(lr=1e-2, weight_decay=1e-2)),
            "po.LARS": (po.LARS, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
            "po.Lamb": (po.Lamb, dict(lr=1e-2, weight_decay=1e-2))}


MOMENTUM_CASES = _momentum_cases()


@pytest.mark.parametrize("name", sorted(MOMENTUM_CASES))
def test_compiled_steps_follow_momentum_and_weight_decay_schedules(name):
    """OneCycleLR cycles momentum (or beta1) with the learning rate on every step, and the weight
    decay here decays by a tenth a step: compiled, every such step matches unfused, on 2 graphs.
    Compiled AdamW once kept the first beta1 it made symbolic in its bias correction ``1 - beta1 **
    step`` (Inductor compiled the base of ``pow(float, tensor)`` as a constant, with no guard: 2e-2
    from unfused after 8 steps, silently), and pytorch-optimizer's AdaBelief and Adan drifted 1-2e-2
    through a ``lerp`` weight, so a changing beta1 switched compiled steps off everywhere but in
    torch's Adam family; each use that drifted now enters the graph as a tensor."""
    cls, kwargs = MOMENTUM_CASES[name]
    data = batches(10)
    models = [TinyNet() for _ in range(2)]
    plain = cls(two_groups(models[0], lr=3e-3), **kwargs)
    compiled = fuse_optimizer(cls(two_groups(models[1], lr=3e-3), **kwargs), compile=True)
    for model, opt in zip(models, (plain, compiled)):
        cycles = "momentum" in opt.defaults or "betas" in opt.defaults
        schedule = O.lr_scheduler.OneCycleLR(opt, max_lr=[2 * g["lr"] for g in opt.param_groups],
                                             total_steps=len(data) + 1, cycle_momentum=cycles)

        def decay_weight_decay(_, groups=opt.param_groups):
            for group in groups:
                group["weight_decay"] *= 0.9

        _run(model, opt, data, schedule, after_step=decay_weight_decay)
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)
    report = fusion_report(compiled)
    assert report.compiled and report.compile_disabled_reason is None, report
    assert report.compile_graphs <= 2, report


def test_a_changing_float_compiled_steps_do_not_follow_turns_them_off():
    """Any other param-group float that changes (here ``eps``, set by hand after three steps)
    switches the compiled step off before a step runs with it, with one warning naming it: its
    uses are untested. Eager fused from then on, exact."""
    data = batches(8)
    models = [TinyNet() for _ in range(2)]
    plain = O.AdamW(two_groups(models[0], lr=3e-3), lr=1e-2)
    compiled = fuse_optimizer(O.AdamW(two_groups(models[1], lr=3e-3), lr=1e-2), compile=True)
    with pytest.warns(CompileFallbackWarning, match=r"'eps' changed") as caught:
        for model, opt in zip(models, (plain, compiled)):
            def set_eps_after_three_steps(i, groups=opt.param_groups):
                if i == 2:
                    for group in groups:
                        group["eps"] = 1e-6

            _run(model, opt, data, after_step=set_eps_after_three_steps)
    assert len([w for w in caught if issubclass(w.category, CompileFallbackWarning)]) == 1
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)
    assert "'eps' changed" in fusion_report(compiled).compile_disabled_reason


def test_one_compiled_step_is_within_fp32_rounding_of_eager():
    """From identical state, one compiled step differs from one eager step by rounding only."""
    data = batches(6)
    a, b = TinyNet(), TinyNet()
    eager = fuse_optimizer(O.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1), compile=False)
    compiled = fuse_optimizer(O.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1), compile=True)
    for (x, y) in data:
        for model, opt in ((a, eager), (b, compiled)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.fuse_step()
        assert_same_params(a, b, rtol=1e-6, atol=1e-7)
        with torch.no_grad():  # re-synchronise so errors cannot compound
            for pa, pb in zip(a.parameters(), b.parameters()):
                pb.copy_(pa)
            for sa, sb in zip(eager.state.values(), compiled.state.values()):
                for key in sa:
                    sb[key].copy_(sa[key])
    assert fusion_report(compiled).compiled


def test_learning_rate_schedule_does_not_recompile_every_step():
    model = TinyNet()
    opt = fuse_optimizer(O.AdamW(two_groups(model, lr=3e-3), lr=1e-2, weight_decay=0.01), compile=True)
    sched = O.lr_scheduler.LambdaLR(opt, lambda s: 0.5 + 0.5 * torch.cos(torch.tensor(s / 100.0)).item())
    x, y = batches(1)[0]
    for step in range(1000):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.fuse_step()
        sched.step()
        if step % 250 == 0:
            for group in opt.param_groups:
                group["weight_decay"] = 0.01 * (1 + step / 1000)  # weight-decay changes too
    report = fusion_report(opt)
    assert report.compiled and report.fused_steps == 1000
    assert report.compile_graphs <= 3, report  # the first compile + at most 2 recompiles


@pytest.mark.parametrize("name", ["AdamW", "SGD-nesterov", "RMSprop-centered", "NAdam", "Adadelta", "BertAdam"])
def test_learning_rate_schedule_over_20_steps_keeps_at_most_two_graphs(name):
    """The first graph (every float a constant) and one where the changing learning rate is
    symbolic; torch 2.6 - 2.12 made one graph per learning rate here (see floats_used_directly)."""
    cls, kwargs = CASES[name]
    model = TinyNet()
    opt = fuse_optimizer(cls(model.parameters(), **kwargs), compile=True)
    sched = O.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    graphs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        for x, y in batches(20):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.fuse_step()
            sched.step()
            graphs.append(fusion_report(opt).compile_graphs)
    report = fusion_report(opt)
    assert report.compiled and report.compile_disabled_reason is None, report
    assert graphs[-1] <= 2, graphs


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken_backend(self, graph_module, example_inputs):
        raise RuntimeError("simulated compiler crash")

    monkeypatch.setattr(_compile.CompiledStep, "_backend", broken_backend)
    data = batches(6)
    a, b = TinyNet(), TinyNet()
    eager = fuse_optimizer(O.Adam(a.parameters(), lr=1e-2), compile=False)
    compiled = fuse_optimizer(O.Adam(b.parameters(), lr=1e-2), compile=True)
    _run(a, eager, data)
    with pytest.warns(CompileFallbackWarning, match="simulated compiler crash") as caught:
        _run(b, compiled, data)
    assert len([w for w in caught if issubclass(w.category, CompileFallbackWarning)]) == 1
    assert_same_params(a, b, rtol=0, atol=0)  # nothing was half-applied
    report = fusion_report(compiled)
    assert not report.compiled and "simulated" in report.compile_disabled_reason


def test_compiler_unavailable_warns_and_stays_eager(monkeypatch):
    monkeypatch.setattr(_compile, "_COMPILER_WORKS", {"cpu": False})
    with pytest.warns(CompileFallbackWarning, match="not usable"):
        opt = fuse_optimizer(O.SGD(TinyNet().parameters(), lr=0.1), compile=True)
    assert fusion_report(opt).compile_graphs == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fuse_optimizer(O.SGD(TinyNet().parameters(), lr=0.1), compile="auto")  # auto stays quiet


def test_the_compiler_is_probed_on_the_parameters_device_once(monkeypatch):
    """A GPU machine's fused step needs Triton, not the host's C++ compiler: probing Inductor with a
    CPU tensor there made it check the host's vector instructions by compiling test programs (40 s of
    a 45 s startup on an H200). Each device type is probed once, on its own tensors."""
    asked = []
    real = _compile.compile_unavailable_reason
    monkeypatch.setattr(fused_optimizer_module, "compile_unavailable_reason",
                        lambda path="elementwise", device_type="cpu": asked.append(device_type) or real(path, device_type))
    fuse_optimizer(O.SGD(TinyNet().parameters(), lr=0.1), compile=True)
    assert asked and set(asked) == {"cpu"}
    monkeypatch.setattr(_compile, "_COMPILER_WORKS", {"cpu": True})
    reason = _compile.compile_unavailable_reason(device_type="meta")  # no kernel runs on meta tensors
    assert reason is not None and "meta tensors" in reason
    assert _compile._COMPILER_WORKS == {"cpu": True, "meta": False}
    assert _compile.compile_unavailable_reason(device_type="cpu") is None


def test_a_gpu_is_probed_with_its_own_tensors_and_the_probe_works(monkeypatch):
    """CUDA tensors are answered by the probe alone, run on their device, without the CPU's checks.
    A local ``import torch._inductor...`` in the CPU's branch once made ``torch`` a local name that
    the CUDA branch read unbound: every GPU probe failed, silently, and every compiled step on a GPU
    ran eagerly (H200, torch 2.11: 9 compiled CUDA tests failed). The probe itself runs here on CPU
    tensors, as it runs on CUDA ones there."""
    probed = []
    monkeypatch.setattr(_compile, "_COMPILER_WORKS", {})
    monkeypatch.setattr(_compile, "_probe_compile", lambda device_type: probed.append(device_type) or True)
    monkeypatch.setattr(_compile, "start_cpu_vector_isa_checks",
                        lambda: pytest.fail("a CUDA probe started the CPU's vector-instruction checks"))
    assert _compile.compiler_available("cuda") is True and probed == ["cuda"]
    assert _compile.compiler_available("cuda") is True and probed == ["cuda"]  # once per process
    monkeypatch.undo()
    assert _compile._probe_compile("cpu") is True
    assert _compile._probe_compile("meta") is False  # no kernel runs on meta tensors


_COMPILER_CHECK = r"""
import json, torch
from bagua_integrations import _compile

answers = []
start = _compile.start_cpu_vector_isa_checks

def recording(**kwargs):
    wait = start(**kwargs)
    return lambda: answers.append(wait()) or answers[-1]

def probe(*args, **kwargs):
    raise RuntimeError("the probe compiled")

_compile.start_cpu_vector_isa_checks = recording
torch.compile = probe
print(json.dumps({"works": _compile.compiler_available("cpu"), "built": answers}))
"""


def test_vector_isa_checks_that_built_answer_for_the_compiler_without_a_probe(tmp_path):
    """A cold start: when Inductor's vector-ISA checks built and loaded their test programs, that
    is the answer (the probe's compile, 0.7 s, is skipped); when none was started, the probe
    decides (here it fails, so the compiler counts as unusable)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", _COMPILER_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["built"] in ([True], [False]), seen
    assert seen["works"] is seen["built"][0], seen  # True without the probe; False: the probe ran (and failed)
    if not seen["built"][0]:
        pytest.skip("fewer than two vector ISAs to check on this CPU: the probe decides (checked above)")


def test_auto_compiles_only_big_buffers_and_never_torch_fused_kernels():
    small = fuse_optimizer(O.AdamW(TinyNet().parameters()), compile="auto")
    assert fusion_report(small).compile_graphs == 0 and small._bagua_fusion.compiled_step is None
    big = torch.nn.Linear(1024, 1024)
    assert fuse_optimizer(O.AdamW(big.parameters()), compile="auto")._bagua_fusion.compiled_step is not None
    fused_kernel = fuse_optimizer(O.AdamW(torch.nn.Linear(1024, 1024).parameters(), fused=True), compile=True)
    assert fused_kernel._bagua_fusion.compiled_step is None
    with pytest.raises(ValueError, match="compile must be"):
        fuse_optimizer(O.SGD(TinyNet().parameters(), lr=0.1), compile="yes")


def _bytes_allocated_during(step) -> int:
    """Bytes torch's CPU allocator handed out while ``step`` ran (an upper bound on its peak RSS growth).

    Deterministic, unlike sampling RSS, which depends on whether the C allocator reuses memory
    that is already resident.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return sum(event.self_cpu_memory_usage for event in prof.key_averages() if event.self_cpu_memory_usage > 0)


def test_compiled_step_allocates_no_full_size_temporaries(monkeypatch):
    import bagua_integrations.fused_optimizer as fused_module

    torch.manual_seed(0)
    n = 8_000_000  # 32 MB of fp32 parameters

    def make(compile):
        param = torch.nn.Parameter(torch.randn(n))
        opt = fuse_optimizer(BertAdam([param], lr=1e-3, max_grad_norm=-1.0), compile=compile)
        for _ in range(3):  # state created, compiled, warm
            param.grad = torch.randn(n)
            opt.fuse_step()
        return opt

    compiled = make(True)
    assert fusion_report(compiled).compiled
    param_bytes = n * 4
    assert _bytes_allocated_during(compiled.fuse_step) <= 0.10 * param_bytes
    # the instrument sees temporaries: eager BertAdam over whole buffers builds full-size ones
    monkeypatch.setattr(fused_module, "EAGER_RUN_ELEMENTS", None)
    eager = make(False)
    assert _bytes_allocated_during(eager.fuse_step) >= 1.0 * param_bytes


class ForeachLamb(torch.optim.Optimizer):
    """LAMB written as pytorch-optimizer writes it: ``_foreach_*`` calls over the whole group (split
    per run on segmented runs), per-parameter norms, and the learning rate reaching a foreach call
    as ``alpha=`` (``how="alpha"``), ``value=`` (``"value"``) or a lerp weight (``"lerp"``, and
    ``"lerp keyword"``: ``Tensor.lerp_(end, weight=...)`` per tensor)."""

    def __init__(self, params, lr=1e-3, how="alpha"):
        super().__init__(params, dict(lr=lr))
        self.how = how

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            group["step"] = group.get("step", 0) + 1  # a group-level count, as pytorch-optimizer keeps it
            lr = group["lr"] / (1.0 - math.pow(0.9, group["step"]))  # bias-corrected
            if self.how == "lerp":  # a weight that follows the schedule
                torch._foreach_lerp_(exp_avgs, grads, 50 * lr)
            elif self.how == "lerp keyword":  # the same by keyword, one tensor at a time (AdaBelief's beta1)
                for exp_avg, grad in zip(exp_avgs, grads):
                    exp_avg.lerp_(grad, weight=50 * lr)
            else:
                torch._foreach_mul_(exp_avgs, 0.9)
                torch._foreach_add_(exp_avgs, grads, alpha=0.1)
            trust = [w / (u + 1e-6) for w, u in zip(torch._foreach_norm(params), torch._foreach_norm(exp_avgs))]
            if self.how == "value":
                torch._foreach_addcmul_(params, exp_avgs, trust, value=-lr)
            else:
                torch._foreach_add_(params, torch._foreach_mul(exp_avgs, trust), alpha=-lr)


@pytest.mark.skipif(_compile.compile_unavailable_reason("segmented") is not None,
                    reason=str(_compile.compile_unavailable_reason("segmented")))
@pytest.mark.parametrize("how", ["alpha", "value", "lerp", "lerp keyword"])
def test_a_scheduled_learning_rate_reaching_foreach_calls_on_segmented_runs_is_followed(how):
    """A learning rate passed to a ``_foreach_*`` call as a scalar argument, on segmented runs
    (which split the call per run), is symbolic in the compiled step: one graph follows the
    schedule. Before, each new rate recompiled until the compiled step switched itself off, or,
    in pytorch-optimizer's Lamb, the rate was frozen silently
    (test_third_party_optimizers.py::test_pytorch_optimizer_lamb_compiled_follows_a_schedule)."""
    data = batches(8)
    models = [TinyNet() for _ in range(2)]
    plain = ForeachLamb(models[0].parameters(), how=how)
    fused = fuse_optimizer(ForeachLamb(models[1].parameters(), how=how), compile=True)
    schedulers = [O.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) for opt in (plain, fused)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # the compiled step must be what ran
        for opt, model, scheduler in zip((plain, fused), models, schedulers):
            _run(model, opt, data, scheduler)
    report = fusion_report(fused)
    assert report.group_paths == ["segmented"] and report.compiled, report  # (compiled: the last step ran the kernel)
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)


def test_python_scalars_reaching_foreach_calls_follow_a_schedule_without_recompiling():
    """``_foreach_*`` calls with Python scalars (``alpha=``, ``value=``, lerp weights, plain operands)
    run element by element inside the compiled step, so the scalars stay graph inputs: one graph for
    the first step and one making them symbolic, however the learning rate moves. (Left as foreach
    calls they recompile on every new rate here; on CUDA with torch 2.11 they kept the first graph's
    rate with no recompile at all: see tests/test_cuda.py.)"""
    data = batches(10)
    models = [TinyNet() for _ in range(2)]
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    plain = ForeachScalarsAdam(two_groups(models[0], lr=3e-3), **kwargs)
    fused = fuse_optimizer(ForeachScalarsAdam(two_groups(models[1], lr=3e-3), **kwargs), compile=True)
    for model, opt in zip(models, (plain, fused)):
        _run(model, opt, data, O.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
    report = fusion_report(fused)
    assert report.compiled and report.compile_disabled_reason is None, report
    assert report.compile_graphs <= 2, report
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)
    assert_same_state(plain, fused, rtol=2e-5, atol=1e-6)


def test_torch_optim_groups_with_foreach_left_to_torch_trace_their_single_tensor_step(monkeypatch):
    """``foreach=None`` lets torch.optim pick its implementation: foreach for CUDA tensors. Inside the
    compiled step it is the single-tensor one (its scalars stay symbolic), and the group's setting is
    left as the user gave it. Here torch is made to pick foreach on CPU, as it does on CUDA."""
    adam_module = __import__("torch.optim.adam", fromlist=["adam"])
    monkeypatch.setattr(adam_module, "_default_to_fused_or_foreach", lambda *args, **kwargs: (False, True))
    picked = []  # whether each call of the foreach implementation was being traced by the compiler
    multi_tensor = adam_module._multi_tensor_adam
    monkeypatch.setattr(adam_module, "_multi_tensor_adam",
                        lambda *a, **k: (picked.append(torch.compiler.is_compiling()), multi_tensor(*a, **k))[1])
    data = batches(6)
    models = [TinyNet() for _ in range(2)]
    plain = O.AdamW(two_groups(models[0], lr=3e-3), lr=1e-2, weight_decay=0.1)
    fused = fuse_optimizer(O.AdamW(two_groups(models[1], lr=3e-3), lr=1e-2, weight_decay=0.1), compile=True)
    _run(models[0], plain, data, O.lr_scheduler.LambdaLR(plain, lambda s: 1.0 / (1 + s)))
    assert picked, "the unfused step picks foreach: the test's premise"
    picked.clear()
    _run(models[1], fused, data, O.lr_scheduler.LambdaLR(fused, lambda s: 1.0 / (1 + s)))
    report = fusion_report(fused)
    assert report.compiled and report.compile_disabled_reason is None and report.compile_graphs > 0, report
    assert not any(picked), "a compiled fused step traced torch's foreach implementation"
    assert all(group["foreach"] is None for group in fused.param_groups)
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)


def _foreach_cases():
    a = [torch.tensor([1.0, -2.0, float("nan")]), torch.tensor([[3.0, 0.5]])]
    b = [torch.tensor([0.5, 4.0, 1.0]), torch.tensor([[-1.0, 2.0]])]
    c = [torch.tensor([2.0, 3.0, 5.0]), torch.tensor([[1.5, 0.25]])]
    t = torch
    return {
        "add scalar": (t._foreach_add, (a, 0.3), {}),
        "add_ alpha": (t._foreach_add_, (a, b), {"alpha": -0.25}),
        "sub scalar list": (t._foreach_sub, (a, [0.5, 2.0]), {}),
        "mul_ scalar": (t._foreach_mul_, (a, 0.9), {}),
        "div scalar list": (t._foreach_div, (a, [3.0, -0.5]), {}),
        "pow scalar exponent": (t._foreach_pow, (c, 0.5), {}),
        "pow scalar base": (t._foreach_pow, (2.0, a), {}),
        "maximum scalar": (t._foreach_maximum, (a, 0.7), {}),
        "maximum_ scalar": (t._foreach_maximum_, (a, 0.0), {}),
        "minimum scalar list": (t._foreach_minimum, (a, [0.1, 1.0]), {}),
        "minimum_ scalar": (t._foreach_minimum_, (a, 0.2), {}),
        "clamp_min_ scalar": (t._foreach_clamp_min_, (a, -1.0), {}),
        "clamp_max scalar": (t._foreach_clamp_max, (a, 0.6), {}),
        "addcmul_ value": (t._foreach_addcmul_, (a, b, c), {"value": 0.1}),
        "addcdiv scalar list": (t._foreach_addcdiv, (a, b, c, [0.5, -2.0]), {}),
        "lerp_ scalar weight": (t._foreach_lerp_, (a, b, 0.25), {}),
        "maximum tensors (not rewritten)": (t._foreach_maximum, (a, b), {}),
    }


@pytest.mark.parametrize("case", list(_foreach_cases()))
def test_foreach_calls_with_python_scalars_run_element_by_element_with_the_same_results(case):
    """The element-by-element form of each ``_foreach_*`` call the compiled step rewrites gives what
    the call gives (in place or not, scalar or scalar-list operands, NaN included)."""
    def run(rewritten: bool):
        func, args, kwargs = _foreach_cases()[case]  # fresh tensors: in-place calls change them
        lists = [a for a in args if isinstance(a, list) and isinstance(a[0], torch.Tensor)]
        if rewritten:
            with _compile.ScalarsAsOperands():
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        return out, lists

    (expected, expected_lists), (got, got_lists) = run(False), run(True)
    assert (got is None) == (expected is None)
    if expected is not None and expected is expected_lists[0]:  # in place: torch returns the list it updated
        assert got is got_lists[0]
    for e, g in zip(expected or [], got or []):
        torch.testing.assert_close(g, e, equal_nan=True, rtol=0, atol=0)
    for e_list, g_list in zip(expected_lists, got_lists):
        for e, g in zip(e_list, g_list):
            torch.testing.assert_close(g, e, equal_nan=True, rtol=0, atol=0)


class RunningSumSGD(torch.optim.Optimizer):
    """A step that keeps a running sum in its param group, as schedule-free optimizers keep
    ``weight_sum``: a Python float read, updated and written back by every step, and used in the
    update. Compiled, torch 2.13 and 2.14.1 wrote the sum back wrong from the third call on (the
    parameters then moved by the wrong amount)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr, weight_sum=0.0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["weight_sum"] = group["weight_sum"] + 2.0
            share = 2.0 / group["weight_sum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["z"] = p.detach().clone()
                state["z"].sub_(p.grad, alpha=group["lr"])
                p.lerp_(state["z"], share)


def test_a_step_writing_python_floats_is_compiled_once_then_eager_with_the_unfused_numbers():
    data = batches(8)
    models = [TinyNet() for _ in range(2)]
    plain = RunningSumSGD(two_groups(models[0], lr=0.05))
    fused = fuse_optimizer(RunningSumSGD(two_groups(models[1], lr=0.05)), compile=True)
    _run(models[0], plain, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(models[1], fused, data)
    assert [g["weight_sum"] for g in fused.param_groups] == [g["weight_sum"] for g in plain.param_groups] == [16.0, 16.0]
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)
    report = fusion_report(fused)
    assert report.compile_graphs == 1 and not report.compiled, report
    assert "writes Python floats (param group 'weight_sum')" in report.compile_disabled_reason
    assert [w for w in caught if issubclass(w.category, CompileFallbackWarning)]


def test_floats_written_tells_a_float_written_by_the_step_from_one_left_alone():
    """Written: a new key, or a new float object there, even of the same value (schedule-free RAdam adds
    0.0 to its running sum while its rectification holds the rate at 0; missed, its compiled step went on
    to a graph whose compile did not end in 20 minutes)."""
    before = {("param group", 0, "lr"): 0.1, ("state", 7, "ratio"): float("nan"), ("param group", 0, "sum"): 0.0}
    assert _compile._floats_written(before, dict(before)) == []
    same_value = float("0." + "0")  # a new object equal to the old one
    assert _compile._floats_written(before, {**before, ("param group", 0, "sum"): same_value}) == [("param group", "sum")]
    assert _compile._floats_written(before, {**before, ("param group", 0, "weight_sum"): 2.0}) == [("param group", "weight_sum")]
    assert _compile._floats_written(before, {**before, ("state", 7, "ratio"): 0.5}) == [("state", "ratio")]


# =========================================================================== one graph from the start
def _first_graphs(make, steps=6):
    """Train ``make``'s optimizer fused and compiled next to its unfused self; return the fused one,
    its graph count after ``steps`` steps and the worst relative parameter difference."""
    data = batches(steps)
    models = [TinyNet() for _ in range(2)]
    plain = make(models[0].parameters())
    fused = fuse_optimizer(make(models[1].parameters()), compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # the compiled step must be what ran
        for opt, model in ((plain, models[0]), (fused, models[1])):
            step = fused.fuse_step if opt is fused else opt.step
            for x, y in data:
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                step()
    assert fusion_report(fused).compiled, fusion_report(fused)
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)
    assert [sorted(g) for g in fused.param_groups] == [sorted(g) for g in plain.param_groups]
    return fused, fusion_report(fused).compile_graphs


def _pytorch_optimizer_lamb(params):
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    return pytorch_optimizer.Lamb(params)


_COUNTED = {
    "BertAdam": lambda ps: BertAdam(ps, lr=1e-3),  # an int step count in every state entry
    "pytorch-optimizer Lamb": _pytorch_optimizer_lamb,  # group["step"] += 1, foreach calls over runs
}


@pytest.mark.skipif(_compile.compile_unavailable_reason("segmented") is not None,
                    reason=str(_compile.compile_unavailable_reason("segmented")))
@pytest.mark.parametrize("name", sorted(_COUNTED))
def test_python_int_step_counts_are_symbols_in_the_first_graph(name):
    """Python int step counts (in the state entries or the param group) are symbols in the first
    graph: one compile, where a first graph with the count as a constant and a recompile once it
    changed cost BertAdam and LAMB a tenth of their first three steps on BERT-base (CPU). The
    compiled call leaves no key of Dynamo's (``capturable``) in the param groups, which made
    another recompile and reached the optimizer's ``state_dict``; and each step's lists over runs
    start empty (``SegmentedMode.start_step``: left filled, the next call's guard failed)."""
    _, graphs = _first_graphs(_COUNTED[name])
    assert graphs == 1, graphs


@pytest.mark.skipif(_compile.compile_unavailable_reason("segmented") is not None,
                    reason=str(_compile.compile_unavailable_reason("segmented")))
@pytest.mark.parametrize("broken", ["counts constant", "Dynamo's key kept", "stacks kept"])
def test_first_graph_must_take_the_counts_symbolic_and_start_each_step_clean(monkeypatch, broken):
    """Deliberately broken: each of the three things the single compile needs, undone in turn."""
    import contextlib

    from bagua_integrations import _segmented

    if broken == "counts constant":
        monkeypatch.setattr(_compile, "ints_symbolic_from_the_first_graph", lambda places: contextlib.nullcontext())
    elif broken == "Dynamo's key kept":
        monkeypatch.setattr(_compile, "_groups_keep_capturable", lambda optimizer: contextlib.nullcontext())
    else:
        monkeypatch.setattr(_segmented.SegmentedMode, "start_step", lambda self: None)
    make = _COUNTED["BertAdam" if broken == "counts constant" else "pytorch-optimizer Lamb"]
    with pytest.raises(AssertionError):
        _, graphs = _first_graphs(make)
        assert graphs == 1, graphs


# ------------------------------------------------------------------------------ early stores, block loops
class _BlockNet(torch.nn.Module):
    """Parameters whose runs cut into blocks of 256 (matrices) and 64 (vectors) elements."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 128)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _counting_stores_early(monkeypatch):
    from bagua_integrations import _early_stores

    moved = []

    def counting(graph, device_type="cpu"):
        moved.append(_early_stores.stores_early(graph, device_type))
        return moved[-1]

    monkeypatch.setattr(_compile, "stores_early", counting)
    return moved


@pytest.mark.skipif(_compile.compile_unavailable_reason("segmented") is not None,
                    reason=str(_compile.compile_unavailable_reason("segmented")))
def test_an_early_store_comes_after_every_read_of_the_old_value(monkeypatch):
    """``stores_early`` moves an input's write-back to where its value is computed, but never before a
    read of the input's old value: here the old ``m`` is read with the new one reversed (so after it
    is computed, and not element by element with its store), and the new one is read again after
    the write-back (from the written input)."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from bagua_integrations._early_stores import stores_early

    moved = []

    class EarlyStores(CustomGraphPass):
        def __call__(self, graph):
            moved.append(stores_early(graph))

        def uuid(self):
            return "bagua-test-early-stores"

    def step(m, g):
        new = m * 0.9 + g
        old_norm = (m * new.flip(0)).sum()
        m.copy_(new)
        return (new * 2).sum(), old_norm

    def backend(gm, example_inputs):
        passes = _compile.inductor_with_post_grad_pass(_compile.inductor_backend(), EarlyStores(),
                                                       _compile.block_loops_pass())
        return passes(gm, example_inputs)

    gen = torch.Generator().manual_seed(0)
    m0, g = torch.randn(64 * 256, generator=gen), torch.randn(64 * 256, generator=gen)
    m = m0.clone()
    torch._dynamo.reset()
    with config.patch({"fx_graph_cache": False}):
        total, old_norm = torch.compile(step, backend=backend, fullgraph=True)(m, g)
    torch._dynamo.reset()
    assert moved == [1], moved
    assert torch.equal(m, m0 * 0.9 + g)
    expected = (m0 * (m0 * 0.9 + g).flip(0)).sum()
    assert torch.allclose(old_norm, expected, rtol=1e-5), (old_norm, expected)
    assert torch.allclose(total, ((m0 * 0.9 + g) * 2).sum(), rtol=1e-5)


@pytest.mark.skipif(_compile.compile_unavailable_reason("segmented") is not None,
                    reason=str(_compile.compile_unavailable_reason("segmented")))
def test_lamb_stores_its_moments_where_it_computes_them_with_the_same_bits(monkeypatch):
    """LAMB's compiled fused step with its moments stored early (read back by its update, not
    recomputed) and its loops in blocks: the same bits as without, and the unfused numbers."""
    from torch._inductor import config

    from bagua_integrations.optim import Lamb

    moved = _counting_stores_early(monkeypatch)
    data = [(x.repeat(1, 11)[:, :64], torch.randn(16, 128, generator=torch.Generator().manual_seed(i)))
            for i, (x, _) in enumerate(batches(4))]
    models = [_BlockNet() for _ in range(3)]
    opts = [Lamb(models[0].parameters(), lr=1e-2, weight_decay=0.01)]
    with config.patch({"fx_graph_cache": False}):
        for flag, model in ((False, models[1]), (True, models[2])):
            monkeypatch.setattr(_compile, "BLOCK_LOOPS", flag)
            opts.append(fuse_optimizer(Lamb(model.parameters(), lr=1e-2, weight_decay=0.01), compile=True))
            with warnings.catch_warnings():
                warnings.simplefilter("error", CompileFallbackWarning)
                _run(model, opts[-1], data)
    _run(models[0], opts[0], data)
    report = fusion_report(opts[2])
    assert report.compiled and report.group_paths == ["segmented"], report
    if _compile.block_loops_pass() is None:  # (torch < 2.13: no scheduler pass, so no early stores either)
        assert moved == [], moved
    else:
        assert moved and max(moved) >= 4, moved  # m and v of the matrices' run and of the vectors' run
    for a, b in zip(models[1].parameters(), models[2].parameters()):
        assert torch.equal(a, b)
    assert_same_params(models[0], models[2], rtol=2e-5, atol=1e-6)


@pytest.mark.skipif(_compile.compile_unavailable_reason("segmented") is not None,
                    reason=str(_compile.compile_unavailable_reason("segmented")))
@pytest.mark.parametrize("name, kwargs", [
    ("LARS", dict(momentum=0.0)), ("LARS", dict(momentum=0.9)), ("LARS", dict(momentum=0.9, nesterov=True)),
    ("AdaNorm", {}), ("FAdam", {}), ("Lamb", {}),
], ids=["LARS", "LARS-momentum", "LARS-nesterov", "AdaNorm", "FAdam", "Lamb"])
def test_write_backs_stored_early_in_block_loops_are_the_unfused_step(monkeypatch, name, kwargs):
    """pytorch-optimizer's optimizers whose compiled segmented steps store write-backs early, in
    loops over the blocks that their norms reduce: compiled == unfused.

    The block loops pass gives such a loop the reduction's shape by recomputing the node's body,
    and torch's ``recompute_size_and_body`` then names the node's reads afresh: a read of an input
    stored earlier in the step (``stores_early``) became a read of the input itself, so the
    scheduler put the reader in a loop before the store. FAdam's parameter update then used its
    old momentum (3.5e-2 off after 4 steps), LARS with two weight matrices its old gradient (1.8e-3,
    momentum 0), silently; each fails with the pass's renaming removed (checked). Before the fix,
    only this package's own optimizers stored early (pytorch-optimizer's Lamb 1.2x slower)."""
    po = pytest.importorskip("pytorch_optimizer")
    from torch._inductor import config

    moved = _counting_stores_early(monkeypatch)
    data = [(x.repeat(1, 11)[:, :64], torch.randn(16, 128, generator=torch.Generator().manual_seed(i)))
            for i, (x, _) in enumerate(batches(4))]
    models = [_BlockNet() for _ in range(2)]
    kwargs = dict(lr=1e-2, weight_decay=0.01, **kwargs)
    plain = getattr(po, name)(models[0].parameters(), **kwargs)
    compiled = fuse_optimizer(getattr(po, name)(models[1].parameters(), **kwargs), compile=True)
    with warnings.catch_warnings(), config.patch({"fx_graph_cache": False}):  # (the pass runs)
        warnings.simplefilter("error", CompileFallbackWarning)
        for model, opt in zip(models, (plain, compiled)):
            _run(model, opt, data)
    report = fusion_report(compiled)
    assert report.compiled and report.group_paths == ["segmented"], report
    if _compile.block_loops_pass() is not None:  # (torch < 2.13: neither block loops nor early stores)
        assert moved and max(moved) >= 1, moved  # the step did store early
    assert_same_params(models[0], models[1], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("compile", [False, True], ids=["eager-fused", "compiled-fused"])
@pytest.mark.parametrize("how", ["train-step", "opt-step"])
def test_torch_compile_of_a_training_step_runs_the_fused_step_as_it_is(compile, how):
    """``torch.compile`` of a whole training step (or of ``opt.step``), as torch documents it for plain
    optimizers, runs the fused step between graphs: the same numbers as the unfused eager loop, hooks
    once per step, and the fused step still compiles its own update. (Tracing into it failed with
    bare torch errors: an in-place write on a leaf, a fake-tensor shape mismatch.)"""
    if compile and _compile.compile_unavailable_reason() is not None:
        pytest.skip("this torch does not compile fused steps")
    data = batches(4)
    reference = TinyNet()
    plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for x, y in data:
        plain.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        plain.step()

    model = TinyNet()
    opt = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), replace_step=True, compile=compile)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))

    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    compiled_step = torch.compile(opt.step)
    step = torch.compile(train_step)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Dynamo's graph-break notes)
        for x, y in data:
            if how == "train-step":
                step(x, y)
            else:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                compiled_step()
    assert_same_params(model, reference, rtol=2e-5 if compile else 1e-6)
    report = fusion_report(opt)
    assert report.last_step_fused and report.compiled == compile, report
    assert len(calls) == len(data)
