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
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

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


class Slot:
    """One parameter's place in a flat buffer."""

    __slots__ = ("param", "start", "end", "param_ptr", "grad_view", "token", "state_views", "hook")

    def __init__(self, param: torch.Tensor, start: int):
        self.param = param
        self.start = start
        self.end = start + param.numel()
        self.param_ptr = 0  # where param.data must start once it is a view of the flat buffer
        self.grad_view: Optional[torch.Tensor] = None
        # Slots with the same token hold identical scalar state and may share a run.
        self.token: object = None
        self.state_views: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (flat, view)
        self.hook = None


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
                offset += p.numel()
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
