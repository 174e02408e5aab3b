"""Flat gradient memory and the buckets cut from it.

A *segment* is one flat gradient tensor whose slices are the ``.grad`` of some parameters:
either a fused optimizer's flat gradient buffer (shared, zero copy) or a buffer the reducer
allocates itself. A *bucket* is a contiguous range of one segment that one communication
averages; buckets are numbered in the order backward is expected to fill them (last
parameters first) and are launched strictly in that order on every rank.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..fused_optimizer import fused_layout, is_fused_optimizer
from .errors import ReducerStateError
from .packing import shared_flat_view

__all__ = ["GradSegment", "Bucket", "build_segments", "make_buckets", "TensorBucket", "flatten_groups"]


class Entry:
    """One parameter's gradient range in a segment."""

    __slots__ = ("param", "start", "end", "view", "segment", "bucket", "position")

    def __init__(self, param: torch.Tensor, start: int, segment: "GradSegment"):
        self.param = param
        self.start = start
        self.end = start + param.numel()
        self.segment = segment
        self.view = segment.flat[self.start : self.end].view_as(param)
        self.bucket: Optional["Bucket"] = None
        self.position = 0  # index in the reducer's parameter list

    def adopt_grad(self) -> bool:
        """Make ``param.grad`` this entry's view (copying a fresh gradient in); False if it has none."""
        grad = self.param.grad
        if grad is None:
            return False
        if grad.data_ptr() == self.view.data_ptr():
            return True
        if grad.layout != torch.strided:
            raise ReducerStateError(
                f"a parameter of shape {tuple(self.param.shape)} got a {grad.layout} gradient; gradient "
                "algorithms average dense gradients only: use sparse=False embeddings"
            )
        if self.segment.shared:
            raise ReducerStateError(
                "the fused optimizer moved a parameter's gradient out of the flat buffer the reducer "
                "uses (its layout was rebuilt, e.g. by add_param_group, after bagua_init); call "
                "bagua_init (or switch_to) again after changing the optimizer's parameters"
            )
        # backward runs without grad mode; detach only matters under create_graph=True
        self.view.copy_(grad.detach() if grad.requires_grad else grad)
        self.param.grad = self.view
        return True

    def zero_unused(self) -> None:
        """A parameter without a gradient this round contributes zeros."""
        self.view.zero_()


class GradSegment:
    """A flat gradient tensor whose slices are some parameters' ``.grad``.

    ``shared`` segments belong to a fused optimizer (its hook already moved each gradient
    in); the others are allocated here, and a fresh gradient is copied in by the reducer.
    """

    def __init__(self, flat: torch.Tensor, params_and_starts: Sequence[Tuple[torch.Tensor, int]], shared: bool):
        self.flat = flat
        self.shared = shared
        self.entries = [Entry(p, start, self) for p, start in params_and_starts]


def _owned_segment(params: List[torch.Tensor]) -> GradSegment:
    first = params[0]
    flat = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
    starts, offset = [], 0
    for p in params:
        starts.append((p, offset))
        offset += p.numel()
    segment = GradSegment(flat, starts, shared=False)
    for entry in segment.entries:
        grad = entry.param.grad
        if grad is not None and grad.layout == torch.strided:
            with torch.no_grad():
                entry.view.copy_(grad)
            entry.param.grad = entry.view
    return segment


def build_segments(params: Sequence[torch.Tensor], optimizers: Sequence[torch.optim.Optimizer]) -> List[GradSegment]:
    """Segments covering ``params``: fused optimizers' flat gradient buffers first, then own buffers."""
    order: Dict[int, int] = {id(p): i for i, p in enumerate(params)}
    claimed = set()
    segments: List[GradSegment] = []
    for optimizer in optimizers:
        if not is_fused_optimizer(optimizer):
            continue
        layout = fused_layout(optimizer)
        for index in sorted(layout.groups):
            for buffer in layout.groups[index].buffers:
                run: List[Tuple[torch.Tensor, int]] = []
                for slot in buffer.slots + [None]:
                    wanted = slot is not None and id(slot.param) in order and id(slot.param) not in claimed
                    if wanted:
                        run.append((slot.param, slot.start))
                        claimed.add(id(slot.param))
                    elif run:
                        segments.append(GradSegment(buffer.grad, run, shared=True))
                        run = []
    rest: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for p in params:
        if id(p) not in claimed:
            rest.setdefault((p.device, p.dtype), []).append(p)
    segments.extend(_owned_segment(members) for members in rest.values())
    for segment in segments:
        for entry in segment.entries:
            entry.position = order[id(entry.param)]
    # Backward produces the last parameters' gradients first.
    segments.sort(key=lambda s: max(e.position for e in s.entries), reverse=True)
    return segments


class Bucket:
    """A contiguous range of one segment, averaged by one communication."""

    def __init__(self, index: int, segment: GradSegment, entries: List[Entry]):
        self.index = index
        self.entries = entries
        lo = min(e.start for e in entries)
        hi = max(e.end for e in entries)
        self.flat = segment.flat[lo:hi]
        covered = sorted((e.start - lo, e.end - lo) for e in entries)
        self.gaps = []
        cursor = 0
        for start, end in covered:
            if start > cursor:
                self.gaps.append((cursor, start))
            cursor = max(cursor, end)
        for entry in entries:
            entry.bucket = self

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def zero_gaps(self) -> None:
        """Re-zero alignment padding a lossy reduction may have filled."""
        for start, end in self.gaps:
            self.flat[start:end].zero_()

    def describe(self) -> str:
        return f"{self.flat.dtype}:{self.flat.numel()}:{len(self.entries)}"


def make_buckets(segments: Sequence[GradSegment], message_size: int) -> List[Bucket]:
    """Cut segments into buckets of at least ``message_size`` bytes (the last one of a segment may be smaller)."""
    buckets: List[Bucket] = []
    for segment in segments:
        current: List[Entry] = []
        for entry in sorted(segment.entries, key=lambda e: e.start, reverse=True):
            current.append(entry)
            span = (current[0].end - entry.start) * segment.flat.element_size()
            if span >= message_size:
                buckets.append(Bucket(len(buckets), segment, current))
                current = []
        if current:
            buckets.append(Bucket(len(buckets), segment, current))
    return buckets


# ---------------------------------------------------------------------- synchronous bucketing
class TensorBucket:
    """Same-dtype tensors averaged together: a view when they share flat memory, else a flat copy."""

    def __init__(self, tensors: List[torch.Tensor]):
        self.tensors = tensors
        self.flat = shared_flat_view(tensors)
        self.copied = self.flat is None
        self.gaps: List[Tuple[int, int]] = []
        if self.copied:
            self.flat = _flatten_dense_tensors(tensors) if len(tensors) > 1 else tensors[0].detach().reshape(-1).clone()
        else:
            base = self.flat.data_ptr()
            size = self.flat.element_size()
            cursor = 0
            for t in sorted(tensors, key=lambda t: t.data_ptr()):
                start = (t.data_ptr() - base) // size
                if start > cursor:
                    self.gaps.append((cursor, start))
                cursor = start + t.numel()

    def write_back(self) -> None:
        if not self.copied:
            for start, end in self.gaps:
                self.flat[start:end].zero_()
            return
        with torch.no_grad():
            for t, value in zip(self.tensors, _unflatten_dense_tensors(self.flat, self.tensors)):
                t.copy_(value)


def flatten_groups(tensors: Sequence[torch.Tensor], message_size: int) -> List[TensorBucket]:
    """Group tensors by (device, dtype) and pack each group into buckets of about ``message_size`` bytes."""
    by_key: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    buckets: List[TensorBucket] = []
    for members in by_key.values():
        if shared_flat_view(members) is not None:
            members = sorted(members, key=lambda t: t.data_ptr())
        current: List[torch.Tensor] = []
        size = 0
        for t in members:
            current.append(t)
            size += t.numel() * t.element_size()
            if size >= message_size:
                buckets.append(TensorBucket(current))
                current, size = [], 0
        if current:
            buckets.append(TensorBucket(current))
    return buckets
