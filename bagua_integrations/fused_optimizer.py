"""Generic fused optimizer: any PyTorch optimizer, updated over flat buffers where that is exact.

``fuse_optimizer(opt)`` keeps ``opt`` an instance of its own class. Its parameters, gradients
and parameter-shaped state become views of one contiguous buffer per (param group, device,
dtype), and ``opt.fuse_step()`` runs the optimizer's *own* ``step`` on a few flat tensors
instead of hundreds of small ones. Whether that is exact is decided first, per group, by
probes on synthetic tensors (``_paths.py``, ``_probe.py``): elementwise steps run on whole flat
runs, steps that reduce over whole parameters (LAMB, LARS, clipped BertAdam) on segmented runs
(``_segmented.py``), and anything else keeps its exact unfused step (or, on request, is refused).
"""

from __future__ import annotations

import contextlib
import enum
import weakref
import types
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._compile import AUTO_MIN_ELEMENTS, CompiledStep, compile_unavailable_reason
from ._late_reductions import RAISED, DryRun, LateReduction
from ._per_tensor import Bookkeeping, PerTensorSteps
from ._layout import FlatLayout, FusionConfig, is_sharded
from ._paths import ELEMENTWISE, PER_TENSOR, SEGMENTED
from ._planner import Run, StepPlan, StepPlanner
from ._probe import _PROBE_STEPS, _user_tensors, probe_per_tensor_calls
from ._segmented import BranchesDisagree, NotSegmentable, SegmentedMode
from ._state_dict import StateDictHooks
from ._verify import verified
from ._torch_compat import mark_step_taken, step_keeping_lr_scheduler_marker, unwrapped_step
from .errors import (
    AlreadyFusedError,
    CompileFallbackWarning,
    EmptyOptimizerError,
    FusionError,
    LateReductionError,
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


class NeedsWholeParameters(Exception):
    """A fused step over shards cannot step these parameters in flat runs (before their first step,
    or with state not shaped like them); their optimizer steps the whole parameters (``_sharded.py``)."""

    def __init__(self, params):
        super().__init__(f"{len(params)} shard(s) cannot be stepped in flat runs this step")
        self.params = params


class LastStep(enum.Enum):
    """Which kind of step the optimizer took last."""

    NONE = "none"  # no step yet
    FUSED = "fused"  # fuse_step(), or step() with replace_step=True
    ORDINARY = "ordinary"  # the class's own per-tensor step


# torch.optim's own elementwise optimizers (the classes themselves): their steps are torch's code,
# which mixes no parameter's elements at any step count or flag (tests/test_late_reductions.py runs
# the dry run on each, every flag, 12 steps), so the eager dry run (_late_reductions.py) is skipped
# for them; compiled steps are checked as for any optimizer (that check costs nothing per step).
TORCH_ELEMENTWISE = tuple(c for c in (getattr(torch.optim, name, None) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop"))
    if c is not None)

# Graphs the per-tensor compiled step may build: one per distinct parameter shape (and state
# layout) and param group (BERT-base: 8 shapes); beyond it the eager step runs.
PER_TENSOR_MAX_GRAPHS = 32


@dataclass
class FusionReport:
    """How the optimizer is laid out, and what its last step did (or will do, before the first one).

    The layout (``laid_out_params``, ``kept_per_tensor_params``, ``flat_buffers``, ``group_paths``)
    does not change with the steps; ``last_step`` ("none", "fused" or "plain": an ordinary
    ``optimizer.step()`` that bypassed the fused path) and the fields that describe it
    (``fused_params``, ``unfused_params``, ``flat_runs``, ``compiled``) do. ``str(report)`` reads both.
    """

    fused_params: int  # tensors the last step updated through flat buffers
    unfused_params: int  # tensors the last step updated one by one (refused groups, sparse grads, a plain step)
    flat_buffers: int
    flat_runs: int  # flat tensors handed to the optimizer on the last step (ideally == flat_buffers)
    fused_steps: int
    last_step_fused: bool
    compiled: bool = False  # the last step ran the compiled kernel
    compile_graphs: int = 0  # graphs compiled so far (the first compile and any recompiles)
    compile_seconds: float = 0.0  # wall time of the steps that compiled (kept out of step timings)
    compile_disabled_reason: Optional[str] = None
    reasons: Dict[str, str] = field(default_factory=dict)
    step_replaced: bool = False  # optimizer.step() runs the fused step too (replace_step=True)
    # per param group: "elementwise" (flat runs), "segmented" (flat runs, whole-parameter
    # reductions computed per parameter) or "per-tensor" (its exact unfused step)
    group_paths: List[str] = field(default_factory=list)
    # per param group: why it keeps its unfused step (None where it is fused)
    group_reasons: List[Optional[str]] = field(default_factory=list)
    # per param group: why it takes the path in group_paths (for every path)
    group_why: List[str] = field(default_factory=list)
    # nothing fused: the exact unfused step runs compiled, one parameter per call (_per_tensor.py)
    per_tensor_compiled: bool = False
    per_tensor_compile_reason: Optional[str] = None  # why not, where it could have
    laid_out_params: int = 0  # tensors that live in flat buffers (whatever the last step did)
    kept_per_tensor_params: int = 0  # tensors the layout keeps out of flat buffers
    last_step: str = "none"  # "none" (no step yet), "fused" or "plain" (optimizer.step() without fusion)
    # fused steps whose segmented parameters were taken per parameter: a Python branch of the step
    # on per-parameter values went different ways for them (``if weight_norm == 0:``)
    branch_fallback_steps: int = 0

    def __str__(self) -> str:
        total = self.laid_out_params + self.kept_per_tensor_params
        layout = (f"layout: {self.laid_out_params} of {total} tensors in {self.flat_buffers} flat buffer(s); "
                  f"param groups: {', '.join(self.group_paths) or '-'}")
        if self.last_step == "none":
            step = "no step yet"
        elif self.last_step == "plain":
            step = "an ordinary optimizer.step() (not fused: call fuse_step(), or fuse with replace_step=True)"
        else:
            step = (f"fused: {self.fused_params} tensors in {self.flat_runs} flat run(s)"
                    + (f", {self.unfused_params} one by one" if self.unfused_params else "")
                    + (", compiled" if self.compiled else ", eager"))
        return f"{layout}\nlast step: {step} ({self.fused_steps} fused steps so far)"


@dataclass
class FusionStats:
    """Counters behind :func:`fusion_report`."""

    fused_steps: int = 0
    last_step: LastStep = LastStep.NONE
    last_fused_params: int = 0
    last_per_tensor_params: int = 0
    branch_fallback_steps: int = 0
    last_runs: int = 0
    last_step_compiled: bool = False


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


_CAUTION = {ELEMENTWISE: 0, SEGMENTED: 1, PER_TENSOR: 2}


def _worst(paths) -> str:
    return max((p.path for p in paths.values()), key=_CAUTION.__getitem__)


def _describe_findings(what: List[str]) -> str:
    """``"compute linalg_vector_norm over a whole flat run"`` and the like, for messages."""
    ops = [w for w in what if not w.startswith(RAISED)]
    parts = []
    if ops:
        parts.append(f"compute {', '.join(ops)} over a whole flat run")
    parts += [f"fail when checked on copies ({w[len(RAISED):]})" for w in what if w.startswith(RAISED)]
    return "; ".join(parts)


class Fusion:
    """Everything :func:`fuse_optimizer` attaches to one optimizer (``optimizer._bagua_fusion``).

    Composed of one-job parts: the :class:`FusionConfig`, the :class:`FlatLayout` (buffers and
    gradient hooks), the :class:`StepPlanner` (what each step hands to the optimizer), the
    optional :class:`CompiledStep`, and :class:`FusionStats`. This object only sequences them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: FusionConfig):
        self.optimizer = optimizer
        self.config = config
        self.layout = FlatLayout(optimizer, config)
        self.planner = StepPlanner(optimizer, self.layout,
                                   EAGER_RUN_ELEMENTS if EAGER_RUN_ELEMENTS is not None else float("inf"))
        self.stats = FusionStats()
        self.compile_unavailable: Optional[str] = None  # why compile was asked for and cannot run here
        self.compiled_step = self._compiled_step()
        # An optimizer none of whose groups can be fused: its own step compiled one parameter per call.
        self.per_tensor_reason: Optional[str] = None  # why that is off, when it could apply
        self.per_tensor_steps = self._per_tensor_steps()
        # Per segmented call (runs told apart by shape): its mode, kept while the layout holds so
        # that compiled graphs stay valid, and its own compiled step (graphs, recompile budget).
        self.segmented: Dict[Tuple[str, ...], Tuple[SegmentedMode, Optional[CompiledStep]]] = {}
        if self.compiled_step is not None and any(g.path == SEGMENTED for g in self.layout.groups.values()):
            self._segmented_compile_refused()  # warned now, where this torch cannot compile them
        self.step_before_fusing = optimizer.__dict__.get("step")  # restored by unfuse()
        self._just_fused = False  # set by a fused step, consumed by its own post-hook
        self._replay = None  # during a step given a closure: the closure the optimizer's own step gets
        # Steps planned elementwise are checked before they run for operations that mix the elements
        # of a flat run (a reduction that begins after the probes' window; _late_reductions.py):
        # compiled ones when a graph is compiled, eager ones by a dry run on copies.
        self.dry_run = DryRun()
        self.steps_seen = 0  # steps the optimizer took since fusing, fused or not (for messages)
        # groups the probes, seeded with their state, found exact where the dry run could not run (it
        # raised): not checked for the rest of this step, probed again when the next one raises too
        self._unchecked: set = set()
        self.handles = [optimizer.register_step_post_hook(self._after_any_step)]
        if self.layout.wrapper_reason is None:  # (a wrapper may lack the hook dicts; nothing of it is fused)
            self.handles.append(optimizer.register_load_state_dict_post_hook(lambda _: self.planner.invalidate()))
        # model.state_dict() and optimizer.state_dict() save compact copies, not whole flat buffers
        self.state_dict_hooks = StateDictHooks()
        if self.layout.wrapper_reason is None:
            self.state_dict_hooks.install(optimizer, self.layout)
            self.layout.on_refresh = self.state_dict_hooks.cover
        # The gradient hooks live on the parameters, which outlive the optimizer (a second
        # fine-tuning stage builds a new one): release them with it.
        weakref.finalize(optimizer, self.layout.hooks.remove_all)
        weakref.finalize(optimizer, self.state_dict_hooks.remove)

    def _compiled_step(self) -> Optional[CompiledStep]:
        if self.config.compile is False or not CompiledStep.eligible(self.optimizer):
            return None
        if self.config.compile == "auto" and self.layout.fused_elements() < AUTO_MIN_ELEMENTS:
            return None
        unavailable = self._compile_unavailable()  # an old torch or no compiler: one warning, now
        if unavailable is not None:
            self._warn_compile_off(unavailable, stacklevel=6)  # <- _compiled_step <- Fusion <- fuse_optimizer <- user
            return None
        return CompiledStep()

    def _compile_unavailable(self, path: str = "elementwise") -> Optional[str]:
        """Why ``path``'s compiled step cannot run here, for the devices the parameters are on (None: it can)."""
        device_types = sorted({p.device.type for group in self.optimizer.param_groups for p in group["params"]})
        return next(filter(None, (compile_unavailable_reason(path, t) for t in device_types or ["cpu"])), None)

    def _warn_compile_off(self, reason: str, stacklevel: int) -> None:
        """The one up-front warning, where compile=True asked for what cannot run here (an old torch,
        no compiler); the reason goes to ``fusion_report().compile_disabled_reason``."""
        if self.config.compile is True and self.compile_unavailable is None:
            warnings.warn(f"{reason}; the eager fused step runs instead", CompileFallbackWarning, stacklevel=stacklevel)
        self.compile_unavailable = self.compile_unavailable or reason

    def _segmented_compile_refused(self) -> bool:
        """Whether segmented calls stay eager on this torch (warned once, up front where possible)."""
        unavailable = self._compile_unavailable(SEGMENTED)
        if unavailable is not None:
            self._warn_compile_off(unavailable, stacklevel=6)  # <- _segmented_compile_refused <- Fusion <- fuse_optimizer <- user
        return unavailable is not None

    def _per_tensor_steps(self) -> Optional[PerTensorSteps]:
        layout, optimizer = self.layout, self.optimizer
        if layout.buffers() or not any(g.reason for g in layout.groups.values()):
            return None  # something is fused: the per-tensor parameters ride along in its step
        if self.config.compile is False or not CompiledStep.eligible(optimizer):
            return None
        elements = sum(p.numel() for g in layout.groups.values() for p in g.per_tensor)
        if self.config.compile == "auto" and elements < AUTO_MIN_ELEMENTS:
            return None
        unavailable = self._compile_unavailable(PER_TENSOR) or layout.wrapper_reason
        if unavailable is not None:
            self.per_tensor_reason = unavailable
            self._warn_compile_off(unavailable, stacklevel=6)  # <- _per_tensor_steps <- Fusion <- fuse_optimizer <- user
            return None
        for group in optimizer.param_groups:
            for device in {p.device for p in group["params"]}:
                reason = probe_per_tensor_calls(optimizer, group, device)
                if reason is not None:
                    self.per_tensor_reason = f"{type(optimizer).__name__} cannot be stepped one parameter per call: {reason}"
                    return None
        return PerTensorSteps(CompiledStep(max_graphs=PER_TENSOR_MAX_GRAPHS))

    def _after_any_step(self, optimizer, args, kwargs) -> None:
        self.steps_seen += 1
        if self._just_fused:
            self._just_fused = False
            self.stats.last_step = LastStep.FUSED
        else:
            # An ordinary per-tensor step may advance some parameters' scalar state and not others'.
            self.planner.invalidate()
            self.stats.last_step = LastStep.ORDINARY

    def _run_cap(self) -> float:
        # Eager steps stream every op over the whole run; cache-sized runs keep that in cache.
        # A compiled step reads each element once, so its runs span whole buffers.
        compiled = self.compiled_step is not None and self.compiled_step.disabled_reason is None
        # over shards every rank must make the same runs (each reduction is a collective)
        return float("inf") if compiled or self.config.shard_group is not None or EAGER_RUN_ELEMENTS is None else EAGER_RUN_ELEMENTS

    def step(self, closure=None):
        """One fused step: plan, run the optimizer's own step on the plan, write state back."""
        optimizer = self.optimizer
        if not self.layout.buffers() and (closure is not None or self.layout.wrapper_reason is not None):
            # Nothing is fused: the fused step is the optimizer's own step, closure and all (an
            # optimizer that re-evaluates the model through its closure, SAM-style, lands here,
            # as does a wrapper whose param_groups/state cannot be swapped).
            return self._run_unfused(closure)
        loss = replay = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            # The optimizer's own step gets the loss it would have computed (EmoNavi-style
            # optimizers scale their update by it): called once here, replayed to each call.
            replay = lambda: loss  # noqa: E731
        self._replay = replay
        every = self.config.verify
        if every and self.stats.fused_steps % every == 0:
            with verified(optimizer, self._run_own_step, FlatLayout.param_names(optimizer), self._reducing_params()):
                self._fused_step(optimizer)
        else:
            self._fused_step(optimizer)
        return loss

    def _reducing_params(self) -> set:
        """ids of the parameters not on the elementwise path (their steps may reduce over them)."""
        reducing = set()
        for index, group in enumerate(self.optimizer.param_groups):
            layout = self.layout.groups.get(index)  # (None: added since the last step, laid out by this one)
            per_tensor = {id(q) for q in layout.per_tensor} if layout is not None else set()
            for p in group["params"]:
                if layout is None or layout.path != ELEMENTWISE or id(p) in per_tensor:
                    reducing.add(id(p))
        return reducing

    def _fused_step(self, optimizer) -> None:
        """One fused step. A group planned elementwise whose step is about to mix the elements of its
        flat runs in a way the probes did not see (a reduction that begins after their window) has
        its path chosen again first; nothing of the step has run then (``_late_reductions.py``)."""
        try:
            for _ in range(len(optimizer.param_groups) + 1):
                try:
                    self._fused_step_once(optimizer)
                    return
                except LateReduction as late:
                    self._replan(late)
        finally:
            self._unchecked.clear()
        raise LateReductionError(  # (each re-plan changes a group's path or accepts what was seen: not reached)
            f"{type(optimizer).__name__}: its fused step kept mixing whole flat runs after its param groups were "
            "planned again; nothing of this step was applied. Train this optimizer unfused, and please report it."
        )

    def _replan(self, late: LateReduction) -> None:
        """Choose the path of each group in ``late`` again with the probes, seeded with its current
        state (which includes a step count past a warm-up), and lay it out on that path. Nothing of
        the current step has run. Refused where the group cannot switch (on_unsupported="raise")."""
        optimizer = self.optimizer
        cls = type(optimizer).__name__
        because = f"began to {late.what} at step {self.steps_seen + 1} after fusing"
        for index in sorted(late.groups):
            layout = self.layout.groups.get(index)
            if layout is None or layout.path != ELEMENTWISE:
                continue
            group = optimizer.param_groups[index]
            paths: Dict[torch.device, Any] = {}  # per device, the most cautious path any seeding gives
            for template in late.templates.get(index) or [None]:
                for buffer in layout.buffers:
                    path = self.layout.paths.choose_again(group, buffer.device, because, template)
                    known = paths.get(buffer.device)
                    if known is None or _CAUTION[path.path] > _CAUTION[known.path]:
                        paths[buffer.device] = path
            if all(p.path == ELEMENTWISE for p in paths.values()):
                # Exact with what was seen (the probes, seeded with this state, saw it too): accepted.
                for p in paths.values():
                    layout.mixing |= Counter(dict(p.mixing))
                found = late.findings.get(index, Counter())
                layout.mixing |= Counter({k: n for k, n in found.items() if not k.startswith(RAISED)})
                if any(k.startswith(RAISED) for k in found):
                    self._unchecked.add(index)  # this step only: the dry run cannot check it
                continue
            refused = next((p.why for p in paths.values() if p.path == PER_TENSOR), None)
            if refused is not None and self.config.on_unsupported == "raise":
                raise LateReductionError(
                    f"{cls} param group {index} was fused elementwise, and its step {because} (a reduction over "
                    f"whole parameters that began after the probes' {_PROBE_STEPS} steps, e.g. clipping after a "
                    f"warm-up); probed again it cannot be fused exactly ({refused}). Nothing of this step was "
                    "applied. Fuse with on_unsupported='fallback' (the default) to let the group switch to its "
                    "exact unfused step, or train this optimizer unfused; and please report the optimizer."
                )
            before = {device: self.layout.paths.choose(group, device) for device in paths}
            for device, path in paths.items():
                self.layout.paths.remember(group, device, path)
            try:
                self.layout.rebuild_group(index)
            except NotElementwiseError as exc:  # laying it out on that path is refused (do_flatten=False)
                for device, path in before.items():
                    self.layout.paths.remember(group, device, path)
                raise LateReductionError(
                    f"{cls} param group {index} was fused elementwise, and its step {because}; it cannot be "
                    f"laid out again on the {_worst(paths)} path here ({exc}). Nothing of this step was applied. "
                    "Fuse with on_unsupported='fallback' (the default), or train this optimizer unfused; and "
                    "please report the optimizer."
                ) from exc
            self.planner.invalidate()
            self.layout.warn_once(
                f"late{index}:{self.layout.groups[index].path}",
                f"{cls} param group {index} was fused elementwise, and its step {because}, after the probes' "
                f"{_PROBE_STEPS} steps: it now takes the {self.layout.groups[index].path} path, exact. Nothing of "
                "the step had been applied.",
                stacklevel=6,  # (+1 in warn_once) _replan <- _fused_step <- Fusion.step <- _fused_step <- hook wrapper <- user
            )

    def _runs_to_check(self, plan: StepPlan) -> List[Tuple[int, Run]]:
        """``(group index, run)`` for each run of several parameters of a group planned elementwise
        (assume_elementwise=True: none, the user vouched for the update)."""
        if self.config.assume_elementwise:
            return []
        groups = {id(buffer): index for index, layout in self.layout.groups.items()
                  if layout.path == ELEMENTWISE and index not in self._unchecked for buffer in layout.buffers}
        if not groups:
            return []
        return [(groups[id(run.buffer)], run) for run in plan.runs
                if run.segmentation is None and run.last - run.first > 1 and id(run.buffer) in groups]

    def _check_dry(self, raw_step, checked: List[Tuple[int, Run]], always: bool = False) -> None:
        """The dry run of this step (one run per group, scalar state, device and dtype: their steps
        take one course); raises LateReduction for what the probes did not see. Skipped for
        torch.optim's own elementwise optimizers (``TORCH_ELEMENTWISE``) unless ``always``."""
        if not always and type(self.optimizer) in TORCH_ELEMENTWISE:
            return
        chosen = {}
        for index, run in checked:
            chosen.setdefault((index, run.slots[0].token, run.proxy.device, run.proxy.dtype), (index, run))
        runs = list(chosen.values())
        findings = self.dry_run.findings(self.optimizer, raw_step, runs, self._replay)
        by_group: Dict[int, Counter] = {}
        new: set = set()
        templates: Dict[int, List[torch.Tensor]] = {}
        for k, found in findings.items():
            index, run = runs[k]
            by_group[index] = by_group.get(index, Counter()) | found
            extra = found - self.layout.groups[index].mixing
            if extra:
                new.update(extra)
                templates.setdefault(index, []).append(run.slots[0].param)
        if new:
            raise LateReduction(templates.keys(), _describe_findings(sorted(new)), by_group, templates)

    def _fused_step_once(self, optimizer) -> None:
        plan = self.planner.plan(self._run_cap())  # (refreshes the layout: settings changed since are seen)
        if self.config.shard_group is not None and any(p.grad is not None for p in plan.per_tensor):
            # a shard stepped on its own would reduce over this rank's part only: nothing has run yet
            raise NeedsWholeParameters([p for p in plan.per_tensor if p.grad is not None])
        swapped = plan.swapped_state(optimizer.state)
        compiled = []
        bookkeeping = []  # one fused step may call the optimizer's step several times (see below)

        def call(group_params, run):
            with swapped_params_and_state(optimizer, group_params, swapped):
                # A group-level or optimizer-level counter (``group["step"] += 1``, as timm's and
                # apex's LAMB keep it; ``self.state["k"]``) must advance once per step, not once
                # per call: every call after the first starts from the bookkeeping as it was.
                if bookkeeping:
                    bookkeeping[0].restore()
                else:
                    bookkeeping.append(Bookkeeping(optimizer))
                compiled.append(run())

        if self.per_tensor_steps is not None and not plan.runs and not plan.segmented_calls:
            call(plan.group_params, lambda: self._run_per_tensor_step(plan))
        elif any(plan.group_params) or not plan.segmented_calls:
            call(plan.group_params, lambda: self._run_optimizer_step(plan))
        branched = False
        for params, segmentations in plan.segmented_calls:
            try:
                call(params, lambda segmentations=segmentations: self._run_segmented_step(segmentations))
            except BranchesDisagree as exc:
                # undone (the mode's journal, the run state, and the bookkeeping as the next call
                # starts): these parameters take the optimizer's own step, each on its own
                branched = True
                cut = ", and their run is cut where they differ for the steps to come" if exc.taken else ""
                self.layout.warn_once(
                    "branches",
                    f"{type(optimizer).__name__}: {exc} on step {self.steps_seen + 1}; those parameters took "
                    f"that step per parameter{cut} (exact; fusion_report(opt).branch_fallback_steps counts such "
                    "steps)",
                    stacklevel=6,  # (+1 in warn_once) _fused_step_once <- _fused_step <- Fusion.step <- hook <- user
                )
                self.planner.split_where_branches_differ(plan, exc.segmentation, exc.taken)
                call(self.planner.per_parameter(plan, swapped, params), self._run_own_step)
        self.stats.branch_fallback_steps += branched
        self.stats.last_step_compiled = all(compiled)
        self.layout.note_own_keys()
        self.planner.write_back(plan, swapped)
        stats = self.stats
        stats.fused_steps += 1
        stats.last_fused_params = sum(run.last - run.first for run in plan.runs)
        stats.last_per_tensor_params = sum(1 for p in plan.per_tensor if p.grad is not None)
        stats.last_runs = len(plan.runs)
        self._just_fused = True
        mark_step_taken(optimizer)

    def _run_optimizer_step(self, plan: StepPlan) -> None:
        """The optimizer's own step (without its hooks) over the swapped-in flat tensors."""
        optimizer = self.optimizer
        raw_step, strips_grad_mode = unwrapped_step(type(optimizer))
        checked = self._runs_to_check(plan)
        # The first step creates state lazily; tracing it would cost a throw-away graph.
        ready = self.compiled_step is not None and bool(plan.runs) and all(run.state for run in plan.runs)
        if ready and self._replay is None:
            watched: Dict[int, frozenset] = {}  # a new graph must not mix the elements of these runs
            for index, run in checked:
                length = run.end - run.start
                watched[length] = watched.get(length, frozenset()) | {index}
            self.compiled_step.watched = watched
            try:
                compiled = self.compiled_step(optimizer, raw_step)
            except LateReduction:
                # A new graph mixes whole flat runs (refused before it ran). The dry run tells whether
                # that is what the probes saw and found exact (a global norm: the graph is compiled)
                # or something new (raised: the group's path is chosen again).
                with self._eager_grad_mode(strips_grad_mode):
                    self._check_dry(raw_step, checked, always=True)
                self.compiled_step.watched = {}
                compiled = self.compiled_step(optimizer, raw_step)
            if compiled:
                return True
        with self._eager_grad_mode(strips_grad_mode):
            if checked:
                self._check_dry(raw_step, checked)
            self._call_raw(raw_step)
        return False

    def _run_own_step(self) -> bool:
        """The optimizer's own eager step over whatever parameters its groups hold now: the real ones
        (verification mode's reference), or those a disagreeing branch hands back per parameter."""
        raw_step, strips_grad_mode = unwrapped_step(type(self.optimizer))
        with self._eager_grad_mode(strips_grad_mode):
            self._call_raw(raw_step)
        return False

    def _call_raw(self, raw_step) -> None:
        """The optimizer's unwrapped step, given the replayed closure when the user passed one."""
        if self._replay is None:
            raw_step(self.optimizer)
            return
        calls = []

        def once():
            if calls:  # the probes keep such optimizers unfused; a step that hid it from them lands here
                raise FusionError(
                    f"{type(self.optimizer).__name__}'s step called its closure a second time in one step (it "
                    "re-evaluates the model), which a fused step cannot do; this step may be partly applied. "
                    "Restore the last checkpoint and train with this optimizer unfused."
                )
            calls.append(1)
            return self._replay()

        raw_step(self.optimizer, once)

    def _run_unfused(self, closure):
        """The optimizer's own step with the user's closure, as unfused (nothing is fused)."""
        optimizer = self.optimizer
        raw_step, strips_grad_mode = unwrapped_step(type(optimizer))
        self.planner.invalidate()
        with self._eager_grad_mode(strips_grad_mode):
            loss = raw_step(optimizer) if closure is None else raw_step(optimizer, closure)
        self.stats.last_step_compiled = False
        self.stats.fused_steps += 1
        self.stats.last_fused_params = self.stats.last_runs = 0
        self.stats.last_per_tensor_params = sum(1 for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
        self._just_fused = True
        mark_step_taken(optimizer)
        return loss

    def _run_per_tensor_step(self, plan: StepPlan) -> bool:
        """Nothing fused: the optimizer's own step, compiled one parameter per call once every
        parameter has state (the first step creates it lazily, eagerly)."""
        optimizer = self.optimizer
        raw_step, strips_grad_mode = unwrapped_step(type(optimizer))
        ready = all(optimizer.state.get(p) for params in plan.group_params for p in params if p.grad is not None)
        if ready and self._replay is None and self.per_tensor_steps(optimizer, raw_step, plan.group_params,
                                           lambda: self._eager_grad_mode(strips_grad_mode)):
            return True
        with self._eager_grad_mode(strips_grad_mode):
            self._call_raw(raw_step)
        return False

    def _eager_grad_mode(self, strips_grad_mode: bool):
        """The grad mode the optimizer's own ``step`` wrapper would have set (we call it unwrapped)."""
        if not strips_grad_mode:
            return contextlib.nullcontext()
        # torch.set_grad_enabled takes effect when constructed: build it only when it is used.
        return torch.set_grad_enabled(bool(self.optimizer.defaults.get("differentiable", False)))

    def _run_segmented_step(self, segmentations) -> bool:
        """The optimizer's own step over segmented runs: whole-parameter reductions per parameter.
        Compiled when it can be (a segmented call only ever holds runs with state); True if it was."""
        optimizer = self.optimizer
        raw_step, strips_grad_mode = unwrapped_step(type(optimizer))
        key = tuple(seg.key for seg in segmentations)
        if key not in self.segmented:
            groups = self.layout.groups.values()
            # a step that branches on per-parameter values keeps a journal, to be undone where they
            # disagree; it stays eager (a compiled step cannot branch on a tensor's value)
            branches = any(group.value_branches for group in groups)
            shards = self.config.shard_group  # (its compiled all-reduces are not the eager step's)
            compiled = None if branches or self.compiled_step is None or self._segmented_compile_refused() \
                else CompiledStep(agree_over=shards.group if shards is not None else None)
            mode = SegmentedMode(segmentations, lone_lists_over_runs=any(group.lone_lists_over_runs for group in groups),
                                 journal=branches)
            if compiled is not None:  # the compiled step's per-block index, built once per layout
                for group in optimizer.param_groups:
                    for proxy in group["params"]:
                        seg = mode.by_shape.get(tuple(proxy.shape))
                        if seg is not None:
                            seg.index_blocks(proxy.device)
            self.segmented[key] = (mode, compiled)
        mode, compiled = self.segmented[key]
        mode.start_step()
        # a first step on runs (over shards) creates the state: tracing it would cost a throw-away graph
        creates_state = self.stats.fused_steps == 0 and not all(
            optimizer.state.get(p) for group in optimizer.param_groups for p in group["params"])
        if (compiled is not None and compiled.disabled_reason is None and self._replay is None and not creates_state
                and compiled(optimizer, raw_step, mode)):
            return True
        run_state = [  # entries the step may add, replace or remove (references: cheap)
            (entry, dict(entry)) for group in optimizer.param_groups for entry in
            (optimizer.state.get(proxy) for proxy in group["params"]) if entry is not None]
        if mode.journal is None:  # (a journal undoes any write; without one, a write is noted)
            mode.guard(_user_tensors(optimizer))  # (the runs', their gradients' and state's, swapped in)
        try:
            with self._eager_grad_mode(strips_grad_mode), mode:
                self._call_raw(raw_step)
        except NotSegmentable as exc:
            journaled = mode.journal is not None
            if journaled:
                mode.undo()  # what it wrote in place
            elif mode.wrote_guarded:  # nothing recorded to undo (the probes saw no branch on values)
                raise self._partly_applied(exc) from exc
            # (else it stopped before it wrote into a run, its gradient or its state: pytorch-optimizer's
            # FlashAdamW, quantize flipped off mid-run, dequantizes what quantize=True stored first)
            # undone: the run state's entries it set (a step count); the bookkeeping: by the caller,
            # which takes the step per parameter
            for entry, saved in run_state:
                entry.clear()
                entry.update(saved)
            if journaled and isinstance(exc, BranchesDisagree):
                raise
            raise BranchesDisagree(str(exc), None, None) from exc
        finally:
            mode.forget()
        if mode.journal is None and mode.notes.value_branches:
            mode.journal = {}  # it branched on per-parameter values, unseen by the probes: undoable from now on
        return False

    def _partly_applied(self, exc: Exception) -> FusionError:
        return FusionError(
            f"{type(self.optimizer).__name__}'s step did something on this step that its probe did not see "
            f"({exc}); some parameters may already be updated this step. Restore the last checkpoint and "
            "train with this optimizer unfused."
        )

    def remove(self) -> None:
        """Remove every hook this fusion installed."""
        self.layout.remove_hooks()
        self.layout.on_refresh = None
        self.state_dict_hooks.remove(self.layout)
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _fused_step(self, closure=None):
    """Update every flat buffer with one call of the optimizer's own ``step``.

    Wrapped by torch's ``Optimizer.profile_hook_step`` (below), so the optimizer's step pre- and
    post-hooks run exactly as for an ordinary step: once, outside the parameter swap, seeing the
    real parameters and per-parameter state.
    """
    return getattr(self, _ATTR).step(closure)


# torch.compile of a training step that calls it (as torch documents for plain optimizers) runs the
# fused step as it is, between two graphs: tracing into the flat buffers' swaps failed with bare torch
# errors, and the fused step compiles its own update (compile="auto"/True) either way
_fused_step = torch.compiler.disable(torch.optim.Optimizer.profile_hook_step(_fused_step))


def fuse_optimizer(
    optimizer: torch.optim.Optimizer,
    do_flatten: bool = True,
    *,
    replace_step: bool = False,
    on_unsupported: str = "fallback",
    assume_elementwise: bool = False,
    compile="auto",
    verify: Optional[int] = None,
) -> torch.optim.Optimizer:
    """Fuse ``optimizer`` in place and return it (still an instance of its own class).

    Over FSDP2's sharded parameters (DTensors, after ``fully_shard``) each rank fuses the shards it
    holds; reductions over a whole parameter combine every rank's partial values (one all-reduce per
    reduction for all parameters). A first step the probes did not find exact on flat runs is the
    optimizer's own DTensor step.

    Args:
        do_flatten: move parameters into new flat buffers. With ``False`` parameters stay where
            they are and only groups already contiguous in memory are fused.
        replace_step: make ``optimizer.step()`` take the fused path too, for frameworks that
            only ever call ``step()`` (HF Trainer, GradScaler, fairseq). ``fuse_step()`` always does.
        on_unsupported: what to do with a param group whose step cannot be fused exactly (its
            update depends on a parameter's shape, as Adafactor's or Shampoo's does).
            ``"fallback"`` (the default) keeps that group's exact unfused step, compiled one
            parameter per call where that is exact, with one :class:`FusionFallbackWarning`
            naming the reason; ``"raise"`` raises :class:`NotElementwiseError` instead, for
            users who want a guarantee that everything is fused. :func:`fusion_report` says
            which path each group takes and why. A group whose step begins reducing over whole
            parameters after the probes' three steps (clipping after a warm-up) is seen before
            that step runs and switches to an exact path then (one warning); under ``"raise"``,
            where that path is its unfused step, that step raises :class:`LateReductionError`
            with nothing of it applied.
        assume_elementwise: skip the probe and fuse anyway (only when you know the update is
            elementwise; a wrong guess changes the math, and nothing checks it later).
        compile: run each step as compiled kernels generated from the optimizer's own step
            (``torch.compile``/Inductor). ``"auto"`` compiles when the fused buffers hold at least
            2**20 elements and a compiler works; ``True`` always tries; ``False`` stays eager. A
            compile failure falls back to the eager fused step with one warning.
        verify: every ``verify``-th fused step, also run the optimizer's unfused step on the real
            parameters and compare (verification mode, like autograd's anomaly mode): a
            difference beyond rounding restores the unfused result and raises
            :class:`FusionMismatchError` naming the parameter. ``None`` reads the environment
            variable ``BAGUA_VERIFY_FUSED`` (unset or 0: off). A checked step costs one unfused
            step and about three copies of the parameters, gradients and state.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise NotAnOptimizerError(
            f"fuse_optimizer expects a torch.optim.Optimizer instance, got {type(optimizer).__name__}; "
            "build the optimizer first, e.g. fuse_optimizer(torch.optim.AdamW(model.parameters()))"
        )
    if "_optimizer_step_post_hooks" not in optimizer.__dict__:
        inner = getattr(optimizer, "optimizer", None)
        hint = (
            f"fuse the optimizer it wraps (a {type(inner).__name__}) before wrapping it, e.g. "
            "fuse_optimizer(opt) first and accelerator.prepare(..., opt) after, or hf_plugin.prepare"
            if isinstance(inner, torch.optim.Optimizer)
            else "fuse the torch.optim.Optimizer it wraps instead"
        )
        raise NotAnOptimizerError(
            f"{type(optimizer).__name__} did not run torch.optim.Optimizer.__init__ (it is a wrapper); {hint}"
        )
    if is_fused_optimizer(optimizer):
        raise AlreadyFusedError(
            f"this {type(optimizer).__name__} is already fused; call fuse_optimizer once per optimizer"
        )
    config = FusionConfig(do_flatten, replace_step, on_unsupported, assume_elementwise, compile, verify)
    if not any(group["params"] for group in optimizer.param_groups):
        raise EmptyOptimizerError(
            f"{type(optimizer).__name__} has no parameters to fuse; pass the model's parameters "
            "when building it (or add_param_group before fusing)"
        )
    if any(is_sharded(p) for group in optimizer.param_groups for p in group["params"]):
        from ._sharded import ShardedFusion  # (it builds on this module)

        fusion = ShardedFusion(optimizer, config)
        setattr(optimizer, _ATTR, fusion)
        weakref.finalize(optimizer, fusion.remove)
    else:
        setattr(optimizer, _ATTR, Fusion(optimizer, config))  # (warnings count the frames up to the user's)
    optimizer.fuse_step = types.MethodType(_fused_step, optimizer)
    if replace_step:
        fused_step = types.MethodType(_fused_step, optimizer)
        # an LR scheduler built before fusing wrapped step(); keep its marker
        optimizer.step = step_keeping_lr_scheduler_marker(optimizer, fused_step)
    return optimizer


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
    layout = _fusion(optimizer).layout
    layout.refresh()
    return [
        FlatSegment(buffer.grad, tuple(s.param for s in buffer.slots), tuple(s.start for s in buffer.slots))
        for buffer in layout.buffers()
    ]


def unfuse(optimizer) -> torch.optim.Optimizer:
    """Undo :func:`fuse_optimizer`'s hooks: ``optimizer`` steps like an ordinary one again.

    Removes the gradient hooks, the optimizer hooks, the state-dict hooks on the model's
    modules, ``fuse_step`` and the replaced ``step``.
    Parameters, gradients and state keep their values (they stay views of the flat memory,
    which is freed once nothing refers to it). Returns ``optimizer``.
    """
    _fusion(optimizer)  # (checks it is fused)
    fusion = getattr(optimizer, _ATTR)
    fusion.remove()
    for name in ("fuse_step", "step"):
        optimizer.__dict__.pop(name, None)
    if fusion.step_before_fusing is not None:
        optimizer.step = fusion.step_before_fusing
    delattr(optimizer, _ATTR)
    return optimizer


def is_fused_optimizer(optimizer: Any) -> bool:
    """True when ``optimizer`` went through :func:`fuse_optimizer`."""
    fusion = getattr(optimizer, _ATTR, None)
    return isinstance(fusion, Fusion) or hasattr(fusion, "shard_fusion")


def _fusion(optimizer) -> Fusion:
    """The :class:`Fusion` that lays out ``optimizer``'s tensors (over FSDP2 shards: its shards')."""
    if not is_fused_optimizer(optimizer):
        raise FusionError("this optimizer is not fused; call fuse_optimizer(optimizer) first")
    fusion = getattr(optimizer, _ATTR)
    return getattr(fusion, "shard_fusion", fusion)


def fused_layout(optimizer) -> FlatLayout:
    """The flat buffers of a fused optimizer (for tests and tools; communication code uses
    :func:`flat_grad_segments`)."""
    return _fusion(optimizer).layout


def fusion_report(optimizer) -> FusionReport:
    """Describe how much of ``optimizer`` is fused (for the last step, or the plan before one)."""
    fusion = _fusion(optimizer)
    layout, stats = fusion.layout, fusion.stats
    per_tensor = fusion.per_tensor_steps.compiled if fusion.per_tensor_steps is not None else None
    compiled = [c for c in [fusion.compiled_step, per_tensor] + [c for _, c in fusion.segmented.values()] if c is not None]
    buffers = len(layout.buffers())
    if stats.last_step is LastStep.NONE:
        fused, unfused, runs = layout.fused_params(), layout.per_tensor_params(), buffers
    elif stats.last_step is LastStep.FUSED:
        fused, unfused, runs = stats.last_fused_params, stats.last_per_tensor_params, stats.last_runs
    else:
        fused, unfused, runs = 0, sum(len(g["params"]) for g in optimizer.param_groups), 0
    return FusionReport(
        fused_params=fused,
        unfused_params=unfused,
        flat_buffers=buffers,
        flat_runs=runs,
        fused_steps=stats.fused_steps,
        # a "fused" step that fused nothing is not reported as one
        last_step_fused=stats.last_step is LastStep.FUSED and fused > 0,
        compiled=stats.last_step_compiled,
        compile_graphs=sum(c.graphs for c in compiled),
        compile_seconds=sum(c.compile_seconds for c in compiled),
        compile_disabled_reason=next((c.disabled_reason for c in compiled if c.disabled_reason), fusion.compile_unavailable),
        reasons=dict(layout.reasons),
        step_replaced=fusion.config.replace_step,
        group_paths=[layout.groups[i].path for i in sorted(layout.groups)],
        group_reasons=[layout.groups[i].reason for i in sorted(layout.groups)],
        group_why=[layout.groups[i].path_why for i in sorted(layout.groups)],
        per_tensor_compiled=per_tensor is not None and per_tensor.disabled_reason is None,
        per_tensor_compile_reason=fusion.per_tensor_reason or (per_tensor.disabled_reason if per_tensor else None),
        laid_out_params=layout.fused_params(),
        kept_per_tensor_params=layout.per_tensor_params(),
        last_step={LastStep.NONE: "none", LastStep.FUSED: "fused"}.get(stats.last_step, "plain"),
        branch_fallback_steps=stats.branch_fallback_steps,
    )
