"""Fusion must never touch what it should not, and never fuse silently less than it says.

Re-fusing an already-fused model (the two-stage fine-tune), releasing an old optimizer's
hooks, tied weights detected by real aliasing, a probe that cannot step the user's real
tensors, and named refusals for wrappers and meta tensors.
"""

import gc

import pytest
import torch

from bagua_integrations import FusionError, FusionFallbackWarning, NotAnOptimizerError, flat_grad_segments, fuse_optimizer, fusion_report
from bagua_integrations.fused_optimizer import unfuse


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _train(model, optimizer, batches, fused):
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        (optimizer.fuse_step if fused else optimizer.step)()


def test_second_optimizer_over_an_already_fused_model_fuses_and_matches_unfused():
    batches = _batches(8)
    reference, fused_model = _model(), _model()
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches[:3], fused=False)
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9), batches[3:], fused=False)

    first = fuse_optimizer(torch.optim.AdamW(fused_model.parameters(), lr=1e-2))
    _train(fused_model, first, batches[:3], fused=True)
    second = fuse_optimizer(torch.optim.SGD(fused_model.parameters(), lr=0.05, momentum=0.9))
    report = fusion_report(second)
    assert report.fused_params == 4 and not report.reasons, report
    _train(fused_model, second, batches[3:], fused=True)
    assert fusion_report(second).last_step_fused and fusion_report(second).fused_params == 4
    for a, b in zip(reference.parameters(), fused_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_an_old_fused_optimizer_releases_its_gradient_hooks_when_collected_or_unfused():
    model = _model()
    old = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    old_grads = flat_grad_segments(old)[0].flat
    new = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    del old
    gc.collect()
    old_grads.zero_()
    x, y = _batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert old_grads.abs().sum() == 0, "the collected optimizer's hooks still copy gradients"
    assert flat_grad_segments(new)[0].flat.abs().sum() > 0

    new_grads = flat_grad_segments(new)[0].flat
    unfuse(new)
    new_grads.zero_()
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert new_grads.abs().sum() == 0, "unfuse left gradient hooks behind"


def test_tied_weights_are_detected_by_overlapping_bytes_not_by_a_shared_storage():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    other = torch.nn.Linear(4, 4)
    params = list({id(p): p for p in [emb.weight, head.weight, other.weight, other.bias]}.values())
    opt = fuse_optimizer(torch.optim.SGD(params, lr=0.1))
    # module-level tying shares one Parameter object, which the optimizer holds once: nothing aliases
    assert fusion_report(opt).fused_params == 3

    base = torch.zeros(20)
    a, b = torch.nn.Parameter(base[:10]), torch.nn.Parameter(base[5:15])  # overlapping views
    report = fusion_report(fuse_optimizer(torch.optim.SGD([a, b], lr=0.1), on_unsupported="fallback"))
    assert report.fused_params == 0 and all("shares memory" in r for r in report.reasons.values())


def test_meta_parameters_get_a_reason_that_says_to_materialize_them():
    p = torch.nn.Parameter(torch.empty(3, 4, device="meta"))
    q = torch.nn.Parameter(torch.empty(2, device="meta"))
    report = fusion_report(fuse_optimizer(torch.optim.SGD([p, q], lr=0.1)))
    assert report.fused_params == 0 and not report.last_step_fused
    assert all("meta device" in reason for reason in report.reasons.values())


class Lookahead(torch.optim.Optimizer):
    """A wrapper whose step calls an inner optimizer over the same parameters."""

    def __init__(self, inner, alpha=0.5):
        self.inner = inner
        super().__init__(inner.param_groups, dict(alpha=alpha))

    @torch.no_grad()
    def step(self, closure=None):
        self.inner.step()
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(group.get("alpha", 0.5) + 0.5)


def test_probing_a_wrapper_optimizer_never_touches_the_real_weights_or_state():
    model = _model()
    x, y = _batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()  # gradients present at fuse time
    before = [p.detach().clone() for p in model.parameters()]
    inner = torch.optim.Adam(model.parameters(), lr=0.1)
    fuse_optimizer(Lookahead(inner), on_unsupported="fallback", compile=False)
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b), "the probe moved a real weight"
    assert len(inner.state) == 0, "the probe created real optimizer state"


def test_a_wrapper_that_is_not_an_initialised_optimizer_gets_a_named_error():
    class Wrapper(torch.optim.Optimizer):  # like accelerate's AcceleratedOptimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def param_groups(self):
            return self.optimizer.param_groups

    with pytest.raises(NotAnOptimizerError, match="fuse the optimizer it wraps"):
        fuse_optimizer(Wrapper(torch.optim.SGD(_model().parameters(), lr=0.1)))


def test_accelerated_optimizer_gets_the_named_error():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    _, wrapped = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(NotAnOptimizerError, match="AcceleratedOptimizer"):
        fuse_optimizer(wrapped)


def test_a_step_that_fused_nothing_is_not_reported_as_fused():
    opt = fuse_optimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
    opt.fuse_step()  # no gradients: nothing to update
    report = fusion_report(opt)
    assert report.fused_params == 0 and not report.last_step_fused


def test_the_probe_refuses_an_optimizer_it_cannot_copy_with_a_named_error():
    import threading

    class Locked(torch.optim.SGD):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            self.lock = threading.Lock()  # cannot be deep-copied

    with pytest.raises(FusionError, match="cannot be copied"):
        fuse_optimizer(Locked(_model().parameters(), lr=0.1), on_unsupported="raise")
    with pytest.warns(FusionFallbackWarning, match="cannot be copied"):  # the default: its own exact step
        opt = fuse_optimizer(Locked(_model().parameters(), lr=0.1))
    assert fusion_report(opt).group_paths == ["per-tensor"]


class EagerStateAdagrad(torch.optim.Optimizer):
    """Adagrad as torch < 2.12 writes it: ``sum`` is created in ``__init__``, never in ``step``."""

    def __init__(self, params, lr=0.1, initial_accumulator_value=0.5):
        super().__init__(params, dict(lr=lr))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"] = torch.full_like(p, initial_accumulator_value)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    total = self.state[p]["sum"]  # KeyError if the state was not created up front
                    total.addcmul_(p.grad, p.grad)
                    p.addcdiv_(p.grad, total.sqrt().add_(1e-10), value=-group["lr"])


def test_optimizer_whose_state_exists_before_the_first_step_is_probed_and_fused():
    """Seen on torch 2.11's Adagrad on an H100: the probe's state-less copies raised KeyError('sum')."""
    batches = _batches(6)
    reference, fused_model = _model(), _model()
    _train(reference, EagerStateAdagrad(reference.parameters()), batches, fused=False)
    fused = fuse_optimizer(EagerStateAdagrad(fused_model.parameters()), compile=False)
    assert fusion_report(fused).fused_params == 4
    _train(fused_model, fused, batches, fused=True)
    assert fusion_report(fused).last_step_fused
    for a, b in zip(reference.parameters(), fused_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
