"""Segmented fusion: per-parameter reductions (clipping, norms, trust ratios) fused exactly.

An optimizer whose step is elementwise except for reductions over a whole parameter --
``clip_grad_norm_(p, max_norm)``, ``p.norm()``, ``g.pow(2).sum()``, trust ratios guarded with
``torch.where``, a 0-dim per-parameter state -- is fused over the flat buffers with each
reduction computed per parameter ("segmented"), and must give the unfused numbers.

Python branches on tensor *values* (``if norm > max_norm:``) and shape-dependent math
(Adafactor's factored moments) cannot be fused that way: they are refused by name, or keep
their exact per-tensor step under ``on_unsupported="fallback"``. Optimizer-level state and
nested state are either exact or refused by name, never silently different and never a bare
``RuntimeError``/``AttributeError``/``KeyError``.

``fusion_report(opt).group_paths`` says, per param group, which path it takes:
``"elementwise"`` (plain flat fusion), ``"segmented"`` or ``"per-tensor"`` (refused groups).
"""

from __future__ import annotations

import functools
import io
import warnings

import pytest
import torch

from _fused_utils import PerParameterStep, TinyNet, assert_same_params, assert_same_state, batches, train, two_groups
from bagua_integrations import (
    CompileFallbackWarning,
    FusionError,
    FusionFallbackWarning,
    NotElementwiseError,
    fuse_optimizer,
    fusion_report,
    is_fused_optimizer,
)
from bagua_integrations import _compile
from bagua_integrations.optim import BertAdam, Lamb  # the package's LAMB: fused == its own unfused step

# Targets scaled up so that BertAdam's default per-parameter clip (max_grad_norm=1.0) is live:
# TinyNet's weight gradients then have norms ~1.1-1.9 (clipped), its biases ~0.3-0.8 (not).
TARGET_SCALE = 4.0


def loud_batches(steps: int):
    return [(x, y * TARGET_SCALE) for x, y in batches(steps)]


# =========================================================================== reference optimizers
class Lars(torch.optim.Optimizer):
    """SGD momentum with the LARS trust ratio eta * ||p|| / (||g|| + wd * ||p||).

    1-D parameters (biases) get neither the trust ratio nor weight decay: a branch on the
    parameter's *shape*, which a segmented step must keep exact."""

    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=1e-4, eta=0.001):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd, eta = group["weight_decay"], group["eta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.dim() == 1:
                    d = g
                else:
                    w_norm = p.norm()
                    g_norm = g.norm()
                    trust = torch.where(
                        (w_norm > 0) & (g_norm > 0), eta * w_norm / (g_norm + wd * w_norm), torch.ones_like(w_norm)
                    )
                    d = (g + wd * p) * trust
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(d)
                p.add_(buf, alpha=-group["lr"])
        return loss


class NovoGrad(torch.optim.Optimizer):
    """NovoGrad: a per-parameter *scalar* second moment (a 0-dim tensor) of ||g||^2."""

    def __init__(self, params, lr=1e-2, betas=(0.95, 0.98), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros([], dtype=p.dtype, device=p.device)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                v.mul_(b2).add_((1 - b2) * g.pow(2).sum())
                g = g / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                m.mul_(b1).add_(g)
                p.add_(m, alpha=-group["lr"])
        return loss


class BranchyClip(torch.optim.Optimizer):
    """SGD momentum with a per-parameter clip written as a Python branch on a tensor value."""

    def __init__(self, params, lr=0.05, momentum=0.9, max_norm=0.3):
        super().__init__(params, dict(lr=lr, momentum=momentum, max_norm=max_norm))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.norm() > group["max_norm"]:  # bool(tensor): a value branch
                    g.mul_(group["max_norm"] / g.norm())
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(g)
                p.add_(buf, alpha=-group["lr"])


class FactoredLike(torch.optim.Optimizer):
    """Adafactor-like: N-D parameters keep factored row/column second moments (means over the
    last two dims, shape-dependent), 1-D parameters an unfactored one."""

    def __init__(self, params, lr=1e-2, beta2=0.9, eps=1e-30, eps_update=1e-8):
        super().__init__(params, dict(lr=lr, beta2=beta2, eps=eps, eps_update=eps_update))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b2 = group["beta2"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                factored = p.dim() >= 2
                if not state:
                    state["step"] = 0
                    if factored:
                        state["row"] = torch.zeros_like(g.mean(dim=-1, keepdim=True))
                        state["col"] = torch.zeros_like(g.mean(dim=-2, keepdim=True))
                    else:
                        state["v"] = torch.zeros_like(p)
                state["step"] += 1
                sq = g.pow(2) + group["eps"]
                if factored:
                    row, col = state["row"], state["col"]
                    row.mul_(b2).add_(sq.mean(dim=-1, keepdim=True), alpha=1 - b2)
                    col.mul_(b2).add_(sq.mean(dim=-2, keepdim=True), alpha=1 - b2)
                    v = row * col / row.mean(dim=-2, keepdim=True)
                else:
                    v = state["v"]
                    v.mul_(b2).add_(sq, alpha=1 - b2)
                p.sub_(group["lr"] * g / (v.sqrt() + group["eps_update"]))


class GlobalCounter(torch.optim.Optimizer):
    """SGD momentum whose lr decays as 1/k, k an optimizer-level counter in ``self.state``
    (keyed by a string, not by a parameter)."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        self.state["k"] = self.state.get("k", 0) + 1
        k = self.state["k"]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"] / k)


class DictState(torch.optim.Optimizer):
    """SGD momentum whose per-parameter state nests its buffer in a dict."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = {"m": torch.zeros_like(p)}
                m = state["buf"]["m"]
                m.mul_(group["momentum"]).add_(p.grad)
                p.add_(m, alpha=-group["lr"])


# name -> (class, kwargs of the first group, overrides of the second group)
SEGMENTED = {
    "BertAdam-default": (BertAdam, dict(lr=1e-2), dict(lr=3e-3, weight_decay=0.0)),
    "BertAdam-schedule": (BertAdam, dict(lr=1e-2, warmup=0.1, t_total=100), dict(lr=3e-3, weight_decay=0.0)),
    "Lamb": (Lamb, dict(lr=1e-2, weight_decay=0.01), dict(lr=3e-3, weight_decay=0.0)),
    "Lars": (Lars, dict(lr=0.1, momentum=0.9, weight_decay=1e-3, eta=0.1), dict(lr=0.05, eta=0.05)),
    "NovoGrad": (NovoGrad, dict(lr=1e-2, weight_decay=1e-3), dict(lr=3e-3, betas=(0.9, 0.99))),
}
NOT_SEGMENTABLE = {
    "BranchyClip": (BranchyClip, dict(lr=0.05, max_norm=0.3), dict(lr=0.02, max_norm=0.5)),
    "FactoredLike": (FactoredLike, dict(lr=1e-2), dict(lr=3e-3)),
}
EXACT_OR_REFUSED = {
    "GlobalCounter": (GlobalCounter, dict(lr=0.1), dict(lr=0.05)),
    "DictState": (DictState, dict(lr=0.1), dict(lr=0.05)),
}
ALL = {**SEGMENTED, **NOT_SEGMENTABLE, **EXACT_OR_REFUSED}


def build(name, model):
    cls, kwargs, second = ALL[name]
    return cls(two_groups(model, **second), **kwargs)


def fused_pair(name, **fuse_kwargs):
    """(plain model, plain optimizer, fused model, fused optimizer), identical to start with."""
    a, b = TinyNet(), TinyNet()
    fuse_kwargs.setdefault("compile", False)
    return a, build(name, a), b, fuse_optimizer(build(name, b), **fuse_kwargs)


def saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def assert_same_tree(a, b, rtol=1e-6, atol=1e-7, where="state"):
    """Equal nested dicts/lists of tensors and plain values (any keys, any nesting)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (where, type(a), type(b))
        torch.testing.assert_close(b.float(), a.float(), rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), getattr(b, "keys", lambda: b)())
        for key in a:
            assert_same_tree(a[key], b[key], rtol, atol, f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, rtol, atol, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


# =========================================================================== the references themselves
def _naive_flat_step_differs(name, steps=3) -> bool:
    """Does stepping the optimizer on one concatenated tensor differ from stepping it per tensor?
    (True for every optimizer here but the two exact-or-refused ones: fusing them flat without
    segmentation would change their math, so the tests below are not vacuous.)"""
    cls, kwargs, _ = ALL[name]
    model = TinyNet()
    init = [p.detach().clone() for p in (model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias)]
    per_tensor = [torch.nn.Parameter(t.clone()) for t in init]
    flat = torch.nn.Parameter(torch.cat([t.reshape(-1) for t in init]))
    opt_a, opt_b = cls(per_tensor, **kwargs), cls([flat], **kwargs)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        grads = [torch.randn(t.shape, generator=gen) * s for t, s in zip(init, (2.0, 0.1, 1.5, 0.3))]
        for p, g in zip(per_tensor, grads):
            p.grad = g.clone()
        flat.grad = torch.cat([g.reshape(-1) for g in grads])
        opt_a.step()
        opt_b.step()
    joined = torch.cat([p.detach().reshape(-1) for p in per_tensor])
    return not torch.allclose(joined, flat.detach(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(ALL))
def test_reference_optimizer_trains_and_is_deterministic(name):
    """Sanity of the test's own optimizers: they move every parameter with a gradient, leave the
    one without alone, stay finite, and two identical runs agree bit for bit."""
    runs = []
    for _ in range(2):
        model = TinyNet()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = build(name, model)
        losses = train(model, opt, loud_batches(12))
        for n, p in model.named_parameters():
            assert torch.isfinite(p).all(), n
            if n.startswith("unused"):
                assert torch.equal(p, before[n]), n
                assert p not in opt.state or not opt.state[p], n
            else:
                assert not torch.equal(p, before[n]), f"{name} did not move {n}"
        runs.append((model, losses))
    assert runs[0][1] == runs[1][1]
    assert_same_params(runs[0][0], runs[1][0], rtol=0, atol=0)
    if name in SEGMENTED or name in NOT_SEGMENTABLE:
        assert _naive_flat_step_differs(name), f"{name} would fuse flat exactly: the test would prove nothing"
    else:
        assert not _naive_flat_step_differs(name)


def test_bert_adam_default_clip_is_live_on_this_data():
    """The default max_grad_norm=1.0 clips some parameters here (and not others)."""
    results = []
    for max_grad_norm in (1.0, -1.0):
        model = TinyNet()
        train(model, BertAdam(two_groups(model), lr=1e-2, max_grad_norm=max_grad_norm), loud_batches(4))
        results.append(model)
    with pytest.raises(AssertionError):
        assert_same_params(*results)
    model = TinyNet()
    x, y = loud_batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    norms = [float(p.grad.norm()) for p in model.parameters() if p.grad is not None]
    assert min(norms) < 1.0 < max(norms), norms


def test_lamb_reference_matches_a_textbook_formula():
    """One LAMB step on one tensor, written out by hand."""
    p0 = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    g = torch.tensor([[0.1, 0.2], [-0.3, 0.05]])
    p = torch.nn.Parameter(p0.clone())
    p.grad = g.clone()
    Lamb([p], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01).step()
    m_hat, v_hat = g, g * g  # bias correction undoes (1 - beta) on the first step
    update = m_hat / (v_hat.sqrt() + 1e-6) + 0.01 * p0
    expected = p0 - 0.1 * (p0.norm() / update.norm()) * update
    torch.testing.assert_close(p.detach(), expected)
    zero = torch.nn.Parameter(torch.zeros(3))  # ||p|| = 0: trust ratio 1
    zero.grad = torch.ones(3)
    Lamb([zero], lr=0.1).step()
    torch.testing.assert_close(zero.detach(), torch.full((3,), -0.1), rtol=1e-5, atol=1e-6)


# =========================================================================== segmented == unfused
@pytest.mark.parametrize("name", sorted(SEGMENTED))
def test_segmented_fusion_matches_unfused(name):
    a, plain, b, fused = fused_pair(name)
    untouched = b.unused.weight.detach().clone(), b.unused.bias.detach().clone()
    data = loud_batches(12)
    losses_a = train(a, plain, data)
    losses_b = train(b, fused, data, step=fused.fuse_step)
    assert losses_a == pytest.approx(losses_b, rel=1e-6)
    assert_same_params(a, b)
    assert_same_state(plain, fused)
    assert torch.equal(b.unused.weight, untouched[0]) and torch.equal(b.unused.bias, untouched[1])
    assert not fused.state.get(b.unused.weight) and not fused.state.get(b.unused.bias)
    report = fusion_report(fused)
    assert report.last_step_fused and report.fused_steps == 12, report
    assert report.fused_params == 4 and report.unfused_params == 0, report  # through the flat buffers
    assert report.group_paths == ["segmented", "segmented"], report
    assert type(fused) is ALL[name][0] and is_fused_optimizer(fused)


@pytest.mark.parametrize("name", sorted(SEGMENTED))
def test_segmented_fusion_is_chosen_at_fuse_time(name):
    """The path is known (and reported) before the first step; nothing raises or warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused = fuse_optimizer(build(name, TinyNet()), compile=False)
    report = fusion_report(fused)
    assert report.group_paths == ["segmented", "segmented"], report
    assert report.fused_params == 6 and report.unfused_params == 0 and not report.reasons, report


def test_segmented_state_dict_has_the_original_format():
    a, plain, b, fused = fused_pair("NovoGrad")
    data = loud_batches(3)
    train(a, plain, data)
    train(b, fused, data, step=fused.fuse_step)
    sa, sb = plain.state_dict(), fused.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, entry in sb["state"].items():
        assert entry["exp_avg"].shape == sa["state"][index]["exp_avg"].shape
        assert entry["exp_avg_sq"].dim() == 0  # the per-parameter scalar stays one per parameter


def test_bert_adam_without_clipping_stays_on_the_elementwise_path():
    a2, b2 = TinyNet(), TinyNet()
    plain = BertAdam(two_groups(a2, lr=3e-3), lr=1e-2, max_grad_norm=-1.0)
    fused = fuse_optimizer(BertAdam(two_groups(b2, lr=3e-3), lr=1e-2, max_grad_norm=-1.0), compile=False)
    data = loud_batches(6)
    train(a2, plain, data)
    train(b2, fused, data, step=fused.fuse_step)
    assert_same_params(a2, b2)
    assert_same_state(plain, fused)
    report = fusion_report(fused)
    assert report.fused_params == 4 and report.group_paths == ["elementwise", "elementwise"], report


def test_each_group_takes_its_own_path():
    """Group 0 clips (segmented), group 1 does not (elementwise)."""
    a, b = TinyNet(), TinyNet()
    plain = BertAdam(two_groups(a, lr=3e-3, max_grad_norm=-1.0), lr=1e-2)
    fused = fuse_optimizer(BertAdam(two_groups(b, lr=3e-3, max_grad_norm=-1.0), lr=1e-2), compile=False)
    data = loud_batches(8)
    train(a, plain, data)
    train(b, fused, data, step=fused.fuse_step)
    assert_same_params(a, b)
    assert_same_state(plain, fused)
    report = fusion_report(fused)
    assert report.fused_params == 4 and report.group_paths == ["segmented", "elementwise"], report


def test_segmented_params_that_skip_steps_stay_exact():
    """fc1.bias misses some steps: its own Lamb step count (bias correction) must be kept."""
    a, plain, b, fused = fused_pair("Lamb")
    for i, (x, y) in enumerate(loud_batches(10)):
        for model, opt, step in ((a, plain, plain.step), (b, fused, fused.fuse_step)):
            opt.zero_grad(set_to_none=True)
            model.fc1.bias.requires_grad_(i % 4 != 1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            step()
    assert_same_params(a, b)
    assert_same_state(plain, fused)
    assert fusion_report(fused).group_paths == ["segmented", "segmented"]


# =========================================================================== compiled segmented step
class BigNet(torch.nn.Module):
    """More than 2**20 elements (fc2.weight alone is 2**20), 1-D and 2-D, and an unused layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(16, 1024)
        self.fc2 = torch.nn.Linear(1024, 1024)
        self.fc3 = torch.nn.Linear(1024, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _big_groups(model, **second):
    return [
        {"params": [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.unused.weight]},
        {"params": [model.fc2.bias, model.fc3.weight, model.fc3.bias, model.unused.bias], **second},
    ]


COMPILED = {
    "BertAdam": (BertAdam, dict(lr=1e-3), dict(lr=3e-4, weight_decay=0.0)),
    "Lamb": (Lamb, dict(lr=1e-3, weight_decay=0.01), dict(lr=3e-4)),
}


@functools.lru_cache(maxsize=None)
def _compiled_run(name):
    """Unfused vs compile=True fused, 6 steps on BigNet (run once, shared by two tests)."""
    cls, kwargs, second = COMPILED[name]
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen) * 20) for _ in range(6)]
    a, b = BigNet(), BigNet()
    plain = cls(_big_groups(a, **second), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CompileFallbackWarning is judged by the compiled-ness test
        fused = fuse_optimizer(cls(_big_groups(b, **second), **kwargs), compile=True)
        train(a, plain, data)
        train(b, fused, data, step=fused.fuse_step)
    return a, plain, b, fused, fusion_report(fused)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiled_segmented_step_matches_unfused(name):
    """Exact (to fp32 rounding) whether or not the step really ran compiled."""
    a, plain, b, fused, report = _compiled_run(name)
    # Inductor may reorder reductions and contract a*b+c into an FMA: last-bit differences
    assert_same_params(a, b, rtol=2e-5, atol=1e-6)
    assert_same_state(plain, fused, rtol=2e-5, atol=1e-6)
    assert report.fused_params == 6 and report.unfused_params == 0, report
    assert report.group_paths == ["segmented", "segmented"], report


needs_compiler = pytest.mark.skipif(_compile.compile_unavailable_reason("segmented") is not None,
                                    reason=str(_compile.compile_unavailable_reason("segmented")))


@needs_compiler
@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiled_segmented_step_really_compiles(name):
    """The segmented step runs as compiled kernels: per segmented call (here two: the groups'
    runs have equal segment counts) one graph, plus one recompile when Dynamo makes the
    changing int ``step`` symbolic."""
    *_, report = _compiled_run(name)
    assert report.compiled and report.compile_disabled_reason is None, report
    assert report.compile_graphs <= 4, report


class _ScaledSGD(torch.optim.Optimizer):
    """``p -= lr * g / scale(p, g)``: a stateless step whose ``scale`` reduces whole parameters."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad / self.scale(p, p.grad))


class ReductionZoo(_ScaledSGD):
    """Every reduction a compiled segmented step knows, on tensors whose alignment padding is
    not neutral (``p + 1``, ``g - 1``): an unmasked padding would change every value."""

    @staticmethod
    def scale(p, g):
        shifted, down = p + 1, g - 1
        dot = torch.dot(shifted, down) if p.dim() == 1 else (shifted * down).sum()  # dot needs 1-D
        return (
            torch.linalg.vector_norm(g) + g.norm(p=1) + torch.linalg.vector_norm(down, float("inf"))
            + torch.linalg.vector_norm(down, -float("inf")) + torch.linalg.vector_norm(shifted, 3)
            + torch.linalg.vector_norm(shifted, -2) * 1e-2
            + torch.linalg.vector_norm(torch.where(g > 0, shifted, 0.0), 0) * 1e-3
            + shifted.sum() * 1e-3 + shifted.mean() + down.amax() - down.amin() + torch.max(shifted)
            + torch.min(down) + dot * 1e-3
        )


class OddNet(torch.nn.Module):
    """fc1's sizes are not multiples of 16, so the flat runs hold alignment padding inside
    blocks of 16 (each run's end is a multiple of 16, so compiled blocks are 16 long)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(7, 1023)
        self.fc2 = torch.nn.Linear(1023, 1024)
        self.fc3 = torch.nn.Linear(1024, 16)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


@needs_compiler
def test_compiled_segmented_reductions_mask_padding_and_match_unfused():
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 7, generator=gen), torch.randn(8, 16, generator=gen)) for _ in range(5)]
    a, b = OddNet(), OddNet()
    plain = ReductionZoo(a.parameters())
    fused = fuse_optimizer(ReductionZoo(b.parameters()), compile=True)
    train(a, plain, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compile fallback would warn
        train(b, fused, data, step=fused.fuse_step)
    report = fusion_report(fused)
    assert report.compiled and report.fused_params == 6 and report.group_paths == ["segmented"], report
    assert report.group_reasons == [None], report
    assert_same_params(a, b, rtol=2e-5, atol=1e-6)


_INF = float("inf")


@needs_compiler
@pytest.mark.parametrize("name,ord", [("vector_norm", 2.0), ("vector_norm", 1.0), ("vector_norm", 3.0),
                                      ("vector_norm", _INF), ("vector_norm", -_INF), ("vector_norm", 0.0),
                                      ("vector_norm", -2.0), ("vector_norm", -0.5),  # AvaGrad's norm(-2)
                                      ("sum", 0.0), ("mean", 0.0), ("amax", 0.0), ("amin", 0.0), ("dot", 0.0)])
def test_compiled_block_reductions_equal_per_segment_values_and_ignore_padding(name, ord):
    """The compiled reduction (block partials + segment_combine) against each segment's own
    eager value, with alignment padding holding values that would change every result."""
    from bagua_integrations._segmented import Segmentation, _compiled_reduction

    pieces = [(0, 7161, torch.Size([7161])), (7168, 8191, torch.Size([1023])), (8192, 8208, torch.Size([16]))]
    seg = Segmentation((8208,), pieces)
    seg.index_blocks(torch.device("cpu"))
    assert seg.block == 16 and seg.block_valid is not None
    gen = torch.Generator().manual_seed(0)
    x, other = torch.zeros(8208), torch.zeros(8208)
    for tensor in (x, other):
        tensor[7161:7164] = torch.tensor([1e6, -3e5, 0.0])  # padding: large, negative, zero
        tensor[8191] = 2e6
        for start, end, _ in pieces:
            tensor[start:end] = torch.randn(end - start, generator=gen)
    torch.compiler.reset()  # one lambda compiled per case: stay clear of Dynamo's recompile limit
    compiled = torch.compile(lambda a, b: _compiled_reduction(name, ord, a, b, seg), fullgraph=True)
    got = compiled(x, other if name == "dot" else None).reshape(-1)
    reference = {
        "vector_norm": lambda a, b: torch.linalg.vector_norm(a, ord), "sum": lambda a, b: a.sum(),
        "mean": lambda a, b: a.mean(), "amax": lambda a, b: a.amax(), "amin": lambda a, b: a.amin(),
        "dot": lambda a, b: torch.dot(a, b),
    }[name]
    expected = torch.stack([reference(x[s:e], other[s:e]) for s, e, _ in pieces])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class StdScaled(_ScaledSGD):
    """A whole-parameter reduction compiled steps do not know (``std``; ``correction=0`` so a
    one-element parameter has a value): the eager
    segmented step handles it; the compiled one must fall back, not compute something else."""

    @staticmethod
    def scale(p, g):
        return g.std(correction=0) + 1.0


@needs_compiler
def test_compiled_segmented_step_falls_back_to_eager_on_an_unknown_reduction():
    a, b = BigNet(), BigNet()
    plain = StdScaled(a.parameters())
    fused = fuse_optimizer(StdScaled(b.parameters()), compile=True)
    assert fusion_report(fused).group_paths == ["segmented"]
    x = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(4)]
    train(a, plain, x)
    with pytest.warns(CompileFallbackWarning):
        train(b, fused, x, step=fused.fuse_step)
    report = fusion_report(fused)
    assert not report.compiled and report.compile_disabled_reason, report
    assert_same_params(a, b, rtol=1e-6, atol=1e-7)


@needs_compiler
def test_compiled_segmented_step_keeps_its_graphs_under_a_changing_lr():
    """BertAdam's own warmup schedule changes the learning rate every step: no recompiles
    after the first compiled steps, and the numbers stay those of the unfused optimizer."""
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen) * 20) for _ in range(12)]
    a, b = BigNet(), BigNet()
    plain = BertAdam(a.parameters(), lr=1e-3, warmup=0.3, t_total=12)
    fused = fuse_optimizer(BertAdam(b.parameters(), lr=1e-3, warmup=0.3, t_total=12), compile=True)
    train(a, plain, data)
    graphs = []
    for batch in data:
        train(b, fused, [batch], step=fused.fuse_step)
        graphs.append(fusion_report(fused).compile_graphs)
    report = fusion_report(fused)
    assert report.compiled and report.compile_disabled_reason is None, report
    assert graphs[4:] == [graphs[4]] * len(graphs[4:]), graphs
    assert_same_params(a, b, rtol=2e-5, atol=1e-6)


# =========================================================================== refused: value branches, shape math
@pytest.mark.parametrize("name", sorted(NOT_SEGMENTABLE))
def test_value_branches_and_shape_math_are_refused_by_name(name):
    model = TinyNet()
    before = [p.data_ptr() for p in model.parameters()]
    opt = build(name, model)
    with pytest.raises(NotElementwiseError, match=name):
        fuse_optimizer(opt, compile=False, on_unsupported="raise")
    assert not is_fused_optimizer(opt)
    assert [p.data_ptr() for p in model.parameters()] == before


@pytest.mark.parametrize("name", sorted(NOT_SEGMENTABLE))
def test_value_branches_and_shape_math_fall_back_exactly(name):
    a, b = TinyNet(), TinyNet()
    plain = build(name, a)
    with pytest.warns(FusionFallbackWarning, match=name):
        fused = fuse_optimizer(build(name, b), on_unsupported="fallback", compile=False)
    data = loud_batches(10)
    train(a, plain, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the one warning came at fuse time
        train(b, fused, data, step=fused.fuse_step)
    assert_same_params(a, b, rtol=0, atol=0)
    assert_same_state(plain, fused, rtol=0, atol=0)
    report = fusion_report(fused)
    assert report.fused_params == 0 and report.unfused_params == 4 and report.reasons, report
    assert report.group_paths == ["per-tensor", "per-tensor"], report
    assert all(reason and "per-parameter reductions" in reason for reason in report.group_reasons), report


# =========================================================================== exact or refused by name
def _fuse_or_named_refusal(opt, **kwargs):
    """The fused optimizer, or None after a named refusal (a FusionError naming the class)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FusionFallbackWarning)
            return fuse_optimizer(opt, compile=False, **kwargs)
    except FusionError as exc:
        assert type(opt).__name__ in str(exc), f"the refusal does not name {type(opt).__name__}: {exc}"
        return None
    except Exception as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"fusing {type(opt).__name__} raised a bare {type(exc).__name__}, not a FusionError: {exc}")


@pytest.mark.parametrize("on_unsupported", ["raise", "fallback"])
@pytest.mark.parametrize("name", sorted(EXACT_OR_REFUSED))
def test_unusual_state_is_exact_or_refused_by_name(name, on_unsupported):
    a, b = TinyNet(), TinyNet()
    plain, opt = build(name, a), build(name, b)
    fused = _fuse_or_named_refusal(opt, on_unsupported=on_unsupported)
    if fused is None:
        assert not is_fused_optimizer(opt)
        return
    data = loud_batches(12)
    train(a, plain, data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FusionFallbackWarning)
            train(b, fused, data, step=fused.fuse_step)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{name} was accepted by fuse_optimizer, then its fused step raised {type(exc).__name__}: {exc}")
    report = fusion_report(fused)
    # never silently different, whichever path it took (report.fused_params says which)
    if name == "GlobalCounter":
        assert fused.state.get("k") == plain.state["k"] == 12, f"the optimizer-level counter was lost: {report}"
    assert_same_params(a, b)
    assert_same_tree(plain.state_dict()["state"], fused.state_dict()["state"])
    assert report.fused_params + report.unfused_params == 4, report


# =========================================================================== state dicts
LAMB_KW, LAMB_SECOND = SEGMENTED["Lamb"][1], SEGMENTED["Lamb"][2]


def _lamb(model):
    return Lamb(two_groups(model, **LAMB_SECOND), **LAMB_KW)


def test_lamb_state_dict_moves_from_fused_to_plain():
    data = loud_batches(10)
    reference = TinyNet()
    reference_opt = _lamb(reference)
    train(reference, reference_opt, data)

    m1 = TinyNet()
    fused = fuse_optimizer(_lamb(m1), compile=False)
    train(m1, fused, data[:5], step=fused.fuse_step)
    checkpoint = saved({"model": m1.state_dict(), "optimizer": fused.state_dict()})
    m2 = TinyNet()
    m2.load_state_dict(checkpoint["model"])
    plain = _lamb(m2)
    plain.load_state_dict(checkpoint["optimizer"])
    train(m1, fused, data[5:], step=fused.fuse_step)  # both continue
    train(m2, plain, data[5:])
    assert_same_params(m1, m2)
    assert_same_state(fused, plain)
    assert_same_params(reference, m2)
    assert_same_state(reference_opt, plain)
    assert fusion_report(fused).group_paths == ["segmented", "segmented"]


@pytest.mark.parametrize("load_after_fusing", [False, True])
def test_lamb_state_dict_moves_from_plain_to_fused(load_after_fusing):
    data = loud_batches(10)
    m1 = TinyNet()
    plain = _lamb(m1)
    train(m1, plain, data[:5])
    checkpoint = saved({"model": m1.state_dict(), "optimizer": plain.state_dict()})
    m2 = TinyNet()
    m2.load_state_dict(checkpoint["model"])
    opt = _lamb(m2)
    if load_after_fusing:
        fuse_optimizer(opt, compile=False).load_state_dict(checkpoint["optimizer"])
    else:
        opt.load_state_dict(checkpoint["optimizer"])
        fuse_optimizer(opt, compile=False)
    train(m1, plain, data[5:])  # both continue
    train(m2, opt, data[5:], step=opt.fuse_step)
    assert_same_params(m1, m2)
    assert_same_state(plain, opt)
    report = fusion_report(opt)
    assert report.fused_params == 4 and report.group_paths == ["segmented", "segmented"], report


@pytest.mark.parametrize("load_after_fusing", [False, True])
def test_novograd_resumed_from_a_fused_checkpoint_equals_uninterrupted(load_after_fusing):
    data = loud_batches(10)
    plain_model = TinyNet()
    plain = build("NovoGrad", plain_model)
    train(plain_model, plain, data)
    uninterrupted = TinyNet()
    fused = fuse_optimizer(build("NovoGrad", uninterrupted), compile=False)
    train(uninterrupted, fused, data, step=fused.fuse_step)

    m1 = TinyNet()
    first = fuse_optimizer(build("NovoGrad", m1), compile=False)
    train(m1, first, data[:4], step=first.fuse_step)
    checkpoint = saved({"model": m1.state_dict(), "optimizer": first.state_dict()})
    del m1, first
    m2 = TinyNet()
    m2.load_state_dict(checkpoint["model"])
    resumed = build("NovoGrad", m2)
    if load_after_fusing:
        fuse_optimizer(resumed, compile=False).load_state_dict(checkpoint["optimizer"])
    else:
        resumed.load_state_dict(checkpoint["optimizer"])
        fuse_optimizer(resumed, compile=False)
    train(m2, resumed, data[4:], step=resumed.fuse_step)
    assert_same_params(uninterrupted, m2)
    assert_same_state(fused, resumed)
    assert_same_params(plain_model, m2)
    assert_same_state(plain, resumed)
    report = fusion_report(resumed)
    assert report.fused_params == 4 and report.group_paths == ["segmented", "segmented"], report


# =========================================================================== one-value state, held per run
class TrustKeeper(torch.optim.Optimizer):
    """Two kinds of one-value state per parameter, as LAMB-like optimizers keep them: a running
    gradient norm updated in place (``norm_avg``) and a trust ratio replaced every step (``ratio``)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["norm_avg"] = torch.ones([], dtype=p.dtype)
                    state["ratio"] = torch.ones([], dtype=p.dtype)
                state["norm_avg"].lerp_(p.grad.norm(), 0.1)
                state["ratio"] = p.norm() / (state["norm_avg"] + 1e-3)
                p.add_(p.grad * state["ratio"], alpha=-group["lr"])


def _edit_one_value_state(opt, params):
    """Between two steps, as a user may: one value edited in place, one replaced."""
    opt.state[params[0]]["norm_avg"].mul_(3.0)
    opt.state[params[2]]["ratio"] = torch.tensor(0.25)
    opt.state[params[3]]["norm_avg"] = torch.tensor(7.0)


@pytest.mark.parametrize("compiled", [False, True])
def test_one_value_state_is_held_per_run_and_follows_edits_and_checkpoints(compiled):
    """Each parameter's one-value state (a norm, a trust ratio) is its view of one tensor per run,
    which the fused step reads and writes in place: no stack before a step, no copy per parameter
    after it. The values stay each parameter's own, through in-place edits and replacements between
    steps, and through a checkpoint loaded by the unfused optimizer."""
    if compiled and _compile.compile_unavailable_reason("segmented") is not None:
        pytest.skip(str(_compile.compile_unavailable_reason("segmented")))
    data = loud_batches(12)
    models = [TinyNet(), TinyNet()]
    plain = TrustKeeper(models[0].parameters())
    fused = fuse_optimizer(TrustKeeper(models[1].parameters()), compile=compiled)
    train(models[0], plain, data[:3])
    train(models[1], fused, data[:3], step=fused.fuse_step)
    assert fusion_report(fused).group_paths == ["segmented"], fusion_report(fused)
    stepped = [p for p in models[1].parameters() if fused.state.get(p)]
    held = {key: [fused.state[p][key] for p in stepped] for key in ("norm_avg", "ratio")}
    for values in held.values():  # one tensor per run (TinyNet: a run of weights, one of biases)
        assert len({v.untyped_storage().data_ptr() for v in values}) <= 2, values
    train(models[1], fused, data[3:5], step=fused.fuse_step)
    train(models[0], plain, data[3:5])
    for key, values in held.items():  # a usual step wrote through the views: the same objects
        assert all(fused.state[p][key] is v for p, v in zip(stepped, values)), key
    assert_same_state(plain, fused)

    for opt, model in ((plain, models[0]), (fused, models[1])):
        _edit_one_value_state(opt, [p for p in model.parameters() if opt.state.get(p)])
    train(models[0], plain, data[5:8])
    train(models[1], fused, data[5:8], step=fused.fuse_step)
    assert_same_params(*models)
    assert_same_state(plain, fused)

    resumed = TrustKeeper(models[1].parameters())
    resumed.load_state_dict(saved(fused.state_dict()))
    train(models[0], plain, data[8:])
    train(models[1], resumed, data[8:])
    assert_same_params(*models)
    assert_same_state(plain, resumed)


# =========================================================================== a wrong segmentation is caught
def _one_segment(original):
    """The whole run as one segment (the brief's deliberately wrong segmentation)."""
    return lambda flat, *args, **kwargs: [flat]


def _misplaced_segments(original):
    """The right number of segments, each of the right shape, but all starting at element 0:
    a subtle off-by-offset bug that no shape check can see."""

    def misplaced(flat, *args, **kwargs):
        views = original(flat, *args, **kwargs)
        return [flat.reshape(-1)[: v.numel()].view(v.shape) for v in views]

    return misplaced


@pytest.mark.parametrize("wrong", [_one_segment, _misplaced_segments], ids=["one-segment", "misplaced-segments"])
def test_deliberately_wrong_segmentation_must_fail(monkeypatch, wrong):
    """With reductions taken over the wrong elements, LAMB's trust ratios are wrong: the probe
    must refuse it, or (if the probe cannot see it) the numbers must differ -- which proves the
    tests above would notice a broken segmentation."""
    segmented = pytest.importorskip("bagua_integrations._segmented")
    monkeypatch.setattr(segmented, "segment_views", wrong(segmented.segment_views))
    a, b = TinyNet(), TinyNet()
    plain = _lamb(a)
    try:
        fused = fuse_optimizer(_lamb(b), compile=False, on_unsupported="raise")
    except NotElementwiseError as exc:
        assert "Lamb" in str(exc)
        return
    data = loud_batches(6)
    train(a, plain, data)
    train(b, fused, data, step=fused.fuse_step)
    with pytest.raises(AssertionError):
        assert_same_params(a, b)


# =========================================================================== found in review
def _fused_vs_unfused(make, shapes, steps=6, **fuse_kwargs):
    """Train the same seeded parameters with ``make(params)`` unfused and fused; return the
    worst relative difference of the parameters and the fused optimizer."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in shapes]
    plain_params = [torch.nn.Parameter(t.clone()) for t in init]
    fused_params = [torch.nn.Parameter(t.clone()) for t in init]
    plain = make(plain_params)
    fuse_kwargs.setdefault("compile", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = fuse_optimizer(make(fused_params), **fuse_kwargs)
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            for a, b in zip(plain_params, fused_params):
                g = torch.randn(a.shape, generator=gen)
                a.grad, b.grad = g.clone(), g.clone()
            plain.step()
            fused.fuse_step()
    worst = max(((a - b).abs() / a.abs().clamp_min(1e-6)).max().item() for a, b in zip(plain_params, fused_params))
    return worst, plain, fused


class CountingLamb(torch.optim.Optimizer):
    """LAMB with a group-level step (as timm's and apex's keep it) and an optimizer-level call
    counter; groups with ``trust=False`` take plain Adam steps (elementwise)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, trust=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, trust=trust))

    @torch.no_grad()
    def step(self, closure=None):
        self.state["calls"] = self.state.get("calls", 0) + 1
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            step, (b1, b2) = group["step"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = (state["m"] / (1 - b1**step)) / ((state["v"] / (1 - b2**step)).sqrt() + group["eps"])
                update.add_(p, alpha=group["weight_decay"])
                if group["trust"]:
                    w, u = p.norm(), update.norm()
                    update = update * torch.where((w > 0) & (u > 0), w / u, 1.0)
                p.sub_(update * group["lr"])


def test_group_and_optimizer_level_counters_advance_once_per_fused_step():
    """A fused step calls the optimizer's step once per segmented call (runs of equal length or
    segment count) plus once for the elementwise groups: each call must start from the counters
    as they were, or bias corrections run ahead (they did: group["step"] 7 after 4 steps)."""

    def make(params):  # two 2-D and two 1-D segmented parameters, and an elementwise group
        return CountingLamb([{"params": params[:4]}, {"params": params[4:], "trust": False}])

    worst, plain, fused = _fused_vs_unfused(make, [(6, 5), (6,), (7, 7), (5,), (4, 3)], steps=5)
    assert worst <= 1e-5, worst
    assert [g["step"] for g in fused.param_groups] == [5, 5] and fused.state["calls"] == 5
    assert fusion_report(fused).group_paths == ["segmented", "elementwise"]


@pytest.mark.parametrize("make", [
    lambda ps: Lamb(ps, lr=1e-2),
    lambda ps: BertAdam(ps, lr=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
], ids=["Lamb", "BertAdam", "AdamW"])
def test_one_element_zero_dim_and_five_dim_parameters(make):
    """nn.Linear(n, 1)'s bias (one element: its Adam state is shaped like it, not one value per
    parameter), a learnable 0-D scalar (CLIP's logit_scale) and a 5-D weight after others:
    exact, no bare errors (they were a mid-step FusionError, ValueError and RuntimeError)."""
    worst, _, fused = _fused_vs_unfused(make, [(4, 3), (1,), (), (3,), (2, 1, 2, 1, 2)])
    assert worst <= 1e-5, worst
    assert fusion_report(fused).fused_params >= 3


class PositiveCount(torch.optim.Optimizer):
    """Momentum SGD scaled by each parameter's count of positive gradient entries (a bool sum)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(0.9).add_(p.grad * (p.grad > 0).sum() * 0.01)
                p.add_(state["buf"], alpha=-group["lr"])


def test_compiled_segmented_count_of_a_bool_tensor_is_exact():
    """sum() of a bool tensor is an int64 count; the compiled block reduction cast it back to
    bool (1 instead of the count, 16x off) -- now such reductions stay eager."""
    if _compile.compile_unavailable_reason("segmented") is not None:
        pytest.skip(_compile.compile_unavailable_reason("segmented"))
    worst, _, fused = _fused_vs_unfused(lambda ps: PositiveCount(ps), [(6, 5), (6,), (7, 7), (3,)], compile=True)
    assert worst <= 1e-5, worst
    assert fusion_report(fused).group_paths == ["segmented"]


def test_a_parameter_listed_in_two_groups_is_refused_by_name():
    from bagua_integrations import SharedParameterError

    params = [torch.nn.Parameter(torch.randn(s)) for s in [(6, 5), (6,), (4,)]]
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    opt.param_groups[1]["params"].append(params[0])  # torch checks this only in add_param_group
    with pytest.raises(SharedParameterError, match=r"param_groups\[0\]\['params'\]\[0\]"):
        fuse_optimizer(opt, compile=False)
    opt = fuse_optimizer(torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2), compile=False)
    opt.param_groups[1]["params"].append(params[0])
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(SharedParameterError):
        opt.fuse_step()
    assert all(torch.equal(a, p) for a, p in zip(before, params))  # refused before anything moved


class _DirectionSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1, wd=0.05):
        super().__init__(params, dict(lr=lr, wd=wd))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(self.direction(p, p.grad, group), alpha=-group["lr"])


class ConvOnlyDecay(_DirectionSGD):
    def direction(self, p, g, group):  # weight decay on conv weights only
        return g + group["wd"] * p if p.dim() == 4 else g


class LargeOnlyDecay(_DirectionSGD):
    def direction(self, p, g, group):  # a size threshold, as bitsandbytes keeps
        return g + group["wd"] * p if p.numel() >= 4096 else g


class ScaledSizeDecay(_DirectionSGD):
    def direction(self, p, g, group):  # a size threshold behind arithmetic on the count
        return g + group["wd"] * p if p.numel() * 2 >= 8192 else g


class GroupRMS(torch.optim.Optimizer):
    """Normalizes by the RMS of all of the group's gradients: alignment padding changes a mean."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            rms = torch.cat([g.reshape(-1) for g in grads]).pow(2).mean().sqrt()
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / rms, alpha=-group["lr"])


@pytest.mark.parametrize("cls,shapes", [
    (ConvOnlyDecay, [(16, 8, 3, 3), (16,), (10, 16)]),
    (LargeOnlyDecay, [(64, 128), (64,), (10, 64), (10,)]),
    (ScaledSizeDecay, [(64, 128), (64,), (10, 64), (10,)]),
    (GroupRMS, [(6, 5), (6,), (7, 7), (3,)]),
], ids=["conv-only-decay", "size-threshold", "scaled-size-threshold", "group-mean"])
def test_the_probe_sees_rank_four_rules_size_thresholds_and_means_over_padding(cls, shapes):
    """Each went through the elementwise path with wrong numbers (2-3.4x off): the probe had no
    4-D tensor, tensors too small for the threshold, and no padding in its flat tensor."""
    worst, _, fused = _fused_vs_unfused(lambda ps: cls(ps), shapes, on_unsupported="fallback")
    assert worst <= 1e-5, worst
    assert fusion_report(fused).group_paths != ["elementwise"]


# =========================================================================== sizes read per parameter
class FanInMomentum(torch.optim.Optimizer):
    """Momentum on the gradient's direction, scaled by ``1 / sqrt(fan-in)`` of each weight matrix,
    read as ``p.size(1)`` (Amos's target scale, muP-style learning rates): a run's proxy has size 1
    there, so a segmented step must read each parameter's own size, and its runs must hold
    parameters that share it."""

    def __init__(self, params, lr=0.1, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                scale = 1.0 / p.size(1) ** 0.5 if p.dim() > 1 else 0.5
                state["momentum"].mul_(group["beta"]).add_(p.grad / (p.grad.norm() + 1e-8))
                p.add_(state["momentum"], alpha=-group["lr"] * scale)


class FanNet(torch.nn.Module):
    """Weights of fan-in 8, 16, 16 and 8, in that order: one rank, two sizes along dimension 1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_compiler)], ids=["eager", "compiled"])
def test_a_size_read_per_parameter_is_each_parameters_and_cuts_runs_where_it_changes(compiled):
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(6)]
    a, b = FanNet(), FanNet()
    plain = FanInMomentum(a.parameters())
    fused = fuse_optimizer(FanInMomentum(b.parameters()), compile=compiled)
    train(a, plain, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionFallbackWarning)  # no step taken per parameter
        train(b, fused, data, step=fused.fuse_step)
    tolerance = dict(rtol=2e-5, atol=1e-6) if compiled else {}
    assert_same_params(a, b, **tolerance)
    assert_same_state(plain, fused, **tolerance)
    report = fusion_report(fused)
    assert report.group_paths == ["segmented"], report.group_why
    assert "dimension(s) 1" in report.group_why[0], report.group_why
    # the biases, and the weights of fan-in 8 and of fan-in 16: three runs, none taken per parameter
    assert report.fused_params == 8 and report.flat_runs == 3 and report.branch_fallback_steps == 0, report
    if compiled:
        assert report.compiled, report


# =========================================================================== arithmetic, per parameter
LARGE_MATRICES = [(256, 128), (192, 128), (128, 160), (300,), (40,)]  # matrices average > 16384 elements


@pytest.mark.parametrize("make", [lambda ps: Lamb(ps, lr=1e-2, weight_decay=0.01),
                                  lambda ps: BertAdam(ps, lr=1e-2, max_grad_norm=0.5),
                                  lambda ps: NovoGrad(ps, lr=1e-2, weight_decay=1e-3)],
                         ids=["Lamb", "BertAdam", "NovoGrad"])
def test_arithmetic_with_one_value_per_parameter_runs_on_each_parameters_range(monkeypatch, make):
    """``update * trust_ratio``, ``grad.div_(clip)`` on runs of large CPU parameters: on each
    parameter's range with its own value (no run-sized tensor of the values first), exact; a
    version that hands each range the next parameter's value (deliberately broken) is caught."""
    from bagua_integrations import _segmented

    taken = []
    arithmetic = _segmented.SegmentedMode._per_parameter_arithmetic

    def counted(self, func, seg, args, kwargs):
        out = arithmetic(self, func, seg, args, kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(_segmented.SegmentedMode, "_per_parameter_arithmetic", counted)
    worst, _, fused = _fused_vs_unfused(make, LARGE_MATRICES)
    assert worst <= 1e-6, worst
    assert fusion_report(fused).group_paths == ["segmented"]
    assert any(taken), "no arithmetic ran per parameter"

    def next_parameters_value(self, func, seg, args, kwargs):
        args = tuple(a.roll(1) if isinstance(a, torch.Tensor) and tuple(a.shape) == seg.scalar_shape else a
                     for a in args)
        return arithmetic(self, func, seg, args, kwargs)

    monkeypatch.setattr(_segmented.SegmentedMode, "_per_parameter_arithmetic", next_parameters_value)
    worst, _, _ = _fused_vs_unfused(make, LARGE_MATRICES)
    assert worst > 1e-3, worst


class OutOfPlaceMomentum(PerParameterStep):
    """Momentum SGD that writes a new state tensor each step (``state["m"] = beta * m + g``)."""

    def __init__(self, params, lr=0.1, beta=0.9):
        super().__init__(params, lr=lr, beta=beta)

    def update(self, p, state, group):
        state["m"] = group["beta"] * state.get("m", torch.zeros_like(p)) + p.grad
        p.add_(state["m"], alpha=-group["lr"])


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    lambda ps: OutOfPlaceMomentum(ps),
], ids=["Adam", "SGD-momentum", "Adagrad", "out-of-place-momentum"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_zero_dim_parameter_laid_out_first_is_stepped_exactly(make, compile):
    """A model's 0-D parameter (CLIP's ``logit_scale``) first in the flat buffer: its 0-D state
    (Adam's ``exp_avg``) was read as a value the whole run shares, like a step count. Adam then
    raised a bare RuntimeError (``output with shape [] doesn't match the broadcast shape [51]``)
    from its second step, and a momentum written out of place spread one value over every
    parameter, silently (0.45 off after 4 steps). It is now stepped on its own, in the same call."""
    if compile and _compile.compile_unavailable_reason("elementwise") is not None:
        pytest.skip(_compile.compile_unavailable_reason("elementwise"))
    worst, _, fused = _fused_vs_unfused(make, [(), (3, 6), (3,)], steps=4, compile=compile)
    assert worst <= 1e-6, worst
    report = fusion_report(fused)
    assert report.fused_params == 2 and report.unfused_params == 1, report


@pytest.mark.parametrize("call", ["method", "function"])
def test_a_norm_method_goes_straight_to_each_parameter(call):
    """``p.norm()`` hands ``dim=None`` on as a keyword; it took the detour of a norm over the whole run
    first (one more pass over the run for each norm a LAMB-style step takes, and torch's bare error
    for ``norm(inf)`` of an empty run: a rank holding none of a small parameter's rows)."""
    from bagua_integrations import _segmented

    pieces = [(0, 6, torch.Size([2, 3])), (8, 12, torch.Size([4]))]
    seg = _segmented.Segmentation((1, 16), pieces)
    run = torch.arange(16.0).reshape(1, 16)
    whole_run_norms = []

    class Watch(torch.overrides.TorchFunctionMode):  # inside the segmented mode: sees what it calls
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.norm, torch.linalg.vector_norm) and args[0].shape == seg.shape:
                whole_run_norms.append(func)
            return func(*args, **(kwargs or {}))

    with Watch(), _segmented.SegmentedMode([seg]):
        norms = run.norm(2.0) if call == "method" else torch.linalg.vector_norm(run, 2.0)
    assert not whole_run_norms, whole_run_norms
    expected = torch.stack([run.reshape(-1)[s:e].norm() for s, e, _ in pieces])
    torch.testing.assert_close(norms.reshape(-1), expected)
