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
  apart from every proxy). Elementwise arithmetic on segment scalars stays one value per
  segment; combined with a run-shaped tensor, each value is expanded over its segment first.
* A **reduction** is any call that turns a run-shaped tensor into one value (a norm, a sum,
  ``max``, ``clip_grad_norm_``'s internals, ...): it is re-run on each segment's view, shaped
  like the parameter, with the very same function and arguments, so the values are the
  per-parameter ones bit for bit. Nothing is allowlisted; the mode recognises a reduction by
  its result.
* What cannot be expressed raises :class:`NotSegmentable`: reading a value into Python
  (``if norm > 0:``, ``.item()``), a reduction along a dimension (Adafactor's factored
  moments), reshaping a run, or a per-parameter result that is not a single value. The probe
  (``_probe.probe_segmented``) turns that, or any mismatch with the per-tensor step, into
  "keep the exact per-tensor step".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Segmentation", "SegmentedMode", "NotSegmentable", "segment_views", "MAX_RANK", "segment_scalar_shape",
           "state_kind"]

MAX_RANK = 4  # proxies have rank 1..4; a segment scalar has rank 5, so the two never collide
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
_IN_PLACE = {getattr(torch.Tensor, n) for n in dir(torch.Tensor)
             if (n.endswith("_") and not n.startswith("__")) or n.startswith("__i")}


class NotSegmentable(RuntimeError):
    """The optimizer's step does something a segmented run cannot reproduce per parameter."""


def segment_scalar_shape(segments: int) -> Tuple[int, ...]:
    return (segments,) + _SCALAR_TRAILING


def state_kind(value: Any, param_shape: torch.Size) -> str:
    """How a segmented run carries one parameter's state entry: ``"flat"`` (shaped like the
    parameter: a slice of the run), ``"scalar"`` (one value per parameter: a segment scalar),
    ``"other"`` (a tensor that is neither: not segmentable) or ``"python"`` (a plain value,
    equal across the run)."""
    if not isinstance(value, torch.Tensor):
        return "python"
    if value.shape == param_shape and param_shape.numel() > 1:
        return "flat"
    return "scalar" if value.numel() == 1 else "other"


def run_shape(rank: int, length: int) -> Tuple[int, ...]:
    """The proxy shape of a run of rank-``rank`` parameters holding ``length`` elements."""
    return (1,) * (rank - 1) + (length,)


@dataclass
class Segmentation:
    """The segments of one run: ``pieces`` are (start, end, parameter shape), run-relative."""

    shape: Tuple[int, ...]
    pieces: List[Tuple[int, int, torch.Size]]

    @property
    def segments(self) -> int:
        return len(self.pieces)

    @property
    def length(self) -> int:
        return self.shape[-1]

    @property
    def scalar_shape(self) -> Tuple[int, ...]:
        return segment_scalar_shape(self.segments)

    def expand(self, scalars: torch.Tensor) -> torch.Tensor:
        """A run-shaped tensor holding each segment's value over its segment (1 in the padding).

        One concatenation of broadcast views: a single pass writing the run (measured ~5x
        faster on CPU than ``repeat_interleave``)."""
        values = torch.cat([scalars.reshape(self.segments), scalars.new_ones(1)]).unbind(0)
        pieces = [values[i].expand(n) for i, n in self._layout]
        return torch.cat(pieces).view(self.shape)

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


def segment_views(full: torch.Tensor, segmentation: Segmentation) -> List[torch.Tensor]:
    """Each segment of the run-shaped ``full`` as a view shaped like its parameter."""
    flat = full.reshape(-1)
    return [flat[start:end].view(shape) for start, end, shape in segmentation.pieces]


def _leaves(obj, out: List[Any]) -> List[Any]:
    """The leaves of ``obj`` (nested tuples, lists, dicts): torch's pytree costs too much per op."""
    if isinstance(obj, (tuple, list)):
        for item in obj:
            _leaves(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _leaves(item, out)
    else:
        out.append(obj)
    return out


def _map(fn, obj):
    """``obj`` with every leaf replaced by ``fn(leaf)`` (containers rebuilt, named tuples kept)."""
    if isinstance(obj, list):
        return [_map(fn, item) for item in obj]
    if isinstance(obj, tuple):
        items = [_map(fn, item) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, dict):
        return {key: _map(fn, item) for key, item in obj.items()}
    return fn(obj)


def _name(func) -> str:
    return getattr(func, "__name__", None) or repr(func)


class SegmentedMode(TorchFunctionMode):
    """Run an optimizer's ``step`` on segmented runs, computing every whole-parameter reduction per parameter."""

    def __init__(self, segmentations: Iterable[Segmentation]):
        super().__init__()
        self.by_shape: Dict[Tuple[int, ...], Segmentation] = {}
        self.by_scalar_shape: Dict[Tuple[int, ...], Segmentation] = {}
        for seg in segmentations:
            if seg.shape in self.by_shape or seg.scalar_shape in self.by_scalar_shape:
                raise ValueError("two runs of one segmented step must differ in length and in segment count")
            self.by_shape[seg.shape] = seg
            self.by_scalar_shape[seg.scalar_shape] = seg

    # ------------------------------------------------------------------ what a tensor is
    def _kind(self, t: torch.Tensor) -> Tuple[str, Optional[Segmentation]]:
        shape = tuple(t.shape)
        seg = self.by_shape.get(shape)
        if seg is not None:
            return "run", seg
        seg = self.by_scalar_shape.get(shape)
        if seg is not None:
            return "scalar", seg
        return "plain", None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _leaves((args, kwargs), [])
        segs: Dict[int, Segmentation] = {}
        kinds = set()
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                kind, seg = self._kind(leaf)
                if seg is not None:
                    kinds.add(kind)
                    segs[id(seg)] = seg
        if not segs:
            return func(*args, **kwargs)
        if len(segs) > 1:
            raise NotSegmentable(f"{_name(func)} mixes tensors of two different runs")
        (seg,) = segs.values()
        if func in _VALUE_READS:
            raise NotSegmentable(f"the step reads a tensor's value into Python ({_name(func)}), so its control "
                                 "flow may differ per parameter")
        if func in _FOREACH:
            return self._foreach(func, _FOREACH[func], args, kwargs)
        if "run" in kinds:
            return self._on_runs(func, seg, args, kwargs)
        return self._on_scalars(func, seg, args, kwargs)

    # ------------------------------------------------------------------ run-shaped inputs
    def _on_runs(self, func, seg: Segmentation, args, kwargs):
        if "out" in kwargs or (func in _IN_PLACE and args and isinstance(args[0], torch.Tensor)
                               and tuple(args[0].shape) == seg.scalar_shape):
            raise NotSegmentable(f"{_name(func)} writes run-shaped values into a per-parameter value")
        if func in _WHOLE_REDUCTIONS and not ({"dim", "axis"} & set(kwargs)) and all(
            not isinstance(a, int) or func in (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm) for a in args[1:]
        ):
            return self._per_segment(func, seg, args, kwargs)
        expanded_args, expanded_kwargs = _map(
            lambda x: seg.expand(x) if isinstance(x, torch.Tensor) and tuple(x.shape) == seg.scalar_shape else x,
            (args, kwargs),
        )
        out = func(*expanded_args, **expanded_kwargs)
        if not isinstance(out, torch.Tensor):
            if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
                raise NotSegmentable(f"{_name(func)} returns several tensors from a run")
            return out  # dtype, device, shape, requires_grad, ...
        if tuple(out.shape) == seg.shape:
            return out  # elementwise
        if out.numel() == 1 and out.dim() < len(seg.shape) + 1:
            return self._per_segment(func, seg, args, kwargs)
        raise NotSegmentable(f"{_name(func)} turns a run of shape {seg.shape} into shape {tuple(out.shape)} "
                             "(a reshape, or a reduction along a dimension)")

    def _per_segment(self, func, seg: Segmentation, args, kwargs) -> torch.Tensor:
        """The reduction ``func`` on each segment's own view: the per-parameter values, stacked."""
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
            value = func(*a, **k)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise NotSegmentable(f"{_name(func)} of one parameter is not one value")
            values.append(value.reshape(()))
        return torch.stack(values).reshape(seg.scalar_shape)

    # ------------------------------------------------------------------ segment scalars only
    def _on_scalars(self, func, seg: Segmentation, args, kwargs):
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
    def _foreach(self, func, base, args, kwargs):
        """``_foreach_op(list, ...)`` as ``op`` on each element, so each goes through this mode."""
        op = torch.linalg.vector_norm if base == "norm" else getattr(torch.Tensor, base, None)
        if op is None:
            raise NotSegmentable(f"{_name(func)} has no per-tensor counterpart")
        lists = [a for a in args if isinstance(a, (list, tuple))]
        length = len(lists[0])
        results = []
        for i in range(length):
            element = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            # the mode is paused while it handles a call: route each element through it explicitly
            results.append(self.__torch_function__(op, (), tuple(element), kwargs))
        return None if func in _FOREACH_IN_PLACE else results
