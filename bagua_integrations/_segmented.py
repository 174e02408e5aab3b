"""Segmented fusion: optimizers that are elementwise except for reductions over a whole parameter.

BertAdam clips each parameter's gradient to a norm, LAMB and LARS scale each parameter's update
by a trust ratio of two norms, NovoGrad keeps one second moment per parameter. Their ``step``
is elementwise *except* for those per-parameter reductions, so it can still run once on a flat
run of many parameters, provided every reduction is computed per parameter. That is what
:class:`SegmentedMode` does while the optimizer's own ``step`` runs on a run's proxy:

* **segment** -- one parameter's range inside a run (alignment padding belongs to none).
  :class:`Segmentation` knows a run's segments and the proxy's shape. A run holds parameters
  of one rank, and its proxy has that rank (``(1, ..., 1, length)``), so ``p.dim() == 1``
  branches take the same way as for each parameter.
* **segment scalar** -- what a reduction of a whole parameter gives: one value per segment,
  held as a tensor of shape ``(S, 1, 1, 1, 1)`` (``S`` segments; the extra dimensions keep it
  apart from every proxy; two runs of one call with equal ``S`` differ in its rank, see
  :func:`segment_scalar_shape`). Elementwise arithmetic on segment scalars stays one value per
  segment; combined with a run-shaped tensor, each value is expanded over its segment first.
* A **reduction** is any call that turns a run-shaped tensor into one value (a norm, a sum,
  ``max``, ``clip_grad_norm_``'s internals, ...): it is re-run on each segment's view, shaped
  like the parameter, with the very same function and arguments, so the values are the
  per-parameter ones bit for bit. Nothing is allowlisted; the mode recognises a reduction by
  its result.
* A call **along a dimension** (``dim=``: a mean per output channel, ``F.normalize(m, dim=0)``)
  runs on each segment's view too; a result shaped like the parameter, or broadcasting to it
  (``keepdim=True``), is laid over the segment's range of a run-shaped tensor.
* A Python **branch** on a segment scalar (``if exp_avg_sq == 0:``) goes the way every segment
  goes; where they differ, :class:`BranchesDisagree` is raised before the branch, the step's
  writes so far are undone from the mode's journal, and the caller takes those parameters' step
  per parameter.
* What cannot be expressed raises :class:`NotSegmentable`: reading a value into Python
  (``.item()``), a reduction along a dimension that drops it (Nero's per-neuron norms, viewed
  back by hand), reshaping a run, or a per-parameter result that is not a single value. The probe
  (``_probe.probe_segmented``) turns that, or any mismatch with the per-tensor step, into
  "keep the exact per-tensor step".
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ._foreach import element_calls

__all__ = ["Segmentation", "SegmentedMode", "StepNotes", "NotSegmentable", "BranchesDisagree", "SizesDisagree",
           "segment_views", "MAX_RANK", "all_reduce_together", "segment_scalar_shape", "size_key", "state_kind"]

MAX_RANK = 4  # proxies have rank 1..4; segment scalars rank 5, 7, 9, ... and lists over runs 6: they never collide
_SCALAR_TRAILING = (1,) * MAX_RANK
# Reading a value into Python makes the control flow depend on one parameter's numbers.
_VALUE_READS = {getattr(torch.Tensor, n) for n in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__",
                                                   "__complex__", "numpy", "__len__", "numel", "nelement", "__iter__")}
# Sets of functions built once, so that the mode needs no string handling while it is traced.
_FOREACH = {getattr(torch, n): n[len("_foreach_"):] for n in dir(torch) if n.startswith("_foreach_")}
# Reductions whose whole-run result is never needed when called on a run without a dimension:
# going straight to the per-parameter values saves a pass over the run.
_WHOLE_REDUCTIONS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm, torch.sum, torch.Tensor.sum, torch.mean,
                     torch.Tensor.mean, torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin, torch.max,
                     torch.Tensor.max, torch.min, torch.Tensor.min, torch.dot, torch.Tensor.dot}
_FOREACH_IN_PLACE = {f for f, base in _FOREACH.items() if base.endswith("_")}
# Python values read from tensors that a step may branch on, per parameter: taken where every
# parameter gives the same (``SegmentedMode._value_per_parameter``)
_PYTHON_VALUES = {torch.allclose, torch.Tensor.allclose, torch.equal, torch.Tensor.equal, torch.is_nonzero,
                  torch.Tensor.is_nonzero}
_SCALAR_READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__,
                 torch.Tensor.__index__}
_STACKS = {torch.stack, torch.cat, torch.concat, torch.concatenate}
_ELEMENT_COUNTS = {torch.Tensor.numel, torch.Tensor.nelement, torch.numel}
# Shape-only functions: on one value per parameter, the per-parameter result is that one value again.
_RESHAPES = {torch.Tensor.reshape, torch.reshape, torch.Tensor.view, torch.Tensor.squeeze, torch.squeeze,
             torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.flatten, torch.flatten, torch.Tensor.ravel,
             torch.ravel, torch.Tensor.contiguous}
_IN_PLACE = {getattr(torch.Tensor, n) for n in dir(torch.Tensor)
             if (n.endswith("_") and not n.startswith("__")) or n.startswith("__i")}
# Eager arithmetic of a CPU run with one value per parameter (``grad.div_(norm)``, ``update * trust``)
# runs on each parameter's range with its own value when the parameters average at least this many
# elements: a call per parameter then costs less than writing the values over the whole run first
# (``Segmentation.expand``: a pass over the run, ~40 ms a product on BERT-base's matrices on a 2-core
# CPU). (A GPU pays a launch per call instead: it keeps the expansion.)
PER_SEGMENT_MIN_ELEMENTS = 1 << 14
# Out-of-place arithmetic taken that way, as the function that writes into ``out=`` (and whether
# its two operands swap: ``s / x`` is ``x.__rtruediv__(s)``). In-place operations need none.
_WITH_OUT = {
    torch.Tensor.__mul__: (torch.mul, False), torch.Tensor.__rmul__: (torch.mul, True),
    torch.Tensor.mul: (torch.mul, False), torch.mul: (torch.mul, False),
    torch.Tensor.__truediv__: (torch.div, False), torch.Tensor.__rtruediv__: (torch.div, True),
    torch.Tensor.div: (torch.div, False), torch.div: (torch.div, False),
    torch.Tensor.__add__: (torch.add, False), torch.Tensor.__radd__: (torch.add, True),
    torch.Tensor.add: (torch.add, False), torch.add: (torch.add, False),
    torch.Tensor.__sub__: (torch.sub, False), torch.Tensor.__rsub__: (torch.sub, True),
    torch.Tensor.sub: (torch.sub, False), torch.sub: (torch.sub, False),
}


@dataclass
class StepNotes:
    """What a segmented step did that decides where it may run (filled in by :class:`SegmentedMode`)."""

    # reductions over every parameter of a list over runs (a global norm): exact only when one call
    # of the step holds every parameter it reduces over
    across_runs: set = field(default_factory=set)
    # it stacked a Python list of two runs or more as a list over runs (so a lone list may be one)
    python_lists_over_runs: bool = False
    # it stacked a Python list of one run's per-parameter values (taken as that run's own values
    # unless ``lone_lists_over_runs``)
    lone_lists: bool = False
    # it branched in Python on one value per parameter (``if norm == 0:``), every parameter the same way
    value_branches: bool = False
    # dimensions whose size it read from a parameter (``p.size(1)``: Amos's fan-in), every parameter of
    # a run the same (runs are cut where these sizes change: ``size_key``)
    size_dims: set = field(default_factory=set)


class NotSegmentable(RuntimeError):
    """The optimizer's step does something a segmented run cannot reproduce per parameter."""


class BranchesDisagree(NotSegmentable):
    """A Python branch on one value per parameter (``if exp_avg_sq == 0:``) that the parameters of a
    run take different ways, or a value read into Python (``norm.item()``) that differs between
    them: their step must be taken per parameter. Raised before the step uses the value; what it
    wrote before, the mode's journal undoes. ``taken``: for a branch, the way each segment of
    ``segmentation`` goes (the planner cuts the run there for later steps); None for a value."""

    def __init__(self, message: str, segmentation: "Segmentation", taken: Optional[List[bool]]):
        super().__init__(message)
        self.segmentation, self.taken = segmentation, taken


class SizesDisagree(BranchesDisagree):
    """The step reads one dimension's size of a parameter (``p.size(1)``) on a run whose parameters
    differ in it. Runs cut by :func:`size_key` over the dimensions the probes saw read never do;
    ``taken`` holds each segment's size (the planner cuts the run there for later steps)."""

    def __init__(self, message: str, segmentation: "Segmentation", taken: List[int], dim: int):
        super().__init__(message, segmentation, taken)
        self.dim = dim


def size_key(shape: torch.Size, dims: Iterable[int]) -> Tuple[int, ...]:
    """The sizes of ``shape`` along ``dims`` that a step reads (-1 where it has no such dimension):
    parameters of one run must share it (see :class:`SizesDisagree`)."""
    rank = len(shape)
    return tuple(shape[d] if -rank <= d < rank else -1 for d in dims)


def segment_scalar_shape(segments: int, tag: int = 0) -> Tuple[int, ...]:
    """One value per segment, kept apart from every run (rank <= ``MAX_RANK``) and every list over
    runs (rank ``MAX_RANK + 2``): rank ``MAX_RANK + 1 + 2 * tag``, so that runs of equal segment
    count, given different tags, are told apart in one call too."""
    return (segments,) + _SCALAR_TRAILING + (1,) * (2 * tag)


def stacked_row_values(value: torch.Tensor, seg: "Segmentation") -> Optional[torch.Tensor]:
    """This run's segment scalar, where ``value`` is its row of a stacked list over runs (segment
    scalars padded to the widest run of a call: ``SegmentedMode._stack_runs``) rather than the
    scalar itself; else None. A compiled step that iterates such a stack (``for wn in
    torch.stack(norms)``, pytorch-optimizer's Lamb) gets the padded rows: Dynamo indexes the stack
    itself, past the mode. A row has a tag-0 segment-scalar shape at least as wide as the run."""
    shape = tuple(value.shape)
    if shape == seg.scalar_shape or len(shape) != 1 + MAX_RANK or shape[1:] != _SCALAR_TRAILING or shape[0] < seg.segments:
        return None
    return value.reshape(-1)[: seg.segments].reshape(seg.scalar_shape)


def state_kind(value: Any, param_shape: torch.Size) -> str:
    """How a segmented run carries one parameter's state entry: ``"flat"`` (shaped like the
    parameter: a slice of the run), ``"scalar"`` (one value per parameter: a segment scalar),
    ``"other"`` (a tensor that is neither: not segmentable) or ``"python"`` (a plain value,
    equal across the run)."""
    if not isinstance(value, torch.Tensor):
        return "python"
    if value.shape == param_shape:  # for a one-element parameter, elementwise is per parameter anyway
        return "flat"
    return "scalar" if value.numel() == 1 else "other"


def run_shape(rank: int, length: int) -> Tuple[int, ...]:
    """The proxy shape of a run of rank-``rank`` parameters holding ``length`` elements."""
    return (1,) * (rank - 1) + (length,)


_BY_KEY: "weakref.WeakValueDictionary[str, Segmentation]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class ShardGroup(NamedTuple):
    """The process group a run's parameters are sharded over (FSDP2), and the device its
    collectives move: the device mesh's, which is not the shards' under FSDP2's CPU offloading
    (shards, gradients and the step on the host; the group NCCL's, which moves GPU tensors only)."""

    group: Any
    device: torch.device


@dataclass(eq=False)
class Segmentation:
    """The segments of one run: ``pieces`` are (start, end, parameter shape), run-relative.

    ``key`` names it to :func:`segment_combine` inside a compiled graph (a string: the graph keeps
    it as a constant, where an int may be made symbolic); keep one instance per layout so that
    compiled graphs stay valid across steps.
    """

    shape: Tuple[int, ...]
    pieces: List[Tuple[int, int, torch.Size]]
    key: str = field(init=False)
    # The segments are this rank's shards of larger parameters (FSDP2): a reduction combines
    # every rank's partial values over this process group, and a mean divides by ``numels``.
    shard_group: Optional[ShardGroup] = None
    shard_numels: Optional[List[int]] = None
    # Tells this run's segment scalars apart from those of another run of equal segment count
    # stepped in the same call (see ``segment_scalar_shape``; the planner picks it).
    tag: int = 0
    # A flattened view of another run (``p.view(-1)`` of each parameter): its segment scalars are
    # the parent's (same segments, same tag).
    parent: Optional["Segmentation"] = None

    def __post_init__(self):
        self.key = f"segmentation{next(_KEYS)}"
        _BY_KEY[self.key] = self
        # plain attributes, not properties: a compiled step's trace reads them per op, and each
        # property is a call it inlines (a cached_property takes a lock Dynamo cannot trace)
        self.segments: int = len(self.pieces)
        self.scalar_shape: Tuple[int, ...] = segment_scalar_shape(self.segments, self.tag)

    @property
    def length(self) -> int:
        return self.shape[-1]

    @property
    def segment_numels(self) -> List[int]:
        """Each segment's parameter's elements (the whole parameter's over shards)."""
        return self.shard_numels if self.shard_numels is not None else [end - start for start, end, _ in self.pieces]

    @property
    def numel(self) -> int:
        """Elements of its parameters, the padding's not counted (whole parameters' over shards)."""
        return sum(self.segment_numels)

    @cached_property
    def flattened(self) -> "Segmentation":
        """This run with each parameter flattened (``p.view(-1)``): rank 1, the same segments."""
        if len(self.shape) == 1:
            return self
        return Segmentation((self.length,), [(start, end, torch.Size([end - start])) for start, end, _ in self.pieces],
                            self.shard_group, self.shard_numels, self.tag, parent=self)

    def expand(self, scalars: torch.Tensor) -> torch.Tensor:
        """A run-shaped tensor holding each segment's value over its segment (1 in the padding).

        One concatenation of broadcast views: a single pass writing the run (measured ~5x
        faster on CPU than ``repeat_interleave``)."""
        values = torch.cat([scalars.reshape(self.segments), scalars.new_ones(1)]).unbind(0)
        pieces = [values[i].expand(n) for i, n in self._layout]
        return torch.cat(pieces).view(self.shape)

    def index_blocks(self, device: torch.device) -> None:
        """Prepare :meth:`expand_indexed` on ``device`` (outside a compiled region: it builds a tensor).

        The run is cut into blocks of ``block`` elements, the largest power of two (<= 256)
        dividing every segment start and the run's length; ``block_ids`` holds each block's
        segment index (``segments``: padding), so a compiled gather reads one index per block.
        (A last, partial block would need a slice after the broadcast, which Inductor 2.13
        miscompiles on CPU: the slice's tail read the padding's value.) Up to 256 rather than 64:
        4x fewer partial sums to reduce across vector lanes and to combine per segment (BERT-base,
        whose segments are multiples of 768: BertAdam's gradient-norm pass 23 -> 19 ms on a 2-core
        CPU, segment_reduce 1.8 -> 0.9 ms a call)."""
        if getattr(self, "block_ids", None) is not None and self.block_ids.device == device:
            return
        block = 256
        while block > 1 and (self.length % block or any(start % block for start, _, _ in self.pieces)):
            block //= 2
        ids = torch.full((self.length // block,), self.segments, dtype=torch.int32)
        valid = torch.zeros(self.length // block, dtype=torch.int32)
        ranges = []
        for i, (start, end, _) in enumerate(self.pieces):
            first, last = start // block, math.ceil(end / block)
            if last <= first:  # an empty shard: no block, the neutral value (segment_combine)
                ranges.append((first, first))
                continue
            ids[first:last] = i
            valid[first:last] = block
            valid[last - 1] = end - (last - 1) * block
            ranges.append((first, last))
        padded = bool((valid < block).any())
        self.block, self.block_ids = block, ids.to(device)
        # Each segment's blocks for one segment_reduce: from its first block to the next segment's
        # (blocks of padding alone between them hold the neutral value: see _blockwise). One
        # operator, where a reduction per segment cost a launch each (~2 ms a step on a GPU).
        bounds = [0] + [first for first, _ in ranges[1:]] + [self.length // block]
        self.block_counts = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], dtype=torch.int64, device=device)
        self.block_valid = valid.to(device) if padded else None  # elements of each block inside a segment
        self.numels = torch.tensor(self.segment_numels, dtype=torch.float32, device=device)

    def expand_indexed(self, scalars: torch.Tensor) -> torch.Tensor:
        """:meth:`expand` as a gather a compiler fuses into the kernel that uses it (no
        run-sized temporary). Padding that shares a block with a segment takes its value."""
        values = torch.cat([scalars.reshape(self.segments), scalars.new_ones(1)])
        ids = self.block_ids
        per_block = values[ids].unsqueeze(1).expand(ids.numel(), self.block)
        return per_block.reshape(self.shape)

    @cached_property
    def _layout(self) -> List[Tuple[int, int]]:
        """``(value index, count)`` along the run; index ``segments`` is the padding's value."""
        out, cursor = [], 0
        for i, (start, end, _) in enumerate(self.pieces):
            if start > cursor:
                out.append((self.segments, start - cursor))  # padding before this segment
            out.append((i, end - start))
            cursor = end
        if self.length > cursor:
            out.append((self.segments, self.length - cursor))
        return out

    @cached_property
    def _ranges(self) -> List[Tuple[int, int, int]]:
        """``(start, count, value index)`` along the run: :attr:`_layout` with each range's start."""
        starts = itertools.accumulate((count for _, count in self._layout), initial=0)
        return [(start, count, index) for start, (index, count) in zip(starts, self._layout)]


def segment_views(full: torch.Tensor, segmentation: Segmentation) -> List[torch.Tensor]:
    """Each segment of the run-shaped ``full`` as a view shaped like its parameter."""
    flat = full.reshape(-1)
    return [flat[start:end].view(shape) for start, end, shape in segmentation.pieces]


# ---------------------------------------------------------------------- compiled reductions
# Inside a compiled step a reduction cannot be re-run per segment as Python calls (one graph
# node per parameter and reduction would make the graph, and its compile time, grow with the
# model). It becomes two steps: a reduction of each *block* of the run (Inductor fuses it with
# whatever computes the reduced tensor, e.g. LAMB's update), then ``segment_combine``, an
# operator opaque to the compiler that combines each segment's few block partials. Padding is
# masked out of the partials. Compiled steps know the reductions below; any other one fails the
# compile, and the eager segmented step runs instead.
def _reduction_spec(func, args, kwargs) -> Optional[Tuple[str, float]]:
    """``(name, ord)`` when ``func(*args, **kwargs)`` reduces whole tensors in a known way."""
    if func in (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm):
        # (x, ord, dim, keepdim) positionally, dtype by keyword; torch.norm calls its ord "p"
        named = dict(zip(("ord", "dim", "keepdim"), args[1:]), **kwargs)
        ord = named.pop("ord", named.pop("p", 2.0))
        named.pop("keepdim", None)  # one value either way
        if ord == "fro":
            ord = 2.0
        if any(v is not None for v in named.values()) or isinstance(ord, bool) or not isinstance(ord, (int, float)):
            return None
        return "vector_norm", float(ord)
    if any(v is not None for v in kwargs.values()):
        return None
    if len(args) != (2 if func in (torch.dot, torch.Tensor.dot) else 1):
        return None
    name = _REDUCTION_NAMES.get(func)
    return None if name is None else (name, 0.0)


_REDUCTION_NAMES = {torch.sum: "sum", torch.Tensor.sum: "sum", torch.mean: "mean", torch.Tensor.mean: "mean",
                    torch.amax: "amax", torch.Tensor.amax: "amax", torch.max: "amax", torch.Tensor.max: "amax",
                    torch.amin: "amin", torch.Tensor.amin: "amin", torch.min: "amin", torch.Tensor.min: "amin",
                    torch.dot: "dot", torch.Tensor.dot: "dot"}
_INF = float("inf")


# per combination: the value of a segment with no elements (an empty shard), the all-reduce over shards
_NEUTRAL = {"sum": 0.0, "amax": -float("inf"), "amin": float("inf")}
_REDUCE_OPS = {"sum": "SUM", "amax": "MAX", "amin": "MIN"}
_SEGMENT_REDUCE = {"sum": "sum", "amax": "max", "amin": "min"}


def segment_values(partials: torch.Tensor, seg: "Segmentation", how: str) -> torch.Tensor:
    """``how`` ("sum", "amax" or "amin") over each segment's block partials, on this rank."""
    # unsafe=True: no check that the lengths are >= 0 and add up to the partials (ours do, by
    # construction). The check reads two values back to the host: on a GPU that waited for every
    # kernel queued before it, twice per reduction (a LAMB step on an H200 spent most of its host
    # time there).
    return torch.segment_reduce(partials, _SEGMENT_REDUCE[how], lengths=seg.block_counts, initial=_NEUTRAL[how],
                                unsafe=True)


def all_reduce_over_shards(values: torch.Tensor, how: str, shards: ShardGroup) -> torch.Tensor:
    """``values`` combined by ``how`` across the ranks of ``shards``, on ``values``' device (through
    the group's device where they differ: a few bytes a segment)."""
    import torch.distributed as dist

    op = getattr(dist.ReduceOp, _REDUCE_OPS[how])
    moved = values if values.device.type == shards.device.type else values.to(shards.device)
    try:
        dist.all_reduce(moved, op=op, group=shards.group)
    except Exception as exc:
        from .errors import ShardCollectiveError, first_line

        raise ShardCollectiveError(
            f"the all-reduce that combines per-parameter {how}s across the ranks' FSDP2 shards failed "
            f"({first_line(exc)}); another rank stopped, crashed or timed out. "
            "This step may be partly applied on this rank: restart every rank from the last checkpoint") from exc
    return moved if moved is values else moved.to(values.device)


def all_reduce_together(values: List[torch.Tensor], hows: List[str], shards: ShardGroup) -> List[torch.Tensor]:
    """Each of ``values`` combined by its ``how`` across the ranks of ``shards``: one all-reduce per
    reduce operation and dtype for all of them (in the order first met: the same on every rank)."""
    together: Dict[tuple, List[int]] = {}
    for index, (value, how) in enumerate(zip(values, hows)):
        together.setdefault((how, value.dtype), []).append(index)
    combined = list(values)
    for (how, _), indices in together.items():
        flat = all_reduce_over_shards(torch.cat([values[i] for i in indices]), how, shards)
        for i, part in zip(indices, flat.split([values[i].numel() for i in indices])):
            combined[i] = part
    return combined


@torch.library.custom_op("bagua_integrations::segment_combine", mutates_args=())
def segment_combine(partials: torch.Tensor, key: str, how: str) -> torch.Tensor:
    """``how`` ("sum", "amax" or "amin") over each segment's block partials: one value per segment.

    Over shards (``Segmentation.shard_group``) the values are then combined across ranks: one
    all-reduce for all segments of the run (a collective inside an operator the compiler does
    not look into, so a compiled step makes the same calls in the same order as an eager one)."""
    seg = _BY_KEY[key]
    values = segment_values(partials, seg, how)
    if seg.shard_group is not None:
        values = all_reduce_over_shards(values, how, seg.shard_group)
    return values


@segment_combine.register_fake
def _(partials, key, how):
    return partials.new_empty(_BY_KEY[key].segments)


def _blockwise(x: torch.Tensor, seg: "Segmentation", neutral: float) -> torch.Tensor:
    """The run ``x`` as ``(blocks, block)``, padding replaced by ``neutral``, accumulated in fp32 or wider."""
    blocks = x.reshape(seg.length // seg.block, seg.block)
    if blocks.dtype in (torch.float16, torch.bfloat16):
        blocks = blocks.float()
    if seg.block_valid is None:  # no padding inside the run
        return blocks
    valid = torch.arange(seg.block, device=x.device) < seg.block_valid.unsqueeze(1)
    return torch.where(valid, blocks, neutral)


def _compiled_reduction(name: str, ord: float, x: torch.Tensor, other: Optional[torch.Tensor], seg) -> torch.Tensor:
    """``name`` of each segment of ``x`` as a segment scalar, built from block partials."""
    how, part, finish = _block_partials(name, ord, x, other, seg)
    return _finished(segment_combine(part, seg.key, how), finish, x.dtype, seg)


def _finished(values: torch.Tensor, finish, dtype: torch.dtype, seg) -> torch.Tensor:
    """Combined segment values made the reduction's result: ``finish`` (a root, a division), dtype, shape."""
    if finish is not None:
        values = finish(values)
    return values.to(dtype).reshape(seg.scalar_shape)


def _block_partials(name: str, ord: float, x: torch.Tensor, other: Optional[torch.Tensor], seg):
    """``(how, partials, finish)``: each block's partial value of ``name``, how they combine ("sum",
    "amax", "amin"), and what turns the combined values into the reduction's (None: nothing)."""
    finish = None
    if name == "vector_norm":
        if ord == _INF:
            how, part = "amax", _blockwise(x.abs(), seg, 0.0).amax(1)
        elif ord == -_INF:
            how, part = "amin", _blockwise(x.abs(), seg, _INF).amin(1)
        elif ord == 0:
            how, part = "sum", (_blockwise(x, seg, 0.0) != 0).sum(1, dtype=torch.float32)
        else:
            # padding adds nothing: 0 ** ord for ord > 0, inf ** ord for ord < 0 (AvaGrad's norm(-2))
            how, part = "sum", _blockwise(x.abs() if ord != 2 else x, seg, _INF if ord < 0 else 0.0).pow(ord).sum(1)
            finish = (lambda v: v.sqrt()) if ord == 2 else (lambda v: v.pow(1.0 / ord)) if ord != 1 else None
    elif name == "dot":
        how, part = "sum", _blockwise(x * other, seg, 0.0).sum(1)
    elif name in ("sum", "mean"):
        how, part = "sum", _blockwise(x, seg, 0.0).sum(1)
        if name == "mean":
            finish = lambda v: v / seg.numels  # noqa: E731
    else:  # amax, amin
        how = name
        part = getattr(_blockwise(x, seg, -_INF if name == "amax" else _INF), name)(1)
    return how, part, finish


class _PendingCombines:
    """Reductions over shards whose values an eager step has not used yet, combined across ranks
    together when it first does: one all-reduce per reduce operation and dtype, as the compiled
    step's :mod:`._batched_combines` makes. (LAMB's weight and update norms do not depend on each
    other: both are taken before the trust ratio reads either.)

    Each reduction returns its result tensor at once, filled with NaN until :meth:`flush` writes the
    combined value into it. :class:`SegmentedMode` flushes before any call that is given one of them,
    and when the step ends. Every rank runs the same calls, so every rank flushes at the same points
    with the same reductions pending."""

    def __init__(self):
        # (this rank's values per segment, how they combine, finish, segmentation, result)
        self.pending: List[Tuple[torch.Tensor, str, Any, Segmentation, torch.Tensor]] = []
        self.results: set = set()  # ids of the pending results

    def add(self, how: str, part: torch.Tensor, finish, dtype: torch.dtype, seg: Segmentation) -> torch.Tensor:
        result = torch.full(seg.scalar_shape, float("nan"), dtype=dtype, device=part.device)
        self.pending.append((segment_values(part, seg, how), how, finish, seg, result))
        self.results.add(id(result))
        return result

    def needed_by(self, leaves: List[Any]) -> bool:
        results = self.results
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and id(leaf) in results:
                return True
        return False

    def flush(self) -> None:
        """Combine every pending reduction across the ranks and fill in its result."""
        pending, self.pending, self.results = self.pending, [], set()
        for seg in {id(entry[3].shard_group): entry[3] for entry in pending}.values():  # (one group, as a rule)
            mine = [entry for entry in pending if entry[3].shard_group is seg.shard_group]
            combined = all_reduce_together([values for values, *_ in mine], [how for _, how, *_ in mine],
                                           seg.shard_group)
            for (_, _, finish, seg_i, result), values in zip(mine, combined):
                result.copy_(_finished(values, finish, result.dtype, seg_i))

    def drop(self) -> None:
        """Forget the pending reductions (a step that stopped with an error: every rank stops alike)."""
        self.pending, self.results = [], set()


def _reduce_scalars(name: str, x: torch.Tensor, other: Optional[torch.Tensor], ord: float, seg) -> torch.Tensor:
    """A reduction of one value per segment, per segment: the reduction of a single value."""
    column = x.reshape(seg.segments, 1)
    if name == "vector_norm":
        out = torch.linalg.vector_norm(column, ord, dim=1)
    elif name == "dot":
        out = column.reshape(-1) * other.reshape(-1)
    else:
        out = getattr(torch, name)(column, dim=1)
    return out.reshape(seg.scalar_shape)


_CONTAINERS = (tuple, list, dict)


def _leaves(obj, out: List[Any]) -> List[Any]:
    """The leaves of ``obj`` (nested tuples, lists, dicts): torch's pytree costs too much per op.
    Plain loops, each leaf appended where it is met: a compiled step traces this for every op, and
    each call Dynamo inlines (a comprehension is one on Python 3.11) costs far more than a loop's
    own instructions."""
    if not isinstance(obj, _CONTAINERS):
        out.append(obj)
        return out
    if isinstance(obj, dict):
        obj = obj.values()
    for item in obj:
        if isinstance(item, _CONTAINERS):
            _leaves(item, out)
        else:
            out.append(item)
    return out


def _map(fn, obj):
    """``obj`` with every leaf replaced by ``fn(leaf)`` (containers rebuilt, named tuples kept;
    plain loops, as in :func:`_leaves`)."""
    if isinstance(obj, dict):
        mapped = {}
        for key, item in obj.items():
            mapped[key] = _map(fn, item) if isinstance(item, _CONTAINERS) else fn(item)
        return mapped
    if not isinstance(obj, (tuple, list)):
        return fn(obj)
    items = []
    for item in obj:
        items.append(_map(fn, item) if isinstance(item, _CONTAINERS) else fn(item))
    if isinstance(obj, list):
        return items
    return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)


class RunValues(list):
    """The result of a ``_foreach_*`` call on segmented runs: one entry per run of its list.
    ``torch.stack`` of it is a list over runs (:meth:`SegmentedMode._stack_runs`), told apart
    from a stack of one parameter's own values (``torch.stack([w_norm, g_norm])``)."""


class _Stacked:
    """A list over runs held as one tensor: each run's segment scalar in a row, padded with 1."""

    def __init__(self, segs: List[Segmentation], shape: Tuple[int, ...]):
        self.segs, self.shape = segs, shape

    def rows(self, t: torch.Tensor) -> List[torch.Tensor]:
        flat = t.reshape(len(self.segs), -1)
        return [flat[k, : seg.segments].reshape(seg.scalar_shape) for k, seg in enumerate(self.segs)]

    def valid(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([row.reshape(-1) for row in self.rows(t)])


class RunCount:
    """``p.numel()`` of a run: its parameters' elements (never the padding's).

    Summed (``sum(p.numel() for p in params)``: Adai's and AvaGrad's means over a group) it is the
    count the per-tensor step sums, and the sum is a plain ``int``. Anything else uses one
    parameter's count, which a run does not have: compared (``p.numel() >= 4096``, a branch per
    parameter that the probes' small tensors would all take alike) or in arithmetic
    (``p.numel() * 2 >= 8192``, an RMS over ``sqrt(p.numel())``): refused.

    Not an ``int`` subclass: Python's ``float`` computes ``1.0 / n`` and ``0.5 * n`` itself for any
    ``int``, without asking ``n``, so a count used so from a step after the probes' (a scale from
    step 5 on) divided by the run's count, silently. An object of its own is asked every time."""

    __slots__ = ("count",)

    def __init__(self, count: int):
        self.count = int(count)

    def __add__(self, other):
        if isinstance(other, RunCount):
            return self.count + other.count
        if isinstance(other, int) and not isinstance(other, bool):
            return self.count + other
        return self._per_parameter()

    __radd__ = __add__

    def __repr__(self) -> str:
        return f"RunCount({self.count})"

    def _per_parameter(self, *args):
        raise NotSegmentable("the step uses a parameter's count of elements (numel) otherwise than summed over "
                             "its parameters")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = _per_parameter
    __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _per_parameter
    __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = __divmod__ = __rdivmod__ = _per_parameter
    __float__ = __int__ = __index__ = __round__ = __trunc__ = __floor__ = __ceil__ = _per_parameter
    __hash__ = object.__hash__


def _one_value_run(kind: str, seg: Optional[Segmentation]) -> bool:
    """A run of one one-element parameter (a ``(1,)`` scale): its state of shape ``(1,)`` is both
    shaped like it and its one value, as a list over runs takes it."""
    return kind == "run" and seg.length == 1 and seg.segments == 1


# ``dim=`` that names a dimension to reduce or normalise along, not one to read or reshape
_DIM_KEYWORDS = ("dim", "axis")


def _dims_given(kwargs) -> bool:
    """Whether a call names dimensions to reduce along. ``Tensor.norm`` hands ``dim=None`` on as a
    keyword, so ``p.norm()`` reduces the whole tensor as ``torch.linalg.vector_norm(p)`` does."""
    # (a plain loop, not any() over a generator: each would be a call a compiled step's trace inlines per op)
    for key in _DIM_KEYWORDS:
        if kwargs.get(key) is not None:
            return True
    return False


_SHAPE_READS = {torch.Tensor.size, torch.Tensor.stride, torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.squeeze,
                torch.squeeze, torch.Tensor.flatten, torch.flatten, torch.Tensor.transpose, torch.transpose,
                torch.Tensor.unbind, torch.unbind, torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk}


def _along_dims(func, kwargs) -> bool:
    """``func`` works along named dimensions (``dim=``/``axis=``), which a run does not have."""
    # (`if kwargs`, not bool(kwargs): torch 2.11's compiled trace cannot call bool() on a dict, and the
    # compiled step would fall back to the eager one)
    if kwargs and func not in _SHAPE_READS:
        return _dims_given(kwargs)
    return False


def _gathered(func, seg: "Segmentation", values: List[Any], along_dims: bool) -> torch.Tensor:
    """Per-segment results of ``func`` as one tensor: one value per parameter as its segment scalar;
    with ``along_dims``, results shaped like their parameter or broadcasting to it as a run (each
    expanded over its segment: what elementwise math against the parameter reads; padding 1)."""
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise NotSegmentable(f"{_name(func)} of one parameter is not a tensor")
    if along_dims and all(v.dim() == len(shape) and all(n in (1, m) for n, m in zip(v.shape, shape))
                          for v, (_, _, shape) in zip(values, seg.pieces)):
        ones = values[0].new_ones(())
        parts = [values[i].expand(seg.pieces[i][2]).reshape(-1) if i < seg.segments else ones.expand(count)
                 for i, count in seg._layout]  # (index segments: padding)
        return torch.cat(parts).view(seg.shape)
    if all(v.numel() == 1 for v in values):
        return torch.stack([v.reshape(()) for v in values]).reshape(seg.scalar_shape)
    what = "has fewer dimensions than the parameter" if along_dims else "is not one value"
    raise NotSegmentable(f"{_name(func)} of one parameter {what}")


def _name(func) -> str:
    return getattr(func, "__name__", None) or repr(func)


def _written(func, args, kwargs) -> List[Any]:
    """What ``func`` writes in place: its first argument (an in-place op, ``__setitem__``) and ``out=``."""
    targets = [args[0]] if (func in _IN_PLACE or func is torch.Tensor.__setitem__) and args else []
    out = kwargs.get("out")
    targets += list(out) if isinstance(out, (tuple, list)) else [out]
    return targets


class SegmentedMode(TorchFunctionMode):
    """Run an optimizer's ``step`` on segmented runs, computing every whole-parameter reduction per parameter."""

    def __init__(self, segmentations: Iterable[Segmentation], known_reductions_only: bool = False,
                 lone_lists_over_runs: bool = False, notes: Optional[StepNotes] = None, journal: bool = False):
        """``known_reductions_only``: compute every reduction from block partials, as a compiled
        step does, and refuse any other (implied for shards: only those partials combine across ranks).

        ``lone_lists_over_runs``: ``torch.stack``/``torch.cat`` of a Python list holding one run's
        per-parameter values is a list over runs (the group's list of one run: AvaGrad's
        ``stack([norm(r) for r in roots])``), not that run's values stacked per parameter (what
        ``clip_grad_norm_(p)`` builds for one parameter). A list of two runs or more is always
        a list over runs. Which one a lone list is, the probes find out (``_paths``).

        ``journal``: keep a copy of every run and per-parameter value before the step first writes
        it in place, so that a step whose branches disagree (:class:`BranchesDisagree`) can be
        undone (:meth:`undo`) and taken per parameter; :meth:`forget` drops the copies."""
        super().__init__()
        self.journal: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = {} if journal else None
        # without a journal: the storages of the tensors a step must not have written when it stops
        # (the runs, their gradients and state: see :meth:`guard`), and whether it wrote one of them
        self.guarded: Optional[set] = None
        self.wrote_guarded = False
        self.lone_lists_over_runs = lone_lists_over_runs
        self.notes = notes if notes is not None else StepNotes()
        self.pending_combines = _PendingCombines()  # (eager steps over shards)
        segmentations = list(segmentations)
        self.known_reductions_only = known_reductions_only or any(s.shard_group is not None for s in segmentations)
        self.by_shape: Dict[Tuple[int, ...], Segmentation] = {}
        self.by_scalar_shape: Dict[Tuple[int, ...], Segmentation] = {}
        self.by_stack_shape: Dict[Tuple[int, ...], _Stacked] = {}
        for seg in segmentations:
            if seg.shape in self.by_shape or seg.scalar_shape in self.by_scalar_shape:
                raise ValueError("two runs of one segmented step must differ in shape and in segment scalar shape")
            self.by_shape[seg.shape] = seg
            self.by_scalar_shape[seg.scalar_shape] = seg

    # ------------------------------------------------------------------ undoing a step
    def undo(self) -> None:
        """Put every tensor the step wrote in place back as it was before its first write. Latest
        first: of two aliases of one memory (``p`` and ``p.data``), the one recorded first holds
        what the memory held before the step, and is put back last."""
        with torch.no_grad():
            for tensor, copy in reversed(list(self.journal.values())):
                tensor.copy_(copy)
        self.journal.clear()

    def start_step(self) -> None:
        """Forget the lists over runs the last step stacked: each step stacks its own. (A compiled
        step guards on this dict as its trace found it: left filled by the first compiled call,
        the second call compiled again.)"""
        self.by_stack_shape.clear()

    def forget(self) -> None:
        if self.journal:
            self.journal.clear()
        self.guarded, self.wrote_guarded = None, False

    def guard(self, tensors: Iterable[torch.Tensor]) -> None:
        """Note, for this step, whether it writes in place into the memory of any of ``tensors``
        (:attr:`wrote_guarded`): a step without a journal that stops before it did can be taken per
        parameter instead, with nothing to undo. (Storages, not objects: ``p.data`` is another
        object over ``p``'s memory.)"""
        self.guarded = {t.untyped_storage().data_ptr() for t in tensors}
        self.wrote_guarded = False

    def _note_guarded_writes(self, func, args, kwargs) -> None:
        self.wrote_guarded = any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.guarded
                                 for t in _written(func, args, kwargs))

    def _record_writes(self, func, args, kwargs) -> None:
        """Copy each run- or per-parameter-shaped tensor ``func`` writes in place, before its first
        write (any such tensor: ``p.data`` is another object for the same memory as ``p``)."""
        for t in _written(func, args, kwargs):
            if isinstance(t, torch.Tensor) and id(t) not in self.journal and self._kind(t)[0] in ("run", "scalar"):
                self.journal[id(t)] = (t, t.detach().clone())

    def _value_per_parameter(self, func, seg: Segmentation, args, kwargs):
        """A Python value the step reads from each parameter's own values (``if norm == 0:``,
        ``torch.allclose(a, b)``, ``norm.item()``): the one every parameter gives, where they agree."""
        if self.known_reductions_only or torch.compiler.is_compiling():
            raise NotSegmentable(f"the step reads a tensor's value into Python ({_name(func)}), which a compiled "
                                 "step cannot follow (nor one over shards)")
        values = self._each_segment(func, seg, args, kwargs)
        self.notes.value_branches = True
        first = values[0]
        if all(v == first for v in values):
            return first
        if all(isinstance(v, bool) for v in values):
            raise BranchesDisagree(f"a Python branch on one value per parameter ({_name(func)}) goes one way for "
                                   f"{sum(values)} of {seg.segments} parameters and the other way for the rest",
                                   seg.parent or seg, values)  # (the run the planner knows, not its flattening)
        raise BranchesDisagree(f"the step reads one value per parameter into Python ({_name(func)}), and they "
                               "differ between parameters", seg, None)

    def _size_per_parameter(self, seg: Segmentation, args, kwargs) -> int:
        """``p.size(d)`` of a run: its parameters' size along ``d`` (a fan-in, Amos's target scale),
        where they share it; a run's own size there is 1 (or its length) for every parameter."""
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        args[0].size(dim)  # (a dimension the run lacks, its parameters lack too: the same error)
        if self.known_reductions_only:
            raise NotSegmentable("the step reads a parameter's size along a dimension, which a shard does not have "
                                 "whole")
        values = [shape[dim] for _, _, shape in seg.pieces]
        if any(v != values[0] for v in values):
            raise SizesDisagree(f"the step reads each parameter's size along dimension {dim} (size({dim})), and the "
                                "parameters of a run differ in it", seg.parent or seg, values, dim)
        if not torch.compiler.is_compiling():
            self.notes.size_dims.add(dim)
        return values[0]

    # ------------------------------------------------------------------ what a tensor is
    def _kind(self, t: torch.Tensor) -> Tuple[str, Optional[Segmentation]]:
        shape = tuple(t.shape)
        seg = self.by_shape.get(shape)
        if seg is not None:
            return "run", seg
        seg = self.by_scalar_shape.get(shape)
        if seg is not None:
            return "scalar", seg
        stacked = self.by_stack_shape.get(shape)
        if stacked is not None:
            return "stack", stacked
        return "plain", None

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        if self.pending_combines.pending:  # (after leaving the mode: the flush's own calls are plain)
            if exc_type is None:
                self.pending_combines.flush()
            else:
                self.pending_combines.drop()
        return result

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _leaves((args, kwargs), [])
        if self.pending_combines.pending and self.pending_combines.needed_by(leaves):
            self.pending_combines.flush()
        segs: Dict[int, Segmentation] = {}
        stacks: Dict[int, "_Stacked"] = {}
        kinds = set()
        run_segs = set()
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                kind, seg = self._kind(leaf)
                if kind == "stack":
                    stacks[id(seg)] = seg
                elif seg is not None:
                    kinds.add(kind)
                    segs[id(seg)] = seg
                    if kind == "run":
                        run_segs.add(id(seg))
        if len(segs) == 2:
            # a flattened run (``perturb.view(-1)``) with its parent's per-parameter values: the flat one
            flat = next((s for s in segs.values() if s.parent is not None and id(s) in run_segs), None)
            if flat is not None and id(flat.parent) in segs and id(flat.parent) not in run_segs:
                segs = {id(flat): flat}
        if not segs:
            if stacks:
                return self._on_stacks(func, stacks, args, kwargs)
            return func(*args, **kwargs)
        if self.journal is not None and (func in _IN_PLACE or func is torch.Tensor.__setitem__ or "out" in kwargs):
            self._record_writes(func, args, kwargs)
        elif self.guarded is not None and not self.wrote_guarded and (
                func in _IN_PLACE or func is torch.Tensor.__setitem__ or "out" in kwargs):
            self._note_guarded_writes(func, args, kwargs)
        if func in _FOREACH:  # a loop over its lists: each element on its own (one run each)
            return self._foreach(func, args, kwargs)
        if stacks:
            raise NotSegmentable(f"{_name(func)} mixes values of a list over runs with a run")
        if func in _STACKS and self._is_list_over_runs(args[0] if args else kwargs.get("tensors")):
            return self._stack_runs(args, kwargs)
        if func in _ELEMENT_COUNTS and args and isinstance(args[0], torch.Tensor) and kinds == {"run"}:
            # a count of elements: the parameters' (never the padding's), as summed over a group
            # (Adai's and AvaGrad's means over all parameters); any other use is refused (RunCount)
            (seg,) = segs.values()
            # (a compiled step gets a plain int: the eager probes have seen the step compare none)
            return seg.numel if torch.compiler.is_compiling() else RunCount(seg.numel)
        if len(segs) > 1:
            raise NotSegmentable(f"{_name(func)} mixes tensors of two different runs")
        (seg,) = segs.values()
        if func is torch.Tensor.size and kinds == {"run"} and isinstance(args[0], torch.Tensor) and (
                len(args) > 1 or "dim" in kwargs):
            return self._size_per_parameter(seg, args, kwargs)
        if func in _PYTHON_VALUES or (func in _SCALAR_READS and (kinds == {"scalar"} or _one_value_run(
                next(iter(kinds)), seg))):
            # ``if norm == 0:`` per parameter: exact where every parameter goes the same way
            return self._value_per_parameter(func, seg, args, kwargs)
        if func in _VALUE_READS:
            raise NotSegmentable(f"the step reads a tensor's value into Python ({_name(func)}), so its control "
                                 "flow may differ per parameter")
        if func in _FOREACH:
            return self._foreach(func, args, kwargs)
        if "run" in kinds:
            return self._on_runs(func, seg, args, kwargs, with_scalars="scalar" in kinds)
        return self._on_scalars(func, seg, args, kwargs)

    # ------------------------------------------------------------------ run-shaped inputs
    def _on_runs(self, func, seg: Segmentation, args, kwargs, with_scalars: bool = True):
        """``func`` on a run (and per-parameter values, where ``with_scalars``: the caller found an
        operand of a segment-scalar shape; without one, nothing needs expanding)."""
        out = kwargs.get("out")
        into_run = out is None or (isinstance(out, torch.Tensor) and tuple(out.shape) == seg.shape)
        if not into_run or (func in _IN_PLACE and args and isinstance(args[0], torch.Tensor)
                            and tuple(args[0].shape) == seg.scalar_shape):
            raise NotSegmentable(f"{_name(func)} writes run-shaped values into a per-parameter value")
        if _along_dims(func, kwargs):
            # a reduction or normalisation along dimensions of each parameter (row norms, a mean per
            # channel, ``F.normalize(x, dim=0)``): on each parameter's view, shaped like it
            if func in _IN_PLACE:
                raise NotSegmentable(f"{_name(func)} along a dimension writes into a run in place")
            return self._per_segment(func, seg, args, kwargs, along_dims=True)
        if func in (torch.aminmax, torch.Tensor.aminmax) and len(args) == 1 and not kwargs:
            # both extremes of the whole parameter (ROSE's gradient range): two reductions
            return torch.return_types.aminmax((self._per_segment(torch.amin, seg, args, {}),
                                               self._per_segment(torch.amax, seg, args, {})))
        if func in _WHOLE_REDUCTIONS and not _dims_given(kwargs) and all(
            not isinstance(a, int) or func in (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm) for a in args[1:]
        ):
            return self._per_segment(func, seg, args, kwargs)
        if func in _IN_PLACE or func in _WITH_OUT:
            out = self._per_parameter_arithmetic(func, seg, args, kwargs)
            if out is not None:
                return out
        if with_scalars:
            expand = seg.expand_indexed if torch.compiler.is_compiling() else seg.expand
            expanded_args, expanded_kwargs = _map(
                lambda x: expand(x) if isinstance(x, torch.Tensor) and tuple(x.shape) == seg.scalar_shape else x,
                (args, kwargs),
            )
        else:
            expanded_args, expanded_kwargs = args, kwargs
        out = func(*expanded_args, **expanded_kwargs)
        if not isinstance(out, torch.Tensor):
            if isinstance(out, tuple) and out and all(isinstance(o, torch.Tensor) and o.numel() == 1 for o in out):
                return self._per_segment(func, seg, args, kwargs)  # std_mean, var_mean of a whole parameter
            if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
                raise NotSegmentable(f"{_name(func)} returns several tensors from a run")
            return out  # dtype, device, shape, requires_grad, ...
        if tuple(out.shape) == seg.shape:
            return out  # elementwise
        if out.numel() == 1 and out.dim() < len(seg.shape) + 1:
            return self._per_segment(func, seg, args, kwargs)
        if func in _RESHAPES and out.dim() == 1 and out.numel() == seg.length and not torch.compiler.is_compiling():
            # ``p.view(-1)``: each parameter flattened, as one rank-1 run over the same segments
            flat = seg.flattened
            if self.by_shape.setdefault(flat.shape, flat) is not flat:
                raise NotSegmentable(f"{_name(func)} flattens a run to the shape of another run")
            return out
        raise NotSegmentable(f"{_name(func)} turns a run of shape {seg.shape} into shape {tuple(out.shape)} "
                             "(a reshape, or a reduction along a dimension)")

    def _per_parameter_arithmetic(self, func, seg: Segmentation, args, kwargs) -> Optional[torch.Tensor]:
        """``run.mul_(norm)``, ``update * trust``: each parameter's range with its own value, as the
        unfused step computes it, instead of over a run-sized tensor of the values written first
        (see ``PER_SEGMENT_MIN_ELEMENTS``); the result. None where it does not apply (the caller
        expands): a GPU, a compiled step, small parameters, mixed or non-float dtypes (a 0-dim value
        promotes otherwise), ``out=``, or operands other than runs, per-parameter values and 0-dim
        tensors."""
        if (torch.compiler.is_compiling() or not args or "out" in kwargs
                or seg.length < PER_SEGMENT_MIN_ELEMENTS * seg.segments):
            return None
        if func in _IN_PLACE and not (isinstance(args[0], torch.Tensor) and tuple(args[0].shape) == seg.shape):
            return None
        tensors = [x for x in _leaves((args, kwargs), []) if isinstance(x, torch.Tensor)]
        kinds = [("run" if tuple(x.shape) == seg.shape else "scalar" if tuple(x.shape) == seg.scalar_shape
                  else "number" if x.dim() == 0 else "other") for x in tensors]
        if ("other" in kinds or "scalar" not in kinds or "run" not in kinds or len({x.dtype for x in tensors}) > 1
                or not tensors[0].is_floating_point() or any(x.device.type != "cpu" for x in tensors)):
            return None
        pieces = seg._ranges  # (start, count, value index: a segment, or ``segments`` for padding)
        one = tensors[0].new_ones(())
        values = {}

        def piece(x, start, count, index):
            if not isinstance(x, torch.Tensor):
                return x
            shape = tuple(x.shape)
            if shape == seg.shape:
                return x.view(-1)[start:start + count]
            if shape == seg.scalar_shape:
                if id(x) not in values:
                    values[id(x)] = x.reshape(seg.segments)
                return values[id(x)][index] if index < seg.segments else one
            return x

        if func in _IN_PLACE:
            for start, count, index in pieces:
                if index < seg.segments:  # (the padding keeps what it holds)
                    a, k = _map(lambda x: piece(x, start, count, index), (args, kwargs))
                    func(*a, **k)
            return args[0]
        target, swap = _WITH_OUT[func]
        if len(args) != 2 or (swap and kwargs):
            return None
        out = torch.empty(seg.length, dtype=tensors[0].dtype, device=tensors[0].device)
        for start, count, index in pieces:
            a, k = _map(lambda x: piece(x, start, count, index), (args, kwargs))
            target(*(a[::-1] if swap else a), **k, out=out[start:start + count])
        return out.view(seg.shape)

    def _per_segment(self, func, seg: Segmentation, args, kwargs, along_dims: bool = False):
        """``func`` on each segment's own view, shaped like its parameter: a reduction's per-parameter
        values, stacked (a tuple of them for ``std_mean``); with ``along_dims``, results shaped like
        the parameter or broadcasting to it (``keepdim=True``), laid out as a run."""
        if along_dims and (torch.compiler.is_compiling() or self.known_reductions_only):
            # a compiled step would grow a node per parameter; over shards a row may span ranks
            raise NotSegmentable(f"{_name(func)} along a dimension is left to the eager segmented step (and is "
                                 "not combined across shards)")
        if torch.compiler.is_compiling() or self.known_reductions_only:
            return self._per_segment_compiled(func, seg, args, kwargs)
        values = self._each_segment(func, seg, args, kwargs)
        first = values[0]
        if isinstance(first, tuple) and all(isinstance(v, torch.Tensor) for v in first):
            parts = [_gathered(func, seg, [v[j] for v in values], along_dims) for j in range(len(first))]
            return type(first)(parts) if hasattr(first, "n_fields") else tuple(parts)  # (return_types keep names)
        return _gathered(func, seg, values, along_dims)

    def _each_segment(self, func, seg: Segmentation, args, kwargs) -> List[Any]:
        """``func`` on each segment: runs as its parameter-shaped view, segment scalars as its value."""
        views: Dict[int, List[torch.Tensor]] = {}
        scalars: Dict[int, torch.Tensor] = {}

        def piece(i):
            def pick(x):
                if not isinstance(x, torch.Tensor):
                    return x
                shape = tuple(x.shape)
                if shape == seg.shape:
                    if id(x) not in views:
                        views[id(x)] = segment_views(x, seg)
                    return views[id(x)][i]
                if shape == seg.scalar_shape:
                    if id(x) not in scalars:
                        scalars[id(x)] = x.reshape(seg.segments)
                    return scalars[id(x)][i]
                return x

            return _map(pick, (args, kwargs))

        values = []
        for i in range(seg.segments):
            a, k = piece(i)
            values.append(func(*a, **k))
        return values

    def _per_segment_compiled(self, func, seg: Segmentation, args, kwargs) -> torch.Tensor:
        spec = _reduction_spec(func, args, kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if spec is None or not tensors:
            raise NotSegmentable(f"{_name(func)} is not a reduction built from partial values (a norm, sum, mean, "
                                 "max, min or dot over a whole parameter), as compiled steps and shards need")
        name, ord = spec
        if not all(t.is_floating_point() for t in tensors):  # bool/int sums promote to int64: eager knows how
            raise NotSegmentable(f"{_name(func)} of a {tensors[0].dtype} tensor is left to the eager segmented step "
                                 "(and is not combined across shards)")
        shapes = {tuple(t.shape) for t in tensors}
        other = tensors[1] if len(tensors) > 1 else None
        if shapes == {seg.shape}:
            if torch.compiler.is_compiling():
                return _compiled_reduction(name, ord, tensors[0], other, seg)
            seg.index_blocks(tensors[0].device)  # (eager: built once, kept)
            if seg.shard_group is None:
                return _compiled_reduction(name, ord, tensors[0], other, seg)
            how, part, finish = _block_partials(name, ord, tensors[0], other, seg)
            return self.pending_combines.add(how, part, finish, tensors[0].dtype, seg)
        if shapes == {seg.scalar_shape}:
            return _reduce_scalars(name, tensors[0], other, ord, seg)
        raise NotSegmentable(f"{_name(func)} mixes per-parameter values and runs")

    # ------------------------------------------------------------------ segment scalars only
    def _on_scalars(self, func, seg: Segmentation, args, kwargs):
        if func in _RESHAPES and args and isinstance(args[0], torch.Tensor) and tuple(args[0].shape) == seg.scalar_shape:
            # one value per parameter reshaped to another one-value shape ((1,) -> (), unsqueeze(0)):
            # still one value per parameter (a view, as the per-parameter reshape is)
            return args[0].view(seg.scalar_shape)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
                raise NotSegmentable(f"{_name(func)} returns several tensors from per-parameter values")
            return out
        if tuple(out.shape) == seg.scalar_shape:
            return out
        if out.numel() == seg.segments:  # stack([norm]), norm.reshape(1), ...: still one value per parameter
            return out.reshape(seg.scalar_shape)
        if out.numel() == 1:  # a reduction of one per-parameter value (vector_norm(stack([norm])))
            return self._per_segment(func, seg, args, kwargs)
        raise NotSegmentable(f"{_name(func)} turns one value per parameter into shape {tuple(out.shape)}")

    # ------------------------------------------------------------------ torch._foreach_*
    def _foreach(self, func, args, kwargs):
        """``_foreach_op(list, ...)`` as ``op`` on each element, so each goes through this mode."""
        calls = element_calls(func, args, kwargs)
        if calls is None:
            raise NotSegmentable(f"{_name(func)} has no per-tensor counterpart")
        results = RunValues()
        for op, element, element_kwargs in calls:
            # the mode is paused while it handles a call: route each element through it explicitly
            results.append(self.__torch_function__(op, (), element, element_kwargs))
        return args[0] if func in _FOREACH_IN_PLACE else results  # an in-place foreach call returns its list

    # ------------------------------------------------------------------ lists over runs
    def _is_list_over_runs(self, values) -> bool:
        """``values`` (stacked or concatenated) is a list over runs: a ``_foreach_*`` result, or a
        Python list of per-parameter values of distinct runs (two or more, or one where lone lists
        are lists over runs)."""
        if isinstance(values, RunValues):
            return True
        if not isinstance(values, (list, tuple)) or not values or not all(isinstance(v, torch.Tensor) for v in values):
            return False
        kinds = [self._kind(v) for v in values]
        if any(kind != "scalar" and not _one_value_run(kind, seg) for kind, seg in kinds) or len(
                {id(seg) for _, seg in kinds}) < len(values):
            return False
        if len(values) == 1:
            if not torch.compiler.is_compiling():
                self.notes.lone_lists = True
            return self.lone_lists_over_runs
        if not torch.compiler.is_compiling():
            self.notes.python_lists_over_runs = True
        return True

    def _stack_runs(self, args, kwargs):
        """``torch.stack`` of a ``_foreach_*`` result: a list over the call's runs, each holding
        one value per parameter (its segment scalar). Kept as a ``(K, max S, 1, 1, 1, 1)``
        tensor (padding 1) that the mode knows: elementwise math stays a list, ``unbind``,
        iteration and indexing give each run's segment scalar back, and a reduction of the
        whole list reduces over every parameter of every run (a global norm)."""
        values = args[0] if args else kwargs["tensors"]
        if (len(args) > 1 and args[1] != 0) or kwargs.get("dim", 0) != 0:
            raise NotSegmentable("stack of a list over runs along another dimension than 0")
        segs = []
        for value in values:
            kind, seg = self._kind(value) if isinstance(value, torch.Tensor) else ("plain", None)
            if kind != "scalar" and not _one_value_run(kind, seg):
                raise NotSegmentable("stack of a list over runs that holds other values than one per parameter")
            segs.append(seg)
        width = max(seg.segments for seg in segs)
        while True:
            shape = (len(segs), width) + _SCALAR_TRAILING  # rank MAX_RANK + 2: no run, no segment scalar
            known = self.by_stack_shape.get(shape)
            if known is None or [id(s) for s in known.segs] == [id(s) for s in segs]:
                break
            # A list over other runs has this shape (two param groups, or two dtypes of one group, of
            # as many parameters each, stacked in one step): a stack is known by its shape, so this
            # one takes one more padding entry per row.
            width += 1
        stacked = known or _Stacked(segs, shape)
        self.by_stack_shape[shape] = stacked
        rows = [torch.cat([v.reshape(-1), v.new_ones(width - seg.segments)]) for v, seg in zip(values, segs)]
        return torch.stack(rows).reshape(shape)

    def _on_stacks(self, func, stacks, args, kwargs):
        if len(stacks) > 1:
            raise NotSegmentable(f"{_name(func)} mixes two lists over runs")
        (stacked,) = stacks.values()
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and tuple(target.shape) == stacked.shape:
            if func in (torch.Tensor.unbind, torch.unbind) and (len(args) < 2 or args[1] == 0) and not kwargs:
                return tuple(stacked.rows(target))
            if func is torch.Tensor.__iter__:
                return iter(stacked.rows(target))
            if func is torch.Tensor.__getitem__ and isinstance(args[1], int):
                return stacked.rows(target)[args[1]]
            if func in (torch.Tensor.split, torch.split) and (args[1:2] or [kwargs.get("split_size")])[0] == 1 and (
                    (args[2:3] or [kwargs.get("dim", 0)])[0] == 0):
                return tuple(stacked.rows(target))  # split(1): one run per piece, as unbind
            if func is torch.Tensor.__len__:
                return len(stacked.segs)
        if func in _VALUE_READS:
            raise NotSegmentable(f"the step reads a list over runs into Python ({_name(func)})")
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) and not (
                isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)):
            return out  # dim(), dtype, device, ...
        if isinstance(out, torch.Tensor) and tuple(out.shape) == stacked.shape:
            return out  # elementwise
        spec = func in _WHOLE_REDUCTIONS and not _dims_given(kwargs) and (
            len([a for a in args if isinstance(a, torch.Tensor)]) == 1)
        if spec and isinstance(target, torch.Tensor) and tuple(target.shape) == stacked.shape and not any(
                isinstance(a, int) and not isinstance(a, bool) for a in args[1:2]
                if func not in (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm)):
            # over every parameter of every run: the valid entries of the list, in order
            if not torch.compiler.is_compiling():  # (notes are for the probes, which run eagerly)
                self.notes.across_runs.add(_name(func))
            return func(stacked.valid(target), *args[1:], **kwargs)
        raise NotSegmentable(f"{_name(func)} turns a list over runs into shape "
                             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
