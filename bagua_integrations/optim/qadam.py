"""QAdam: Adam whose second moment freezes after a warm-up, so ranks need only share momentum.

Bagua's QAdam (and DeepSpeed's 1-bit Adam) rest on one observation: after a few hundred
steps Adam's second moment ``v`` changes slowly, and with ``v`` frozen the update depends
on the gradients only through the momentum ``m``, a smooth running average that survives
8-bit quantization far better than raw gradients. So:

* steps ``1 .. warmup_steps``: plain Adam (with L2 ``weight_decay`` as in ``torch.optim.Adam``);
  the ``qadam`` algorithm averages gradients in full precision, so this is exactly Adam on the
  averaged gradients;
* later steps: ``v`` and its bias correction stay as they were after step ``warmup_steps``;
  ``m`` keeps its running average and its bias correction. The denominator is
  ``max(sqrt(v_hat), |m_hat|)``, so no element moves more than ``lr`` per step: an element
  whose ``v`` froze at (nearly) 0 -- an embedding row of a token first seen after the warm-up --
  would otherwise be divided by ``eps`` and blow up (Bagua's QAdam has no such bound). While
  ``v`` is adequate, ``|m_hat| <= sqrt(v_hat)`` (as in Adam's own steady state) and the bound
  changes nothing.

Used alone, the later steps compute ``m = beta1 * m + (1 - beta1) * grad`` themselves. With the
``qadam`` algorithm attached (``bagua_init(model, QAdam(...), "qadam")``) each rank folds its
gradient into its momentum before communicating, the ranks average the *momentum* compressed
to uint8, and :attr:`QAdam.momentum_in_grad` tells the step that ``grad`` now holds that
averaged momentum. Every rank then holds the same ``m``, and the step stays elementwise, so
``fuse_optimizer`` fuses it (the algorithm's buckets are then slices of the flat buffers).
"""

from __future__ import annotations

import math

import torch

__all__ = ["QAdam", "QAdamOptimizer"]


class QAdam(torch.optim.Optimizer):
    """Adam with its second moment frozen after ``warmup_steps`` (Bagua's ``QAdamOptimizer``).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        warmup_steps: steps of plain Adam (full-precision communication) before ``v`` freezes;
            at least 1, a few hundred in practice.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient, as in ``torch.optim.Adam``; with
            ``decoupled_weight_decay=True`` the weights decay directly, as in ``torch.optim.AdamW``
            (better for transformers: an L2 term makes Adam pull rarely used embeddings to 0).
        decoupled_weight_decay: AdamW's weight decay instead of L2 (as ``torch.optim.Adam``'s flag).
    """

    #: Set by the ``qadam`` algorithm while it is attached: after warm-up, ``p.grad`` holds the
    #: ranks' averaged momentum ``beta1 * m + (1 - beta1) * grad`` instead of the gradient.
    momentum_in_grad: bool = False

    def __init__(self, params, lr: float = 1e-3, warmup_steps: int = 100, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled_weight_decay: bool = False):
        defaults = dict(lr=lr, warmup_steps=warmup_steps, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay)
        _check_group(defaults, "QAdam")
        defaults.update(warmup_steps=int(warmup_steps), betas=tuple(betas), decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group as torch does, and checks the group's own settings like the constructor's:
        a group's ``warmup_steps=0`` would divide by a zero bias correction (NaN weights)."""
        if isinstance(param_group, dict):  # anything else: torch's own error
            _check_group({**self.defaults, **param_group}, f"QAdam parameter group {len(self.param_groups)}")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        """Also what ``load_state_dict`` ends with: groups from a checkpoint of another optimizer
        (torch Adam/AdamW) get QAdam's keys from the defaults, and every group is checked."""
        defaults = state.get("defaults", getattr(self, "defaults", {}))  # unpickling: in ``state``
        for i, group in enumerate(state.get("param_groups", ())):  # before anything is replaced
            for key, value in defaults.items():
                group.setdefault(key, value)
            _check_group(group, f"QAdam parameter group {i}")
        super().__setstate__(state)

    @staticmethod
    def past_warmup(group, state) -> bool:
        """Whether this parameter's *next* step freezes ``v`` (its warm-up steps are all taken)."""
        return bool(state) and state["step"] >= group["warmup_steps"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            warmup, weight_decay = group["warmup_steps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("QAdam does not support sparse gradients; use dense embeddings (sparse=False)")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
                l2 = weight_decay if not group["decoupled_weight_decay"] else 0.0
                if weight_decay != 0 and not l2:
                    p.mul_(1 - group["lr"] * weight_decay)
                if step > warmup and self.momentum_in_grad:
                    # grad = the ranks' average of beta1 * m + (1 - beta1) * g; the L2 term is the
                    # same on every rank (equal weights), so it is added after averaging
                    exp_avg.copy_(p.grad)
                    if l2 != 0:
                        exp_avg.add_(p, alpha=(1 - beta1) * l2)
                else:
                    grad = p.grad if l2 == 0 else p.grad.add(p, alpha=l2)
                    exp_avg.lerp_(grad, 1 - beta1)
                    if step <= warmup:
                        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2 ** min(step, warmup)  # v froze with its correction
                denom = exp_avg_sq.sqrt().div_(math.sqrt(bias_correction2))
                if step > warmup:  # bounded: |update| <= lr where the frozen v is too small (see above)
                    torch.maximum(denom, exp_avg.abs().div_(bias_correction1), out=denom)
                p.addcdiv_(exp_avg, denom.add_(group["eps"]), value=-group["lr"] / bias_correction1)
        return loss


def _check_group(group: dict, where: str) -> None:
    """``ValueError`` naming the setting and its valid range, for values the step cannot use."""
    warmup = group["warmup_steps"]
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or int(warmup) != warmup or warmup < 1:
        raise ValueError(
            f"{where}: invalid warmup_steps {warmup!r}; QAdam needs an integer of at least 1 step of plain Adam to "
            "build the second moment it then freezes (a few hundred in practice)"
        )
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(isinstance(b, (int, float)) for b in betas)
            and 0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"{where}: invalid betas {betas!r}; pass two numbers, each in [0, 1)")
    for key in ("lr", "eps", "weight_decay"):
        value = group[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{where}: invalid {key} {value!r}; it must be a number >= 0")


#: Bagua's name.
QAdamOptimizer = QAdam
