"""Fused optimizers over FSDP2's sharded parameters: each rank fuses the shards it holds.

FSDP2 (``fully_shard``) turns every parameter into a DTensor holding one rank's shard and
reduce-scatters gradients into sharded DTensor gradients. An optimizer over such parameters
is fused through a **shard optimizer**: a copy of it (same class, the same param-group settings)
whose parameters are plain tensors standing in for this rank's shards, fused as any optimizer
(:class:`~bagua_integrations.fused_optimizer.Fusion`), with three differences:

* **one memory**: FSDP2's padded shard of every parameter is pointed into the shard optimizer's
  flat parameter buffer (the slot keeps room for the padding, ``_flat.ShardOf``), so FSDP2
  all-gathers straight from the memory the fused step updates;
* **whole-parameter reductions across ranks**: a LAMB trust ratio or BertAdam's per-parameter
  clipping needs the norm of a whole parameter. Each rank computes every segment's partial
  value, and one all-reduce per reduction combines those of all parameters of a run
  (``_segmented.segment_combine``; a compiled step sends its independent ones together,
  ``_batched_combines``); a reduction that has no such partial form, or one over all
  of a group's parameters, keeps the optimizer's own DTensor step (decided by the probes, up front);
* **first steps**: an optimizer creates its state lazily, in its first step. That step runs on the
  flat runs where the probes found it exact there (elementwise groups; segmented ones checked with
  ``first_step_on_runs``), else it is the optimizer's own step on the DTensors, exact through DTensor's
  own collectives, and its state then moves into the flat buffers. Any step in which a shard would
  be stepped on its own (``NeedsWholeParameters``) is that DTensor step too.

``optimizer.state`` shows the shard optimizer's state as DTensors sharded like their parameters
(views of the flat state), so ``state_dict()``, ``load_state_dict()`` and DCP see what the
unfused optimizer keeps.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections import defaultdict, deque
from itertools import chain, compress, repeat
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _torch_compat as compat
from ._flat import SHARD_ATTR, ShardOf
from ._layout import FlatLayout, FusionConfig, is_sharded
from ._paths import ELEMENTWISE, PER_TENSOR, SEGMENTED
from ._planner import _GRAD, _GRAD_VIEW, _META, _NUMBERS, _PARAM_PTR
from ._segmented import ShardGroup
from ._optimizer_copy import optimizer_like
from ._torch_compat import mark_step_taken, unwrapped_step
from ._verify import verified
from .errors import ShardedParameterError


def _shard_group(params: List[torch.Tensor]) -> ShardGroup:
    """The process group over which every parameter of ``params`` is sharded (one mesh dimension
    with ``Shard(0)``, others replicated, as FSDP2 and HSDP lay them out), and its mesh's device."""
    from torch.distributed.tensor import Replicate, Shard

    first = params[0]
    mesh, placements = first.device_mesh, tuple(first.placements)
    for p in params:
        if p.device_mesh != mesh or tuple(p.placements) != placements:
            raise ShardedParameterError(
                f"fuse_optimizer over DTensor parameters needs them all on one device mesh with one placement; "
                f"found {placements} and {tuple(p.placements)}: build one optimizer per mesh"
            )
    sharded = [dim for dim, placement in enumerate(placements) if isinstance(placement, Shard)]
    if len(sharded) != 1 or placements[sharded[0]] != Shard(0) or not all(
            isinstance(pl, (Shard, Replicate)) for pl in placements):
        raise ShardedParameterError(
            f"fuse_optimizer supports parameters sharded along their first dimension over one mesh dimension "
            f"(FSDP2's fully_shard, HSDP); these have placements {placements}. Use the optimizer unfused here"
        )
    return ShardGroup(mesh.get_group(sharded[0]), torch.device(mesh.device_type))


def _stand_in(p: torch.Tensor, fsdp_param) -> torch.nn.Parameter:
    """A plain parameter over ``p``'s local shard, marked with the room of FSDP2's padded shard."""
    local = compat.local_shard(p)
    stand_in = torch.nn.Parameter(local.detach(), requires_grad=p.requires_grad)
    setattr(stand_in, SHARD_ATTR, ShardOf(room=compat.fsdp2_padded_numel(fsdp_param), numel=p.numel()))
    return stand_in


def _shard_optimizer(optimizer: torch.optim.Optimizer, stand_ins: Dict[int, torch.nn.Parameter]):
    """``optimizer``'s class over the stand-ins: its settings shared, its hooks and per-parameter state
    its own, its optimizer-level state (``self.state["k"]``) the same objects."""
    state = defaultdict(dict)
    state.update({k: v for k, v in optimizer.state.items() if not isinstance(k, torch.Tensor)})
    groups = [dict(group, params=[stand_ins[id(p)] for p in group["params"]]) for group in optimizer.param_groups]
    return optimizer_like(optimizer, groups, state)


class ShardedFusion:
    """What :func:`fuse_optimizer` attaches to an optimizer over FSDP2's sharded parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: FusionConfig):
        from .fused_optimizer import _ATTR, Fusion

        self.optimizer = optimizer
        self.config = config
        self.step_before_fusing = optimizer.__dict__.get("step")  # restored by unfuse()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        plain = [p for p in params if not is_sharded(p)]
        if plain:
            raise ShardedParameterError(
                f"this {type(optimizer).__name__} mixes DTensor parameters with {len(plain)} plain one(s) "
                f"(first: {tuple(plain[0].shape)}); fuse_optimizer over FSDP2 needs every parameter sharded: apply "
                "fully_shard to the root module too, or build a separate optimizer for the rest"
            )
        self.shard_group = _shard_group(params)
        fsdp = compat.fsdp2_params(params)
        missing = [p for p in params if id(p) not in fsdp]
        if missing:
            raise ShardedParameterError(
                f"a DTensor parameter of shape {tuple(missing[0].shape)} is not sharded by FSDP2's fully_shard "
                "(tensor parallelism?); fuse_optimizer supports FSDP2 shards only. Use the optimizer unfused here"
            )
        self.params = params
        self.fsdp_params = [fsdp[id(p)] for p in params]
        self.stand_ins = [_stand_in(p, fp) for p, fp in zip(params, self.fsdp_params)]
        self.shard_optimizer = _shard_optimizer(optimizer, {id(p): s for p, s in zip(params, self.stand_ins)})
        shard_config = dataclasses.replace(config, replace_step=False, verify=0, shard_group=self.shard_group)
        self.shard_fusion = Fusion(self.shard_optimizer, shard_config)
        setattr(self.shard_optimizer, _ATTR, self.shard_fusion)
        layout = self.shard_fusion.layout
        self.unfused_reason: Optional[str] = None
        self._padded = {}  # id(stand-in) -> its padded shard in the flat buffer
        self._pointers: Optional[List[int]] = None  # FSDP2's shard pointers once pointed at the buffers
        self._generation = None  # the layout's generation _padded was taken from
        # (id(parameter), state key or None for the gradient) -> (flat view, the DTensor shown over it)
        self._shown: Dict[Any, Any] = {}
        self._shown_entries: Dict[int, "_Shown"] = {}  # id(parameter) -> what _show_state last made of its state
        self._shown_all: Optional["_ShownAll"] = None  # and of all of them, after its last pass over each
        # gradients become views of the flat buffer after a step while the program keeps them
        # (zero_grad(set_to_none=False), accumulation): see _fused_shard_step
        self._grads_kept = True  # (until a step shows otherwise)
        # (index, weak reference) of a gradient after the last fused step: still there at the next one?
        self._grad_after_step: Optional[Tuple[int, Any]] = None
        self._slots: List[Any] = []
        self._shown_grads: List[Any] = [None] * len(params)  # each parameter's gradient shown over the buffer
        self._flat_grads: List[torch.Tensor] = []
        self._follow_layout()
        # ids of parameters whose step can run in flat runs: their state exists, or their group's first
        # step was found exact on runs (elementwise groups; segmented ones the probes checked)
        self.stepped = set()
        for index, group in layout.groups.items():
            if group.path == ELEMENTWISE or (group.path == SEGMENTED and group.first_step_on_runs):
                self.stepped.update(id(p) for p in optimizer.param_groups[index]["params"])
                self.shard_fusion.planner.first_steps_taken(self.shard_optimizer.param_groups[index]["params"])
        self._import_state()
        self.handles = [optimizer.register_load_state_dict_post_hook(lambda _: self._import_state()),
                        optimizer.register_state_dict_post_hook(_compact_state)]

    # ------------------------------------------------------------------ memory
    def _follow_layout(self) -> None:
        """FSDP2 all-gathers from the flat buffers the shard optimizer has now: at fusing, and after it
        laid a group out anew (a setting its step branches on changed, a late reduction re-planned it),
        when the new buffers hold the values. A group that left the flat buffers makes every step the
        optimizer's own DTensor step: a shard stepped on its own would reduce over this rank's part only."""
        layout = self.shard_fusion.layout
        if layout.generation == self._generation:
            return
        self._generation = layout.generation
        self.unfused_reason = next(
            (g.reason or g.path_why for g in layout.groups.values() if g.path == PER_TENSOR or g.per_tensor), None)
        self._padded = {id(slot.param): buffer.param[slot.start: slot.start + getattr(slot.param, SHARD_ATTR).room]
                        for buffer in layout.buffers() for slot in buffer.slots}
        slots = {id(slot.param): slot for buffer in layout.buffers() for slot in buffer.slots}
        self._slots = [slots.get(id(stand_in)) for stand_in in self.stand_ins]
        self._flat_grads = [buffer.grad for buffer in layout.buffers()]
        self._pointers = None
        self._point_fsdp_at_buffers(copy=False)

    def _point_fsdp_at_buffers(self, copy: bool) -> None:
        """FSDP2 all-gathers from the flat buffer; after FSDP2 re-pointed a shard (``model.to``,
        ``load_state_dict(assign=True)``) its values are copied back in first (``copy``)."""
        if compat.fsdp2_shard_pointers(self.fsdp_params) == self._pointers:
            return  # (a usual step: as they were pointed)
        for p, fsdp_param, stand_in in zip(self.params, self.fsdp_params, self.stand_ins):
            padded = self._padded.get(id(stand_in))
            if padded is None or compat.fsdp2_shard_points_at(fsdp_param, padded):
                continue
            with torch.no_grad():
                if copy:
                    stand_in.data.copy_(compat.local_shard(p))
                compat.fsdp2_point_shard_at(fsdp_param, padded, stand_in.data)
        self._pointers = compat.fsdp2_shard_pointers(self.fsdp_params)

    # ------------------------------------------------------------------ state both ways
    def _import_state(self) -> None:
        """``optimizer.state`` (DTensors: loaded, or written by a whole-parameter step) into the
        shard optimizer's state; the next fused step moves it into the flat buffers."""
        state, shard_state = self.optimizer.state, self.shard_optimizer.state
        for p, stand_in in zip(self.params, self.stand_ins):
            entry = state.get(p)
            if entry:
                shard_state[stand_in] = {k: compat.local_shard(v) if is_sharded(v) else v for k, v in entry.items()}
                self.stepped.add(id(p))
            else:
                shard_state.pop(stand_in, None)
        for key, value in state.items():  # optimizer-level state
            if not isinstance(key, torch.Tensor):
                shard_state[key] = value
        self.shard_fusion.planner.invalidate()

    def _show_state(self) -> None:
        """The shard optimizer's state in ``optimizer.state``: shard-shaped tensors as DTensors
        (views of the flat state), the rest as it is. Only what changed is rewrapped; a usual step
        (the same state objects, in place, and new Python numbers) is followed for all parameters
        at once (``_ShownAll``): per parameter, that cost 0.3-0.6 ms a step on BERT-base's 199."""
        state, shard_state, last_shown = self.optimizer.state, self.shard_optimizer.state, self._shown_entries
        if self._shown_all is None or not self._shown_all.follow(shard_state, state):
            sources = [shard_state.get(stand_in, _EMPTY) for stand_in in self.stand_ins]
            self._show_each(state, sources, last_shown)
            self._show_optimizer_level_state(state, shard_state)
            self._shown_all = _ShownAll(shard_state, state, sources, [state.get(p, _EMPTY) for p in self.params])
        else:
            self._show_optimizer_level_state(state, shard_state)

    @staticmethod
    def _show_optimizer_level_state(state, shard_state) -> None:
        for key, value in shard_state.items():
            if not isinstance(key, torch.Tensor):
                state[key] = value

    def _show_each(self, state, sources, last_shown) -> None:
        """``_show_state`` parameter by parameter."""
        for p, stand_in, source in zip(self.params, self.stand_ins, sources):
            if not source:
                continue
            entry = state[p]
            shown = last_shown.get(id(p))
            if shown is not None and shown.follow(source, entry):
                continue  # (a usual step: the same state objects, in place, and new Python numbers)
            for key, value in source.items():
                current = entry.get(key)
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == stand_in.shape:
                    shown = self._shown.get((id(p), key))
                    if shown is None or shown[0] is not value or current is not shown[1]:
                        entry[key] = compat.dtensor_over(value, p)
                        self._shown[(id(p), key)] = (value, entry[key])
                elif current is not value:
                    entry[key] = value
            for key in [k for k in entry if k not in source]:
                del entry[key]
            last_shown[id(p)] = _Shown(source, entry)

    def _sync_settings(self, source, target) -> None:
        for a, b in zip(source.param_groups, target.param_groups):
            for key, value in a.items():
                if key != "params" and (key not in b or b[key] is not value):
                    b[key] = value

    # ------------------------------------------------------------------ the step
    def step(self, closure=None):
        optimizer = self.optimizer
        if len(optimizer.param_groups) != len(self.shard_optimizer.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(optimizer.param_groups, self.shard_optimizer.param_groups)):
            raise ShardedParameterError(
                "the param groups changed after fuse_optimizer (add_param_group?); over FSDP2 shards, "
                "fuse the optimizer once every group is added"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._point_fsdp_at_buffers(copy=True)
        with_grads = [p for p in self.params if p.grad is not None]
        if self.unfused_reason is not None or any(id(p) not in self.stepped for p in with_grads):
            self._whole_parameter_step(with_grads)
            return loss
        replay = None if closure is None else (lambda: loss)  # the closure's loss, to the optimizer's own step
        every = self.config.verify
        if every and self.shard_fusion.stats.fused_steps % every == 0:
            # verification mode: the optimizer's own step on the DTensors (whole parameters) first
            names, reducing = FlatLayout.param_names(optimizer), {id(p) for p in self.params}
            with verified(optimizer, self._reference_step, names, reducing):
                self._fused_shard_step(optimizer, replay, with_grads)
        else:
            self._fused_shard_step(optimizer, replay, with_grads)
        return loss

    def _reference_step(self) -> None:
        """The optimizer's own step on the DTensors, for verification mode (nothing of it is kept)."""
        raw_step, strips_grad_mode = unwrapped_step(type(self.optimizer))
        with self.shard_fusion._eager_grad_mode(strips_grad_mode):
            raw_step(self.optimizer)

    def _fused_shard_step(self, optimizer, replay, with_grads) -> None:
        """The shard optimizer's fused step on this rank's shards (the optimizer's own DTensor step
        where a shard cannot be stepped in flat runs this step)."""
        fresh = self._grads_to_stand_ins()
        versions, generation = compat.tensor_versions(self._flat_grads), self._generation
        self._sync_settings(optimizer, self.shard_optimizer)
        from .fused_optimizer import NeedsWholeParameters, _fused_step

        try:
            _fused_step(self.shard_optimizer, replay)
        except NeedsWholeParameters:
            self._follow_layout()
            self._whole_parameter_step(with_grads)
            return
        self._follow_layout()
        self._sync_settings(self.shard_optimizer, optimizer)
        self._show_state()
        relaid = self._generation != generation  # (new flat buffers: shown gradients are views of the old)
        if (fresh or relaid) and (self._grads_kept or relaid or compat.tensor_versions(self._flat_grads) != versions):
            # (also where the step wrote the gradients, as BertAdam's clipping does: the parameters'
            # .grad then shows the written values, as after the unfused step)
            self._grads_into_buffers()
        self._grad_after_step = next(((i, weakref.ref(p.grad)) for i, p in enumerate(self.params) if p.grad is not None),
                                     None)

    def _grads_to_stand_ins(self) -> int:
        """Each stand-in's gradient: the DTensor gradient's local tensor, copied into the stand-in's view
        of the flat gradient buffer (one foreach copy for all: FSDP2 hands over new gradients after
        ``zero_grad(set_to_none=True)``, and a copy per parameter is a kernel launch each). Returns how
        many gradients are not yet shown as views of the buffer.

        Also notes whether the program keeps its gradients from one step to the next (``zero_grad(
        set_to_none=False)``, accumulation over steps): only then are they shown as views of the flat
        buffer after the step, so that FSDP2 accumulates the next backward there; a program that sets
        them to None would have them rebuilt as DTensors each step for nothing (199 on BERT-base)."""
        grads = list(map(_GRAD, self.params))
        if self._grad_after_step is not None:
            index, ref = self._grad_after_step
            self._grads_kept = grads[index] is not None and grads[index] is ref()
        quick = self._grads_quickly(grads)
        if quick is not None:
            return quick
        views, locals_, fresh = [], [], 0
        for p, grad, stand_in, slot in zip(self.params, grads, self.stand_ins, self._slots):
            if grad is None:
                stand_in.grad = None
                continue
            local = compat.local_shard(grad)
            shown = self._shown.get((id(p), None))
            if shown is not None and shown[1] is grad:
                stand_in.grad = local
                continue
            fresh += 1
            view = None if slot is None else slot.grad_view
            if (view is not None and local is not view and view.shape == local.shape and view.dtype == local.dtype
                    and view.device == local.device and stand_in.data_ptr() == slot.param_ptr):
                views.append(view)
                locals_.append(local)
                stand_in.grad = view
            else:
                stand_in.grad = local  # (the planner copies it in, or steps it per tensor)
        if views:
            with torch.no_grad():
                torch._foreach_copy_(views, locals_)
        return fresh

    def _grads_quickly(self, grads: List[Any]) -> Optional[int]:
        """:meth:`_grads_to_stand_ins` for the usual steps, in C-level passes; None where a gradient
        needs a look of its own. A program that keeps its gradients: every one is shown as a view of
        the buffer and its stand-in holds that view (0: nothing new). One that sets them to None: every
        one is new, shaped, typed and placed as its stand-in's view of the flat gradient buffer, and
        every stand-in is in its slot: one foreach copy (the number of gradients). A parameter without
        a gradient: its stand-in gets none. (Identity tests only: ``None in grads`` would compare
        tensors with ``==``, through DTensor's dispatch.)"""
        has = list(map(operator.is_not, grads, repeat(None)))
        slots, stand_ins = list(compress(self._slots, has)), list(compress(self.stand_ins, has))
        grads = list(compress(grads, has))
        if any(map(operator.is_, slots, repeat(None))):
            return None
        views = list(map(_GRAD_VIEW, slots))
        if all(map(operator.is_, grads, compress(self._shown_grads, has))):
            if not (all(map(operator.is_, map(_GRAD, stand_ins), views))
                    and all(map(operator.is_, map(compat.local_shard, grads), views))):
                return None  # (shown over another buffer's views: the group was laid out anew)
            for _ in map(setattr, compress(self.stand_ins, map(operator.not_, has)), repeat("grad"), repeat(None)):
                pass
            return 0
        if any(map(operator.is_, grads, compress(self._shown_grads, has))):
            return None
        locals_ = list(map(compat.local_shard, grads))
        if (any(map(operator.is_, views, repeat(None)))
                or list(map(torch.Tensor.data_ptr, stand_ins)) != list(map(_PARAM_PTR, slots))
                or list(map(_META, locals_)) != list(map(_META, views))
                or any(map(operator.is_, locals_, views))):
            return None
        if views:
            with torch.no_grad():
                torch._foreach_copy_(views, locals_)
        for _ in map(setattr, stand_ins, repeat("grad"), views):
            pass
        for _ in map(setattr, compress(self.stand_ins, map(operator.not_, has)), repeat("grad"), repeat(None)):
            pass
        return len(views)

    def _grads_into_buffers(self) -> None:
        """Each DTensor gradient becomes a view of the flat gradient buffer (which holds its values now),
        so that FSDP2 accumulates the next backward into it when gradients are not set to None."""
        for index, (p, stand_in) in enumerate(zip(self.params, self.stand_ins)):
            grad, view = p.grad, stand_in.grad
            shown = self._shown.get((id(p), None))
            if grad is None or view is None or (shown is not None and shown[0] is view and shown[1] is grad):
                continue
            p.grad = self._shown_grads[index] = compat.dtensor_over(view, grad)
            self._shown[(id(p), None)] = (view, p.grad)

    def _whole_parameter_step(self, with_grads) -> None:
        """The optimizer's own step on the DTensors (its first step: state created per parameter)."""
        optimizer = self.optimizer
        raw_step, strips_grad_mode = unwrapped_step(type(optimizer))
        with self.shard_fusion._eager_grad_mode(strips_grad_mode):
            raw_step(optimizer)
        self.shard_fusion._after_any_step(self.shard_optimizer, (), {})  # (an ordinary step, to its report)
        self.stepped.update(id(p) for p in with_grads)
        self._import_state()
        self.shard_fusion.planner.first_steps_taken([s for p, s in zip(self.params, self.stand_ins) if id(p) in self.stepped])
        mark_step_taken(optimizer)

    def remove(self) -> None:
        self.shard_fusion.remove()
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _same_or_numbers(a, b) -> bool:
    return a is b or (type(a) in _NUMBERS and type(b) in _NUMBERS)


class _Shown:
    """What ``_show_state`` last made of one parameter's state: the shard optimizer's entry (its keys
    and objects) and the entry shown in ``optimizer.state``. Identity only: a tensor's ``==`` compares
    values."""

    __slots__ = ("keys", "values", "numbers", "shown")

    def __init__(self, source: Dict[str, Any], entry: Dict[str, Any]):
        self.keys, self.values = tuple(source), tuple(source.values())
        self.numbers = [key for key, value in source.items() if type(value) in _NUMBERS]
        self.shown = tuple(entry.values())

    def follow(self, source: Dict[str, Any], entry: Dict[str, Any]) -> bool:
        """Where the shard entry holds the same keys and objects, Python numbers aside (a step count
        changes every step), and nobody edited the shown entry: copy the numbers over, and True."""
        if not (len(source) == len(self.keys) and len(entry) == len(self.shown)
                and all(map(operator.is_, self.keys, source)) and all(map(operator.is_, self.shown, entry.values()))
                and all(map(_same_or_numbers, self.values, source.values()))):
            return False
        for key in self.numbers:
            entry[key] = source[key]
        self.values, self.shown = tuple(source.values()), tuple(entry.values())
        return True


_EMPTY: Dict[str, Any] = {}  # (read only) a parameter without state


class _ShownAll:
    """What ``_show_state`` made of every parameter's state in its last pass over each: both state
    dicts' keys and entries, and the entries' keys and objects, flattened into tuples, so that a
    usual step is recognised in a few C-level passes (no tensor is hashed) instead of one
    ``_Shown.follow`` per parameter. Identity only, as ``_Shown``: a tensor's ``==`` compares values."""

    __slots__ = ("dicts", "sources", "entries", "sizes", "keys", "values", "is_number", "not_number", "numbers", "shown")

    def __init__(self, shard_state, state, sources: List[Dict[str, Any]], entries: List[Dict[str, Any]]):
        self.dicts = (tuple(shard_state), tuple(shard_state.values()), tuple(state), tuple(state.values()))
        self.sources, self.entries = tuple(sources), tuple(entries)
        self.sizes = (tuple(map(len, sources)), tuple(map(len, entries)))
        self.keys = tuple(k for source in sources for k in source)
        self.values = tuple(v for source in sources for v in source.values())
        self.is_number = tuple(type(v) in _NUMBERS for v in self.values)
        self.not_number = tuple(not n for n in self.is_number)
        # the shown entry and the key of each Python number, in the order of the flattened values
        self.numbers = tuple(zip(*[(entry, key) for source, entry in zip(sources, entries)
                                   for key, value in source.items() if type(value) in _NUMBERS])) or ((), ())
        self.shown = tuple(v for entry in entries for v in entry.values())

    def follow(self, shard_state, state) -> bool:
        """Where both state dicts hold the same entries, each with the same keys and objects (Python
        numbers aside), and nobody edited a shown entry: copy the numbers over, and True. Else
        False, changing nothing."""
        shard_keys, shard_entries, keys_shown, entries_shown = self.dicts
        if not (len(shard_state) == len(shard_keys) and len(state) == len(keys_shown)
                and all(map(operator.is_, shard_state.values(), shard_entries))
                and all(map(operator.is_, state.values(), entries_shown))
                and all(map(operator.is_, shard_state, shard_keys)) and all(map(operator.is_, state, keys_shown))):
            return False
        sources, entries = self.sources, self.entries
        if (tuple(map(len, sources)), tuple(map(len, entries))) != self.sizes:
            return False
        values = list(chain.from_iterable(map(dict.values, sources)))
        numbers = list(compress(values, self.is_number))
        if not (all(map(operator.is_, chain.from_iterable(sources), self.keys))
                and all(map(operator.is_, compress(values, self.not_number), compress(self.values, self.not_number)))
                and set(map(type, numbers)) <= _NUMBERS
                and all(map(operator.is_, chain.from_iterable(map(dict.values, entries)), self.shown))):
            return False
        deque(map(operator.setitem, self.numbers[0], self.numbers[1], numbers), maxlen=0)  # the numbers, shown
        self.values, self.shown = values, tuple(chain.from_iterable(map(dict.values, entries)))
        return True


def _compact_state(optimizer, state_dict):
    """``state_dict()`` holds each DTensor state as a DTensor over its own copy of the shard: a view
    of a flat state buffer would be saved with the whole buffer (``torch.save``), and cannot be
    deep-copied. (One copy of the optimizer's state while the state dict lives.)"""
    for entry in state_dict["state"].values():
        for key, value in entry.items():
            if is_sharded(value):
                local = compat.local_shard(value)
                if local.untyped_storage().nbytes() != local.numel() * local.element_size():
                    entry[key] = compat.dtensor_over(local.clone(), value)
    return state_dict

