"""Planning one fused step: which tensors the optimizer's own ``step`` gets, and writing back.

The optimizer's ``step`` is run unchanged, on different tensors: for each param group, the
*runs* of adjacent flat slots that may be updated as one tensor this step (each handed over
as a *proxy* parameter with run-sized state), plus the parameters that must be stepped one
by one. Vocabulary (see also ``_flat.py``):

* **run** -- adjacent slots of one flat buffer that all have a dense gradient this step and
  whose scalar state is identical, so one call on the flat range is exactly the per-tensor
  calls. A parameter without a gradient ends a run (the optimizer would skip it).
* **token** -- an opaque object per slot: slots whose scalar state (Adam's ``step``, ...)
  is equal share a token; only slots with the same token can share a run. Tokens are
  recomputed from the state values after anything but a fused step may have changed them
  (an ordinary step, ``load_state_dict``, a layout change); a fused step gives every slot
  of a run one new token, since it advanced them together.
* **per-tensor parameters** -- stepped with their own tensors: groups that are not
  elementwise, sparse gradients, and state not shaped like the parameter.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Tuple

import torch

from ._flat import FlatBuffer, Slot
from ._layout import FlatLayout
from .errors import FusionError

# A slot's token when its state cannot be flattened (a tensor not shaped like the parameter,
# an unhashable value): it never joins a run.
UNFUSABLE_STATE = object()


@dataclass
class Run:
    """Slots ``[first, last)`` of ``buffer``, handed to the optimizer as the one tensor ``proxy``."""

    buffer: FlatBuffer
    first: int
    last: int
    proxy: torch.nn.Parameter
    state: Dict[str, Any] = field(default_factory=dict)  # the proxy's state for this step

    @property
    def slots(self) -> List[Slot]:
        return self.buffer.slots[self.first : self.last]

    @property
    def start(self) -> int:
        return self.buffer.slots[self.first].start

    @property
    def end(self) -> int:
        return self.buffer.slots[self.last - 1].end


@dataclass
class StepPlan:
    """What one fused step hands to the optimizer."""

    group_params: List[List[torch.Tensor]]  # per param group: proxies and per-tensor parameters
    runs: List[Run]
    per_tensor: List[torch.Tensor]  # real parameters among group_params

    def swapped_state(self, state) -> Dict[torch.Tensor, Dict[str, Any]]:
        """The state dict the optimizer sees during the step: run state per proxy, real state per tensor."""
        swapped: Dict[torch.Tensor, Dict[str, Any]] = defaultdict(dict)  # the optimizer creates state lazily
        for run in self.runs:
            swapped[run.proxy] = run.state
        for p in self.per_tensor:
            if p in state:
                swapped[p] = state[p]
        return swapped


def _state_signature(state: Dict[str, Any], param: torch.Tensor):
    """What must be equal for two parameters' state to be stepped as one run (None: never)."""
    tensors, scalars = [], []
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != param.shape:
                return None
            tensors.append((key, value.dtype))
        elif isinstance(value, torch.Tensor):
            scalars.append((key, value.item(), value.dtype, value.device))
        else:
            try:
                hash(value)
            except TypeError:
                return None
            scalars.append((key, value))
    return tuple(sorted(tensors, key=repr)), tuple(sorted(scalars, key=repr))


class StepPlanner:
    """Builds each step's :class:`StepPlan` and maps the resulting flat state back per parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: FlatLayout):
        self.optimizer = optimizer
        self.layout = layout
        self.tokens_stale = True

    def invalidate(self) -> None:
        """Something other than a fused step may have changed scalar state: recompute tokens."""
        self.tokens_stale = True

    def _retoken(self) -> None:
        state = self.optimizer.state
        tokens: Dict[Any, object] = {}
        for group in self.layout.groups.values():
            for slot in group.slots():
                signature = _state_signature(state.get(slot.param, {}), slot.param)
                slot.token = UNFUSABLE_STATE if signature is None else tokens.setdefault(signature, object())
        self.tokens_stale = False

    # ------------------------------------------------------------------ planning
    def plan(self, run_cap: float) -> StepPlan:
        """This step's work; ``run_cap`` bounds a run's length in elements."""
        if self.layout.refresh():
            self.tokens_stale = True
        if self.tokens_stale:
            self._retoken()
        plan = StepPlan([], [], [])
        for index in range(len(self.optimizer.param_groups)):
            group = self.layout.groups[index]
            params: List[torch.Tensor] = list(group.per_tensor)
            plan.per_tensor.extend(group.per_tensor)
            for buffer in group.buffers:
                for first, last in self._runs(buffer, run_cap, params, plan.per_tensor):
                    run = self._make_run(buffer, first, last)
                    plan.runs.append(run)
                    params.append(run.proxy)
            plan.group_params.append(params)
        return plan

    def _runs(self, buffer: FlatBuffer, run_cap: float, params, per_tensor) -> Iterator[Tuple[int, int]]:
        """The runs of ``buffer`` as ``(first, last)`` slot ranges; slots that must be stepped
        per tensor this step are appended to ``params`` and ``per_tensor`` on the way."""
        slots = buffer.slots
        first = None
        for i, slot in enumerate(slots):
            if not self._joins_a_run(buffer, slot, params, per_tensor):
                if first is not None:
                    yield first, i
                    first = None
                continue
            if first is not None and (slot.token is not slots[first].token or slot.end - slots[first].start > run_cap):
                yield first, i
                first = None
            if first is None:
                first = i
        if first is not None:
            yield first, len(slots)

    def _joins_a_run(self, buffer: FlatBuffer, slot: Slot, params, per_tensor) -> bool:
        """Put the slot's parameter and gradient back in place; False if it is not in a run this step."""
        buffer.sync_param(slot)
        if buffer.sync_grad(slot) and slot.token is not UNFUSABLE_STATE:
            return True
        if slot.param.grad is not None:  # sparse gradient, or state not shaped like the parameter
            self.layout.warn_once(
                f"per-tensor{id(slot)}",
                f"a fused parameter of shape {tuple(slot.param.shape)} is updated unfused this step "
                f"(sparse gradient or state not shaped like the parameter)",
                stacklevel=6,  # _joins_a_run <- _runs <- plan <- Fusion.step <- hooked step <- user
            )
            params.append(slot.param)
            per_tensor.append(slot.param)
            self.tokens_stale = True
        return False

    def _make_run(self, buffer: FlatBuffer, first: int, last: int) -> Run:
        state = self.optimizer.state
        run = Run(buffer, first, last, buffer.proxy(first, last))
        for key, value in state.get(buffer.slots[first].param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                for slot in run.slots:
                    per_param = state[slot.param]
                    per_param[key] = buffer.sync_state(key, slot, per_param[key])
                run.state[key] = buffer.state_slice(key, run.start, run.end)
            else:
                run.state[key] = value
        return run

    # ------------------------------------------------------------------ after the step
    def write_back(self, plan: StepPlan, swapped_state) -> None:
        """Map the state the optimizer produced for each proxy back onto every parameter's state."""
        state = self.optimizer.state
        for p in plan.per_tensor:
            if p in swapped_state:
                state[p] = swapped_state[p]
        for run in plan.runs:
            new_state = swapped_state.get(run.proxy, {})
            token = object()  # the run's slots were advanced together
            for key, value in new_state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    self._write_flat_state(run, key, value)
                else:
                    self._write_scalar_state(run, key, value)
            for slot in run.slots:
                slot.token = token

    def _write_flat_state(self, run: Run, key: str, value: torch.Tensor) -> None:
        if value.shape != run.proxy.shape:
            raise FusionError(
                f"{type(self.optimizer).__name__} created state '{key}' of shape {tuple(value.shape)} "
                f"for a flat tensor of shape {tuple(run.proxy.shape)}; its update is not elementwise. "
                "Fuse it with on_unsupported='fallback' and without assume_elementwise=True."
            )
        buffer, state = run.buffer, self.optimizer.state
        buffer.adopt_or_copy_state(key, run.start, run.end, value)
        for slot in run.slots:
            view = buffer.state_view(key, slot)
            per_param = state[slot.param]
            if per_param.get(key) is not view:
                per_param[key] = view

    def _write_scalar_state(self, run: Run, key: str, value) -> None:
        state = self.optimizer.state
        for slot in run.slots:
            per_param = state[slot.param]
            current = per_param.get(key)
            if current is value:
                continue
            if (
                isinstance(value, torch.Tensor)
                and isinstance(current, torch.Tensor)
                and current.shape == value.shape
                and current.dtype == value.dtype
                and current.device == value.device
            ):
                current.copy_(value)
            else:
                per_param[key] = value.clone() if isinstance(value, torch.Tensor) else value
