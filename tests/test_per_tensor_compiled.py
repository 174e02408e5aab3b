"""Issue 11 item 2: what cannot be fused keeps its exact unfused step, compiled one parameter per call.

Adafactor (factored second moments: shape-dependent math) is refused by both probes; with
``on_unsupported="fallback"`` and a compiler its own step runs compiled on per-shape stand-ins
(``_per_tensor.py``). In float64 the compiled step equals the unfused one to rounding (1e-12),
which shows the stand-ins, the state hand-over and the bookkeeping restore are exact; float32
differs only by compiled rounding (reductions summed in another order). Optimizers whose step
counts per parameter are detected by the probe and keep the eager step.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from bagua_integrations import fuse_optimizer, fusion_report
from bagua_integrations._compile import compile_unavailable_reason

pytestmark = pytest.mark.skipif(compile_unavailable_reason("per-tensor") is not None,
                                reason=str(compile_unavailable_reason("per-tensor")))

SHAPES = [(40, 24), (24,), (24, 40), (40, 24), (24,)]  # 3 distinct shapes, ranks 1 and 2
STEPS = 6


def _params(dtype, with_unused=True):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype) * 0.5) for s in SHAPES]
    if with_unused:
        params.append(torch.nn.Parameter(torch.randn(7, generator=gen, dtype=dtype)))  # never gets a gradient
    return params


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params[: len(SHAPES)]:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def _fused(optimizer, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "keeps its unfused step" notice
        return fuse_optimizer(optimizer, on_unsupported="fallback", compile=True, **kwargs)


def _run_pair(make, dtype, steps=STEPS):
    ours, reference = _params(dtype), _params(dtype)
    fused = _fused(make(ours))
    plain = make(reference)
    for step in range(steps):
        _grads(ours, step)
        _grads(reference, step)
        fused.fuse_step()
        plain.step()
    return fused, plain, ours, reference


def _max_relative(a_params, b_params) -> float:
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(a_params, b_params))


class CountsPerStep(torch.optim.SGD):
    """Group- and optimizer-level bookkeeping once per step, used by the update (like a step count)."""

    @torch.no_grad()
    def step(self, closure=None):
        self.state["calls"] = self.state.get("calls", 0) + 1
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(0.5).add_(p.grad)
                p.sub_(state["buf"] * group["lr"] / group["k"] ** 0.5)
                p.mul_(1 - 1e-3 * torch.linalg.vector_norm(p) / p.numel())  # also not elementwise
        return None


class CountsPerParameter(CountsPerStep):
    """Bookkeeping that adds up over the parameters of a call: per-parameter calls would change it."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["seen"] = group.get("seen", 0) + sum(p.grad is not None for p in group["params"])
        return super().step(closure)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adafactor_runs_compiled_per_parameter_and_equals_the_unfused_step(dtype):
    fused, plain, ours, reference = _run_pair(lambda ps: torch.optim.Adafactor(ps, lr=1e-2), dtype)
    report = fusion_report(fused)
    assert report.group_paths == ["per-tensor"] and report.fused_params == 0
    assert report.per_tensor_compiled and report.compiled, report
    assert report.compile_graphs == 3, "one graph per distinct shape"  # (40,24), (24,), (24,40)
    assert _max_relative(ours, reference) < (1e-12 if dtype == torch.float64 else 1e-5)
    assert torch.equal(ours[-1], reference[-1])  # no gradient: untouched
    # the state is the real parameters' (no stand-in left behind) and loads into the plain class
    assert set(fused.state) == set(p for p in ours if p.grad is not None)
    clone = torch.optim.Adafactor(_params(dtype), lr=1e-2)
    clone.load_state_dict(fused.state_dict())
    state = fused.state_dict()["state"]
    assert state[0]["step"].item() == STEPS and state[0]["row_var"].shape == (40, 1)


def test_pytorch_optimizers_adafactor_with_a_3d_weight_equals_the_unfused_step():
    """pytorch-optimizer's AdaFactor scales a 0-dim rate ``max(eps2, rms)`` by ``min(1e-2, 1 /
    sqrt(step))``: compiled on torch 2.11 a 3-D weight's step read that min truncated to an int (0),
    1.4e-3 from unfused after 8 steps (1e-4 after 2); now hoisted into the prologue."""
    po = pytest.importorskip("pytorch_optimizer")
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3, 3), (24,), (40, 24)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    fused, plain = _fused(po.AdaFactor(ours, lr=1e-2)), po.AdaFactor(reference, lr=1e-2)
    for step in range(STEPS):
        for params in (ours, reference):
            _grads(params, step)
        fused.fuse_step()
        plain.step()
    report = fusion_report(fused)
    assert report.compiled and report.compile_disabled_reason is None, report
    # (its momentum is bfloat16: compiled rounding shows as ~1e-5 here)
    assert _max_relative(ours, reference) < 5e-5


def test_group_and_optimizer_level_bookkeeping_is_applied_once_per_step():
    fused, plain, ours, reference = _run_pair(lambda ps: CountsPerStep(ps, lr=0.1), torch.float64)
    report = fusion_report(fused)
    assert report.per_tensor_compiled and report.compiled, report
    assert fused.param_groups[0]["k"] == plain.param_groups[0]["k"] == STEPS
    assert fused.state["calls"] == plain.state["calls"] == STEPS
    assert _max_relative(ours, reference) < 1e-12


def test_bookkeeping_that_adds_up_per_parameter_keeps_the_eager_step():
    fused, plain, ours, reference = _run_pair(lambda ps: CountsPerParameter(ps, lr=0.1), torch.float64)
    report = fusion_report(fused)
    assert not report.per_tensor_compiled and not report.compiled
    assert "cannot be stepped one parameter per call" in report.per_tensor_compile_reason
    assert "'seen'" in report.per_tensor_compile_reason
    assert fused.param_groups[0]["seen"] == plain.param_groups[0]["seen"]
    assert _max_relative(ours, reference) == 0.0


def test_compile_false_and_small_auto_keep_the_eager_step():
    for compile_mode in (False, "auto"):  # "auto": these few elements are below the compile threshold
        params = _params(torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = fuse_optimizer(torch.optim.Adafactor(params, lr=1e-2), on_unsupported="fallback", compile=compile_mode)
        _grads(params, 0)
        opt.fuse_step()
        report = fusion_report(opt)
        assert not report.per_tensor_compiled and not report.compiled and report.per_tensor_compile_reason is None
