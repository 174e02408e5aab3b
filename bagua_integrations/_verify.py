"""Verification mode: every N fused steps, the unfused step runs too and the two must agree.

Like autograd's anomaly mode, a check users turn on when they want certainty rather than speed
(``fuse_optimizer(opt, verify=N)`` or ``BAGUA_VERIFY_FUSED=N``). The probes decide each group's
path from synthetic tensors at fuse time; what they cannot see (state kept on the optimizer keyed
by ``id(p)``, a parameter attribute or name read by the step, a reduction they saw whose effect
starts later) shows up here, on the real parameters. (A reduction that *begins* after their three
steps is caught before it runs, by default: ``_late_reductions.py``.)

On a checked step, :class:`Reference` first runs the optimizer's **own unfused step on the real
parameters** (their own identities, attributes and state), keeps its result, and puts every
parameter, gradient, state entry, group setting, optimizer attribute and the random number
generators back. Then the fused step runs as usual, and :meth:`Reference.check` compares each
parameter's and state tensor's update. A difference beyond rounding restores the unfused result
(so no wrong update stays in the model) and raises :class:`FusionMismatchError` naming the group,
the parameter and the size of the difference.

Cost of a checked step: one unfused step, and about three copies of the parameters, gradients
and optimizer state (before, the reference's result, the comparison), so ``verify=1`` roughly
triples a step's time and needs that memory; ``verify=100`` costs ~1-2% of training time.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._per_tensor import Bookkeeping
from .errors import FusionError, FusionMismatchError

ENV = "BAGUA_VERIFY_FUSED"


def verify_every(verify: Optional[int]) -> int:
    """The checking period from ``fuse_optimizer(verify=...)`` or, when that is None, the environment (0: off)."""
    if verify is None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return 0
        try:
            verify = int(raw)
        except ValueError:
            raise ValueError(f"{ENV} must be a whole number of steps (0: off), got {raw!r}") from None
    if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
        raise ValueError(f"verify must be a whole number of steps >= 0 (0: off), got {verify!r}")
    return verify


def tolerance(dtype: torch.dtype, numel: int, reduces: bool) -> float:
    """Allowed difference, relative to the size of the unfused update (see :meth:`Reference.check`).

    Elementwise steps differ only by how a compiled kernel rounds (fused multiply-adds: ~1e-6 of an
    update). Steps that reduce over a parameter (a norm for clipping or a trust ratio) also differ
    by the order of the reduction, which grows with the parameter's size: torch's own eager
    ``vector_norm`` of 2.3 M fp32 elements is 4e-5 off the exact value (the compiled one 1e-7), and
    an update scaled by that norm differs by as much. bf16/fp16: the update is rounded into the
    parameter, so a couple of units in its last place. Whatever the update's size, a difference of
    up to ``ROUNDING_ULPS`` units in the last place of the values is rounding (see
    :func:`_relative_difference`)."""
    if torch.finfo(dtype).bits < 32:
        return 2.0
    if not reduces:
        return 1e-4
    return max(1e-3, 64 * torch.finfo(dtype).eps * math.sqrt(numel))


def _optimizer_attributes(optimizer) -> Dict[str, Any]:
    """Containers an optimizer keeps on itself besides its groups and state (``self.norms = {}``)."""
    return {k: v for k, v in vars(optimizer).items()
            if not k.startswith("_") and k not in ("param_groups", "state", "defaults") and isinstance(v, (dict, list))}


def _rng_devices(params) -> List[int]:
    return sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})


# Units in the last place of a tensor's largest value that one step may differ by from rounding
# alone, however small its update: where an update shrinks towards the values' own rounding (Adam's
# first moment under a constant gradient moves by 0.9 ** step of it), a compiled step's fused
# multiply-add differs from the eager step by an ulp or two, which is a large part of such an update
# (BertAdam compiled, BERT-base's shapes at 8 elements: 1-2 ulps, 0.00108x of the update at step 65).
ROUNDING_ULPS = 4


@torch.no_grad()
def _relative_difference(got: torch.Tensor, expected: torch.Tensor, before: Optional[torch.Tensor],
                         allowed: float = 1.0) -> float:
    """max |got - expected|, relative to the unfused update's size, computed in the tensors' own
    dtype (no float64 copies). The size is taken as at least ``ROUNDING_ULPS`` units in the last
    place of the largest value over ``allowed`` (the tolerance it is compared with): such a difference
    is within that tolerance whatever the update. Complex tensors are compared as their real and
    imaginary parts (rounding and matching NaNs as for real ones). FSDP2's sharded parameters and
    state (DTensors) are compared whole, on every rank (an all-gather each: a rank's own shard may be
    empty, and every rank must reach the same verdict)."""
    from ._layout import is_sharded  # (_layout imports this module)

    if is_sharded(got) and is_sharded(expected):
        got, expected = got.full_tensor(), expected.full_tensor()
        before = before.full_tensor() if is_sharded(before) else None
    if expected.is_complex() and got.is_complex():
        got, expected = torch.view_as_real(got), torch.view_as_real(expected)
        before = torch.view_as_real(before) if before is not None and before.is_complex() else None
    if not expected.is_floating_point():
        return float(torch.ne(got, expected).any())
    difference = float(torch.sub(got, expected).abs_().amax()) if got.numel() else 0.0
    if difference != difference:  # a NaN: fine only where both have it
        return float("inf") if bool(torch.ne(got.isnan(), expected.isnan()).any()) else 0.0
    if difference == 0.0:
        return 0.0
    largest = float(expected.abs().amax())
    update = float(torch.sub(expected, before).abs_().amax()) if before is not None and before.shape == expected.shape \
        else largest
    rounding = ROUNDING_ULPS * torch.finfo(expected.dtype).eps * largest / allowed
    return difference / max(update, rounding, 1e-30)


class Reference:
    """The unfused step's result on the real parameters, taken before the fused step runs."""

    def __init__(self, optimizer: torch.optim.Optimizer, run_unfused, names: Dict[int, str], reducing: set):
        self.optimizer, self.names = optimizer, names
        self.reducing = reducing  # ids of parameters whose step reduces over the parameter (see tolerance())
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        state = optimizer.state
        before = {id(p): p.detach().clone() for p in self.params}
        grads = {id(p): p.grad.detach().clone() for p in self.params if p.grad is not None}
        states = {id(p): Bookkeeping._snapshot(state[p]) for p in self.params if p in state}
        bookkeeping = Bookkeeping(optimizer)
        attributes = {k: copy.deepcopy(v) for k, v in _optimizer_attributes(optimizer).items()}
        try:
            with torch.random.fork_rng(devices=_rng_devices(self.params)):  # the fused step draws the same numbers
                run_unfused()
            # what the unfused step made of each parameter and state entry
            self.expected = {id(p): p.detach().clone() for p in self.params}
            self.expected_state = {id(p): {k: v.detach().clone() for k, v in state.get(p, {}).items()
                                           if isinstance(v, torch.Tensor)} for p in self.params}
        except Exception as exc:
            self._put_back(before, grads, states, bookkeeping, attributes)
            raise FusionError(
                f"verification: {type(optimizer).__name__}'s own unfused step fails here ({type(exc).__name__}: "
                f"{exc}), so there is nothing to check the fused step against; nothing of it was applied. "
                "Train without verify (or check the optimizer on a model it can step unfused)"
            ) from exc
        self.before = before
        self.before_state = {key: {k: copy for k, (_, copy) in entries.items() if copy is not None}
                             for key, entries in states.items()}
        self._put_back(before, grads, states, bookkeeping, attributes)

    def _put_back(self, before, grads, states, bookkeeping, attributes) -> None:
        """Parameters, gradients, state, settings and attributes as they were before the unfused step."""
        optimizer, state = self.optimizer, self.optimizer.state
        with torch.no_grad():
            for p in self.params:
                p.copy_(before[id(p)])
                if id(p) in grads:
                    p.grad.copy_(grads[id(p)])
        for p in self.params:
            if id(p) in states:
                Bookkeeping._restore(state.setdefault(p, {}), states[id(p)])
            elif p in state:
                del state[p]
        bookkeeping.restore()
        for key, value in attributes.items():
            setattr(optimizer, key, value)

    def _compared(self, p):
        """``(what, fused result, unfused result, value before the step)`` for ``p`` and each of its
        state tensors that both steps left with the same shape."""
        yield "its value", p.detach(), self.expected[id(p)], self.before[id(p)]
        entry = self.optimizer.state.get(p, {})
        for key, expected in self.expected_state[id(p)].items():
            got = entry.get(key)
            if isinstance(got, torch.Tensor) and got.shape == expected.shape:
                yield f"its state {key!r}", got.detach(), expected, self.before_state.get(id(p), {}).get(key)

    def _worst(self) -> Optional[Tuple[float, str, str]]:
        """(relative difference, parameter name, what) of the largest difference beyond tolerance."""
        worst = None
        for p in self.params:
            for what, got, expected, before in self._compared(p):
                allowed = tolerance(expected.dtype, expected.numel(), id(p) in self.reducing)
                error = _relative_difference(got, expected, before, allowed)
                if error > allowed and (
                        worst is None or error > worst[0]):
                    worst = (error, self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}"), what)
        return worst

    def check(self) -> None:
        """Compare the fused step's result; on a difference, put the unfused result in place and raise."""
        worst = self._worst()
        if worst is None:
            return
        with torch.no_grad():
            for p in self.params:
                for _, got, expected, _ in self._compared(p):
                    got.copy_(expected)
        error, name, what = worst
        raise FusionMismatchError(
            f"verification: the fused step of {type(self.optimizer).__name__} differs from its unfused step for "
            f"{name} ({what}: {error:.3g}x the size of the unfused update). The parameters and state now hold "
            "the unfused step's result. Train this optimizer unfused (do not call fuse_optimizer on it), and "
            "please report the optimizer: its step depends on something the fusion probes did not see."
        )


@contextlib.contextmanager
def verified(optimizer, run_unfused, names, reducing):
    """``with verified(...): fused step`` -- the unfused reference before, the check after."""
    reference = Reference(optimizer, run_unfused, names, reducing)
    yield
    reference.check()
