"""A ``torch._foreach_*`` call is a loop over its lists: the per-tensor call of each element.

The modes that rewrite an optimizer's step see each call it makes. A foreach call hides its
elements' calls inside one kernel, so the compiled step (``_compile.ScalarsAsOperands``: Python
scalars made operands) and the segmented step (``_segmented.SegmentedMode``: reductions per
parameter) expand it here into the per-tensor calls it stands for, and handle each of those.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

__all__ = ["element_calls", "in_place", "is_python_number"]

# ``torch.maximum`` takes tensors only: with a Python number, the foreach call is a clamp
# (there is no ``Tensor.maximum_``: the in-place call has a per-tensor form only with a number)
_SCALAR_FORMS = {"maximum": "clamp_min", "minimum": "clamp_max"}


class _Forms(NamedTuple):
    """One foreach function's per-tensor forms, found once: the modes run while Dynamo traces a
    step, and Dynamo cannot trace string handling. A named tuple, not an object with attributes:
    Dynamo reads a tuple's items as the functions they are, where torch 2.11 kept an object's
    attribute as an unknown value and then could not look it up (``func in _ADD_LIKE``: "comparison
    with constant failed"), which switched the compiled step off for every step with such a call."""

    in_place: bool
    value_list: bool  # a list of scalars is each element's value= (addcmul, addcdiv)
    with_tensors: Any
    with_number: Any
    number_first: Any  # _foreach_pow(scalar, tensors)


def _forms(base: str) -> _Forms:
    name = base.rstrip("_")
    in_place = base.endswith("_")
    return _Forms(
        in_place=in_place,
        value_list=name in ("addcmul", "addcdiv"),
        with_tensors=torch.linalg.vector_norm if name == "norm" else getattr(torch.Tensor, base, None),
        with_number=getattr(torch.Tensor, _SCALAR_FORMS.get(name, name) + "_" * in_place, None),
        number_first=getattr(torch, name, None),
    )


_FORMS = {getattr(torch, n): _forms(n[len("_foreach_"):]) for n in dir(torch) if n.startswith("_foreach_")}


def is_python_number(value: Any) -> bool:
    return isinstance(value, (float, int, torch.SymFloat, torch.SymInt)) and not isinstance(value, bool)


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def element_calls(func, args, kwargs) -> Optional[List[Tuple[Any, tuple, Dict[str, Any]]]]:
    """``(op, args, kwargs)`` of each element's per-tensor call of ``func`` (a ``torch._foreach_*``
    function), in order; None where an element's call has no per-tensor form. An in-place foreach
    call returns its first list (the callers return ``args[0]`` then), others the list of results."""
    forms = _FORMS[func]
    length = len(next(a for a in args if _is_list(a)))
    calls = []
    for i in range(length):
        element = [a[i] if _is_list(a) else a for a in args]
        element_kwargs = kwargs
        if forms.value_list and len(element) == 4:
            element_kwargs = dict(kwargs, value=element.pop())
        if not _is_list(args[0]):
            op = forms.number_first
        elif len(element) == 2 and is_python_number(element[1]):
            op = forms.with_number
        else:
            op = forms.with_tensors
        if op is None:
            return None
        calls.append((op, tuple(element), element_kwargs))
    return calls


def in_place(func) -> bool:
    """Whether the foreach call writes its first list (and returns it)."""
    return _FORMS[func].in_place
