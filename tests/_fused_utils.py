"""Shared helpers for the fused-optimizer tests: a small model, a training loop, comparisons."""

from __future__ import annotations

import math

import torch

SEED = 0


class TinyNet(torch.nn.Module):
    """Two layers that train, plus one that never receives a gradient."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(SEED)
        self.fc1 = torch.nn.Linear(6, 10).to(dtype)
        self.fc2 = torch.nn.Linear(10, 3).to(dtype)
        self.unused = torch.nn.Linear(3, 3).to(dtype)  # in the optimizer, never in forward

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def two_groups(model: TinyNet, **second):
    """Two param groups with different hyper-parameters (the second from ``second``)."""
    return [
        {"params": [model.fc1.weight, model.fc1.bias, model.unused.weight]},
        {"params": [model.fc2.weight, model.fc2.bias, model.unused.bias], **second},
    ]


def batches(steps: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(SEED + 1)
    return [(torch.randn(16, 6, generator=gen).to(dtype), torch.randn(16, 3, generator=gen).to(dtype)) for _ in range(steps)]


def train(model, optimizer, data, step=None, set_to_none=True, loss_fn=torch.nn.functional.mse_loss):
    """Plain loop: zero_grad(set_to_none), forward, backward, step. Returns the losses."""
    step = step or optimizer.step
    losses = []
    for x, y in data:
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = loss_fn(model(x), y)
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


def assert_same_params(model_a, model_b, rtol=1e-6, atol=1e-7):
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_same_state(opt_a, opt_b, rtol=1e-6, atol=1e-7):
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys(), (sa.keys(), sb.keys())
    for index in sa:
        assert sa[index].keys() == sb[index].keys()
        for key in sa[index]:
            va, vb = sa[index][key], sb[index][key]
            if isinstance(va, torch.Tensor):
                torch.testing.assert_close(va.float(), vb.float(), rtol=rtol, atol=atol, msg=lambda m: f"state[{index}][{key}]: {m}")
            else:
                assert va == vb, (index, key, va, vb)


def count_replans(monkeypatch):
    """The calls of ``Fusion._replan`` (a group's path chosen again after the late-reduction check
    saw something the probes did not; bagua_integrations/_late_reductions.py), as (class, what)."""
    from bagua_integrations import fused_optimizer as fused_module

    calls = []
    original = fused_module.Fusion._replan

    def counting(self, late):
        calls.append((type(self.optimizer).__name__, late.what))
        return original(self, late)

    monkeypatch.setattr(fused_module.Fusion, "_replan", counting)
    return calls


class PerParameterStep(torch.optim.Optimizer):
    """A test optimizer written as most are: settings as the group's defaults, and ``update(p,
    state, group)`` for each parameter with a gradient, under ``torch.no_grad()``."""

    def __init__(self, params, **defaults):
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, self.state[p], group)

    def update(self, p, state, group):
        raise NotImplementedError


class ForeachScalarsAdam(torch.optim.Optimizer):
    """An Adam written the way many installed optimizers are: ``torch._foreach_*`` calls over the
    group, hyper-parameters passed as Python scalars (``alpha=``, ``value=``, a lerp weight, plain
    scalar operands, a bias correction from a Python step count). Compiled on CUDA with torch 2.11,
    such scalars were baked into the first graph with no guard: a scheduled learning rate was
    silently ignored."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
            beta1, beta2 = group["betas"]
            lr, step = group["lr"], states[0]["step"]
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, math.sqrt(1 - beta2**step))
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / (1 - beta1**step))
        return None
