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
  (an ordinary step, ``load_state_dict``, a layout change, an edit of the state between
  steps: see :class:`StateWatch`); a fused step gives every slot of a run one new token,
  since it advanced them together (shared with the runs that shared its token before the step:
  they were advanced alike).
* **per-tensor parameters** -- stepped with their own tensors: groups that are not
  elementwise, sparse gradients, and state not shaped like the parameter.
* **nested state** -- an entry holding a container of parameter-shaped tensors (AggMo's
  ``{beta: buffer}``): each tensor has a flat state buffer of its own, keyed ``(key, *path)``
  (``_nested_state.py``), and the run's container holds the run's slices of them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import chain, groupby, repeat
from operator import attrgetter, is_
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ._flat import FlatBuffer, Slot, shard_of
from ._layout import FlatLayout
from ._nested_state import leaf_at, structure, tensor_leaves, with_leaves
from ._probe import probe_empty_group
from ._segmented import Segmentation, run_shape, stacked_row_values, state_kind
from ._torch_compat import tensor_versions
from .errors import FusionError

# A slot's token when its state cannot be flattened (a tensor not shaped like the parameter,
# an unhashable value): it never joins a run.
UNFUSABLE_STATE = object()
# A slot of a segmented group before its first step: the optimizer creates its state lazily,
# shaped per parameter, so that step runs per tensor (no warning).
FIRST_STEP = object()
_MISSING = object()  # a key no longer in a state entry
# Tags (segment_scalar_shape) for runs of equal segment count; beyond it runs share one and go in calls of their own.
_MAX_TAG = 8


@dataclass
class Run:
    """Slots ``[first, last)`` of ``buffer``, handed to the optimizer as the one tensor ``proxy``."""

    buffer: FlatBuffer
    first: int
    last: int
    proxy: torch.nn.Parameter
    state: Dict[str, Any] = field(default_factory=dict)  # the proxy's state for this step
    # segmented runs: the segments, and the per-parameter scalar state keys with their shapes
    segmentation: Optional[Segmentation] = None
    scalar_keys: Dict[str, torch.Size] = field(default_factory=dict)
    # each slot's state entry, looked up once per step where the state exists when the run is made
    entries: Optional[List[Dict[str, Any]]] = None

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
    # Segmented runs go in calls of their own when two of them could be told apart only by
    # their place in the step (equal shape, or segment scalars of equal shape: see
    # ``segment_scalar_shape``): per call, the params per group and the segmentations. Usually one call.
    segmented_calls: List[Tuple[List[List[torch.Tensor]], List[Segmentation]]] = field(default_factory=list)

    def swapped_state(self, state) -> Dict[torch.Tensor, Dict[str, Any]]:
        """The state dict the optimizer sees during the step: run state per proxy, real state per tensor."""
        swapped: Dict[torch.Tensor, Dict[str, Any]] = defaultdict(dict)  # the optimizer creates state lazily
        for key, value in state.items():  # optimizer-level state (e.g. state["k"]), not keyed by a tensor
            if not isinstance(key, torch.Tensor):
                swapped[key] = value
        for run in self.runs:
            swapped[run.proxy] = run.state
        for p in self.per_tensor:
            if p in state:
                swapped[p] = state[p]
        return swapped


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _segmented_signature(state: Dict[str, Any], param: torch.Tensor, stepped: bool):
    """The signature of a segmented group's slot: scalar *tensors* may differ per parameter
    (they are stacked, one value per segment); the rank is part of it (a run holds one rank).
    No state before the parameter's first step means lazy state (FIRST_STEP); after it, a
    stateless optimizer."""
    if not state and not stepped:
        return FIRST_STEP
    tensors, per_segment, scalars = [], [], []
    for key, value in state.items():
        kind = state_kind(value, param.shape)
        if kind == "flat":
            tensors.append((key, value.dtype))
        elif kind == "scalar":
            per_segment.append((key, tuple(value.shape), value.dtype, value.device))
        elif kind == "python" and _hashable(value):
            scalars.append((key, value))
        else:
            return None
    return ("segmented", param.dim(), tuple(sorted(tensors, key=repr)), tuple(sorted(per_segment, key=repr)),
            tuple(sorted(scalars, key=repr)))


def _state_signature(state: Dict[str, Any], param: torch.Tensor):
    """What must be equal for two parameters' state to be stepped as one run (None: never)."""
    tensors, scalars = [], []
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != param.shape:
                return None
            tensors.append((key, value.dtype))
        elif (leaves := tensor_leaves(value)) is not None:
            if any(leaf.shape != param.shape for _, leaf in leaves):
                return None
            tensors.append((key, structure(value)))
        elif isinstance(value, torch.Tensor):
            scalars.append((key, value.item(), value.dtype, value.device))
        elif _hashable(value):
            scalars.append((key, value))
        else:
            return None
    return tuple(sorted(tensors, key=repr)), tuple(sorted(scalars, key=repr))


_META = attrgetter("shape", "dtype", "device")


def _apart(a: Segmentation, b: Segmentation) -> bool:
    """Two runs one call can hold: the mode tells their tensors apart by shape."""
    return a.shape != b.shape and a.scalar_shape != b.scalar_shape


def _apart_over_shards(a: Segmentation, b: Segmentation) -> bool:
    """:func:`_apart` on every rank: runs of one rank of tensors could have equal shapes on another."""
    return len(a.shape) != len(b.shape) and a.scalar_shape != b.scalar_shape

_NUMBERS = {int, float, bool}
_PARAM, _GRAD, _GRAD_VIEW, _PARAM_PTR = attrgetter("param"), attrgetter("grad"), attrgetter("grad_view"), attrgetter("param_ptr")
_TOKEN = attrgetter("token")


def _grad_in_place(grad, view) -> bool:
    return grad is view or grad is None


def _token_branch_and_grad(slot) -> tuple:
    return slot.token, slot.branch, slot.param.grad is not None


def _hold_their_views(entries: List[Dict[str, Any]], key: str, views: List[torch.Tensor]) -> bool:
    """Each entry's ``key`` is its slot's view of the flat state (one C-level pass)."""
    return all(map(is_, map(dict.get, entries, repeat(key)), views))


def _segment_state_key(run, key: str) -> Tuple[Any, ...]:
    return id(run.buffer), run.start, run.end, run.segmentation.scalar_shape, key


def _all_like(values: List[Any], meta: Tuple[torch.Size, torch.dtype, torch.device]) -> bool:
    """Every one of ``values`` is a plain tensor (no subclass: a DTensor's copy dispatches on its
    own) of this shape, dtype and device, checked in C-level passes."""
    return set(map(type, values)) <= {torch.Tensor} and set(map(_META, values)) <= {meta}


class StateWatch:
    """The optimizer's state as a fused step left it, to tell whether anything edited it since.

    Between two fused steps a user may ``del optimizer.state[p]``, replace an entry or one of its
    values, or edit a one-element tensor (a step count) in place; the next step must then plan
    its runs from the state as it is now. The check runs every step, so it must cost little next
    to the step (BERT-base: 201 parameters, 603 state values): a tensor's ``__hash__`` is Python
    code, so even looking each parameter up in ``optimizer.state`` would cost ~50 us. Instead
    the watch keeps flat lists of what it saw and compares them in C-level passes (``map``):

    * ``optimizer.state`` has the same keys and entries, in the same order: this covers every
      fused parameter's entry (deleted, added, replaced) without hashing a parameter;
    * each key seen in a fused parameter's entry still holds the same value (by identity), and
      the entries hold no more keys than they did (their lengths add up the same);
    * each one-element tensor among those values has the same ``_version`` (in-place edits);
    * each container of tensors among them (nested state) holds the same tensors.

    Identity is exact: the fused parameters are held by the layout, and the watch holds the
    state's keys and the fused entries with their values, so none of them can be freed and its
    id reused. Other entries are compared by id without being held (an unfused parameter's
    dropped state is not kept alive): an id reused there could only hide an edit of state the
    fused step does not plan from. The check is stricter than needed (an edit of an unfused
    parameter's entry counts too), which costs only a re-plan. An entry that is not a dict is
    never trusted (always "changed").
    """

    def __init__(self, state, params: List[torch.Tensor], generation: int):
        self.state_id = id(state)
        self.generation = generation  # of the layout whose fused ``params`` these are
        self.keys = list(state)
        self.entry_ids = list(map(id, state.values()))
        self.entries = [entry for entry in map(state.get, params) if entry is not None]
        self.trusted = all(isinstance(entry, dict) for entry in self.entries)
        self.length = sum(map(len, self.entries))
        # one row per (entry, key, value) of the fused entries, as parallel lists
        entries = self.entries
        self.owners = list(chain.from_iterable(map(repeat, entries, map(len, entries))))
        self.entry_keys = list(chain.from_iterable(entries))
        self.values = list(chain.from_iterable(map(dict.values, entries)))
        self.scalars = [v for v in self.values if isinstance(v, torch.Tensor) and v.numel() == 1]
        self.versions = tensor_versions(self.scalars)
        # the tensors of nested state (``{beta: buffer}``): a container holds its leaves by identity too
        self.nested = [(value, path, leaf) for value in self.values if type(value) in (dict, list, tuple)
                       for path, leaf in tensor_leaves(value) or ()]

    def same_frame(self, state, generation: int) -> bool:
        """The cheap part of :meth:`same_objects`: same dict, layout and number of entries."""
        return (
            self.trusted and id(state) == self.state_id and generation == self.generation and len(state) == len(self.keys)
        )

    def same_objects(self, state, generation: int) -> bool:
        """The state holds the objects it held (values of one-element tensors aside)."""
        return (
            self.same_frame(state, generation)
            and all(map(is_, state, self.keys))
            and list(map(id, state.values())) == self.entry_ids
            and all(map(is_, map(dict.get, self.owners, self.entry_keys, repeat(_MISSING)), self.values))
            and sum(map(len, self.entries)) == self.length
            and all(leaf_at(value, path) is leaf for value, path, leaf in self.nested)
        )

    def unchanged(self, state, generation: int) -> bool:
        """Nothing in the state was replaced, added, removed or edited in place."""
        return self.same_objects(state, generation) and tensor_versions(self.scalars) == self.versions

    def reread_versions(self) -> None:
        """After a fused step advanced the step counts in place."""
        self.versions = tensor_versions(self.scalars)

    def reread_values(self) -> None:
        """After a fused step replaced Python numbers it found in the entries (no key added or
        removed, no tensor replaced: the rows and the one-element tensors stay)."""
        self.values = list(map(dict.get, self.owners, self.entry_keys, repeat(_MISSING)))
        self.versions = tensor_versions(self.scalars)


class StepPlanner:
    """Builds each step's :class:`StepPlan` and maps the resulting flat state back per parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: FlatLayout, eager_run_elements: float = float("inf")):
        self.optimizer = optimizer
        self.layout = layout
        self.eager_run_elements = eager_run_elements  # runs' length where a segmented step stays eager
        self.tokens_stale = True
        self._shaped: Dict[Tuple[int, int, int, str], torch.Tensor] = {}  # rank-shaped views, reused
        self._segmentations: Dict[Any, Segmentation] = {}  # one per run layout: compiled graphs key on it
        # (buffer id, run start, run end, segment scalar shape, key) -> a run's one-value state as one
        # tensor of its segments' values, and each parameter's view of it (see _segment_state)
        self._segment_states: Dict[Tuple[Any, ...], Tuple[torch.Tensor, List[torch.Tensor]]] = {}
        self._first_stepped: set = set()  # ids of FIRST_STEP slots that took their first step per tensor
        # (slot.branch, way taken or size read) -> the slot's new class (_segmented.BranchesDisagree)
        self._branch_classes: Dict[Tuple[Any, Any], int] = {}
        self._state_seen: Optional[StateWatch] = None  # the state as the last write-back left it
        # Set when this step may have replaced or added a state object after plan()'s check (see
        # _put): write_back() then compares the state with the watch instead of only re-reading
        # the versions of the step counts, which is all a usual step changes.
        self._state_written = True
        # Set when this step replaced only Python numbers the state already held (BertAdam's int
        # step count, in every entry): the watch then reads its values again in one C-level pass.
        self._numbers_written = False
        self._empty_group_reason: Any = _MISSING  # probe_empty_group's answer, once it is needed

    def first_steps_taken(self, params) -> None:
        """``params`` took their first step elsewhere (over FSDP2 shards: as DTensors); a stateless
        segmented optimizer's slots are then ready for runs (see ``_segmented_signature``)."""
        ids = {id(p) for p in params}
        for group in self.layout.groups.values():
            self._first_stepped.update(id(slot) for slot in group.slots() if id(slot.param) in ids)
        self.tokens_stale = True

    def invalidate(self) -> None:
        """Something other than a fused step may have changed scalar state: recompute tokens."""
        self.tokens_stale = True

    def _state_unchanged(self) -> bool:
        """Nothing edited the fused parameters' state since the last write-back (nor the layout):
        ``del optimizer.state[p]``, a replaced entry or an in-place edit of a step count between
        steps is seen, and the runs are then planned from the state as it is now."""
        seen = self._state_seen
        return seen is not None and seen.unchanged(self.optimizer.state, self.layout.generation)

    def _see_state(self) -> None:
        """Record the state as this write-back leaves it. A usual step wrote no state object (it
        advanced the step counts in place): the watch still holds the right objects and only
        their versions are read again. Otherwise the state is compared with the watch, and a new
        one is taken if it differs (first step, an edit, a parameter stepped on its own)."""
        seen, state, generation = self._state_seen, self.optimizer.state, self.layout.generation
        if seen is not None and not self._state_written and self._numbers_written and seen.same_frame(state, generation):
            seen.reread_values()
        elif seen is not None and (
            seen.same_objects(state, generation) if self._state_written else seen.same_frame(state, generation)
        ):
            seen.reread_versions()
        else:
            params = [slot.param for group in self.layout.groups.values() for slot in group.slots()]
            self._state_seen = StateWatch(state, params, generation)
        self._state_written = self._numbers_written = False

    def _put(self, entry: Dict[Any, Any], key: Any, value: Any) -> None:
        """``entry[key] = value`` into ``optimizer.state`` or one of its entries during a fused
        step; noted, so that the write-back records the state anew (see ``_see_state``)."""
        entry[key] = value
        self._state_written = True

    def _retoken(self) -> None:
        state = self.optimizer.state
        tokens: Dict[Any, object] = {}
        for group in self.layout.groups.values():
            for slot in group.slots():
                if group.segmented:
                    signature = _segmented_signature(state.get(slot.param, {}), slot.param, id(slot) in self._first_stepped)
                else:
                    signature = _state_signature(state.get(slot.param, {}), slot.param)
                if signature is None or signature is FIRST_STEP:
                    slot.token = UNFUSABLE_STATE if signature is None else FIRST_STEP
                else:
                    slot.token = tokens.setdefault(signature, object())
        self.tokens_stale = False

    # ------------------------------------------------------------------ planning
    def plan(self, run_cap: float) -> StepPlan:
        """This step's work; ``run_cap`` bounds a run's length in elements."""
        if self.layout.refresh():
            self.tokens_stale = True
        if self.tokens_stale or not self._state_unchanged():
            self.tokens_stale = self._state_written = True
        if self.tokens_stale:
            self._retoken()
        plan = StepPlan([], [], [])
        groups = len(self.optimizer.param_groups)
        for index in range(groups):
            group = self.layout.groups[index]
            params: List[torch.Tensor] = list(group.per_tensor)
            plan.per_tensor.extend(group.per_tensor)
            # segmented runs span whole buffers: a run cut in two would be a call more (equal lengths);
            # except where the step reads values into Python, which keeps it eager: runs of a
            # cache's size, as eager elementwise steps take them (the whole buffer per op was 4x
            # slower than the unfused step for torch-optimizer's NovoGrad on BERT-base)
            cap = run_cap if not group.segmented else (
                self.eager_run_elements if group.value_branches and not group.across_runs else float("inf"))
            proxies = 0
            for buffer in group.buffers:
                for first, last in self._runs(buffer, cap, params, plan.per_tensor):
                    run = self._make_run(buffer, first, last, group.segmented)
                    plan.runs.append(run)
                    if run.segmentation is None:
                        params.append(run.proxy)
                        proxies += 1
                    else:
                        self._add_segmented_call(plan, groups, index, run)
            plan.group_params.append(params if len(params) - proxies < 2 else self._in_group_order(index, params))
        why = self._not_splittable(plan)
        return self._unfused_plan(why) if why else plan

    def _in_group_order(self, index: int, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """``params`` with the parameters stepped on their own first, in the group's order, then the
        runs: a step that draws random numbers per parameter (Gravity's initial state) draws them
        in the unfused step's order on a first step, where every parameter is stepped on its own."""
        order = {id(p): i for i, p in enumerate(self.optimizer.param_groups[index]["params"])}
        singles = [p for p in params if id(p) in order]
        return sorted(singles, key=lambda p: order[id(p)]) + [p for p in params if id(p) not in order]

    def _not_splittable(self, plan: StepPlan) -> Optional[str]:
        """Why ``plan``'s several calls of the optimizer's step would not make its one step exactly
        (None: they would, or it has one call). A step reducing over every parameter of a list over
        runs (``_paths.GroupPath.across_runs``: a global norm) would reduce over each call's part;
        a step that fails on a group without gradients fails on the calls that hold none of a group's."""
        if not plan.segmented_calls or (len(plan.segmented_calls) == 1 and not any(plan.group_params)):
            return None
        across = sorted({name for group in self.layout.groups.values() for name in group.across_runs})
        if across:
            return f"its step reduces over all of its parameters at once ({', '.join(across)})"
        if self._empty_group_reason is _MISSING:
            group = self.optimizer.param_groups[0]
            device = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
            self._empty_group_reason = probe_empty_group(self.optimizer, group, device)
        return self._empty_group_reason

    def _unfused_plan(self, why: str) -> StepPlan:
        """This step as the optimizer's own step over its own parameters (views of the flat buffers),
        where splitting it over several calls would not be exact (``why``: see :meth:`_not_splittable`)."""
        self.layout.warn_once(
            "unsplittable",
            f"{type(self.optimizer).__name__}: this step's parameters do not fit one call of its step (two "
            "segmented runs of equal shape, or parameters stepped on their own this step), and split over "
            f"several calls it would not be exact: {why}. The step is taken unfused, per parameter",
            stacklevel=5,  # _unfused_plan <- plan <- Fusion.step <- hooked step <- user
        )
        plan = StepPlan([], [], [])
        for index, group in enumerate(self.optimizer.param_groups):
            plan.group_params.append(list(group["params"]))
            plan.per_tensor.extend(group["params"])
            for slot in self.layout.groups[index].slots():
                if slot.param.grad is not None and slot.token is FIRST_STEP:
                    self._first_stepped.add(id(slot))
                    self.tokens_stale = True
        self._state_written = True  # the optimizer steps each parameter's own state entry
        return plan

    def split_where_branches_differ(self, plan: StepPlan, seg: Segmentation, taken: Optional[List[Any]]) -> None:
        """Cut the run of ``seg`` where its parameters took different ways at a Python branch (or
        differ in a size the step read: ``SizesDisagree``), for the steps to come: each part then
        takes one way, as long as they keep to them. (``taken`` None: a value read that differed,
        not a branch; cutting by value would leave no runs.)"""
        run = next((run for run in plan.runs if run.segmentation is seg), None)
        if run is None or taken is None:
            return
        for slot, way in zip(run.slots, taken):
            slot.branch = self._branch_classes.setdefault((slot.branch, way), len(self._branch_classes) + 1)
        self.tokens_stale = True

    def per_parameter(self, plan: StepPlan, swapped_state, call_params: List[List[torch.Tensor]]) -> List[List[torch.Tensor]]:
        """Take the runs of one segmented call (``call_params``: its proxies per group) out of
        ``plan``: their parameters are stepped on their own this step, with their own state entries
        (views of the flat state: what the runs held). Returns those parameters per group, each
        group's in its order. Their runs' state is not written back."""
        proxies = {id(proxy) for params in call_params for proxy in params}
        moved = [run for run in plan.runs if id(run.proxy) in proxies]
        plan.runs = [run for run in plan.runs if id(run.proxy) not in proxies]
        by_proxy = {id(run.proxy): run for run in moved}
        state = self.optimizer.state
        out = []
        for index, params in enumerate(call_params):
            singles = [slot.param for proxy in params for slot in by_proxy[id(proxy)].slots]
            for p in singles:
                plan.per_tensor.append(p)
                if p in state:
                    swapped_state[p] = state[p]
            out.append(self._in_group_order(index, singles) if len(singles) > 1 else singles)
        self.tokens_stale = True
        self._state_written = True  # the optimizer steps each parameter's own state entry
        return out

    @staticmethod
    def _add_segmented_call(plan: StepPlan, groups: int, index: int, run: Run) -> None:
        seg = run.segmentation
        # Over shards every rank must make the same calls (each reduction is an all-reduce), but a
        # run's shape is its shards' length on this rank: two runs of one rank of tensors may have
        # equal shapes on one rank only (FSDP2's last shard of a parameter is shorter, or empty), so
        # there they never share a call (a collective mismatch, or a hang, otherwise).
        apart = _apart_over_shards if seg.shard_group is not None else _apart
        for params, segs in plan.segmented_calls:
            if all(apart(s, seg) for s in segs):
                break
        else:
            params, segs = [[] for _ in range(groups)], []
            plan.segmented_calls.append((params, segs))
        params[index].append(run.proxy)
        segs.append(seg)

    def _runs(self, buffer: FlatBuffer, run_cap: float, params, per_tensor) -> Iterator[Tuple[int, int]]:
        """The runs of ``buffer`` as ``(first, last)`` slot ranges; slots that must be stepped
        per tensor this step are appended to ``params`` and ``per_tensor`` on the way."""
        slots = buffer.slots
        if run_cap == float("inf") and self._in_place(buffer):
            first = 0
            for (_, _, has_grad), same in groupby(map(_token_branch_and_grad, slots)):
                last = first + len(list(same))
                if has_grad:  # (a parameter without a gradient is not stepped: the runs end there)
                    yield first, last
                first = last
            return
        first = None
        for i, slot in enumerate(slots):
            if not self._joins_a_run(buffer, slot, params, per_tensor):
                if first is not None:
                    yield first, i
                    first = None
                continue
            if first is not None and (slot.token is not slots[first].token or slot.branch != slots[first].branch
                                      or slot.end - slots[first].start > run_cap):
                yield first, i
                first = None
            if first is None:
                first = i
        if first is not None:
            yield first, len(slots)

    @staticmethod
    def _in_place(buffer: FlatBuffer) -> bool:
        """Every slot of ``buffer`` joins a run this step, with nothing to put back in place (a usual
        step): each parameter and gradient is its view of the buffer (or the parameter has no gradient:
        a model's unused parameters, BERT's pooler under a masked-LM loss), and no slot holds a first
        step's or unfusable state's token. The runs are then where the tokens and branches change and
        around the parameters without gradients, as :meth:`_runs` would find them slot by slot.
        C-level passes over the slots."""
        slots = buffer.slots
        params = list(map(_PARAM, slots))
        tokens = list(map(_TOKEN, slots))
        return (
            UNFUSABLE_STATE not in tokens and FIRST_STEP not in tokens
            and all(map(_grad_in_place, map(_GRAD, params), map(_GRAD_VIEW, slots)))
            and list(map(torch.Tensor.data_ptr, params)) == list(map(_PARAM_PTR, slots))
        )

    def _joins_a_run(self, buffer: FlatBuffer, slot: Slot, params, per_tensor) -> bool:
        """Put the slot's parameter and gradient back in place; False if it is not in a run this step."""
        buffer.sync_param(slot)
        if buffer.sync_grad(slot) and slot.token is not UNFUSABLE_STATE and slot.token is not FIRST_STEP:
            return True
        if slot.param.grad is not None:
            if slot.token is FIRST_STEP:  # lazy state, created per tensor (expected)
                self._first_stepped.add(id(slot))
            else:
                self.layout.warn_once(
                    f"per-tensor{id(slot)}",
                    f"a fused parameter of shape {tuple(slot.param.shape)} is updated unfused this step "
                    f"(sparse gradient or state not shaped like the parameter)",
                    stacklevel=6,  # _joins_a_run <- _runs <- plan <- Fusion.step <- hooked step <- user
                )
            params.append(slot.param)
            per_tensor.append(slot.param)
            self.tokens_stale = True
            self._state_written = True  # the optimizer steps the parameter's own state entry
        return False

    def _shaped_view(self, buffer: FlatBuffer, tensor: torch.Tensor, start: int, what: str, shape) -> torch.Tensor:
        """``tensor`` viewed as ``shape``; the same object while it is the same memory (compilers guard on it)."""
        key = (id(buffer), start, tensor.numel(), what)
        view = self._shaped.get(key)
        if view is None or view.data_ptr() != tensor.data_ptr() or view.dtype != tensor.dtype:
            view = tensor.view(shape)
            self._shaped[key] = view
        return view

    def _make_segmented_run(self, buffer: FlatBuffer, first: int, last: int) -> Run:
        state = self.optimizer.state
        flat_proxy = buffer.proxy(first, last)
        slots = buffer.slots[first:last]
        start = slots[0].start
        shape = run_shape(slots[0].param.dim(), flat_proxy.numel())
        proxy_key = (id(buffer), start, flat_proxy.numel(), "proxy")
        proxy = self._shaped.get(proxy_key)
        if proxy is None or proxy.data_ptr() != flat_proxy.data_ptr():
            proxy = torch.nn.Parameter(flat_proxy.detach().view(shape), requires_grad=True)
            self._shaped[proxy_key] = proxy
        proxy.grad = flat_proxy.grad.view(shape)
        pieces = [(slot.start - start, slot.end - start, slot.param.shape) for slot in slots]
        group = self.layout.config.shard_group
        # (over shards, equal shards of parameters of other sizes are other segmentations: a mean
        # divides by the whole parameter's elements)
        numels = tuple(shard_of(slot.param).numel for slot in slots) if group is not None else None
        seg = self._segmentations.get((shape, tuple(pieces), numels))
        if seg is None:
            # runs of equal segment count get different tags, so that one call can hold them all
            tag = min(sum(1 for known in self._segmentations.values() if known.segments == len(pieces)), _MAX_TAG)
            seg = self._segmentations[(shape, tuple(pieces), numels)] = Segmentation(
                shape, pieces, group, None if numels is None else list(numels), tag)
        run = Run(buffer, first, last, proxy, segmentation=seg)
        first_state = state.get(slots[0].param)
        if not first_state:
            return run
        entries = run.entries = [state[slot.param] for slot in slots]
        for key, value in first_state.items():
            kind = state_kind(value, slots[0].param.shape)  # the signature made it equal across the run
            if kind == "flat":
                self._sync_run_state(run, key, entries)
                flat = buffer.state_slice(key, run.start, run.end)
                run.state[key] = self._shaped_view(buffer, flat, start, key, shape)
            elif kind == "scalar":
                run.scalar_keys[key] = value.shape
                run.state[key] = self._segment_state(run, key, entries)
            else:
                run.state[key] = value
        return run

    def _segment_state(self, run: Run, key: str, entries: List[Dict[str, Any]]) -> torch.Tensor:
        """The run's one-value-per-parameter state ``key`` (a trust ratio, a norm kept between
        steps) as one tensor of the segments' values, shaped as the segmentation's scalars; each
        parameter's entry holds its view of it. A usual step then reads and writes it in place,
        with no stack before the step and no copy per parameter after it (on a GPU: no launch).
        Where an entry holds another tensor (first step, ``load_state_dict``, an edit), the values
        are stacked into a new tensor and the entries get its views."""
        cache_key = _segment_state_key(run, key)
        held = self._segment_states.get(cache_key)
        if held is not None and _hold_their_views(entries, key, held[1]):
            return held[0]
        # (equal shapes across the run: the signature)
        stacked = torch.stack([entry[key] for entry in entries])
        views = list(stacked.unbind(0))
        for entry, view in zip(entries, views):
            self._put(entry, key, view)
        shaped = stacked.view(run.segmentation.scalar_shape)
        self._segment_states[cache_key] = (shaped, views)
        return shaped

    def _sync_run_state(self, run: Run, key: str, entries: List[Dict[str, Any]], path: Tuple = ()) -> None:
        """Each parameter's state ``key`` (with a ``path``: the leaf there of its container ``key``)
        as its view of the flat state, copied in where it is not; checked in one pass where every
        entry already holds its view (a usual step; a C-level pass for plain keys)."""
        buffer = run.buffer
        if not path:
            flat_key = key
            if key in buffer.state and _hold_their_views(entries, key, buffer.state_views(key, run.first, run.last)):
                return
            currents = [per_param[key] for per_param in entries]
        else:
            flat_key = (key,) + path
            currents = [leaf_at(per_param[key], path) for per_param in entries]
            if flat_key in buffer.state and all(map(is_, currents, buffer.state_views(flat_key, run.first, run.last))):
                return
        for slot, per_param, current in zip(run.slots, entries, currents):
            synced = buffer.sync_state(flat_key, slot, current)
            if synced is not current:  # a container is updated in place (the same dict: noted)
                self._put(per_param, key, with_leaves(per_param[key], {path: synced}) if path else synced)

    def _make_run(self, buffer: FlatBuffer, first: int, last: int, segmented: bool = False) -> Run:
        if segmented:
            return self._make_segmented_run(buffer, first, last)
        state = self.optimizer.state
        run = Run(buffer, first, last, buffer.proxy(first, last))
        first_state = state.get(buffer.slots[first].param)
        if not first_state:
            return run
        entries = run.entries = [state[slot.param] for slot in run.slots]
        for key, value in first_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                self._sync_run_state(run, key, entries)
                run.state[key] = buffer.state_slice(key, run.start, run.end)
            elif (leaves := tensor_leaves(value)) is not None:  # (the signature made it alike across the run)
                slices = {}
                for path, _ in leaves:
                    self._sync_run_state(run, key, entries, path)
                    slices[path] = buffer.state_slice((key,) + path, run.start, run.end)
                run.state[key] = with_leaves(value, slices, copy=True)
            else:
                run.state[key] = value
        return run

    # ------------------------------------------------------------------ after the step
    def write_back(self, plan: StepPlan, swapped_state) -> None:
        """Map the state the optimizer produced for each proxy back onto every parameter's state."""
        state = self.optimizer.state
        for key, value in swapped_state.items():
            if not isinstance(key, torch.Tensor) and state.get(key, _MISSING) is not value:
                self._put(state, key, value)
        for p in plan.per_tensor:
            entry = swapped_state.get(p)
            if entry is not None and state.get(p) is not entry:
                self._put(state, p, entry)
        renewed: Dict[int, object] = {}  # id(token before the step) -> token after it
        for run in plan.runs:
            new_state = swapped_state.get(run.proxy, {})
            # The run's slots were advanced together; runs that shared a token (equal scalar state)
            # were advanced alike and share the new one (the eager step's check runs one of them).
            token = renewed.setdefault(id(run.slots[0].token), object())
            entries = run.entries  # the optimizer's step saw the swapped state: these entries are as they were
            if entries is None:
                entries = [state[slot.param] for slot in run.slots] if new_state else []  # (created where missing)
            for key, value in new_state.items():
                seg = run.segmentation
                if seg is not None and isinstance(value, torch.Tensor) and tuple(value.shape) == seg.scalar_shape:
                    self._write_per_segment_state(run, key, value, entries)
                elif seg is not None and isinstance(value, torch.Tensor) and (row := stacked_row_values(value, seg)) is not None:
                    self._write_per_segment_state(run, key, row, entries)
                elif seg is not None and isinstance(value, torch.Tensor) and tuple(value.shape) == seg.shape:
                    self._write_flat_state(run, key, value.reshape(-1), entries)
                elif seg is None and isinstance(value, torch.Tensor) and value.dim() > 0:
                    self._write_flat_state(run, key, value, entries)
                elif seg is None and (leaves := tensor_leaves(value)) is not None and all(
                        leaf.dim() > 0 for _, leaf in leaves):
                    self._write_nested_state(run, key, value, leaves, entries)
                else:
                    self._write_scalar_state(run, key, value, entries)
            for slot in run.slots:
                slot.token = token
        self._see_state()

    def _write_per_segment_state(self, run: Run, key: str, value: torch.Tensor, entries) -> None:
        held = self._segment_states.get(_segment_state_key(run, key))
        if held is not None and type(value) is torch.Tensor and _hold_their_views(entries, key, held[1]):
            shaped = held[0]  # a usual step: the entries hold their views of the run's values
            if value is shaped:  # updated in place
                return
            if value.dtype == shaped.dtype and value.device == shaped.device:
                shaped.copy_(value.reshape(shaped.shape))  # one copy for all the run's parameters
                return
        shape = torch.Size(run.scalar_keys.get(key, ()))
        values = value.reshape(len(entries), *shape).unbind(0)  # each segment's value, shaped like its state
        currents = list(map(dict.get, entries, repeat(key)))
        if type(value) is torch.Tensor and _all_like(currents, (shape, value.dtype, value.device)):
            torch._foreach_copy_(currents, values)  # one call where a copy each cost ~1 us (a launch each on a GPU)
            return
        for per_param, current, new in zip(entries, currents, values):
            if isinstance(current, torch.Tensor) and current.shape == shape and current.dtype == new.dtype:
                current.copy_(new)
            else:
                self._put(per_param, key, new.clone())

    def _write_flat_state(self, run: Run, key: str, value: torch.Tensor, entries) -> None:
        self._check_run_shaped(run, key, value)
        buffer = run.buffer
        buffer.adopt_or_copy_state(key, run.start, run.end, value)
        views = buffer.state_views(key, run.first, run.last)
        if _hold_their_views(entries, key, views):  # a usual step
            return
        for per_param, view in zip(entries, views):
            if per_param.get(key) is not view:
                self._put(per_param, key, view)

    def _write_nested_state(self, run: Run, key: str, value, leaves, entries) -> None:
        """A container of run-shaped tensors: each leaf into its flat state buffer, and each parameter's
        container holding its views (a new one where it does not: one container per parameter)."""
        buffer = run.buffer
        views = []
        for path, leaf in leaves:
            self._check_run_shaped(run, f"{key}{list(path)}", leaf)
            buffer.adopt_or_copy_state((key,) + path, run.start, run.end, leaf)
            views.append(buffer.state_views((key,) + path, run.first, run.last))
        paths = [path for path, _ in leaves]
        for index, per_param in enumerate(entries):
            current = per_param.get(key)
            if current is not None and all(leaf_at(current, path) is view[index] for path, view in zip(paths, views)):
                continue  # a usual step: it holds its views
            self._put(per_param, key, with_leaves(value, {path: view[index] for path, view in zip(paths, views)},
                                                  copy=True))

    def _check_run_shaped(self, run: Run, key: str, value: torch.Tensor) -> None:
        if value.numel() != run.end - run.start or value.dim() != 1:
            raise FusionError(
                f"{type(self.optimizer).__name__} created state '{key}' of shape {tuple(value.shape)} "
                f"for a flat tensor of shape {tuple(run.proxy.shape)}; its update is not elementwise. "
                "Fuse it with on_unsupported='fallback' and without assume_elementwise=True."
            )

    def _write_scalar_state(self, run: Run, key: str, value, entries) -> None:
        if type(value) in _NUMBERS:
            if set(map(type, map(dict.get, entries, repeat(key)))) <= _NUMBERS:  # (a missing key: NoneType)
                for _ in map(dict.__setitem__, entries, repeat(key), repeat(value)):
                    pass
                self._numbers_written = True
                return
        if type(value) is torch.Tensor:
            currents = [current for current in map(dict.get, entries, repeat(key)) if current is not value]
            if _all_like(currents, (value.shape, value.dtype, value.device)):
                if currents:
                    torch._foreach_copy_(currents, [value] * len(currents))
                return
        for per_param in entries:
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
                self._put(per_param, key, value.clone() if isinstance(value, torch.Tensor) else value)
