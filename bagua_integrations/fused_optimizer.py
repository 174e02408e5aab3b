"""Generic fused optimizer: any elementwise PyTorch optimizer, updated over flat buffers.

``fuse_optimizer(opt)`` keeps ``opt`` an instance of its own class. Its parameters, gradients
and parameter-shaped state become views of one contiguous buffer per (param group, device,
dtype), and ``opt.fuse_step()`` runs the optimizer's *own* ``step`` on a few flat tensors
instead of hundreds of small ones. Whether that is exact is checked first by a probe
(see ``_probe.py``); optimizers whose update is not elementwise are refused or keep their
exact unfused step.
"""

from __future__ import annotations

import contextlib
import enum
import types
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._compile import AUTO_MIN_ELEMENTS, CompiledStep, compiler_available
from ._flat import FlatBuffer, Slot
from ._probe import probe_elementwise
from ._torch_compat import mark_step_taken, step_keeping_lr_scheduler_marker, unwrapped_step
from .errors import (
    AlreadyFusedError,
    CompileFallbackWarning,
    EmptyOptimizerError,
    FusionError,
    FusionFallbackWarning,
    NotAnOptimizerError,
    NotElementwiseError,
)

__all__ = [
    "fuse_optimizer",
    "unfuse",
    "is_fused_optimizer",
    "fusion_report",
    "FusionReport",
    "FlatSegment",
    "flat_grad_segments",
]

_ATTR = "_bagua_fusion"
# Longest run (in elements) an eager fused step hands to the optimizer; None: whole buffers.
EAGER_RUN_ELEMENTS = 1 << 20
_ON_UNSUPPORTED = ("raise", "fallback")
_COMPILE = (True, False, "auto")


class LastStep(enum.Enum):
    """Which kind of step the optimizer took last."""

    NONE = "none"  # no step yet
    FUSED = "fused"  # fuse_step(), or step() with replace_step=True
    ORDINARY = "ordinary"  # the class's own per-tensor step


@dataclass
class FusionReport:
    """What the fused optimizer did on its last step (or will do, before the first one)."""

    fused_params: int  # tensors updated through flat buffers
    unfused_params: int  # tensors updated one by one (refused groups, sparse grads, ...)
    flat_buffers: int
    flat_runs: int  # flat tensors handed to the optimizer on the last step (ideally == flat_buffers)
    fused_steps: int
    last_step_fused: bool
    compiled: bool = False  # the last step ran the compiled kernel
    compile_graphs: int = 0  # graphs compiled so far (the first compile and any recompiles)
    compile_seconds: float = 0.0  # wall time of the steps that compiled (kept out of step timings)
    compile_disabled_reason: Optional[str] = None
    reasons: Dict[str, str] = field(default_factory=dict)


@dataclass
class _Run:
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


class _GroupLayout:
    def __init__(self, params: List[torch.Tensor]):
        self.param_ids = tuple(id(p) for p in params)
        self.buffers: List[FlatBuffer] = []
        self.loose: List[torch.Tensor] = []  # always stepped per tensor

    def slots(self):
        for buffer in self.buffers:
            yield from buffer.slots


class FusedLayout:
    """All fusion bookkeeping of one optimizer, stored on it as ``optimizer._bagua_fusion``."""

    def __init__(self, optimizer, do_flatten, on_unsupported, assume_elementwise, compile="auto"):
        self.optimizer = optimizer
        self.compile = compile
        self.replace_step = False  # set by fuse_optimizer: .step() runs the fused update too
        self.do_flatten = do_flatten
        self.on_unsupported = on_unsupported
        self.assume_elementwise = assume_elementwise
        self.groups: Dict[int, _GroupLayout] = {}
        self.reasons: Dict[str, str] = {}
        self.dirty = True  # scalar-state tokens must be recomputed from values
        self.just_fused = False  # set by the fused step, consumed by _after_any_step
        self.fused_steps = 0
        self.last_step = LastStep.NONE
        self.last_fused_params = 0
        self.last_unfused_params = 0
        self.last_runs = 0
        self.compiled_step: Optional[CompiledStep] = None
        self.last_step_compiled = False
        self._probe_cache: Dict[Tuple[str, torch.device], Optional[str]] = {}
        self._warned = set()
        self.handles = [
            optimizer.register_step_post_hook(self._after_any_step),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]
        for index, group in enumerate(optimizer.param_groups):
            self._build_group(index, group)
        self._setup_compile()

    def _setup_compile(self) -> None:
        if self.compile is False or not CompiledStep.eligible(self.optimizer):
            return
        if self.compile == "auto" and self.fused_elements() < AUTO_MIN_ELEMENTS:
            return
        if not compiler_available():
            if self.compile is True:
                warnings.warn(
                    "torch.compile is not usable here (no working C++ compiler / Triton); the eager "
                    "fused step runs instead",
                    CompileFallbackWarning,
                    stacklevel=4,
                )
            return
        self.compiled_step = CompiledStep()

    def fused_elements(self) -> int:
        return sum(buffer.numel for layout in self.groups.values() for buffer in layout.buffers)

    def run_step(self, optimizer, runs) -> None:
        """The optimizer's own step (without its hooks) over the swapped-in flat tensors."""
        raw_step, strips_grad_mode = unwrapped_step(type(optimizer))
        # The first step creates state lazily; tracing it would cost a throw-away graph.
        ready = self.compiled_step is not None and all(run.state for run in runs)
        self.last_step_compiled = ready and self.compiled_step(optimizer, raw_step)
        if self.last_step_compiled:
            return
        differentiable = bool(optimizer.defaults.get("differentiable", False))
        # torch.set_grad_enabled takes effect when constructed: build it only when it is used.
        grad_mode = torch.set_grad_enabled(differentiable) if strips_grad_mode else contextlib.nullcontext()
        with grad_mode:
            raw_step(optimizer)

    # ------------------------------------------------------------------ layout construction
    def _warn_once(self, key: str, message: str, stacklevel: int) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, FusionFallbackWarning, stacklevel=stacklevel + 1)

    def _param_name(self, group, index, i, p) -> str:
        names = group.get("param_names")
        name = names[i] if names and i < len(names) else f"param_groups[{index}]['params'][{i}]"
        return f"{name} {tuple(p.shape)}"

    def _probe(self, group, device) -> Optional[str]:
        if self.assume_elementwise:
            return None
        key = (repr(sorted((k, repr(v)) for k, v in group.items() if k not in ("params", "param_names"))), device)
        if key not in self._probe_cache:
            self._probe_cache[key] = probe_elementwise(self.optimizer, group, device)
        return self._probe_cache[key]

    def _build_group(self, index: int, group: Dict[str, Any]) -> None:
        params = group["params"]
        layout = _GroupLayout(params)
        by_key: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        storages = defaultdict(int)
        for p in params:
            storages[p.untyped_storage().data_ptr()] += 1
        for i, p in enumerate(params):
            reason = None
            if p.numel() == 0:
                reason = "it has no elements"
            elif p.layout != torch.strided:
                reason = "it is not a dense tensor"
            elif storages[p.untyped_storage().data_ptr()] > 1 and self.do_flatten:
                reason = "it shares memory with another parameter (flattening would untie them)"
            if reason:
                self.reasons[self._param_name(group, index, i, p)] = reason
                layout.loose.append(p)
            else:
                by_key.setdefault((p.device, p.dtype), []).append(p)
        cls = type(self.optimizer).__name__
        for (device, dtype), members in by_key.items():
            reason = self._probe(group, device)
            if reason is None and not self.do_flatten and not FlatBuffer.adoptable(members):
                reason = "do_flatten=False and its parameters are not already contiguous in memory"
            if reason is not None:
                if self.on_unsupported == "raise":
                    self._remove_hooks()
                    raise NotElementwiseError(
                        f"{cls} (param group {index}) cannot be fused exactly: {reason}. Flattening would "
                        f"change its math (per-tensor norms, clipping or shape-dependent updates). Use "
                        f"fuse_optimizer(opt, on_unsupported='fallback') to keep its exact unfused step, or "
                        f"fuse_optimizer(opt, assume_elementwise=True) to force fusion if you know the update "
                        f"is elementwise."
                    )
                self._warn_once(
                    f"group{index}",
                    f"{cls} param group {index} keeps its unfused step: {reason}",
                    stacklevel=4,  # _build_group <- FusedLayout <- fuse_optimizer <- user
                )
                member_ids = {id(p) for p in members}
                for i, p in enumerate(params):
                    if id(p) in member_ids:
                        self.reasons[self._param_name(group, index, i, p)] = reason
                layout.loose.extend(members)
                continue
            # Trainable parameters first: frozen ones never get gradients and would split runs.
            ordered = [p for p in members if p.requires_grad] + [p for p in members if not p.requires_grad]
            if not self.do_flatten:
                ordered = members
            buffer = FlatBuffer(ordered, flatten=self.do_flatten)
            for slot in buffer.slots:
                if slot.param.requires_grad:
                    slot.hook = slot.param.register_post_accumulate_grad_hook(self._grad_hook(buffer, slot))
            layout.buffers.append(buffer)
        self.groups[index] = layout
        self.dirty = True

    @staticmethod
    def _grad_hook(buffer: FlatBuffer, slot: Slot):
        # After zero_grad(set_to_none=True) autograd hands over a fresh tensor: move it into
        # the flat gradient buffer so every step stays as fused as the first one.
        def hook(param: torch.Tensor) -> None:
            buffer.sync_grad(slot)

        return hook

    def _remove_hooks(self) -> None:
        for layout in self.groups.values():
            for slot in layout.slots():
                if slot.hook is not None:
                    slot.hook.remove()
                    slot.hook = None
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def refresh_groups(self) -> None:
        """Lay out groups added with ``add_param_group`` (or whose parameter lists changed)."""
        for index, group in enumerate(self.optimizer.param_groups):
            layout = self.groups.get(index)
            if layout is None or layout.param_ids != tuple(id(p) for p in group["params"]):
                if layout is not None:
                    for slot in layout.slots():
                        if slot.hook is not None:
                            slot.hook.remove()
                self._build_group(index, group)
        for index in [i for i in self.groups if i >= len(self.optimizer.param_groups)]:
            del self.groups[index]

    # ------------------------------------------------------------------ hooks on the optimizer
    def _after_any_step(self, optimizer, args, kwargs) -> None:
        if self.just_fused:
            self.just_fused = False
            self.last_step = LastStep.FUSED
        else:
            # An ordinary per-tensor step may advance some parameters' scalar state and not others'.
            self.dirty = True
            self.last_step = LastStep.ORDINARY

    def _after_load(self, optimizer) -> None:
        self.dirty = True

    # ------------------------------------------------------------------ scalar-state tokens
    @staticmethod
    def _signature(state: Dict[str, Any], param: torch.Tensor):
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

    def _retoken(self) -> None:
        state = self.optimizer.state
        tokens: Dict[Any, object] = {}
        for layout in self.groups.values():
            for slot in layout.slots():
                signature = self._signature(state.get(slot.param, {}), slot.param)
                slot.token = _LOOSE if signature is None else tokens.setdefault(signature, object())
        self.dirty = False

    # ------------------------------------------------------------------ one fused step
    def plan(self):
        """Decide this step's work: per group the tensors to hand to the optimizer, the flat runs
        among them, and the real parameters among them (stepped per tensor)."""
        self.refresh_groups()
        if self.dirty:
            self._retoken()
        state = self.optimizer.state
        # Eager steps stream every op over the whole run; cache-sized runs keep that in cache.
        # A compiled step reads each element once, so its runs span whole buffers.
        compiled = self.compiled_step is not None and self.compiled_step.disabled_reason is None
        run_cap = float("inf") if compiled or EAGER_RUN_ELEMENTS is None else EAGER_RUN_ELEMENTS
        group_params: List[List[torch.Tensor]] = []
        runs: List[_Run] = []
        loose: List[torch.Tensor] = []
        for index, group in enumerate(self.optimizer.param_groups):
            layout = self.groups[index]
            params: List[torch.Tensor] = list(layout.loose)
            loose.extend(layout.loose)
            for buffer in layout.buffers:
                first = None
                slots = buffer.slots
                for i, slot in enumerate(slots + [None]):
                    ok = False
                    if slot is not None:
                        buffer.sync_param(slot)
                        ok = buffer.sync_grad(slot) and slot.token is not _LOOSE
                        if not ok and slot.param.grad is not None:
                            # sparse gradient or non-elementwise state: exact per-tensor step
                            self._warn_once(
                                f"loose{id(slot)}",
                                f"a fused parameter of shape {tuple(slot.param.shape)} is updated unfused "
                                f"this step (sparse gradient or state not shaped like the parameter)",
                                stacklevel=3,  # plan <- fuse_step <- user
                            )
                            params.append(slot.param)
                            loose.append(slot.param)
                            self.dirty = True
                    if first is not None and not (
                        ok and slot.token is slots[first].token and slot.end - slots[first].start <= run_cap
                    ):
                        runs.append(self._make_run(buffer, first, i, state))
                        params.append(runs[-1].proxy)
                        first = None
                    if ok and first is None:
                        first = i
            group_params.append(params)
        return group_params, runs, loose

    def _make_run(self, buffer: FlatBuffer, first: int, last: int, state) -> _Run:
        run = _Run(buffer, first, last, buffer.proxy(first, last))
        for key, value in state.get(buffer.slots[first].param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                for slot in run.slots:
                    per_param = state[slot.param]
                    per_param[key] = buffer.sync_state(key, slot, per_param[key])
                run.state[key] = buffer.state_slice(key, run.start, run.end)
            else:
                run.state[key] = value
        return run

    def write_back(self, runs: List[_Run], swapped_state) -> None:
        """Map the flat state the optimizer produced back onto every parameter's state."""
        state = self.optimizer.state
        for run in runs:
            buffer = run.buffer
            new_state = swapped_state.get(run.proxy, {})
            token = object()
            for key, value in new_state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.shape != run.proxy.shape:
                        raise FusionError(
                            f"{type(self.optimizer).__name__} created state '{key}' of shape "
                            f"{tuple(value.shape)} for a flat tensor of shape {tuple(run.proxy.shape)}; "
                            "its update is not elementwise. Fuse it with on_unsupported='fallback' "
                            "and without assume_elementwise=True."
                        )
                    buffer.adopt_or_copy_state(key, run.start, run.end, value)
                    for slot in run.slots:
                        view = buffer.state_view(key, slot)
                        per_param = state[slot.param]
                        if per_param.get(key) is not view:
                            per_param[key] = view
                else:
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
            for slot in run.slots:
                slot.token = token

    def fused_params_total(self) -> int:
        return sum(len(buffer.slots) for layout in self.groups.values() for buffer in layout.buffers)

    def loose_params_total(self) -> int:
        return sum(len(layout.loose) for layout in self.groups.values())


_LOOSE = object()


@contextmanager
def swapped_params_and_state(optimizer, group_params, state):
    """Temporarily give ``optimizer`` other parameter lists (one per group) and another state dict."""
    saved_params = [group["params"] for group in optimizer.param_groups]
    saved_state = optimizer.state
    try:
        for group, params in zip(optimizer.param_groups, group_params):
            group["params"] = params
        optimizer.state = state
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved_params):
            group["params"] = params
        optimizer.state = saved_state


def _fused_step(self, closure=None):
    """Update every flat buffer with one call of the optimizer's own ``step``.

    Wrapped by torch's ``Optimizer.profile_hook_step`` (below), so the optimizer's step pre- and
    post-hooks run exactly as for an ordinary step: once, outside the parameter swap, seeing the
    real parameters and per-parameter state.
    """
    layout: FusedLayout = getattr(self, _ATTR)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    group_params, runs, loose = layout.plan()
    loose_count = sum(1 for p in loose if p.grad is not None)
    swapped = defaultdict(dict)
    for run in runs:
        swapped[run.proxy] = run.state
    for p in loose:
        if p in self.state:
            swapped[p] = self.state[p]
    with swapped_params_and_state(self, group_params, swapped):
        layout.run_step(self, runs)
    for p in loose:
        if p in swapped:
            self.state[p] = swapped[p]
    layout.write_back(runs, swapped)
    layout.fused_steps += 1
    layout.just_fused = True  # read by the layout's own post-hook, which runs next
    layout.last_fused_params = sum(run.last - run.first for run in runs)
    layout.last_unfused_params = loose_count
    layout.last_runs = len(runs)
    mark_step_taken(self)
    return loss


_fused_step = torch.optim.Optimizer.profile_hook_step(_fused_step)


def fuse_optimizer(
    optimizer: torch.optim.Optimizer,
    do_flatten: bool = True,
    *,
    replace_step: bool = False,
    on_unsupported: str = "raise",
    assume_elementwise: bool = False,
    compile="auto",
) -> torch.optim.Optimizer:
    """Fuse ``optimizer`` in place and return it (still an instance of its own class).

    Args:
        do_flatten: move parameters into new flat buffers. With ``False`` parameters stay where
            they are and only groups already contiguous in memory are fused.
        replace_step: make ``optimizer.step()`` take the fused path too, for frameworks that
            only ever call ``step()`` (HF Trainer, GradScaler, fairseq). ``fuse_step()`` always does.
        on_unsupported: ``"raise"`` a :class:`NotElementwiseError` for a non-elementwise optimizer,
            or ``"fallback"`` to its exact unfused step for those groups, with one warning.
        assume_elementwise: skip the probe and fuse anyway (only when you know the update is
            elementwise; a wrong guess changes the math).
        compile: run each step as compiled kernels generated from the optimizer's own step
            (``torch.compile``/Inductor). ``"auto"`` compiles when the fused buffers hold at least
            2**20 elements and a compiler works; ``True`` always tries; ``False`` stays eager. A
            compile failure falls back to the eager fused step with one warning.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise NotAnOptimizerError(
            f"fuse_optimizer expects a torch.optim.Optimizer instance, got {type(optimizer).__name__}; "
            "build the optimizer first, e.g. fuse_optimizer(torch.optim.AdamW(model.parameters()))"
        )
    if is_fused_optimizer(optimizer):
        raise AlreadyFusedError(
            f"this {type(optimizer).__name__} is already fused; call fuse_optimizer once per optimizer"
        )
    if on_unsupported not in _ON_UNSUPPORTED:
        raise ValueError(f"on_unsupported must be one of {_ON_UNSUPPORTED}, got {on_unsupported!r}")
    if compile not in _COMPILE:
        raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
    if not any(group["params"] for group in optimizer.param_groups):
        raise EmptyOptimizerError(
            f"{type(optimizer).__name__} has no parameters to fuse; pass the model's parameters "
            "when building it (or add_param_group before fusing)"
        )
    layout = FusedLayout(optimizer, do_flatten, on_unsupported, assume_elementwise, compile)
    layout.step_before_fusing = optimizer.__dict__.get("step")
    setattr(optimizer, _ATTR, layout)
    optimizer.fuse_step = types.MethodType(_fused_step, optimizer)
    if replace_step:
        _replace_step(optimizer)
    layout.replace_step = replace_step
    return optimizer


def _replace_step(optimizer) -> None:
    """Make ``optimizer.step`` the fused step (keeping an LR scheduler's marker if one wrapped it)."""
    fused_step = types.MethodType(_fused_step, optimizer)
    optimizer.step = step_keeping_lr_scheduler_marker(optimizer, fused_step)


@dataclass(frozen=True)
class FlatSegment:
    """One flat buffer of a fused optimizer, as the distributed code sees it.

    ``flat`` is a 1-D tensor; ``params[i]``'s view of it starts at element ``starts[i]`` (slots
    are aligned, so there may be padding between them). Parameters are in buffer order.
    """

    flat: torch.Tensor
    params: Tuple[torch.Tensor, ...]
    starts: Tuple[int, ...]


def flat_grad_segments(optimizer) -> List[FlatSegment]:
    """The flat gradient buffers of a fused optimizer, in param-group order.

    Every fused parameter's ``.grad`` is a view of its segment's ``flat`` (the optimizer's
    gradient hook moves a fresh gradient in), so communication can reduce gradients in place,
    bucket by bucket, without copying. Parameters that are not fused do not appear.
    """
    layout = fused_layout(optimizer)
    layout.refresh_groups()
    return [
        FlatSegment(buffer.grad, tuple(s.param for s in buffer.slots), tuple(s.start for s in buffer.slots))
        for index in sorted(layout.groups)
        for buffer in layout.groups[index].buffers
    ]


def unfuse(optimizer) -> torch.optim.Optimizer:
    """Undo :func:`fuse_optimizer`'s hooks: ``optimizer`` steps like an ordinary one again.

    Removes the gradient hooks, the optimizer hooks, ``fuse_step`` and the replaced ``step``.
    Parameters, gradients and state keep their values (they stay views of the flat memory,
    which is freed once nothing refers to it). Returns ``optimizer``.
    """
    layout = fused_layout(optimizer)
    layout._remove_hooks()
    for name in ("fuse_step", "step"):
        optimizer.__dict__.pop(name, None)
    if layout.step_before_fusing is not None:
        optimizer.step = layout.step_before_fusing
    delattr(optimizer, _ATTR)
    return optimizer


def is_fused_optimizer(optimizer: Any) -> bool:
    """True when ``optimizer`` went through :func:`fuse_optimizer`."""
    return isinstance(getattr(optimizer, _ATTR, None), FusedLayout)


def fused_layout(optimizer) -> FusedLayout:
    """The flat-buffer layout of a fused optimizer (used by the distributed reducer)."""
    if not is_fused_optimizer(optimizer):
        raise FusionError("this optimizer is not fused; call fuse_optimizer(optimizer) first")
    return getattr(optimizer, _ATTR)


def fusion_report(optimizer) -> FusionReport:
    """Describe how much of ``optimizer`` is fused (for the last step, or the plan before one)."""
    layout = fused_layout(optimizer)
    buffers = sum(len(group.buffers) for group in layout.groups.values())
    if layout.last_step is LastStep.NONE:
        fused, unfused, runs = layout.fused_params_total(), layout.loose_params_total(), buffers
    elif layout.last_step is LastStep.FUSED:
        fused, unfused, runs = layout.last_fused_params, layout.last_unfused_params, layout.last_runs
    else:
        fused, unfused, runs = 0, sum(len(g["params"]) for g in optimizer.param_groups), 0
    return FusionReport(
        fused_params=fused,
        unfused_params=unfused,
        flat_buffers=buffers,
        flat_runs=runs,
        fused_steps=layout.fused_steps,
        last_step_fused=layout.last_step is LastStep.FUSED,
        compiled=layout.last_step_compiled,
        compile_graphs=layout.compiled_step.graphs if layout.compiled_step else 0,
        compile_seconds=layout.compiled_step.compile_seconds if layout.compiled_step else 0.0,
        compile_disabled_reason=layout.compiled_step.disabled_reason if layout.compiled_step else None,
        reasons=dict(layout.reasons),
    )
