"""Which path each param group takes, decided once, before anything is laid out.

A group's update is one of:

* ``"elementwise"`` -- each element's update depends on that element alone: its parameters go
  into flat buffers and the optimizer's own step runs on whole flat runs;
* ``"segmented"`` -- elementwise except for reductions over a whole parameter (norms, clipping,
  trust ratios): flat runs of one rank, every reduction computed per parameter
  (``_segmented.py``);
* ``"per-tensor"`` -- anything else: the optimizer's own exact step over its own tensors.

:class:`PathChooser` asks the optimizer itself (``_probe.py``) rather than an allowlist, caches the
answer per group settings and device, and keeps the reason for every path, so that
``fusion_report(opt).group_why`` can say why each group runs as it does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ._probe import probe_elementwise, probe_segmented
from ._segmented import StepNotes

ELEMENTWISE, SEGMENTED, PER_TENSOR = "elementwise", "segmented", "per-tensor"

# A step that reads per-parameter values into Python (``if exp_avg_sq == 0:``, ``.item()``) is exact on
# segmented runs (``_segmented.SegmentedMode._value_per_parameter``: undone and taken per parameter where
# the parameters differ), but only eagerly, with a journal of its writes. On a CPU that measured about
# 2x slower than the optimizer's own per-parameter step (torch-optimizer's NovoGrad: 14 vs 7.7 ms on
# 200 parameters of 10k elements, ~360 vs ~185 ms on BERT-base), so such groups keep their own step
# until the segmented form compiles. (Reads a group's probes did not see are still followed on runs.)
SEGMENT_VALUE_READS = False


@dataclass(frozen=True)
class GroupPath:
    """The path of one param group on one device, and why."""

    path: str
    why: str
    # elementwise: what one flat step did that mixes the whole flat tensor, found exact by the probe
    # ((operation, count per step) pairs; _late_reductions)
    mixing: Tuple[Tuple[str, int], ...] = ()
    # segmented, over shards: its first step (lazy state) was found exact on runs too
    first_step_on_runs: bool = False
    # segmented: reductions over every parameter of a list over runs (a global norm) that the
    # probe found exact; such a step is exact only over all its parameters at once (one call)
    across_runs: Tuple[str, ...] = ()
    # segmented: a Python list of one run's per-parameter values, stacked, is a list over runs (the
    # group's list, when the group has one run), not the run's values per parameter (SegmentedMode)
    lone_lists_over_runs: bool = False
    # segmented: it branches in Python on one value per parameter (``if norm == 0:``); a step whose
    # parameters would take different ways is undone and taken per parameter (_segmented.BranchesDisagree)
    value_branches: bool = False
    # segmented: dimensions whose size its step reads from a parameter (``p.size(1)``); its runs are
    # cut where those sizes change (_segmented.size_key)
    size_dims: Tuple[int, ...] = ()

    @property
    def refusal(self) -> Optional[str]:
        """Why the group cannot be fused (None where it is)."""
        return self.why if self.path == PER_TENSOR else None


def wrapper_reason(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer`` cannot have tensors swapped into its step (None: it can).

    A fused step hands the optimizer's own ``step`` other parameters and another state dict.
    Wrapper optimizers (Lookahead/Magma-style) that expose ``param_groups`` or ``state`` as
    read-only properties of the optimizer they wrap cannot be given either."""
    cls = type(optimizer)
    for name in ("param_groups", "state"):
        attr = getattr(cls, name, None)
        if isinstance(attr, property) and attr.fset is None:
            return (f"{cls.__name__} is a wrapper whose '{name}' is the optimizer it wraps (a read-only property); "
                    "fuse the inner optimizer before wrapping it to fuse anything")
    # A list of the parameters kept apart from param_groups (L-BFGS's ``_params``, taken at
    # construction): its step would update those, not the tensors a fused step hands it.
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, value in vars(optimizer).items():
        if name not in ("param_groups", "state", "defaults") and isinstance(value, (list, tuple)) and any(
                id(v) in params for v in value if isinstance(v, torch.Tensor)):
            return (f"{cls.__name__} keeps its own list of the parameters ('{name}') apart from its param_groups, "
                    "so its step would not see the flat tensors a fused step hands it")
    return None


def _signature(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return value
        return (value > 0) - (value < 0)
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_signature(v) for v in value)
    if isinstance(value, torch.Tensor):
        return "tensor", value.dtype, tuple(value.shape), value.device
    return type(value).__qualname__


def settings_signature(group: Dict[str, Any]) -> Tuple:
    """What a group's step can branch on in its settings, for telling when its path must be chosen again.

    Exact for flags, strings and ``None``; the sign of a number (0 turns BertAdam's clipping off,
    -1 its schedule), so that a learning rate, momentum or beta moved by a scheduler every step
    keeps the group's signature while ``max_grad_norm`` going from 0 to 1.0 changes it. (Keys the
    optimizer's own step writes, its bookkeeping, are set aside by the layout: ``note_own_keys``.)"""
    return tuple((key, _signature(value)) for key, value in group.items() if key not in ("params", "param_names"))


class PathChooser:
    """Decides each group's :class:`GroupPath`; cached per group settings and device."""

    def __init__(self, optimizer: torch.optim.Optimizer, assume_elementwise: bool = False, sharded: bool = False):
        self.optimizer = optimizer
        self.assume_elementwise = assume_elementwise
        # parameters are shards (FSDP2): a reduction must be one whose partial values combine
        # across ranks, and a reduction over a whole flat run would see this rank's shards only
        self.sharded = sharded
        self.wrapper_reason = wrapper_reason(optimizer)
        self._cache: Dict[Tuple[str, torch.device], GroupPath] = {}

    def choose(self, group: Dict[str, Any], device: torch.device) -> GroupPath:
        if self.wrapper_reason is not None:
            return GroupPath(PER_TENSOR, self.wrapper_reason)
        if self.assume_elementwise:
            return GroupPath(ELEMENTWISE, "assume_elementwise=True (not probed)")
        key = self._key(group, device)
        if key not in self._cache:
            self._cache[key] = self._probe(group, device)
        return self._cache[key]

    @staticmethod
    def _key(group, device) -> Tuple[str, torch.device]:
        return repr(sorted((k, repr(v)) for k, v in group.items() if k not in ("params", "param_names"))), device

    def choose_again(self, group: Dict[str, Any], device: torch.device, because: str,
                     template: Optional[torch.Tensor] = None) -> GroupPath:
        """The group's path probed again now (not cached), seeded with its current state --
        ``template``'s (a parameter whose step was seen doing ``because``), the optimizer-level
        state and the group's settings: a step count past a warm-up included. See :meth:`remember`."""
        if self.wrapper_reason is not None or self.assume_elementwise:
            return self.choose(group, device)
        probed = self._probe(group, device, template)
        return GroupPath(probed.path, f"probed again with its state after its step {because}: {probed.why}",
                         probed.mixing, probed.first_step_on_runs, probed.across_runs, probed.lone_lists_over_runs,
                         probed.value_branches, probed.size_dims)

    def remember(self, group: Dict[str, Any], device: torch.device, path: GroupPath) -> None:
        """Make ``path`` the group's path under its current settings (laying it out again takes it)."""
        self._cache[self._key(group, device)] = path

    def _probe(self, group, device, template=None) -> GroupPath:
        mixing = Counter()
        not_elementwise = probe_elementwise(self.optimizer, group, device, mixing, template)
        if not_elementwise is None and self.sharded and mixing:
            not_elementwise = (f"its step reduces over all of the group's parameters ({', '.join(sorted(mixing))}), "
                               "which on shards would see only this rank's")
        elif not_elementwise is None:
            return GroupPath(ELEMENTWISE, "its step is elementwise (checked against per-tensor steps on synthetic tensors)",
                             tuple(sorted(mixing.items())))
        notes = StepNotes()
        not_segmented = probe_segmented(self.optimizer, group, device, template, known_reductions_only=self.sharded,
                                        notes=notes)
        lone = False
        if not_segmented is None and notes.python_lists_over_runs:
            # It stacks Python lists over runs. In a group of one run such a list holds one run: is it
            # the group's list (AvaGrad) or one run's own values (clip_grad_norm_(p))? Where the
            # step on several runs stacked no list of one, the former; otherwise probed on one run.
            lone = not notes.lone_lists or probe_segmented(
                self.optimizer, group, device, template, self.sharded, ranks=(1,)) is not None
            if lone:
                not_segmented = probe_segmented(self.optimizer, group, device, template, self.sharded, ranks=(1,),
                                                lone_lists_over_runs=True)
                if not_segmented is None and notes.lone_lists:  # the step's own lone lists, on several runs
                    not_segmented = probe_segmented(self.optimizer, group, device, template, self.sharded,
                                                    lone_lists_over_runs=True)
                if not_segmented is not None:
                    not_segmented = f"on a group of one run: {not_segmented}"
        if not_segmented is None and notes.value_branches and not SEGMENT_VALUE_READS:
            not_segmented = ("its step reads per-parameter values into Python (`if norm == 0:`, `.item()`): exact on "
                             "segmented runs, but only eagerly, which is slower than its own step")
        if not_segmented is None:
            first_on_runs = self.sharded and probe_segmented(
                self.optimizer, group, device, template, known_reductions_only=True, first_step_on_runs=True,
                lone_lists_over_runs=lone) is None
            branches = ("; it branches on per-parameter values (`if norm == 0:`): a step whose parameters go "
                        "different ways is taken per parameter" if notes.value_branches else "")
            size_dims = tuple(sorted(notes.size_dims))
            if size_dims:
                branches += (f"; it reads each parameter's size along dimension(s) {', '.join(map(str, size_dims))}: "
                             "its runs hold parameters of equal sizes there")
            return GroupPath(SEGMENTED, f"not elementwise ({not_elementwise}); elementwise apart from reductions "
                                        f"over whole parameters, which are computed per parameter{branches}",
                             first_step_on_runs=first_on_runs, across_runs=tuple(sorted(notes.across_runs)),
                             lone_lists_over_runs=lone, value_branches=notes.value_branches, size_dims=size_dims)
        return GroupPath(PER_TENSOR, f"{not_elementwise}; with per-parameter reductions: {not_segmented}")
