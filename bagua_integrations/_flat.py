"""Flat memory: the one model of "many tensors as views of one contiguous tensor".

Used by fusion (the fused optimizer owns its parameters' memory) and by communication
(gradient buckets and weight packs are ranges of the same memory). Glossary:

* **flat buffer** (:class:`FlatBuffer`) -- one per (param group, device, dtype) of a fused
  optimizer: a 1-D parameter tensor, a 1-D gradient tensor and one 1-D tensor per
  parameter-shaped state key (``exp_avg``, ...), all with the same layout.
* **slot** (:class:`Slot`) -- one parameter's range ``[start, end)`` in a flat buffer;
  ``param.data``, ``param.grad`` and its state tensors are views of that range. Slots start
  on 64-byte boundaries (:data:`ALIGN_BYTES`), so there may be a little padding between them.
* **proxy** -- an ``nn.Parameter`` over the slots ``[first, last)`` of a buffer (param and
  grad are views of the flat tensors): what the optimizer's own ``step`` is handed instead of
  the real parameters. The planner (``_planner.py``) decides which ranges (*runs*) to hand over.
* **shard** (:class:`ShardOf`) -- a parameter that is one rank's part of a larger one (FSDP2):
  its slot keeps room for FSDP2's padded shard, which is a view of the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .errors import LayoutChangedError

# Slots start on 64-byte boundaries so flat runs and their slices stay vector-aligned.
ALIGN_BYTES = 64


def align_elements(element_size: int) -> int:
    """Elements per alignment step: slots start on multiples of it, so a shorter gap is padding."""
    return max(1, ALIGN_BYTES // element_size)


def _aligned(offset: int, element_size: int) -> int:
    per = align_elements(element_size)
    return (offset + per - 1) // per * per


@dataclass(frozen=True)
class ShardOf:
    """What a flat buffer knows of a parameter that is one rank's shard of a larger parameter.

    ``room``: elements its slot keeps (FSDP2 pads every rank's shard to one size, and all-gathers
    the padded shard straight from the slot), so slots start at the same offsets on every rank
    and an empty shard still has a slot. ``numel``: the whole parameter's elements (a mean over
    the parameter divides by it). Attached to a shard's stand-in as :data:`SHARD_ATTR`.
    """

    room: int
    numel: int


SHARD_ATTR = "_bagua_shard_of"


def shard_of(param: torch.Tensor) -> Optional[ShardOf]:
    return getattr(param, SHARD_ATTR, None)


def slot_room(param: torch.Tensor) -> int:
    """Elements a parameter's slot keeps: its own, or its padded shard's."""
    shard = shard_of(param)
    return param.numel() if shard is None else max(shard.room, param.numel())


class Slot:
    """One parameter's place in a flat buffer."""

    __slots__ = ("param", "start", "end", "param_ptr", "grad_view", "token", "state_views", "branch")

    def __init__(self, param: torch.Tensor, start: int):
        self.param = param
        self.start = start
        self.end = start + param.numel()
        self.param_ptr = 0  # where param.data must start once it is a view of the flat buffer
        self.grad_view: Optional[torch.Tensor] = None
        # Slots with the same token hold identical scalar state and may share a run.
        self.token: object = None
        self.state_views: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (flat, view)
        # Slots whose step took different ways at a Python branch on per-parameter values differ
        # here, and go in different runs (_planner.StepPlanner.split_where_branches_differ).
        self.branch = 0


def _pinned(device: torch.device, tensors: List[torch.Tensor]) -> bool:
    """All of ``tensors`` are in pinned host memory. (Only asked once CUDA is initialized, as it
    must be for a tensor to be pinned: ``is_pinned`` may otherwise start a CUDA context.)"""
    return device.type == "cpu" and torch.cuda.is_initialized() and all(t.is_pinned() for t in tensors)


class FlatBuffer:
    """Contiguous parameter / gradient / state storage for one (group, device, dtype)."""

    def __init__(self, params: List[torch.Tensor], flatten: bool):
        first = params[0]
        self.device, self.dtype = first.device, first.dtype
        self.element_size = first.element_size()
        offset, slots = 0, []
        if flatten:
            for p in params:
                offset = _aligned(offset, self.element_size)
                slots.append(Slot(p, offset))
                offset += slot_room(p)
        else:
            offset = self._adopt_offsets(params, slots)
        self.slots = slots
        self.numel = offset
        self.param = self._flatten_params(flatten)
        self.grad = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for slot in slots:
            slot.param_ptr = self.param.data_ptr() + slot.start * self.element_size
            slot.grad_view = self.grad[slot.start : slot.end].view_as(slot.param)
            existing = slot.param.grad
            if existing is not None and existing.layout == torch.strided:
                slot.grad_view.copy_(existing)
                slot.param.grad = slot.grad_view
        self.state: Dict[str, torch.Tensor] = {}
        self.proxies: Dict[Tuple[int, int], torch.nn.Parameter] = {}
        self._run_views: Dict[Tuple[str, int, int], torch.Tensor] = {}
        self._views_lists: Dict[Tuple[str, int, int], Tuple[torch.Tensor, List[torch.Tensor]]] = {}

    @staticmethod
    def adoptable(params: List[torch.Tensor]) -> bool:
        """True when ``params`` already lie back to back in one storage (``do_flatten=False``)."""
        storage = params[0].untyped_storage().data_ptr()
        expected = params[0].storage_offset()
        for p in params:
            if (
                p.untyped_storage().data_ptr() != storage
                or p.storage_offset() != expected
                or not p.is_contiguous()
            ):
                return False
            expected += p.numel()
        return True

    def _adopt_offsets(self, params, slots) -> int:
        base = params[0].storage_offset()
        for p in params:
            slots.append(Slot(p, p.storage_offset() - base))
        return slots[-1].end

    def _flatten_params(self, flatten: bool) -> torch.Tensor:
        if not flatten:
            first = self.slots[0].param
            flat = torch.empty(0, dtype=self.dtype, device=self.device)
            flat.set_(first.untyped_storage(), first.storage_offset(), (self.numel,))
            return flat
        flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        if _pinned(self.device, [slot.param for slot in self.slots]):
            # pinned host memory (FSDP2's CPUOffloadPolicy(pin_memory=True) shards, which it copies to
            # the accelerator before every all-gather): keep the copies asynchronous
            flat = flat.pin_memory()
        with torch.no_grad():
            for slot in self.slots:
                flat[slot.start : slot.end].copy_(slot.param.detach().reshape(-1))
                slot.param.data = flat[slot.start : slot.end].view_as(slot.param)
        return flat

    # ----------------------------------------------------------------- keeping views in place
    # Each check starts with an identity test, so a step whose views are all in place costs
    # a few Python comparisons per parameter and no tensor work.
    def sync_param(self, slot: Slot) -> None:
        """Put a parameter whose ``.data`` was replaced back into its slot."""
        p = slot.param
        if p.data_ptr() == slot.param_ptr:
            return
        if p.device != self.device or p.dtype != self.dtype or p.numel() != slot.end - slot.start:
            raise LayoutChangedError(
                f"a fused parameter changed from {self.dtype} on {self.device} with "
                f"{slot.end - slot.start} elements to {p.dtype} on {p.device} with {p.numel()}; "
                "move or cast the model before calling fuse_optimizer, not after"
            )
        with torch.no_grad():
            view = self.param[slot.start : slot.end].view_as(p)
            view.copy_(p.detach())
            p.data = view
        slot.grad_view = self.grad[slot.start : slot.end].view_as(p)

    def sync_grad(self, slot: Slot) -> bool:
        """Make ``param.grad`` the slot's view; return False if there is no dense gradient."""
        g = slot.param.grad
        view = slot.grad_view
        if g is view:
            return True
        if g is None or g.layout != torch.strided:
            return False
        if g.dtype != view.dtype or g.device != view.device or g.shape != view.shape:
            return False  # the parameter itself moved; sync_param raises LayoutChangedError
        if g.data_ptr() != view.data_ptr():
            view.copy_(g.detach())  # cheaper than entering no_grad, once per parameter per backward
        slot.param.grad = view
        return True

    def state_view(self, key: str, slot: Slot) -> torch.Tensor:
        """The slot's view of flat state ``key`` (cached per flat buffer object)."""
        flat = self.state[key]
        entry = slot.state_views.get(key)
        if entry is None or entry[0] is not flat:
            entry = (flat, flat[slot.start : slot.end].view_as(slot.param))
            slot.state_views[key] = entry
        return entry[1]

    def state_views(self, key: str, first: int, last: int) -> List[torch.Tensor]:
        """:meth:`state_view` of slots ``[first, last)``: the same list while flat state ``key`` is
        the same tensor, so a step compares a run's entries with it in one C-level pass."""
        flat = self.state[key]
        cached = self._views_lists.get((key, first, last))
        if cached is None or cached[0] is not flat:
            cached = (flat, [self.state_view(key, slot) for slot in self.slots[first:last]])
            self._views_lists[(key, first, last)] = cached
        return cached[1]

    def sync_state(self, key: str, slot: Slot, value: torch.Tensor) -> torch.Tensor:
        """Copy a per-parameter state tensor into the flat state buffer (if not already a view of it)."""
        flat = self.state.get(key)
        entry = slot.state_views.get(key)
        if entry is not None and entry[1] is value and entry[0] is flat:
            return value
        if flat is None or flat.dtype != value.dtype:
            flat = torch.zeros(self.numel, dtype=value.dtype, device=self.device)
            self.state[key] = flat
        view = self.state_view(key, slot)
        if value.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(value)
        return view

    def adopt_or_copy_state(self, key: str, start: int, end: int, value: torch.Tensor) -> torch.Tensor:
        """Store the flat run state ``value`` for ``[start, end)``; return the flat buffer."""
        flat = self.state.get(key)
        if flat is not None and flat.dtype == value.dtype:
            if value.data_ptr() != flat.data_ptr() + start * flat.element_size():
                flat[start:end].copy_(value)
            return flat
        owns_storage = value.is_contiguous() and value.untyped_storage().nbytes() == value.numel() * value.element_size()
        if start == 0 and end == self.numel and owns_storage and value.storage_offset() == 0:
            flat = value  # the optimizer just created it for the whole buffer: no copy
        else:
            flat = torch.zeros(self.numel, dtype=value.dtype, device=self.device)
            flat[start:end].copy_(value)
        self.state[key] = flat
        return flat

    def state_slice(self, key: str, start: int, end: int) -> torch.Tensor:
        """The flat state of ``[start, end)``; the same tensor object every step (compilers guard on it)."""
        flat = self.state[key]
        if start == 0 and end == self.numel:
            return flat
        view = self._run_views.get((key, start, end))
        if view is None or view.data_ptr() != flat.data_ptr() + start * flat.element_size() or view.dtype != flat.dtype:
            view = flat[start:end]
            self._run_views[(key, start, end)] = view
        return view

    def proxy(self, first: int, last: int) -> torch.nn.Parameter:
        """A parameter over slots ``[first, last)`` sharing memory with the flat buffers."""
        key = (first, last)
        proxy = self.proxies.get(key)
        start, end = self.slots[first].start, self.slots[last - 1].end
        if proxy is None or proxy.data_ptr() != self.param.data_ptr() + start * self.element_size:
            proxy = torch.nn.Parameter(self.param[start:end], requires_grad=True)
            self.proxies[key] = proxy
        proxy.grad = self.grad[start:end]
        return proxy


# ============================================================================= packs
# Communication moves many tensors at once by handing a collective one flat tensor. Where the
# tensors are a fused optimizer's (parameters, gradients, state: slots of one flat buffer)
# that flat tensor is a view of the buffer and nothing is copied; anything else is gathered
# into a private copy and scattered back. The gradient reducer's buckets, the synchronous
# gradient average, model algorithms and the start-of-training broadcasts all use this.


def shared_flat_view(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 1-D view covering exactly ``tensors`` and the padding between them, or None.

    Not None when the tensors (in any order) lie back to back in one storage with at most
    alignment padding between neighbours, as the slots of a :class:`FlatBuffer` do. A gap of
    a whole alignment step or more might hold a tensor that is not in the list, which a
    collective on the view would overwrite, so it means "no view".
    """
    first = tensors[0]
    storage = first.untyped_storage()
    per = align_elements(first.element_size())
    ordered = sorted(tensors, key=lambda t: t.storage_offset())
    for t in ordered:
        if (
            t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.dtype != first.dtype
            or t.layout != torch.strided
            or not t.is_contiguous()
        ):
            return None
    for before, after in zip(ordered, ordered[1:]):
        gap = after.storage_offset() - (before.storage_offset() + before.numel())
        if gap < 0 or gap >= per:
            return None
    start = ordered[0].storage_offset()
    length = ordered[-1].storage_offset() + ordered[-1].numel() - start
    flat = torch.empty(0, dtype=first.dtype, device=first.device)
    flat.set_(storage, start, (length,))
    return flat


def _gaps(tensors: List[torch.Tensor], start: int) -> List[Tuple[int, int]]:
    """The ranges of a view starting at storage offset ``start`` that no tensor covers."""
    gaps, cursor = [], 0
    for t in sorted(tensors, key=lambda t: t.storage_offset()):
        lo = t.storage_offset() - start
        if lo > cursor:
            gaps.append((cursor, lo))
        cursor = max(cursor, lo + t.numel())
    return gaps


class PackedTensors:
    """Some same-device, same-dtype tensors seen as one flat 1-D tensor (a *pack*).

    Glossary (communication side of flat memory):

    * **pack** -- tensors that one collective moves as one flat tensor: ``flat = pack.gather()``,
      change ``flat`` in place (all-reduce it, average it, ...), then ``pack.scatter()``.
    * **view** -- when the tensors already lie back to back in one storage (a fused optimizer's
      parameters, gradients or state), ``flat`` is a view of that storage: gathering and
      scattering copy nothing. The view is trusted only while every tensor's ``data_ptr`` is
      the one it had when the pack was made; once one changed (someone assigned ``.data``,
      the optimizer rebuilt its buffers) the pack copies from then on (``copied``).
    * **copy** -- otherwise ``flat`` is a private buffer (allocated once, reused):
      ``gather`` copies the values in, ``scatter`` copies them back.
    * **gap** -- alignment padding inside a view, between two tensors (``gaps`` are
      ``(start, end)`` element ranges of ``flat``). It belongs to no tensor and must stay zero
      (the fused optimizer steps whole flat runs, padding included), so ``scatter`` re-zeroes
      it in case a lossy reduction (bytegrad) wrote something there.
    """

    def __init__(self, tensors: List[torch.Tensor]):
        if not tensors:
            raise ValueError("a pack needs at least one tensor")
        first = tensors[0]
        for t in tensors:
            if t.device != first.device or t.dtype != first.dtype:
                raise ValueError(
                    f"a pack holds tensors of one device and dtype, got {first.dtype} on {first.device} "
                    f"and {t.dtype} on {t.device}; use pack_tensors to group them"
                )
        self.tensors = list(tensors)
        self.numel = sum(t.numel() for t in self.tensors)
        self._view = shared_flat_view(self.tensors)
        self._copy: Optional[torch.Tensor] = None
        self._gap_index: Optional[torch.Tensor] = None
        self.gaps: List[Tuple[int, int]] = []
        if self._view is not None:
            self._ptrs = [t.data_ptr() for t in self.tensors]
            self.gaps = _gaps(self.tensors, self._view.storage_offset())

    @property
    def copied(self) -> bool:
        """True when ``flat`` is a private copy rather than a view of the tensors' memory."""
        return self._view is None

    @property
    def flat(self) -> torch.Tensor:
        """The flat tensor: the view, or the private copy (holding what :meth:`gather` last read)."""
        return self._view if self._view is not None else self._private_copy()

    def _private_copy(self) -> torch.Tensor:
        if self._copy is None:
            first = self.tensors[0]
            self._copy = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        return self._copy

    def gather(self) -> torch.Tensor:
        """The flat tensor holding the tensors' current values (the view itself, or a fresh copy)."""
        if self._view is not None:
            if all(t.data_ptr() == ptr for t, ptr in zip(self.tensors, self._ptrs)):
                return self._view
            self._view, self.gaps, self._gap_index = None, [], None  # a tensor moved: copy from now on
        copy = self._private_copy()
        with torch.no_grad():
            torch.cat([t.detach().reshape(-1) for t in self.tensors], out=copy)
        return copy

    def scatter(self) -> None:
        """Give the tensors the values of ``flat`` (after :meth:`gather` and changing ``flat``).

        A copy is written back; a view already is the tensors, only its gaps are re-zeroed.
        """
        if self._view is not None:
            self.zero_gaps()
            return
        if self._copy is None:
            raise RuntimeError("PackedTensors.scatter() before gather(): there is nothing to write back")
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                t.detach().copy_(self._copy[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def zero_gaps(self) -> None:
        """Re-zero the alignment padding inside the view (one kernel however many gaps)."""
        if not self.gaps:
            return
        if len(self.gaps) == 1:
            start, end = self.gaps[0]
            self._view[start:end].zero_()
            return
        if self._gap_index is None:
            index = torch.cat([torch.arange(start, end) for start, end in self.gaps])
            self._gap_index = index.to(self._view.device)
        self._view.index_fill_(0, self._gap_index, 0)


def _distinct_nonempty(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """``tensors`` in order, each once, without the empty ones (they have nothing to move)."""
    seen, out = set(), []
    for t in tensors:
        if t.numel() > 0 and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class Packs(list):
    """The packs :func:`pack_tensors` made (a list of :class:`PackedTensors`), used together.

    ``flats = packs.gather()``; change the flats in place; ``packs.scatter()``.
    ``tensors`` are the tensors packed: each once, empty ones left out, in the order given.
    """

    def __init__(self, packs: List[PackedTensors], tensors: List[torch.Tensor]):
        super().__init__(packs)
        self.tensors = tensors

    @property
    def zero_copy(self) -> bool:
        """True when every pack is a view (nothing is copied to communicate them)."""
        return all(not pack.copied for pack in self)

    def gather(self) -> List[torch.Tensor]:
        return [pack.gather() for pack in self]

    def scatter(self) -> None:
        for pack in self:
            pack.scatter()

    def same_tensors(self, tensors: Iterable[torch.Tensor]) -> bool:
        """True when packing ``tensors`` would pack the same tensors in the same order."""
        return [id(t) for t in _distinct_nonempty(tensors)] == [id(t) for t in self.tensors]


def pack_tensors(tensors: Iterable[torch.Tensor], max_bytes: Optional[int] = None) -> Packs:
    """Group ``tensors`` by (device, dtype) into packs of about ``max_bytes`` bytes.

    Each tensor counts once; empty tensors are left out. A pack is closed once it holds at
    least ``max_bytes`` (None: one pack per device and dtype). Tensors that share flat memory
    are cut in memory order, so that every pack of them is still a view.
    """
    distinct = _distinct_nonempty(tensors)
    by_key: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for t in distinct:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    packs: List[PackedTensors] = []
    for members in by_key.values():
        if max_bytes is None:
            packs.append(PackedTensors(members))
            continue
        if shared_flat_view(members) is not None:
            members = sorted(members, key=lambda t: t.data_ptr())
        current: List[torch.Tensor] = []
        size = 0
        for t in members:
            current.append(t)
            size += t.numel() * t.element_size()
            if size >= max_bytes:
                packs.append(PackedTensors(current))
                current, size = [], 0
        if current:
            packs.append(PackedTensors(current))
    return Packs(packs, distinct)
