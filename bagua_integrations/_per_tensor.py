"""The exact per-tensor step of optimizers that cannot be fused, compiled once per kind of tensor.

What cannot be fused (Adafactor's factored moments, Shampoo-style preconditioners) keeps the
optimizer's own step over its own tensors. Eager, that step is a few small ops per tensor;
``torch.compile(opt.step)`` makes it one traced loop over every parameter, whose compile time grows
with the model (minutes on BERT-base) and whose guards name every parameter object.

:class:`PerTensorSteps` calls the optimizer's own ``step`` once per parameter instead, on a
*stand-in*: always the same ``Parameter`` object (per device and dtype), given the real tensor's
``data`` and ``grad`` and the real state dict for that call, with every other group empty. The
compiled step therefore sees one parameter whose sizes vary: one graph per kind of tensor (rank,
state layout, branch taken) with dynamic sizes, a handful for a whole model, bounded by
``max_graphs``. The in-place updates land in the real tensors (the stand-in shares their memory),
and state entries the step assigns land in the real state dict (it is the same dict object).

Splitting one call into one call per parameter is exact only if the step's group-level and
optimizer-level bookkeeping (``group["step"] += 1``, ``self.state["k"]``) does not add up over
the parameters of a call: before every call but the first, that bookkeeping is put back to
what it was before the step (:class:`Bookkeeping`), so each call sees what the unfused loop's
parameter would see and the step ends with it applied once. ``probe_per_tensor_calls`` checks
this on synthetic tensors against the ordinary step before the path is used.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["Bookkeeping", "PerTensorSteps", "per_parameter_calls"]


class Bookkeeping:
    """The param groups' settings and the optimizer-level state (keys that are not tensors), restorable."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.groups = [self._snapshot({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]
        self.global_state = self._snapshot({k: v for k, v in optimizer.state.items() if not isinstance(k, torch.Tensor)})

    @staticmethod
    def _snapshot(entries: Dict[Any, Any]) -> Dict[Any, Tuple[Any, Optional[torch.Tensor]]]:
        return {k: (v, v.detach().clone() if isinstance(v, torch.Tensor) else None) for k, v in entries.items()}

    @staticmethod
    def _restore(target: Dict[Any, Any], saved, keep=lambda key: False) -> None:
        for key in [k for k in target if not keep(k) and k not in saved]:
            del target[key]
        for key, (value, copy) in saved.items():
            if copy is not None:
                with torch.no_grad():
                    value.copy_(copy)
            target[key] = value

    def restore(self) -> None:
        for group, saved in zip(self.optimizer.param_groups, self.groups):
            self._restore(group, saved, keep=lambda key: key == "params")
        self._restore(self.optimizer.state, self.global_state, keep=lambda key: isinstance(key, torch.Tensor))


def per_parameter_calls(optimizer, params_by_group: List[List[torch.Tensor]], call_one) -> bool:
    """Call ``call_one(p, alone)`` for each parameter with a gradient, in the unfused loop's order.

    ``alone(x)`` makes ``x`` the only parameter of ``p``'s group (every other group empty);
    ``call_one`` then runs the step. Before every call but the first, the group settings and
    optimizer-level state are put back as they were before the step (:class:`Bookkeeping`).
    ``call_one`` returning False stops the loop (and this returns False); the groups' parameter
    lists are restored either way.
    """
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    bookkeeping = Bookkeeping(optimizer)
    first = True
    try:
        for index, params in enumerate(params_by_group):

            def alone(x, index=index):
                for i, g in enumerate(groups):
                    g["params"] = [x] if i == index else []

            for p in params:
                if p.grad is None:
                    continue
                if not first:
                    bookkeeping.restore()
                first = False
                if call_one(p, alone) is False:
                    return False
    finally:
        for g, params in zip(groups, saved):
            g["params"] = params
    return True


class _StandIns:
    """The objects the compiled step sees: one parameter, one state dict and one tensor per state
    entry for each shape (and device, dtype, flags), re-pointed (``.data``) at the real tensors of
    that shape. Dynamo guards the optimizer's tensors by identity (torch marks them static):
    the same objects for every parameter of a shape keep those guards true, so there is one graph
    per distinct shape and state layout, and in-place updates land in the real tensors."""

    def __init__(self):
        self.params: Dict[Tuple, torch.nn.Parameter] = {}
        self.states: Dict[Tuple, Dict[str, Any]] = {}
        self.tensors: Dict[Tuple, torch.Tensor] = {}

    @staticmethod
    def _key(t: torch.Tensor, *extra) -> Tuple:
        # The shape too: Dynamo guards optimizer tensors by identity (static addresses), not by
        # size, so one stand-in must never be re-pointed at a tensor of another shape.
        return (*extra, tuple(t.shape), t.stride(), t.device, t.dtype, t.requires_grad)

    @staticmethod
    def _empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, device=t.device, dtype=t.dtype)

    def bind(self, p: torch.Tensor, real_state: Dict[str, Any]) -> Tuple[torch.nn.Parameter, Dict[str, Any], Dict[str, torch.Tensor]]:
        key = self._key(p)
        param = self.params.get(key)
        if param is None:
            param = self.params[key] = torch.nn.Parameter(self._empty(p), requires_grad=p.requires_grad)
        param.data = p.data
        param.grad = p.grad
        state = self.states.setdefault(key, {})
        state.clear()
        bound: Dict[str, torch.Tensor] = {}
        for name, value in real_state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                tkey = self._key(value, key, name)
                stand_in = self.tensors.get(tkey)
                if stand_in is None:
                    stand_in = self.tensors[tkey] = self._empty(value)
                stand_in.data = value.data
                bound[name] = stand_in
                state[name] = stand_in
            else:
                state[name] = value
        return param, state, bound

    def unbind(self, param, state: Dict[str, Any], bound: Dict[str, torch.Tensor], real_state: Dict[str, Any]) -> None:
        """Copy what the step assigned (new entries, replaced values) into the real state; release the real tensors."""
        for name, value in state.items():
            if bound.get(name) is not value:
                real_state[name] = value
        for name in [n for n in real_state if n not in state]:
            del real_state[name]
        for stand_in in bound.values():
            stand_in.data = self._empty(stand_in)
        state.clear()
        param.grad = None
        param.data = self._empty(param)


class PerTensorSteps:
    """Runs an unfusable optimizer's own step compiled, one parameter per call, on stand-ins.

    ``compiled`` is a :class:`~bagua_integrations._compile.CompiledStep` (dynamic shapes, its own
    graph budget). A call returns False, having run nothing, when the compiled path is off.
    """

    def __init__(self, compiled):
        self.compiled = compiled
        self.stand_ins = _StandIns()

    @property
    def disabled_reason(self) -> Optional[str]:
        return self.compiled.disabled_reason

    def __call__(self, optimizer, raw_step, params_by_group: List[List[torch.Tensor]], eager_grad_mode) -> bool:
        if self.compiled.disabled_reason is not None:
            return False
        state = optimizer.state
        done = []

        def call_one(p, alone):
            real_state = state[p]
            stand_in, stand_in_state, bound = self.stand_ins.bind(p, real_state)
            state[stand_in] = stand_in_state
            alone(stand_in)
            try:
                if not self.compiled(optimizer, raw_step):
                    if not done:  # nothing ran at all: the caller's eager step does everything
                        return False
                    with eager_grad_mode():  # the graph budget ran out mid-step: the rest eagerly
                        raw_step(optimizer)
            finally:
                del state[stand_in]
                self.stand_ins.unbind(stand_in, stand_in_state, bound, real_state)
            done.append(p)
            return True

        return per_parameter_calls(optimizer, params_by_group, call_one)
