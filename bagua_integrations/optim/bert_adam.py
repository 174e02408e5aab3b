"""BertAdam: the per-tensor Adam variant of the original BERT code (the seed's example).

It differs from ``torch.optim.AdamW`` in three ways that matter here: no bias correction,
decoupled weight decay added to the update, and an optional per-parameter gradient clip
(``max_grad_norm``, on by default), which makes it *not* elementwise: ``fuse_optimizer``
fuses it on the segmented path (each parameter's norm computed per parameter over the flat
buffers). With ``max_grad_norm <= 0`` it is elementwise and takes the plain flat path.
"""

from __future__ import annotations

import math

import torch


def _warmup_linear(progress: float, warmup: float) -> float:
    if progress < warmup:
        return progress / warmup
    return max(0.0, (1.0 - progress) / max(1e-12, 1.0 - warmup))


def _warmup_cosine(progress: float, warmup: float) -> float:
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (progress - warmup) / max(1e-12, 1.0 - warmup)))


def _warmup_constant(progress: float, warmup: float) -> float:
    return progress / warmup if progress < warmup else 1.0


SCHEDULES = {"warmup_linear": _warmup_linear, "warmup_cosine": _warmup_cosine, "warmup_constant": _warmup_constant}


class BertAdam(torch.optim.Optimizer):
    """Adam with BERT's weight-decay fix, written one tensor at a time like the original.

    Args:
        lr: peak learning rate.
        warmup: fraction of ``t_total`` spent warming up (``-1``: no schedule).
        t_total: total number of steps for the schedule (``-1``: constant ``lr``).
        schedule: one of ``warmup_linear``, ``warmup_cosine``, ``warmup_constant``.
        b1, b2, e: Adam's betas and epsilon (no bias correction).
        weight_decay: decoupled weight decay added to the update.
        max_grad_norm: clip each parameter's gradient to this norm (``<= 0``: off).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        warmup: float = -1,
        t_total: int = -1,
        schedule: str = "warmup_linear",
        b1: float = 0.9,
        b2: float = 0.999,
        e: float = 1e-6,
        weight_decay: float = 0.01,
        max_grad_norm: float = 1.0,
    ):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}; it must be >= 0")
        if schedule not in SCHEDULES:
            raise ValueError(f"invalid schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
        if not (0.0 <= warmup < 1.0 or warmup == -1):
            raise ValueError(f"invalid warmup {warmup}; use a fraction in [0, 1) or -1")
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"invalid betas ({b1}, {b2}); each must be in [0, 1)")
        defaults = dict(
            lr=lr, warmup=warmup, t_total=t_total, schedule=schedule, b1=b1, b2=b2, e=e,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)

    @staticmethod
    def scheduled_lr(group, step: int) -> float:
        if group["t_total"] == -1 or group["warmup"] == -1:
            return group["lr"]
        return group["lr"] * SCHEDULES[group["schedule"]](step / group["t_total"], group["warmup"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("BertAdam does not support sparse gradients; use SparseAdam")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["next_m"] = torch.zeros_like(p)
                    state["next_v"] = torch.zeros_like(p)
                next_m, next_v = state["next_m"], state["next_v"]
                if group["max_grad_norm"] > 0:
                    torch.nn.utils.clip_grad_norm_(p, group["max_grad_norm"])
                next_m.mul_(group["b1"]).add_(grad, alpha=1 - group["b1"])
                next_v.mul_(group["b2"]).addcmul_(grad, grad, value=1 - group["b2"])
                update = next_m / (next_v.sqrt() + group["e"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p
                p.add_(update, alpha=-self.scheduled_lr(group, state["step"]))
                state["step"] += 1
        return loss
