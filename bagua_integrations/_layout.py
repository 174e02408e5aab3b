"""Where a fused optimizer's parameters live: its configuration and its flat buffers.

:class:`FusionConfig` is what the user asked ``fuse_optimizer`` for. :class:`FlatLayout`
decides, per param group, which parameters go into flat buffers (see ``_flat.py``) and which
keep an ordinary per-tensor update, keeps the gradient hooks that move fresh gradients into
the flat buffers, and rebuilds a group when its parameter list changes. It knows nothing
about steps: that is the planner's job (``_planner.py``).
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ._flat import FlatBuffer, Slot, slot_room
from ._verify import verify_every
from ._paths import settings_signature, SEGMENTED, PathChooser
from ._segmented import MAX_RANK, size_key
from .errors import FusionFallbackWarning, NotElementwiseError, ShardedParameterError, SharedParameterError

try:  # public from torch 2.5 (the oldest supported release)
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support
    DTensor = None

ON_UNSUPPORTED = ("raise", "fallback")


def is_sharded(tensor: Any) -> bool:
    """A DTensor (FSDP2's ``fully_shard``, tensor parallelism): this rank holds part of it."""
    return DTensor is not None and isinstance(tensor, DTensor)
COMPILE_MODES = (True, False, "auto")


@dataclass(frozen=True)
class FusionConfig:
    """The arguments of ``fuse_optimizer`` (see its docstring), checked once."""

    do_flatten: bool = True
    replace_step: bool = False
    on_unsupported: str = "fallback"
    assume_elementwise: bool = False
    compile: Any = "auto"
    verify: Optional[int] = None  # check every N-th fused step against the unfused one (_verify.py)
    # the parameters are each rank's shards of larger ones (FSDP2, _sharded.py): a reduction over
    # a whole parameter combines every rank's partial values over this process group
    shard_group: Any = None

    def __post_init__(self):
        object.__setattr__(self, "verify", verify_every(self.verify))  # frozen: set once, here
        for flag in ("do_flatten", "replace_step", "assume_elementwise"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.on_unsupported not in ON_UNSUPPORTED:
            raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got {self.on_unsupported!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be True, False or 'auto', got {self.compile!r}")


def tied_parameters(params: List[torch.Tensor]) -> set:
    """``id``s of parameters whose bytes overlap another parameter's (tied weights).

    Sharing a storage is not enough: every parameter of an already-fused model lives in one
    flat storage, side by side, and can be fused again (re-laid out) by a new optimizer.
    """
    spans = defaultdict(list)  # storage -> [(first byte, end byte, id)]
    for p in params:
        if p.device.type == "meta" or p.numel() == 0 or p.layout != torch.strided:
            continue
        first = p.storage_offset() * p.element_size()
        extent = max(((size - 1) * stride for size, stride in zip(p.shape, p.stride())), default=0)  # 0-D: one element
        last = first + max(0, extent) * p.element_size()
        spans[(p.device, p.untyped_storage().data_ptr())].append((first, last + p.element_size(), id(p)))
    tied = set()
    for ranges in spans.values():
        ranges.sort()
        reach, owner = -1, None
        for start, end, ident in ranges:
            if start < reach:
                tied.update((ident, owner))
            if end > reach:
                reach, owner = end, ident
    return tied


class GradHooks:
    """The gradient hooks of one layout, by slot. Holds no reference to the optimizer, so it
    can be cleared when the optimizer is garbage-collected."""

    def __init__(self):
        self.handles: Dict[int, Any] = {}  # id(slot) -> RemovableHandle

    def add(self, slot: Slot, handle) -> None:
        self.handles[id(slot)] = handle

    def remove(self, slots) -> None:
        for slot in slots:
            handle = self.handles.pop(id(slot), None)
            if handle is not None:
                handle.remove()

    def remove_all(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()


def _settings_changed(layout: "GroupLayout", signature: Tuple) -> bool:
    """Whether a group's settings changed since its signature was last seen, its own bookkeeping aside."""
    if signature == layout.signature:
        return False
    own = layout.own_keys
    return [item for item in signature if item[0] not in own] != [item for item in layout.signature if item[0] not in own]


class GroupLayout:
    """One param group: its flat buffers, and the parameters always stepped one by one."""

    def __init__(self, params: List[torch.Tensor], signature: Tuple = ()):
        self.param_ids = tuple(id(p) for p in params)
        self.signature = signature  # _paths.settings_signature of the group as last seen (refresh, a step)
        self.own_keys: frozenset = frozenset()  # group keys the optimizer's step writes (see note_own_keys)
        self.buffers: List[FlatBuffer] = []
        self.per_tensor: List[torch.Tensor] = []
        # True when the group's step is elementwise except for whole-parameter reductions
        # (_segmented.py): its runs hold parameters of one rank and reduce per parameter.
        self.segmented = False
        self.reason: Optional[str] = None  # why the group's parameters keep their unfused step
        # elementwise: operations mixing a whole flat run that the probes found exact (a global norm),
        # counted per step; checks of the real steps look for others (_late_reductions.py)
        self.mixing: Counter = Counter()
        self.why: Dict[str, str] = {}  # path -> why the group (on some device) takes it
        # over shards: segmented, its first step found exact on runs (_paths.GroupPath.first_step_on_runs)
        self.first_step_on_runs = False
        # segmented: its step reduces over every parameter of a list over runs (_paths.GroupPath.across_runs)
        self.across_runs: Tuple[str, ...] = ()
        self.lone_lists_over_runs = False  # segmented: _paths.GroupPath.lone_lists_over_runs
        self.value_branches = False  # segmented: _paths.GroupPath.value_branches
        self.size_dims: Tuple[int, ...] = ()  # segmented: _paths.GroupPath.size_dims

    @property
    def path_why(self) -> str:
        """Why the group takes :attr:`path`."""
        return self.reason or self.why.get(self.path, "")

    @property
    def path(self) -> str:
        """How the group is stepped: "elementwise", "segmented" or "per-tensor"."""
        if not self.buffers:
            return "per-tensor"
        return "segmented" if self.segmented else "elementwise"

    def slots(self):
        for buffer in self.buffers:
            yield from buffer.slots


def _stepped_alone_in_runs(p: torch.Tensor) -> Optional[str]:
    """Why ``p``, in a group whose step reduces per parameter, is stepped on its own rather than in a
    segmented run (None: it joins the runs)."""
    if p.dim() > MAX_RANK:  # (a 0-D one is stepped on its own in every group: _unfusable_reason)
        return f"its step reduces per parameter and a {p.dim()}-D parameter is stepped on its own"
    if p.is_complex():
        # the probes step real (fp32) tensors; an optimizer may take another code path for complex
        # ones (pytorch-optimizer's Lamb: its per-parameter loop, whose Python scalars a segmented
        # run cannot give), so these keep their own exact step
        return ("its step reduces per parameter, which was checked on real tensors, and it is complex: "
                "stepped on its own")
    return None


class FlatLayout:
    """The flat buffers of every param group of one optimizer, and their gradient hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: FusionConfig):
        self.optimizer = optimizer
        self.config = config
        self.groups: Dict[int, GroupLayout] = {}
        self.generation = 0  # bumped whenever refresh() rebuilds or drops a group (the planner watches it)
        self.reasons: Dict[str, str] = {}  # parameter name -> why it is stepped per tensor
        self.hooks = GradHooks()
        # called with this layout after refresh() laid out a group anew (the fusion hooks the
        # state_dict of the modules owning new parameters)
        self.on_refresh: Optional[Callable[["FlatLayout"], None]] = None
        self._warned = set()
        # each group's path is decided before it is laid out (one place: _paths.py)
        self.paths = PathChooser(optimizer, config.assume_elementwise, sharded=config.shard_group is not None)
        # the optimizer's step cannot be given other tensors: every group keeps its own step
        self.wrapper_reason = self.paths.wrapper_reason
        try:
            self._check_each_parameter_once()
            for index, group in enumerate(optimizer.param_groups):
                self._build_group(index, group)
        except BaseException:
            self.remove_hooks()
            raise

    # ------------------------------------------------------------------ sizes
    def fused_elements(self) -> int:
        return sum(buffer.numel for layout in self.groups.values() for buffer in layout.buffers)

    def fused_params(self) -> int:
        return sum(len(buffer.slots) for layout in self.groups.values() for buffer in layout.buffers)

    def per_tensor_params(self) -> int:
        return sum(len(layout.per_tensor) for layout in self.groups.values())

    def buffers(self) -> List[FlatBuffer]:
        return [buffer for index in sorted(self.groups) for buffer in self.groups[index].buffers]

    # ------------------------------------------------------------------ building groups
    def _check_each_parameter_once(self) -> None:
        """torch.optim checks this only in the constructor and ``add_param_group``; a parameter
        put into a second group by editing ``param_groups`` directly would be stepped twice
        unfused and once fused."""
        ids = [id(p) for group in self.optimizer.param_groups for p in group["params"]]
        if len(set(ids)) == len(ids):  # (every step: the usual answer in one pass)
            return
        seen: Dict[int, Tuple[int, int]] = {}
        for index, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) in seen:
                    first = seen[id(p)]
                    raise SharedParameterError(
                        f"{self._param_name(group, index, i, p)} is also param_groups[{first[0]}]['params'][{first[1]}]: "
                        f"{type(self.optimizer).__name__} would step it once per listing, a fused step cannot; "
                        "list each parameter in one group"
                    )
                seen[id(p)] = (index, i)

    def _check_no_sharded_parameters(self, index: int, group: Dict[str, Any]) -> None:
        """DTensor parameters hold only this rank's shard, behind DTensor's own dispatch: a flat buffer
        cannot take them in (it would fail deep inside torch). An optimizer over FSDP2's shards is fused
        through its shards (``_sharded.py``); this layout sees one only where a DTensor was added later
        (``add_param_group``) to an optimizer fused over plain parameters."""
        for i, p in enumerate(group["params"]):
            if is_sharded(p):
                raise ShardedParameterError(
                    f"{self._param_name(group, index, i, p)} is a DTensor added to an optimizer fused over plain "
                    "parameters; an optimizer over FSDP2's shards must hold only sharded parameters when "
                    "fuse_optimizer is called. Build and fuse a separate optimizer for the sharded model"
                )

    def warn_once(self, key: str, message: str, stacklevel: int) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, FusionFallbackWarning, stacklevel=stacklevel + 1)

    @staticmethod
    def param_names(optimizer) -> Dict[int, str]:
        """id(parameter) -> the name errors and reports give it (see :meth:`_param_name`)."""
        return {id(p): FlatLayout._param_name(group, index, i, p)
                for index, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])}

    @staticmethod
    def _param_name(group, index, i, p) -> str:
        names = group.get("param_names")
        name = names[i] if names and i < len(names) else f"param_groups[{index}]['params'][{i}]"
        return f"{name} {tuple(p.shape)}"

    def _unfusable_reason(self, p: torch.Tensor, tied: set) -> Optional[str]:
        if p.numel() == 0 and slot_room(p) == 0:  # (an empty shard keeps its slot: all ranks lay out alike)
            return "it has no elements"
        if p.layout != torch.strided:
            return "it is not a dense tensor"
        if p.dim() == 0:
            # its state is 0-D too (Adam's exp_avg of CLIP's logit_scale): in a run, where 0-D state
            # is what the run keeps once for all its parameters (a step count), the two kinds would
            # look alike; one value costs nothing to step on its own, in the same call of the step
            return "it is 0-dimensional (one value): stepped on its own, in the same call as the flat runs"
        if p.device.type == "meta":
            return "it is on the meta device (materialize the model, e.g. model.to_empty(device=...), before fusing)"
        if not p.is_contiguous() and self.config.do_flatten:
            # a flat-buffer view is contiguous: channels_last or transposed strides would be lost,
            # and with them the memory format (and rounding) of the model's own kernels
            return "its memory is not contiguous (channels_last or a transposed view); flattening would change its strides"
        if id(p) in tied and self.config.do_flatten:
            return "it shares memory with another parameter (flattening would untie them)"
        return None

    def _build_group(self, index: int, group: Dict[str, Any]) -> None:
        self._check_no_sharded_parameters(index, group)
        params = group["params"]
        layout = GroupLayout(params, settings_signature(group))
        self.groups[index] = layout
        tied = tied_parameters(params)
        by_key: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        for i, p in enumerate(params):
            reason = self._unfusable_reason(p, tied)
            if reason:
                self.reasons[self._param_name(group, index, i, p)] = reason
                layout.per_tensor.append(p)
            else:
                by_key.setdefault((p.device, p.dtype), []).append(p)
        for (device, _), members in by_key.items():
            path = self.paths.choose(group, device)
            layout.why.setdefault(path.path, path.why)
            layout.mixing |= Counter(dict(path.mixing))
            reason, segmented = path.refusal, path.path == SEGMENTED
            if segmented:
                alone = {id(p): why for p in members if (why := _stepped_alone_in_runs(p)) is not None}
                for p in members:
                    if id(p) in alone:  # (by identity: list.index compares tensors with ==)
                        position = next(i for i, q in enumerate(group["params"]) if q is p)
                        self.reasons[self._param_name(group, index, position, p)] = alone[id(p)]
                        layout.per_tensor.append(p)
                members = [p for p in members if id(p) not in alone]
                if not members:
                    continue
                layout.segmented = True
                layout.first_step_on_runs = path.first_step_on_runs
                layout.across_runs = path.across_runs
                layout.lone_lists_over_runs = path.lone_lists_over_runs
                layout.value_branches = path.value_branches
                layout.size_dims = path.size_dims
            if reason is None and not self.config.do_flatten and not FlatBuffer.adoptable(members):
                reason = "do_flatten=False and its parameters are not already contiguous in memory"
            if reason is not None:
                self._keep_per_tensor(index, group, members, reason)
                continue
            layout.buffers.append(self._flat_buffer(members, by_rank=segmented,
                                                    size_dims=layout.size_dims if segmented else ()))

    def _keep_per_tensor(self, index, group, members, reason: str) -> None:
        cls = type(self.optimizer).__name__
        if self.config.on_unsupported == "raise":
            raise NotElementwiseError(
                f"{cls} (param group {index}) cannot be fused exactly: {reason}. Fusing it would change "
                f"its math, and on_unsupported='raise' asks for an error. Use "
                f"fuse_optimizer(opt, on_unsupported='fallback') (the default) to keep this group's exact "
                f"unfused step, or fuse_optimizer(opt, assume_elementwise=True) to force fusion if you "
                f"know the update is elementwise."
            )
        # _keep_per_tensor <- _build_group <- FlatLayout <- Fusion <- fuse_optimizer <- user
        self.warn_once(f"group{index}", f"{cls} param group {index} keeps its unfused step: {reason}", stacklevel=6)
        self.groups[index].reason = reason
        member_ids = {id(p) for p in members}
        for i, p in enumerate(group["params"]):
            if id(p) in member_ids:
                self.reasons[self._param_name(group, index, i, p)] = reason
        self.groups[index].per_tensor.extend(members)

    def _flat_buffer(self, members: List[torch.Tensor], by_rank: bool = False, size_dims: Tuple[int, ...] = ()) -> FlatBuffer:
        if self.config.do_flatten:
            # Trainable parameters first: frozen ones never get gradients and would split runs;
            # segmented runs hold one rank, so parameters of equal rank sit together, and of equal
            # sizes where the step reads them (``size_dims``: a run's parameters share those).
            members = sorted(members, key=lambda p: (not p.requires_grad, p.dim() if by_rank else 0,
                                                     size_key(p.shape, size_dims)))
        buffer = FlatBuffer(members, flatten=self.config.do_flatten)
        if size_dims:
            for slot in buffer.slots:  # (classes the planner cuts runs by: see split_where_branches_differ)
                slot.branch = ("sizes",) + size_key(slot.param.shape, size_dims)
        for slot in buffer.slots:
            if slot.param.requires_grad:
                self.hooks.add(slot, slot.param.register_post_accumulate_grad_hook(self._grad_hook(buffer, slot)))
        return buffer

    @staticmethod
    def _grad_hook(buffer: FlatBuffer, slot: Slot):
        # After zero_grad(set_to_none=True) autograd hands over a fresh tensor: move it into
        # the flat gradient buffer so every step stays as fused as the first one.
        def hook(param: torch.Tensor) -> None:
            buffer.sync_grad(slot)

        return hook

    def refresh(self) -> bool:
        """Lay out groups added with ``add_param_group``, whose parameter lists changed, or whose
        settings changed in a way the step may branch on (``max_grad_norm`` from 0 to 1.0: the
        path is chosen again, see ``_paths.settings_signature``).

        Returns True when anything was rebuilt.
        """
        changed = False
        self._check_each_parameter_once()
        for index, group in enumerate(self.optimizer.param_groups):
            layout = self.groups.get(index)
            signature = settings_signature(group)
            if (layout is None or layout.param_ids != tuple(map(id, group["params"]))
                    or (_settings_changed(layout, signature) and not self._same_paths(layout, group))):
                if layout is not None:
                    self.hooks.remove(layout.slots())
                self._build_group(index, group)
                changed = True
            else:
                layout.signature = signature
        for index in [i for i in self.groups if i >= len(self.optimizer.param_groups)]:
            self.hooks.remove(self.groups.pop(index).slots())
            changed = True
        if changed:
            self.generation += 1
            if self.on_refresh is not None:
                self.on_refresh(self)
        return changed

    def rebuild_group(self, index: int) -> None:
        """Lay group ``index`` out again on the paths ``self.paths`` now gives it (after
        ``PathChooser.choose_again``: its step began reducing over whole parameters). Its
        parameters move into new flat buffers; their state follows on the next step (``sync_state``)."""
        old = self.groups[index]
        self.hooks.remove(old.slots())
        try:
            self._build_group(index, self.optimizer.param_groups[index])
        except BaseException:  # (refused under on_unsupported="raise"): the group stays as it was
            self.hooks.remove(self.groups[index].slots())
            self.groups[index] = old
            for buffer in old.buffers:
                for slot in buffer.slots:
                    if slot.param.requires_grad:
                        self.hooks.add(slot, slot.param.register_post_accumulate_grad_hook(self._grad_hook(buffer, slot)))
            raise
        self.groups[index].own_keys = old.own_keys  # the step's bookkeeping keys stay known
        self.generation += 1
        if self.on_refresh is not None:
            self.on_refresh(self)

    def _same_paths(self, layout: GroupLayout, group: Dict[str, Any]) -> bool:
        """Whether the group's new settings keep the paths chosen for it (then nothing is rebuilt:
        a scheduler that adds its keys, or a flag that changes nothing the step does)."""
        devices = {p.device for p in group["params"] if p.device.type != "meta"}
        return {self.paths.choose(group, device).path for device in devices} == set(layout.why)

    def note_own_keys(self) -> None:
        """After a fused step (whose plan() refreshed every group's signature): keys whose signature
        the optimizer's own step changed are its bookkeeping, not settings, and no longer make the
        group's path be chosen again."""
        for index, group in enumerate(self.optimizer.param_groups):
            layout = self.groups.get(index)
            if layout is None:
                continue
            signature = settings_signature(group)
            if signature != layout.signature:
                seen = set(layout.signature)
                layout.own_keys = layout.own_keys | {key for key, value in signature if (key, value) not in seen}
                layout.signature = signature

    def remove_hooks(self) -> None:
        self.hooks.remove_all()
