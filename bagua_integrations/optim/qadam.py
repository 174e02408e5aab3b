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
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}; it must be >= 0")
        if int(warmup_steps) != warmup_steps or warmup_steps < 1:
            raise ValueError(
                f"invalid warmup_steps {warmup_steps!r}; QAdam needs at least 1 step of plain Adam to build "
                "the second moment it then freezes (a few hundred in practice)"
            )
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}; each must be in [0, 1)")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid eps {eps} or weight_decay {weight_decay}; both must be >= 0")
        defaults = dict(lr=lr, warmup_steps=int(warmup_steps), betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults)

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


#: Bagua's name.
QAdamOptimizer = QAdam
