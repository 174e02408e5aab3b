"""_scalar_prologue: expensive scalar expressions of the step count leave the compiled kernels.

Without it, Inductor evaluates ``1 - beta ** step`` (a symbolic float) for every vector of a
flat buffer; LAMB's compiled step took 3x longer. These tests pin what the pass may change
(nothing in the results) and what it must do (hoist those scalars, keep every in-place update).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from bagua_integrations._compile import compiler_available
from bagua_integrations.errors import CompileFallbackWarning
from bagua_integrations._scalar_prologue import _hoistable, with_scalar_prologue
from bagua_integrations._torch_compat import inductor_backend

pytestmark = pytest.mark.skipif(not compiler_available(), reason="needs a working torch.compile (C++ compiler)")


class Spy:
    """A backend: the prologue pass over Inductor, recording what reached Inductor."""

    def __init__(self):
        self.graphs = []

    def inductor(self, gm, example_inputs, **kwargs):
        self.graphs.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return inductor_backend()(gm, example_inputs, **kwargs)

    def __call__(self, gm, example_inputs):
        return with_scalar_prologue(self.inductor, gm, example_inputs)

    def hoisted(self):
        return [[name for name in names if name.startswith("bagua_hoisted_scalar")] for names in self.graphs]


def adam_like(param, exp_avg, step, lr, beta=0.9):
    """In-place updates plus a bias correction of a Python int step (what Lamb/BertAdam compute)."""
    exp_avg.mul_(beta).add_(param * (1 - beta))
    param.sub_(exp_avg / (1 - beta ** step) * lr)
    param.mul_(1 - math.sqrt(step) * 1e-3)  # another transcendental of the step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hoisted_bias_correction_gives_the_eager_numbers(dtype):
    spy = Spy()
    compiled = torch.compile(adam_like, backend=spy, fullgraph=True)
    torch.manual_seed(0)
    p, m = torch.randn(4099, dtype=dtype), torch.zeros(4099, dtype=dtype)
    p_ref, m_ref = p.clone(), m.clone()
    for step in range(1, 8):
        lr = 0.1
        compiled(p, m, step, lr)
        adam_like(p_ref, m_ref, step, lr)
        # every in-place update happened (a dead-code pass once dropped them) with eager's values
        torch.testing.assert_close(m, m_ref, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
        torch.testing.assert_close(p, p_ref, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    assert len(spy.graphs) <= 2, "recompiled for every step: the step count did not stay symbolic"
    assert spy.hoisted()[-1], f"the symbolic graph hoisted nothing: {spy.graphs[-1]}"


def test_only_scalars_of_inputs_with_transcendental_math_are_hoisted():
    captured = {}

    def backend(gm, example_inputs):
        captured["hoisted"] = [n.format_node() for n in _hoistable(gm)[0]]
        return gm.forward

    def f(t, step, lr):
        cheap = t * (lr * 2 + step)  # arithmetic only: stays in the kernel
        data = t / t.norm()  # depends on tensor data: not a prologue value
        return cheap + data / (1 - 0.999 ** step)  # pow of the step: hoisted

    f_compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    f_compiled(torch.ones(5), 3, 0.5)
    assert len(captured["hoisted"]) == 1 and "sub" in captured["hoisted"][0], captured


def test_a_graph_without_such_scalars_is_compiled_as_it_was():
    spy = Spy()
    compiled = torch.compile(lambda t, lr: t.mul_(1 - lr), backend=spy, fullgraph=True)
    t = torch.ones(10)
    compiled(t, 0.25)
    compiled(t, 0.5)
    assert torch.equal(t, torch.full((10,), 0.375))
    assert all(not names for names in spy.hoisted())


def warmup_linear_step(param, update, state, warmup=0.3, t_total=12):
    """BertAdam's scheduled learning rate: a float max() of the symbolic step count."""
    progress = state["step"] / t_total
    scale = progress / warmup if progress < warmup else max(0.0, (1.0 - progress) / max(1e-12, 1.0 - warmup))
    param.add_(update * -(1e-3 * scale))
    state["step"] += 1


def test_a_float_max_of_the_step_gives_the_eager_numbers():
    """Torch < 2.13 evaluates a float max() inlined into a C++ kernel in int64 (0 after the warmup
    here); the prologue computes it in Python there (cpu_kernels_truncate_float_min_max)."""
    spy = Spy()
    compiled = torch.compile(warmup_linear_step, backend=spy, fullgraph=True)
    p, ref, update = torch.zeros(64), torch.zeros(64), torch.linspace(0.5, 1.5, 64)
    state, ref_state = {"step": 0}, {"step": 0}
    for _ in range(12):
        compiled(p, update, state)
        warmup_linear_step(ref, update, ref_state)
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-9)
    assert float(ref.abs().max()) > 0.005  # the decay branch moved it



class WarmupSGD(torch.optim.Optimizer):
    """A warm-up of a Python int step count times the group's (scheduled) learning rate."""

    def __init__(self, params, lr=1e-2, warmup=3, kind="min"):
        super().__init__(params, dict(lr=lr, warmup=warmup, kind=kind))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                ramp = state["step"] / group["warmup"]
                if group["kind"] == "of the rate":  # (the min reads the rate: no prologue can compute it)
                    p.add_(p.grad, alpha=-min(group["lr"] * 100, ramp) * 0.01)
                    continue
                scale = min(1.0, ramp) if group["kind"] == "min" else max(0.5, 2.0 - ramp)
                p.add_(p.grad, alpha=-group["lr"] * scale)


def _trained_under_lambda_lr(model, opt, fused: bool, steps: int):
    """``steps`` steps of ``opt`` (fused and compiled: ``fuse_step``) on ``model`` (7 inputs) under
    ``LambdaLR``; ``(model, opt)``."""
    from bagua_integrations import fuse_optimizer

    if fused:
        fuse_optimizer(opt, compile=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 7, generator=gen)
        out = model(x)
        opt.zero_grad()
        torch.nn.functional.mse_loss(out, torch.randn(out.shape, generator=gen)).backward()
        (opt.fuse_step if fused else opt.step)()
        schedule.step()
    return model, opt


@pytest.mark.parametrize("kind", ["min", "max", "of the rate"])
def test_a_float_min_max_of_the_step_times_a_scheduled_rate_gives_the_eager_numbers(kind):
    """``lr * min(1.0, step / warmup)`` under LambdaLR. Dynamo makes the rate an input read with
    ``.item()``, which the prologue cannot replay, so the min() reached the kernel through that
    product, and torch 2.6 - 2.12 evaluated it in int64 there: compiled, 6e-2 from unfused after
    the warm-up on torch 2.11, silently. Now it is hoisted and read back as a Python float; a
    min() of the rate itself (0.28 off), which no prologue can compute, sends the step to eager."""
    from bagua_integrations._torch_compat import floats_need_a_direct_use

    def run(fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(7, 5)
        return _trained_under_lambda_lr(model, WarmupSGD(model.parameters(), kind=kind), fused, steps=6)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (plain, _), (fused, opt) = run(False), run(True)
    for a, b in zip(plain.parameters(), fused.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    if floats_need_a_direct_use():  # (torch 2.6 - 2.12 keep the rate symbolic: compiled, 2 graphs)
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
        if kind == "of the rate":
            assert any("FloatMinMaxInKernel" in message for message in fallbacks), fallbacks
        else:
            assert opt._bagua_fusion.stats.last_step_compiled, fallbacks


def test_bert_adam_warmup_linear_under_a_scheduler_gives_the_eager_numbers():
    """BertAdam's own ``max(0, ...)`` decay times a rate an outside scheduler changes: compiled on
    torch 2.11, 1.1 relative from unfused after the warm-up before the fix above."""
    from bagua_integrations.optim import BertAdam

    def run(fused):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        opt = BertAdam(model.parameters(), lr=1e-2, warmup=0.3, t_total=10, schedule="warmup_linear")
        return _trained_under_lambda_lr(model, opt, fused, steps=8)[0]

    for a, b in zip(run(False).parameters(), run(True).parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------- 0-dim tensors of the step
# torch.optim keeps each step count as a 0-dim tensor; compiled, AdamW computes its bias corrections
# from it (``1 - beta ** step_t``) and Inductor evaluated that per vector: BERT-base AdamW fused took
# 95 ms a step instead of 66 (one Adam pass of memory traffic) on a 2-core CPU.
BIG = 1 << 18


def adam_tensor_step(param, exp_avg, exp_avg_sq, grad, step_t):
    """What torch.optim.AdamW's single-tensor step does under torch.compile, written out."""
    step_t += 1
    exp_avg.lerp_(grad, 0.1)
    exp_avg_sq.mul_(0.999).addcmul_(grad, grad, value=0.001)
    bias_correction1 = 1 - torch.pow(0.9, step_t)
    bias_correction2 = 1 - torch.pow(0.999, step_t)
    step_size_neg = -(1e-3 / bias_correction1)
    denom = exp_avg_sq.sqrt() / (bias_correction2.sqrt() * step_size_neg) + 1e-8 / step_size_neg
    param.addcdiv_(exp_avg, denom)


def _tensors(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(2)] + [torch.rand(n, generator=gen),
                                                                torch.randn(n, generator=gen)]


@pytest.mark.parametrize("n", [BIG, 1000])
def test_step_tensor_math_is_hoisted_from_every_kernel(n):
    torch._dynamo.reset()  # static sizes: the other size's graph would make them dynamic
    spy = Spy()
    compiled = torch.compile(adam_tensor_step, backend=spy, fullgraph=True)
    p, m, v, g = _tensors(n)
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    step_t, step_ref = torch.tensor(0.0), torch.tensor(0.0)
    for _ in range(6):
        compiled(p, m, v, g, step_t)
        adam_tensor_step(p_ref, m_ref, v_ref, g, step_ref)
        assert step_t.item() == step_ref.item()  # advanced once a step: the prologue does not write it
        torch.testing.assert_close(p, p_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m, m_ref, rtol=1e-6, atol=1e-6)
    assert len(spy.graphs) == 1
    assert spy.hoisted()[0], spy.graphs


def _written_between_reads(kind):
    def step(param, step_t):
        first = 1 - torch.pow(0.9, step_t)
        param.mul_(first)
        if kind == "unknown write":
            step_t.copy_(step_t * 2 + 1)
        elif kind == "write through a view":
            step_t.view(1).add_(3)
        elif kind == "a result of an in-place update, updated again":
            alias = step_t.add_(1)
            step_t.add_(1)
            step_t = alias
        param.div_(1 - torch.pow(0.5, step_t))  # must read the value written above
    return step


@pytest.mark.parametrize("kind", ["unknown write", "write through a view",
                                  "a result of an in-place update, updated again"])
def test_a_step_tensor_written_between_two_reads_is_read_as_written(kind):
    """The prologue runs before the graph: a 0-dim tensor the graph writes other than by a known
    in-place update (or through an alias) must not be read there from its value before the call."""
    _reads_after_writes_match_eager(kind)


def _reads_after_writes_match_eager(kind):
    fn = _written_between_reads(kind)
    compiled = torch.compile(fn, backend=Spy(), fullgraph=True)
    p = torch.rand(BIG) + 1
    p_ref = p.clone()
    step_t, step_ref = torch.tensor(1.0), torch.tensor(1.0)
    for _ in range(3):
        compiled(p, step_t)
        fn(p_ref, step_ref)
        assert step_t.item() == step_ref.item() and step_t.dtype == torch.float32
        # (the prologue computes in double precision, this float32 reference in float32; a value read
        # before its write is off by a factor of 2 or more)
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["AdamW", "NAdam", "RAdam"])
def test_fused_torch_optimizers_compiled_on_a_flat_buffer_hoist_their_bias_corrections(monkeypatch, name):
    """Under a learning-rate schedule the compiled step's second graph reads the rate from a 0-dim
    tensor (``lr_t.item()``): the bias corrections it starts from are hoisted there too, without
    Dynamo specializing the rate (a recompile per step)."""
    from bagua_integrations import _scalar_prologue, fuse_optimizer, fusion_report
    from bagua_integrations._compile import compile_unavailable_reason

    if compile_unavailable_reason("elementwise") is not None:  # (torch 2.5: a recompile per new rate)
        pytest.skip(compile_unavailable_reason("elementwise"))
    chosen = []  # per graph
    original = _scalar_prologue._hoistable
    monkeypatch.setattr(_scalar_prologue, "_hoistable", lambda gm: (lambda r: (chosen.append(r[0]), r)[1])(original(gm)))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 1000)), torch.nn.Parameter(torch.randn(1000))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    cls = getattr(torch.optim, name)
    opts = [cls(ref, lr=1e-2), cls(params, lr=1e-2)]
    schedules = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)) for opt in opts]
    fuse_optimizer(opts[1], compile=True)
    for step in range(5):
        for ps in (ref, params):
            for i, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.01 * (step + 1)) * (i + 1)
        opts[0].step()
        opts[1].fuse_step()
        for schedule in schedules:
            schedule.step()
    report = fusion_report(opts[1])
    assert report.compiled and report.compile_graphs == 2, report
    assert len(chosen) == 2 and all(chosen), f"a graph kept its bias corrections in the kernel: {chosen}"
    for a, b in zip(ref, params):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def _every_device(node) -> bool:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float32 \
        and not value.requires_grad


def _radam_max_relative_difference(steps=12):
    from bagua_integrations import fuse_optimizer, fusion_report

    gen = torch.Generator().manual_seed(0)
    plain_params = [torch.nn.Parameter(torch.randn(4096, generator=gen)) for _ in range(2)]
    fused_params = [torch.nn.Parameter(p.detach().clone()) for p in plain_params]
    plain = torch.optim.RAdam(plain_params, lr=1e-2)
    fused = fuse_optimizer(torch.optim.RAdam(fused_params, lr=1e-2), compile=True)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        grads = [torch.randn(4096, generator=gen) * 0.1 for _ in plain_params]
        for params, take_step in ((plain_params, plain.step), (fused_params, fused.fuse_step)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            take_step()
    assert fusion_report(fused).compiled
    return max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(plain_params, fused_params))


def test_gpu_step_count_math_runs_in_double_precision(monkeypatch):
    """On a GPU, Dynamo moves torch.optim's step counts to the device, where the prologue (CPU
    kernels only) does not replay their math: RAdam's rectification was float32 there, its
    parameters 1.6e-6 of their largest value off unfused after 12 steps (H200). The graph now does
    that math in float64. Checked here on CPU tensors, with the pass taking CPU values for GPU
    ones and the prologue off: without the pass the same run is 2.4e-6 off."""
    from bagua_integrations import _scalar_prologue
    from bagua_integrations._compile import compile_unavailable_reason

    if compile_unavailable_reason("elementwise") is not None:  # (torch < 2.6: no compiled fused steps)
        pytest.skip(compile_unavailable_reason("elementwise"))
    monkeypatch.setattr(_scalar_prologue, "_hoistable", lambda gm: ([], None))
    assert _radam_max_relative_difference() > 5e-7  # (the check can fail: float32 step math)
    monkeypatch.setattr(_scalar_prologue, "_zero_dim_float32_on_device", _every_device)
    assert _radam_max_relative_difference() < 2e-7


@pytest.mark.parametrize("kind", ["unknown write", "write through a view",
                                  "a result of an in-place update, updated again"])
def test_gpu_step_count_math_in_double_reads_what_was_written(monkeypatch, kind):
    """The float64 reads of a step count are made where the graph read it: after its writes."""
    from bagua_integrations import _scalar_prologue

    monkeypatch.setattr(_scalar_prologue, "_hoistable", lambda gm: ([], None))
    monkeypatch.setattr(_scalar_prologue, "_zero_dim_float32_on_device", _every_device)
    _reads_after_writes_match_eager(kind)
