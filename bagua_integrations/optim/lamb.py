"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning"), one tensor at a time.

The layer-wise optimizer of large-batch BERT pre-training: Adam's bias-corrected direction plus
decoupled weight decay, scaled per parameter by the trust ratio ``||p|| / ||update||`` (1 where
either norm is 0). The two norms are whole-parameter reductions, so ``fuse_optimizer`` fuses it
on the segmented path; the guard is a ``torch.where``, not a Python branch, so that one step
serves every parameter. Written plainly so that the fused and unfused steps run the same code.
"""

from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        max_trust: upper bound of the trust ratio (``None``: unbounded, as in the paper).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, max_trust=None):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}; it must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}; each must be in [0, 1)")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid eps {eps} or weight_decay {weight_decay}; both must be >= 0")
        if max_trust is not None and max_trust <= 0:
            raise ValueError(f"invalid max_trust {max_trust}; use a positive bound or None")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_trust=max_trust))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                # bias corrections as reciprocals: one division per element, not three (the step is
                # bound by arithmetic, not memory, with three); the same math up to rounding
                unbias1, unbias2 = 1 / (1 - beta1**step), 1 / (1 - beta2**step)
                update = (exp_avg * unbias1) / ((exp_avg_sq * unbias2).sqrt() + group["eps"])
                if group["weight_decay"] > 0:
                    update.add_(p, alpha=group["weight_decay"])
                weight_norm, update_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
                trust = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, 1.0)
                if group["max_trust"] is not None:
                    trust = trust.clamp(max=group["max_trust"])
                p.sub_(update * (group["lr"] * trust))
        return loss
