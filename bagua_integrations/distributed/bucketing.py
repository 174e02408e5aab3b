"""Gradient segments and the buckets the reducer cuts from them.

The reducer averages gradients while backward is still running, so before backward it must
know where each gradient will land and in which order the gradients will arrive:

* a *segment* is one flat gradient tensor whose slices are the ``.grad`` of some parameters:
  a fused optimizer's flat gradient buffer (shared: the optimizer's hook already moves every
  fresh gradient there, so the reducer copies nothing), or a buffer allocated here for the
  other parameters (a fresh gradient is copied in once, then ``.grad`` stays a view of it);
* a *bucket* is a contiguous range of one segment that one communication averages. Buckets
  are numbered in the order backward is expected to fill them (last parameters first) and
  are launched strictly in that order on every rank.

Seeing tensors as one flat tensor (views, alignment gaps) is :mod:`bagua_integrations._flat`'s
job: a bucket is a :class:`~bagua_integrations._flat.PackedTensors` of its gradients that is
always a view. The fused optimizer is reached only through its public
:func:`~bagua_integrations.fused_optimizer.flat_grad_segments`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .._flat import PackedTensors
from ..fused_optimizer import flat_grad_segments, is_fused_optimizer
from .errors import ReducerStateError

__all__ = ["GradSegment", "Bucket", "build_segments", "make_buckets"]


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


def _fused_segments(optimizer, order: Dict[int, int], claimed: set) -> List[GradSegment]:
    """Segments sharing a fused optimizer's flat gradient buffers.

    A buffer is split wherever it holds a parameter the reducer does not average (frozen, or
    already claimed by another optimizer): a bucket is one view of the buffer, and averaging
    over that parameter's slice would change a gradient nobody asked to average.
    """
    segments: List[GradSegment] = []
    for flat_segment in flat_grad_segments(optimizer):
        run: List[Tuple[torch.Tensor, int]] = []
        for param, start in zip(flat_segment.params, flat_segment.starts):
            if id(param) in order and id(param) not in claimed:
                run.append((param, start))
                claimed.add(id(param))
            elif run:
                segments.append(GradSegment(flat_segment.flat, run, shared=True))
                run = []
        if run:
            segments.append(GradSegment(flat_segment.flat, run, shared=True))
    return segments


def build_segments(params: Sequence[torch.Tensor], optimizers: Sequence[torch.optim.Optimizer]) -> List[GradSegment]:
    """Segments covering ``params``: fused optimizers' flat gradient buffers first, then own buffers."""
    order: Dict[int, int] = {id(p): i for i, p in enumerate(params)}
    claimed: set = set()
    segments: List[GradSegment] = []
    for optimizer in optimizers:
        if is_fused_optimizer(optimizer):
            segments.extend(_fused_segments(optimizer, order, claimed))
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
    """A contiguous range of one segment, averaged by one communication.

    ``flat`` is a view of the segment covering the entries' gradients and the alignment
    ``gaps`` between them (a fused buffer's padding), which a lossy reduction must re-zero.
    """

    def __init__(self, index: int, entries: List[Entry]):
        self.index = index
        self.entries = entries
        self.pack = PackedTensors([e.view for e in entries])
        if self.pack.copied:  # entries of one segment are adjacent slices of it: always a view
            raise ReducerStateError("internal error: a gradient bucket is not a view of its segment")
        self.flat = self.pack.flat
        #: (parameter, its gradient's view of ``flat``) for algorithms that read per-parameter state
        self.members = [(e.param, e.view) for e in entries]
        for entry in entries:
            entry.bucket = self

    @property
    def gaps(self) -> List[Tuple[int, int]]:
        return self.pack.gaps

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def zero_gaps(self) -> None:
        """Re-zero alignment padding a lossy reduction may have filled."""
        self.pack.zero_gaps()

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
                buckets.append(Bucket(len(buckets), current))
                current = []
        if current:
            buckets.append(Bucket(len(buckets), current))
    return buckets
