"""fuse_optimizer: same numbers as the unfused optimizer, or a clear refusal."""

from __future__ import annotations

import io
import re
import warnings

import pytest
import torch

from _fused_utils import TinyNet, assert_same_params, assert_same_state, batches, train, two_groups
from bagua_integrations import (
    AlreadyFusedError,
    EmptyOptimizerError,
    FusionFallbackWarning,
    NotAnOptimizerError,
    NotElementwiseError,
    fuse_optimizer,
    fusion_report,
    is_fused_optimizer,
)
from bagua_integrations.optim import BertAdam

O = torch.optim
# name -> (class, kwargs of the first group, overrides of the second group)
TORCH_OPTIMIZERS = {
    "SGD": (O.SGD, dict(lr=0.05), dict(lr=0.02)),
    "SGD-momentum-nesterov-wd": (O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), dict(lr=0.02, weight_decay=0.0)),
    "SGD-foreach": (O.SGD, dict(lr=0.05, momentum=0.9, foreach=True), dict(lr=0.02)),
    "SGD-fused": (O.SGD, dict(lr=0.05, momentum=0.9, fused=True), dict(lr=0.02)),
    "Adam": (O.Adam, dict(lr=1e-2, weight_decay=0.01, foreach=False), dict(lr=3e-3, weight_decay=0.0)),
    "Adam-amsgrad": (O.Adam, dict(lr=1e-2, amsgrad=True), dict(lr=3e-3)),
    "Adam-foreach": (O.Adam, dict(lr=1e-2, foreach=True), dict(lr=3e-3)),
    "Adam-fused": (O.Adam, dict(lr=1e-2, fused=True), dict(lr=3e-3)),
    "AdamW": (O.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=False), dict(lr=3e-3, weight_decay=0.0)),
    "AdamW-foreach": (O.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True), dict(lr=3e-3, weight_decay=0.0)),
    "AdamW-fused": (O.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True), dict(lr=3e-3, weight_decay=0.0)),
    "Adagrad": (O.Adagrad, dict(lr=0.1, weight_decay=0.01), dict(lr=0.05)),
    "Adagrad-fused": (O.Adagrad, dict(lr=0.1, fused=True), dict(lr=0.05)),
    "Adadelta": (O.Adadelta, dict(lr=1.0, weight_decay=0.01), dict(lr=0.5)),
    "Adamax": (O.Adamax, dict(lr=1e-2), dict(lr=3e-3)),
    "NAdam": (O.NAdam, dict(lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True), dict(lr=3e-3)),
    "RAdam": (O.RAdam, dict(lr=1e-2), dict(lr=3e-3)),
    "RMSprop-centered": (O.RMSprop, dict(lr=1e-2, centered=True, momentum=0.5), dict(lr=3e-3)),
    "Rprop": (O.Rprop, dict(lr=1e-2), dict(lr=3e-3)),
    "ASGD": (O.ASGD, dict(lr=1e-2, t0=3), dict(lr=3e-3)),
}


def pair(cls, kwargs, second, dtype=torch.float32, **fuse_kwargs):
    a, b = TinyNet(dtype), TinyNet(dtype)
    plain = cls(two_groups(a, **second), **kwargs)
    fused = fuse_optimizer(cls(two_groups(b, **second), **kwargs), **fuse_kwargs)
    return a, plain, b, fused


@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZERS))
def test_every_torch_optimizer_matches_unfused(name):
    cls, kwargs, second = TORCH_OPTIMIZERS[name]
    a, plain, b, fused = pair(cls, kwargs, second)
    untouched = b.unused.weight.detach().clone()
    data = batches(12)
    losses_a = train(a, plain, data)
    losses_b = train(b, fused, data, step=fused.fuse_step)
    assert losses_a == pytest.approx(losses_b, rel=1e-6)
    assert_same_params(a, b)
    assert_same_state(plain, fused)
    # never got a gradient: no decay, no momentum (its state, if any, is compared above)
    assert torch.equal(b.unused.weight, untouched)
    report = fusion_report(fused)
    assert report.last_step_fused and report.fused_params == 4 and report.unfused_params == 0
    assert report.flat_buffers == 2 and report.flat_runs == 2
    assert type(fused) is cls and is_fused_optimizer(fused)


def test_fusion_survives_set_to_none_and_grads_land_in_flat_buffer():
    from bagua_integrations.fused_optimizer import fused_layout

    a, plain, b, fused = pair(O.AdamW, dict(lr=1e-2), {})
    train(b, fused, batches(30), step=fused.fuse_step, set_to_none=True)
    for group in fused_layout(fused).groups.values():
        for buffer in group.buffers:
            for slot in buffer.slots:
                p = slot.param
                assert p.data_ptr() == buffer.param.data_ptr() + slot.start * p.element_size()
                if p.grad is not None:
                    assert p.grad.data_ptr() == buffer.grad.data_ptr() + slot.start * p.element_size()
                for value in fused.state[p].values():
                    if isinstance(value, torch.Tensor) and value.dim():
                        assert value.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    report = fusion_report(fused)
    assert report.fused_steps == 30 and report.fused_params == 4 and report.flat_runs == 2


def test_step_keeps_ordinary_semantics_and_replace_step_takes_fused_path():
    a, plain, b, fused = pair(O.Adam, dict(lr=1e-2), {})
    data = batches(6)
    train(a, plain, data)
    train(b, fused, data)  # ordinary .step()
    assert fusion_report(fused).last_step_fused is False
    assert_same_params(a, b)

    c = TinyNet()
    replaced = fuse_optimizer(O.Adam(two_groups(c), lr=1e-2), replace_step=True)
    train(c, replaced, data)
    assert fusion_report(replaced).last_step_fused and fusion_report(replaced).fused_steps == 6
    assert_same_params(a, c)


def test_mixing_step_and_fuse_step_with_params_skipping_steps():
    """A parameter that misses steps keeps its own Adam step count (runs split by scalar state)."""
    a, plain, b, fused = pair(O.Adam, dict(lr=1e-2), dict(lr=3e-3))
    data = batches(10)
    for i, (x, y) in enumerate(data):
        for model, opt, step in ((a, plain, plain.step), (b, fused, fused.fuse_step if i % 3 else fused.step)):
            opt.zero_grad()
            model.fc1.bias.requires_grad_(i % 4 != 1)  # fc1.bias skips some steps
            torch.nn.functional.mse_loss(model(x), y).backward()
            step()
    assert_same_params(a, b)
    assert_same_state(plain, fused)


# --------------------------------------------------------------------------- per-tensor optimizers
class BertAdamLike(torch.optim.Optimizer):
    """The seed's use case, written here: per-tensor Adam without bias correction, optional per-param clip."""

    def __init__(self, params, lr=1e-3, b1=0.9, b2=0.999, e=1e-6, weight_decay=0.01, max_grad_norm=-1.0):
        super().__init__(params, dict(lr=lr, b1=b1, b2=b2, e=e, weight_decay=weight_decay, max_grad_norm=max_grad_norm))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                if group["max_grad_norm"] > 0:
                    torch.nn.utils.clip_grad_norm_(p, group["max_grad_norm"])
                state["m"].mul_(group["b1"]).add_(p.grad, alpha=1 - group["b1"])
                state["v"].mul_(group["b2"]).addcmul_(p.grad, p.grad, value=1 - group["b2"])
                update = state["m"] / (state["v"].sqrt() + group["e"]) + group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])
                state["step"] += 1


class LambLike(torch.optim.Optimizer):
    """Adam direction scaled by a per-tensor trust ratio ||p|| / ||update||."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.setdefault(p, {})
                if not state:
                    state["m"] = torch.zeros_like(p)
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                trust = p.norm() / state["m"].norm().clamp_min(1e-12)
                p.add_(state["m"], alpha=-group["lr"] * float(trust))


@pytest.mark.parametrize("cls", [BertAdamLike, BertAdam])
def test_bert_adam_without_clipping_fuses_and_matches(cls):
    a, plain, b, fused = pair(cls, dict(lr=1e-2, max_grad_norm=-1.0), dict(lr=3e-3, weight_decay=0.0))
    data = batches(12)
    train(a, plain, data)
    train(b, fused, data, step=fused.fuse_step)
    assert_same_params(a, b)
    assert_same_state(plain, fused)
    assert fusion_report(fused).fused_params == 4


@pytest.mark.parametrize("cls,kwargs", [(BertAdamLike, dict(lr=1e-2, max_grad_norm=1.0)), (BertAdam, dict(lr=1e-2))])
def test_per_parameter_clipping_fuses_exactly_on_segmented_runs(cls, kwargs):
    a, plain, b, fused = pair(cls, kwargs, dict(lr=3e-3, weight_decay=0.0))
    data = batches(12)
    train(a, plain, data)
    train(b, fused, data, step=fused.fuse_step)
    assert_same_params(a, b)
    assert_same_state(plain, fused)
    report = fusion_report(fused)
    assert report.fused_params == 4 and report.group_paths == ["segmented", "segmented"]


@pytest.mark.parametrize("cls,kwargs", [(LambLike, dict(lr=1e-2))])  # float(trust): a value read into Python
def test_per_tensor_math_is_refused_or_falls_back_exactly(cls, kwargs):
    with pytest.raises(NotElementwiseError, match=f"{cls.__name__}.*on_unsupported='fallback'.*assume_elementwise=True"):
        fuse_optimizer(cls(TinyNet().parameters(), **kwargs), on_unsupported="raise")

    a, plain, b, fused = pair(cls, kwargs, {}, on_unsupported="fallback")
    data = batches(8)
    train(a, plain, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(b, fused, data, step=fused.fuse_step)
    assert not caught  # the one warning came at fuse time
    assert_same_params(a, b, rtol=0, atol=0)
    report = fusion_report(fused)
    assert report.fused_params == 0 and report.unfused_params == 4 and report.reasons


def test_fallback_warns_once_at_fuse_time():
    with pytest.warns(FusionFallbackWarning, match="LambLike param group 0 keeps its unfused step"):
        fuse_optimizer(LambLike(TinyNet().parameters()), on_unsupported="fallback")


@pytest.mark.parametrize("opt", ["adafactor", "lbfgs", "sparse_adam"])
def test_non_elementwise_torch_optimizers_are_refused(opt):
    model = TinyNet()
    optimizer = {
        "adafactor": lambda: O.Adafactor(model.parameters(), lr=1e-2),
        "lbfgs": lambda: O.LBFGS(model.parameters()),
        "sparse_adam": lambda: O.SparseAdam(list(model.parameters())),
    }[opt]()
    with pytest.raises(NotElementwiseError):
        fuse_optimizer(optimizer, on_unsupported="raise")


# --------------------------------------------------------------------------- state dicts
def test_state_dict_round_trips_between_fused_and_plain():
    data = batches(16)
    ref, ref_opt = TinyNet(), None
    ref_opt = O.AdamW(two_groups(ref, lr=3e-3), lr=1e-2)
    train(ref, ref_opt, data)

    # fused for 8 steps -> plain for 8 steps (the seed's promise)
    m1 = TinyNet()
    fused = fuse_optimizer(O.AdamW(two_groups(m1, lr=3e-3), lr=1e-2))
    train(m1, fused, data[:8], step=fused.fuse_step)
    buffer = io.BytesIO()
    torch.save({"model": m1.state_dict(), "optimizer": fused.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    m2 = TinyNet()
    m2.load_state_dict(checkpoint["model"])
    plain = O.AdamW(two_groups(m2, lr=3e-3), lr=1e-2)
    plain.load_state_dict(checkpoint["optimizer"])
    train(m2, plain, data[8:])
    assert_same_params(ref, m2)

    # plain for 8 steps -> fused for 8 steps (state loaded before or after fusing)
    for load_after_fusing in (False, True):
        m3 = TinyNet()
        plain3 = O.AdamW(two_groups(m3, lr=3e-3), lr=1e-2)
        train(m3, plain3, data[:8])
        saved = io.BytesIO()
        torch.save(plain3.state_dict(), saved)
        saved.seek(0)
        m4 = TinyNet()
        m4.load_state_dict(m3.state_dict())
        opt4 = O.AdamW(two_groups(m4, lr=3e-3), lr=1e-2)
        if load_after_fusing:
            fuse_optimizer(opt4).load_state_dict(torch.load(saved))
        else:
            opt4.load_state_dict(torch.load(saved))
            fuse_optimizer(opt4)
        train(m4, opt4, data[8:], step=opt4.fuse_step)
        assert_same_params(ref, m4)
        assert_same_state(ref_opt, opt4)
        assert fusion_report(opt4).fused_params == 4


def test_state_dict_has_the_original_format():
    a, plain, b, fused = pair(O.Adam, dict(lr=1e-2), dict(lr=3e-3))
    data = batches(3)
    train(a, plain, data)
    train(b, fused, data, step=fused.fuse_step)
    sa, sb = plain.state_dict(), fused.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for index, entry in sb["state"].items():
        assert entry["exp_avg"].shape == sa["state"][index]["exp_avg"].shape
        assert entry["step"].dim() == 0


def test_add_param_group_after_fusing():
    a, plain, b, fused = pair(O.SGD, dict(lr=0.05, momentum=0.9), {})
    extra_a, extra_b = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(5))
    plain.add_param_group({"params": [extra_a], "lr": 0.1})
    fused.add_param_group({"params": [extra_b], "lr": 0.1})
    data = batches(6)
    for opt, model, extra, step in ((plain, a, extra_a, plain.step), (fused, b, extra_b, fused.fuse_step)):
        for x, y in data:
            opt.zero_grad()
            (torch.nn.functional.mse_loss(model(x), y) + extra.pow(2).sum()).backward()
            step()
    assert_same_params(a, b)
    torch.testing.assert_close(extra_a, extra_b, rtol=1e-6, atol=0)
    assert fusion_report(fused).flat_buffers == 3 and fusion_report(fused).fused_params == 5


# --------------------------------------------------------------------------- torch releases without compiled steps
OLD_TORCH = {  # a release too old to compile a path -> an optimizer taking that path, the warning
    "2.5.1": (lambda ps: O.SGD(ps, lr=0.05, momentum=0.9), r"torch 2\.5\.1 .*torch >= 2\.6"),
    "2.10.0": (lambda ps: BertAdam(ps, lr=1e-2, max_grad_norm=1.0), r"torch 2\.10\.0 .*segmented steps need torch >= 2\.11"),
    "2.9.1": (lambda ps: O.Adafactor(ps, lr=1e-2), r"torch 2\.9\.1 .*per-tensor steps need torch >= 2\.10"),
}


@pytest.mark.parametrize("release", sorted(OLD_TORCH))
def test_a_torch_too_old_to_compile_a_path_runs_its_eager_step_with_one_warning_up_front(monkeypatch, release):
    """compile=True warns once, when fusing (not after a few recompiles or a failed compile), and
    every step is the eager fused step's, bit for bit (_torch_compat.compiled_steps_unsupported)."""
    from bagua_integrations import CompileFallbackWarning, _torch_compat

    make, message = OLD_TORCH[release]
    monkeypatch.setattr(_torch_compat, "_RELEASE", torch.torch_version.TorchVersion(release))
    data = batches(6)
    a, b = TinyNet(), TinyNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Adafactor: its FusionFallbackWarning)
        eager = fuse_optimizer(make(a.parameters()), compile=False)
    with pytest.warns(Warning) as caught:
        old = fuse_optimizer(make(b.parameters()), compile=True)
    compile_warnings = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(compile_warnings) == 1 and re.search(message, compile_warnings[0]), compile_warnings
    schedulers = [O.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) for opt in (eager, old)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing more while training
        for model, opt, sched in zip((a, b), (eager, old), schedulers):
            for x, y in data:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.fuse_step()
                sched.step()
    assert_same_params(a, b, rtol=0, atol=0)
    report = fusion_report(old)
    assert not report.compiled and report.compile_graphs == 0 and re.search(message, report.compile_disabled_reason)


# --------------------------------------------------------------------------- dtypes, AMP, schedulers
def test_bf16_parameters_match():
    a, plain, b, fused = pair(O.AdamW, dict(lr=1e-2, foreach=False), {}, dtype=torch.bfloat16)
    data = batches(8, dtype=torch.bfloat16)

    def loss_fn(out, y):  # in fp32: torch 2.5 has no bf16 mse_loss on CPU (the gradients stay bf16)
        return torch.nn.functional.mse_loss(out.float(), y.float())

    train(a, plain, data, loss_fn=loss_fn)
    train(b, fused, data, step=fused.fuse_step, loss_fn=loss_fn)
    assert_same_params(a, b, rtol=0, atol=0)
    assert fusion_report(fused).fused_params == 4


@pytest.mark.parametrize("fused_kernel", [False, True])
def test_grad_scaler_with_replace_step(fused_kernel):
    def run(fuse):
        model = TinyNet()
        opt = O.AdamW(model.parameters(), lr=1e-2, fused=fused_kernel)
        if fuse:
            fuse_optimizer(opt, replace_step=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        for i, (x, y) in enumerate(batches(8)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if i == 3:
                loss = loss * float("inf")  # an overflow step must be skipped
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return model, opt, scaler.get_scale()

    a, plain, scale_a = run(False)
    b, fused, scale_b = run(True)
    assert scale_a == scale_b
    assert_same_params(a, b)
    assert fusion_report(fused).last_step_fused


def test_lr_scheduler_works_and_does_not_warn():
    a, plain, b, fused = pair(O.SGD, dict(lr=0.1, momentum=0.9), {}, replace_step=True)
    sched_a = O.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
    sched_b = O.lr_scheduler.StepLR(fused, step_size=2, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in batches(7):
            for model, opt, sched in ((a, plain, sched_a), (b, fused, sched_b)):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                sched.step()
    assert fused.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert_same_params(a, b)


def test_closure_is_evaluated_once_like_the_unfused_step():
    a, plain, b, fused = pair(O.SGD, dict(lr=0.05, momentum=0.9), {})
    for x, y in batches(5):
        results = []
        for model, opt, step in ((a, plain, plain.step), (b, fused, fused.fuse_step)):
            def closure(model=model, opt=opt):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            results.append(step(closure).item())
        assert results[0] == pytest.approx(results[1], rel=1e-6)
    assert_same_params(a, b)


# --------------------------------------------------------------------------- memory
def _unique_bytes(tensors):
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def test_fusing_keeps_no_duplicate_copies():
    def footprint(fuse):
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
        opt = O.Adam(model.parameters(), lr=1e-3)
        if fuse:
            fuse_optimizer(opt)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 64)).sum().backward()
            (opt.fuse_step if fuse else opt.step)()
        tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
        return _unique_bytes(tensors)

    plain, fused = footprint(False), footprint(True)
    assert fused <= plain * 1.05, (plain, fused)


# --------------------------------------------------------------------------- sparse grads, do_flatten
def test_sparse_gradient_takes_the_exact_per_tensor_step():
    def run(fuse):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(20, 4, sparse=True)
        head = torch.nn.Linear(4, 1)
        opt = O.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1)
        if fuse:
            fuse_optimizer(opt)
        for i in range(4):
            opt.zero_grad()
            head(emb(torch.tensor([i, i + 1, 7]))).sum().backward()
            (opt.fuse_step if fuse else opt.step)()
        return emb.weight.detach().clone(), head.weight.detach().clone(), opt

    e1, h1, _ = run(False)
    with pytest.warns(FusionFallbackWarning, match="sparse gradient"):
        e2, h2, fused = run(True)
    torch.testing.assert_close(e1, e2, rtol=0, atol=0)
    torch.testing.assert_close(h1, h2, rtol=1e-6, atol=0)
    assert fusion_report(fused).unfused_params == 1 and fusion_report(fused).fused_params == 2


def test_do_flatten_false_adopts_contiguous_params_and_refuses_scattered_ones():
    storage = torch.randn(30)
    params = [torch.nn.Parameter(storage[:10].view(2, 5)), torch.nn.Parameter(storage[10:30])]
    # nn.Parameter() detaches but keeps the storage: both are views of `storage`, back to back
    opt = fuse_optimizer(O.SGD(params, lr=0.1), do_flatten=False, on_unsupported="fallback")
    ref = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.fuse_step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r - 0.1)
    assert fusion_report(opt).fused_params == 2 and params[0].data_ptr() == storage.data_ptr()

    with pytest.warns(FusionFallbackWarning, match="not already contiguous"):
        fuse_optimizer(O.SGD(TinyNet().parameters(), lr=0.1), do_flatten=False, on_unsupported="fallback")


# --------------------------------------------------------------------------- bad input
def test_bad_input_gets_named_errors():
    model = TinyNet()
    opt = fuse_optimizer(O.SGD(model.parameters(), lr=0.1))
    with pytest.raises(AlreadyFusedError, match="already fused"):
        fuse_optimizer(opt)
    with pytest.raises(NotAnOptimizerError, match="torch.optim.Optimizer"):
        fuse_optimizer(model)
    with pytest.raises(TypeError):  # NotAnOptimizerError is a TypeError too
        fuse_optimizer([p for p in model.parameters()])
    empty = O.SGD([{"params": []}], lr=0.1)
    with pytest.raises(EmptyOptimizerError, match="no parameters"):
        fuse_optimizer(empty)
    with pytest.raises(ValueError, match="on_unsupported"):
        fuse_optimizer(O.SGD(TinyNet().parameters(), lr=0.1), on_unsupported="ignore")


def test_refused_fusion_leaves_the_optimizer_untouched():
    model = TinyNet()
    before = [p.data_ptr() for p in model.parameters()]
    opt = LambLike(model.parameters())
    with pytest.raises(NotElementwiseError):
        fuse_optimizer(opt, on_unsupported="raise")
    assert not is_fused_optimizer(opt)
    assert [p.data_ptr() for p in model.parameters()] == before
    fuse_optimizer(opt, on_unsupported="fallback")  # and can still be fused differently afterwards


def test_moving_params_after_fusing_is_a_named_error():
    from bagua_integrations import LayoutChangedError

    model = TinyNet()
    opt = fuse_optimizer(O.SGD(model.parameters(), lr=0.1))
    model.double()
    model(torch.randn(2, 6, dtype=torch.double)).sum().backward()
    with pytest.raises(LayoutChangedError, match="before calling fuse_optimizer"):
        opt.fuse_step()


def test_replace_step_keeps_a_scheduler_built_before_fusing_quiet():
    model = TinyNet()
    opt = O.SGD(model.parameters(), lr=0.1)
    sched = O.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fuse_optimizer(opt, replace_step=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in batches(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
    assert fusion_report(opt).fused_steps == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_eager_runs_are_capped_to_cache_sized_pieces_and_stay_exact(monkeypatch):
    import bagua_integrations.fused_optimizer as fused_module

    monkeypatch.setattr(fused_module, "EAGER_RUN_ELEMENTS", 40)  # fc1.weight alone is 60 elements
    a, plain, b, fused = pair(O.Adam, dict(lr=1e-2), dict(lr=3e-3), compile=False)
    data = batches(8)
    train(a, plain, data)
    train(b, fused, data, step=fused.fuse_step)
    assert_same_params(a, b, rtol=0, atol=0)
    assert_same_state(plain, fused, rtol=0, atol=0)
    report = fusion_report(fused)
    # fc1.weight (60) and fc1.bias each get a run; fc2.weight (30) + fc2.bias (3) still fit in one
    assert report.fused_params == 4 and report.flat_runs == 3


def test_step_hooks_run_once_per_fused_step_and_see_the_real_parameters():
    model = TinyNet()
    opt = fuse_optimizer(O.Adam(model.parameters(), lr=1e-2), compile=False)
    real = [id(p) for p in model.parameters()]
    seen = []

    def pre(optimizer, args, kwargs):
        seen.append(("pre", [id(p) for g in optimizer.param_groups for p in g["params"]]))

    def post(optimizer, args, kwargs):
        state_is_per_param = all(optimizer.state[p]["exp_avg"].shape == p.shape for p in model.parameters() if p.grad is not None)
        seen.append(("post", [id(p) for g in optimizer.param_groups for p in g["params"]], state_is_per_param))

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    train(model, opt, batches(3), step=opt.fuse_step)
    assert [entry[0] for entry in seen] == ["pre", "post"] * 3
    assert all(entry[1] == real for entry in seen)
    assert all(entry[2] for entry in seen if entry[0] == "post")
    assert fusion_report(opt).flat_runs == 1 and not opt._bagua_fusion.planner.tokens_stale


# ---------------------------------------------------------------------- edits between steps (found in review)
def _edited_run(make, edit, steps=5, at=2):
    """Unfused and fused copies stepped side by side; ``edit(model, optimizer)`` runs on both before step ``at``
    (``edit`` may also be a dict ``{step: edit}``)."""
    import copy

    torch.manual_seed(0)
    plain_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fused_model = copy.deepcopy(plain_model)
    plain, fused = make(plain_model.parameters()), make(fused_model.parameters())
    fuse_optimizer(fused, compile=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(5, 4, generator=gen) * 10
        step_edit = edit.get(step) if isinstance(edit, dict) else edit if step == at else None
        if step_edit is not None:
            step_edit(plain_model, plain)
            step_edit(fused_model, fused)
        for model, opt in ((plain_model, plain), (fused_model, fused)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            (opt.fuse_step if opt is fused else opt.step)()
        for a, b in zip(plain_model.parameters(), fused_model.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=f"step {step}")
    return plain, fused, fused_model


@pytest.mark.parametrize("which", [0, 2])  # the first parameter of the flat run, and one inside it
def test_deleting_one_parameters_state_restarts_only_that_parameter(which):
    def edit(model, opt):
        del opt.state[model[which].weight]

    plain, fused, _ = _edited_run(lambda ps: torch.optim.Adam(ps, lr=0.01), edit)
    assert [s["step"].item() for s in fused.state.values()] != [5.0] * 4


def test_state_moved_to_another_key_restarts_the_parameter():
    """``optimizer.state[q] = optimizer.state.pop(p)`` for the last key: the same entries in the
    same order, under another key. p restarts, as after ``del``."""
    def move(model, opt):
        assert list(opt.state)[-1] is model[2].bias
        opt.state[torch.zeros(1)] = opt.state.pop(model[2].bias)

    _edited_run(lambda ps: torch.optim.Adam(ps, lr=0.01), move)


@pytest.mark.parametrize("how", ["in_place", "replaced"])
def test_editing_one_parameters_step_count_between_steps_is_followed(how):
    def edit(model, opt):
        entry = opt.state[model[2].weight]
        if how == "in_place":
            entry["step"].zero_()
        else:
            entry["step"] = torch.tensor(0.0)

    _edited_run(lambda ps: torch.optim.Adam(ps, lr=0.01), edit)


def test_a_parameter_whose_data_is_replaced_between_steps_is_put_back_in_its_slot():
    """``p.data = ...`` between two fused steps (weights loaded by assignment): the next step copies
    the new values into the flat buffer and makes ``p`` its view again, though its gradient still
    is one (the check that every slot is in place looks at both). BertAdam with its clipping is
    segmented: its runs span whole buffers, where that check decides them in one pass."""
    def load(model, opt):
        model[2].weight.data = model[2].weight.detach() * 0.5 + 1.0

    plain, fused, fused_model = _edited_run(lambda ps: BertAdam(ps, lr=0.01), load, steps=5, at=3)
    buffer_view = fused._bagua_fusion.layout.buffers()[0].param
    weight = fused_model[2].weight
    assert buffer_view.data_ptr() <= weight.data_ptr() < buffer_view.data_ptr() + buffer_view.numel() * 4


def test_a_python_step_count_edited_between_steps_is_followed_and_usual_steps_keep_the_watch(monkeypatch):
    """BertAdam counts steps in a Python int, replaced in every entry each step (its warm-up reads
    it). A usual step re-reads those numbers into the state watch instead of building a new one
    (the watch object stays); a user's edit of one count between steps is still seen, and that
    parameter leaves the run (shown to fail with the watch's value comparison switched off)."""
    def make(ps):
        return BertAdam(ps, lr=0.05, warmup=0.5, t_total=10, max_grad_norm=-1.0)

    def edit(model, opt):
        opt.state[model[2].weight]["step"] = 0

    from bagua_integrations import _planner

    watches = []
    original = _planner.StepPlanner._see_state

    def see_state(planner):
        original(planner)
        watches.append(planner._state_seen)

    monkeypatch.setattr(_planner.StepPlanner, "_see_state", see_state)
    _edited_run(make, {4: edit}, steps=7)
    assert watches[1] is watches[2] is watches[3], "a usual step built a new state watch"

    monkeypatch.setattr(_planner.StateWatch, "same_objects",
                        lambda watch, state, generation: watch.same_frame(state, generation))  # values not compared
    with pytest.raises(AssertionError, match="step 4"):
        _edited_run(make, {4: edit}, steps=7)


def test_a_replaced_entry_is_followed_after_it_looked_unchanged():
    """``optimizer.state[p]`` replaced by an equal-looking dict (same keys, same values): the next
    edit happens in the new dict, and must be followed like one in the old."""
    def copy_entry(model, opt):
        opt.state[model[2].weight] = dict(opt.state[model[2].weight])

    def replace_step(model, opt):
        opt.state[model[2].weight]["step"] = torch.tensor(0.0)

    _edited_run(lambda ps: torch.optim.Adam(ps, lr=0.01), {2: copy_entry, 3: replace_step}, steps=6)


def test_a_state_key_the_step_does_not_write_is_watched():
    """A key Adam neither reads nor writes, added to every entry (one run), then edited in place in
    one: that parameter leaves the run, and keeps its value (a run's scalar state is written back
    from its first parameter)."""
    def add_key(model, opt):
        for p in model.parameters():
            opt.state[p]["mark"] = torch.tensor(0.0)

    def edit_key(model, opt):
        opt.state[model[2].weight]["mark"].fill_(1.0)

    plain, fused, fused_model = _edited_run(lambda ps: torch.optim.Adam(ps, lr=0.01), {2: add_key, 3: edit_key})
    marks = [fused.state[p]["mark"].item() for p in fused_model.parameters()]
    assert marks == [plain.state[p]["mark"].item() for p in plain.param_groups[0]["params"]] == [0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, lr=0.01), lambda ps: BertAdamLike(ps, lr=0.01)],
                         ids=["tensor_step", "int_step"])
def test_only_an_edit_replans_the_runs(make, monkeypatch):
    """The state check must not see a fused step's own writes as an edit (step counts advanced in
    place, or Python numbers replaced): only the first step and the one after an edit re-plan."""
    from bagua_integrations._planner import StepPlanner

    retokens = []
    retoken = StepPlanner._retoken
    monkeypatch.setattr(StepPlanner, "_retoken", lambda self: (retokens.append(1), retoken(self))[1])
    model = TinyNet()
    opt = fuse_optimizer(make(model.parameters()), compile=False)
    train(model, opt, batches(4), step=opt.fuse_step)
    assert len(retokens) == 1
    opt.state[model.fc2.weight] = dict(opt.state[model.fc2.weight])  # an equal, new entry
    train(model, opt, batches(3), step=opt.fuse_step)
    assert len(retokens) == 2


def test_a_parameter_without_a_gradient_keeps_the_usual_steps_on_the_fast_path(monkeypatch):
    """A model's unused parameter (BERT's pooler under a masked-LM loss) has no gradient: the usual
    step still finds its runs in C-level passes (not slot by slot), the runs end around it, and it
    is left alone, as the unfused step leaves it."""
    from bagua_integrations._compile import compile_unavailable_reason
    from bagua_integrations._planner import StepPlanner

    if (reason := compile_unavailable_reason()) is not None:
        pytest.skip(reason)

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 6), torch.nn.Linear(6, 2))

    def loss(model, x):  # the middle layer's weight gets no gradient; its bias does
        return model[2](model[0](x)[:, :1] * model[1].bias.unsqueeze(0)).pow(2).sum()

    plain_model, fused_model = make_model(), make_model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01)
    # (compiled: an eager step caps its runs' length, and finds them slot by slot)
    fused = fuse_optimizer(torch.optim.AdamW(fused_model.parameters(), lr=0.01), compile=True)
    slot_by_slot = []
    joins = StepPlanner._joins_a_run
    monkeypatch.setattr(StepPlanner, "_joins_a_run", lambda self, *a: (slot_by_slot.append(1), joins(self, *a))[1])
    for step in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for model, opt, take in ((plain_model, plain, plain.step), (fused_model, fused, fused.fuse_step)):
            opt.zero_grad(set_to_none=True)
            loss(model, x).backward()
            take()
        if step == 1:
            slot_by_slot.clear()
    assert fused_model[1].weight.grad is None
    assert not slot_by_slot, f"{len(slot_by_slot)} slots planned one by one in the usual steps"
    assert_same_params(plain_model, fused_model, rtol=1e-5, atol=1e-6)  # (compiled: multiply-adds may fuse)
    report = fusion_report(fused)
    assert report.fused_params == 5 and report.compiled, report


def test_parameters_that_are_not_contiguous_keep_their_strides():
    """A flat-buffer view is contiguous: channels_last and transposed parameters keep their exact step."""
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    linear = torch.nn.Linear(6, 4)
    linear.weight = torch.nn.Parameter(torch.randn(6, 4).t())  # a transposed view
    params = [conv.weight, conv.bias, linear.weight, linear.bias]
    strides = [p.stride() for p in params]
    opt = fuse_optimizer(torch.optim.AdamW(params, lr=0.01), compile=False)
    assert [p.stride() for p in params] == strides
    report = fusion_report(opt)
    assert report.fused_params == 2 and report.unfused_params == 2, report
    assert any("not contiguous" in why for why in report.reasons.values()), report.reasons


def test_the_report_separates_the_layout_from_what_the_last_step_did():
    """Two plain .step() calls do not make the report read as if fusion was undone (issue 26)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    opt = fuse_optimizer(torch.optim.AdamW(model.parameters()), compile=False)
    assert fusion_report(opt).last_step == "none"
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    report = fusion_report(opt)
    assert (report.laid_out_params, report.kept_per_tensor_params, report.last_step) == (6, 0, "plain")
    assert "layout: 6 of 6 tensors in 1 flat buffer(s)" in str(report)
    assert "ordinary optimizer.step() (not fused" in str(report)
    model(torch.randn(2, 4)).sum().backward()
    opt.fuse_step()
    report = fusion_report(opt)
    assert report.last_step == "fused" and "last step: fused: 6 tensors" in str(report)


def test_state_made_in_init_seeds_the_probe_in_the_probe_tensors_dtype():
    """torch's Adagrad before 2.12 creates ``sum`` in ``__init__``, in the parameter's dtype; the
    probe copies such state onto its own fp32 tensors. A bf16 ``sum`` beside fp32 probe parameters
    made CUDA's foreach Adagrad refuse the probe ("Tensors of the same index must be on the same
    device and the same dtype"), and the group stayed unfused on a GPU (H200, torch 2.11). State in
    another dtype than the parameter's keeps its own."""
    from bagua_integrations._probe import _seed_pieces

    params = [torch.nn.Parameter(torch.randn(4, 3).bfloat16()), torch.nn.Parameter(torch.randn(3).bfloat16())]
    opt = O.SGD(params, lr=0.1)
    for p in params:
        opt.state[p] = {"sum": torch.full_like(p, 0.1), "mask": torch.ones(p.shape, dtype=torch.int32),
                        "step": torch.tensor(0.0)}
    like = [torch.zeros(5), torch.zeros(2, 2)]
    per_param, shaped = _seed_pieces(opt, opt.param_groups[0], like, torch.Generator().manual_seed(0))
    assert set(shaped) == {"sum", "mask"}
    for state, probe_param in zip(per_param, like):
        assert state["sum"].dtype == torch.float32 and state["sum"].shape == probe_param.shape
        assert torch.all(state["sum"] == torch.tensor(0.1).bfloat16().float())  # a constant stays that constant
        assert state["mask"].dtype == torch.int32 and state["step"].dtype == torch.float32


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_fused_optimizer_and_its_model_are_freed_once_the_program_drops_them(compile):
    """The flat buffers hold every parameter, gradient and state value: the gradient hooks that keep
    them filled must not make a cycle the garbage collector cannot see (autograd keeps hooks outside
    its view), or each model a program builds stays in memory with them."""
    import gc
    import weakref

    def build_and_train():
        model = TinyNet()
        optimizer = fuse_optimizer(BertAdam(model.parameters(), lr=1e-3), compile=compile)
        train(model, optimizer, batches(2))
        return [weakref.ref(o) for o in (model, optimizer, next(model.parameters()))]

    refs = build_and_train()
    gc.collect()
    assert [ref() is not None for ref in refs] == [False, False, False]
