"""BertAdam against independently written math, not only against itself.

The reference below is BERT's original update rule (pytorch_pretrained_bert 0.6's ``BertAdam``),
written from its description in float64 NumPy: per-parameter gradient clipping to
``max_grad_norm`` (as ``torch.nn.utils.clip_grad_norm_`` does: scale by
``max_norm / (norm + 1e-6)`` when that is below 1), Adam moments without bias correction,
decoupled weight decay added to the update, and the learning rate scheduled on the step count
*before* it is incremented (``warmup_linear``, ``warmup_cosine``, ``warmup_constant``). Both the
unfused and the fused (segmented, flat) BertAdam must follow it; a variant with an off-by-one
schedule must not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bagua_integrations import fuse_optimizer, fusion_report
from bagua_integrations.optim import BertAdam

STEPS = 12
T_TOTAL = 10  # past t_total the linear schedule reaches 0 and stays there


def _schedule(name, progress, warmup):
    if warmup == -1:
        return 1.0
    if progress < warmup:
        return progress / warmup
    if name == "warmup_linear":
        return max(0.0, (1.0 - progress) / (1.0 - warmup))
    if name == "warmup_cosine":
        return 0.5 * (1.0 + math.cos(math.pi * (progress - warmup) / (1.0 - warmup)))
    return 1.0  # warmup_constant


def reference_bert_adam(params, grads_per_step, *, lr, warmup, t_total, schedule, b1=0.9, b2=0.999, e=1e-6,
                        weight_decay=0.01, max_grad_norm=1.0):
    """BERT's BertAdam in float64: ``params`` a list of arrays, ``grads_per_step[t][i]`` each gradient."""
    params = [p.astype(np.float64).copy() for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for step, grads in enumerate(grads_per_step):
        scheduled = lr * _schedule(schedule, step / t_total, warmup) if t_total != -1 else lr
        for i, g in enumerate(grads):
            g = g.astype(np.float64)
            if max_grad_norm > 0:
                norm = np.sqrt((g * g).sum())
                coef = max_grad_norm / (norm + 1e-6)
                if coef < 1:
                    g = g * coef
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            update = m[i] / (np.sqrt(v[i]) + e)
            if weight_decay > 0:
                update = update + weight_decay * params[i]
            params[i] = params[i] - scheduled * update
    return params


SHAPES = [(6, 5), (5,), (3, 4, 2), (1,), (7,)]


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    # gradients of very different sizes, so that some are clipped and some are not
    grads = [[torch.randn(s, generator=g) * (0.05 if i % 2 else 3.0) for i, s in enumerate(SHAPES)]
             for _ in range(STEPS)]
    return params, grads


def _run(optimizer_class, params, grads, fuse, **kwargs):
    tensors = [torch.nn.Parameter(p.clone()) for p in params]
    opt = optimizer_class(tensors, **kwargs)
    if fuse:
        opt = fuse_optimizer(opt, compile=False, on_unsupported="raise")
    for step_grads in grads:
        for t, grad in zip(tensors, step_grads):
            t.grad = grad.clone()
        (opt.fuse_step if fuse else opt.step)()
    return [t.detach().numpy().astype(np.float64) for t in tensors], opt


def _max_relative_error(got, expected):
    return max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)) for a, b in zip(got, expected))


CASES = {
    "defaults (clip 1.0, no schedule)": dict(lr=1e-2, warmup=-1, t_total=-1, schedule="warmup_linear"),
    "warmup_linear": dict(lr=1e-2, warmup=0.3, t_total=T_TOTAL, schedule="warmup_linear"),
    "warmup_cosine": dict(lr=1e-2, warmup=0.2, t_total=T_TOTAL, schedule="warmup_cosine"),
    "warmup_constant, no clip, no decay": dict(lr=1e-2, warmup=0.25, t_total=T_TOTAL, schedule="warmup_constant",
                                               max_grad_norm=-1, weight_decay=0.0),
}


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("case", list(CASES))
def test_bert_adam_follows_berts_update_rule(case, fuse):
    params, grads = _problem()
    kwargs = CASES[case]
    expected = reference_bert_adam([p.numpy() for p in params], [[g.numpy() for g in gs] for gs in grads], **kwargs)
    got, opt = _run(BertAdam, params, grads, fuse, **kwargs)
    if fuse:
        clipped = kwargs.get("max_grad_norm", 1.0) > 0
        assert fusion_report(opt).group_paths == ["segmented" if clipped else "elementwise"]
    assert _max_relative_error(got, expected) < 1e-5, case


class OffByOneScheduleBertAdam(BertAdam):
    """A plausible bug: the schedule read after the step count is incremented."""

    @staticmethod
    def scheduled_lr(group, step):
        return BertAdam.scheduled_lr(group, step + 1)


def test_the_reference_sees_an_off_by_one_schedule():
    params, grads = _problem()
    kwargs = CASES["warmup_linear"]
    expected = reference_bert_adam([p.numpy() for p in params], [[g.numpy() for g in gs] for gs in grads], **kwargs)
    got, _ = _run(OffByOneScheduleBertAdam, params, grads, False, **kwargs)
    assert _max_relative_error(got, expected) > 1e-3


def test_the_reference_sees_clipping_over_the_whole_model():
    """Clipping all parameters to one global norm (another plausible bug) differs from per-parameter clipping."""
    params, grads = _problem()
    kwargs = CASES["defaults (clip 1.0, no schedule)"]
    expected = reference_bert_adam([p.numpy() for p in params], [[g.numpy() for g in gs] for gs in grads], **kwargs)
    globally = [[g * min(1.0, 1.0 / (torch.sqrt(sum((x * x).sum() for x in gs)) + 1e-6)) for g in gs] for gs in grads]
    got, _ = _run(BertAdam, params, globally, False, **dict(kwargs, max_grad_norm=-1))
    assert _max_relative_error(got, expected) > 1e-3
