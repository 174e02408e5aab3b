"""A step planned elementwise that begins reducing over whole parameters later.

The probes (``_probe.py``) run a group's step for three steps on synthetic tensors. A step whose
per-parameter reduction only begins after that::

    state["step"] += 1
    if state["step"] > warmup:                   # warmup = 5: beyond the probes' three steps
        grad = grad / grad.norm().clamp(min=1)   # per-parameter clipping

looks elementwise to them, and from step ``warmup + 1`` a fused step would take one norm over a
whole flat run (every parameter of the run at once). This module sees it before such a step runs.

**What mixes the elements of a run** (:func:`function_kind`): a torch function is named after the
ATen operator it calls (``Tensor.add_`` -> ``add_``, ``Tensor.__mul__`` -> ``mul``, ``_foreach_``
forms -> their base), and ATen's own tags decide: a pointwise operator (``torch.Tag.pointwise``
on one of its overloads), an order-keeping view, copy, fill or ``*_like`` creation, or one of
torch's fused optimizer kernels keeps each element apart; anything else -- reductions (``sum``,
``norm``, ``amax``, ``any``, ``dot``...), scans, sorting, indexing, concatenation, reading values
into Python, a function not known -- mixes them, as does a pointwise-named call whose result is
smaller than its input (``Tensor.max()``) and a read of a run's size (which the probes refuse too).

**Accepted: what the probes saw.** Some elementwise steps mix a whole flat run from their first
step on, exactly: a global gradient norm, D-Adaptation's and Prodigy's sums over every parameter.
The elementwise probe watches its flat tensor (:func:`watched`) and the operations it saw, counted
per step, are accepted for that group (``GroupPath.mixing``, ``GroupLayout.mixing``); the checks
below look only for others: operations the probes never saw are what began after their window.

* **Eager steps** (:class:`DryRun`, every eager fused step): before the real step, the optimizer's
  own step runs on copies -- one run per group and scalar state as a few elements (a distinct
  prime count per run) of its device and dtype, copies of its scalar state, of the group settings,
  of the optimizer-level state and of the optimizer's attributes (public containers deep-copied),
  the random number generators forked -- under :func:`watched`. Its findings beyond the accepted
  ones raise :class:`LateReduction` (``Fusion._check_dry``). Cost: one pass of the step's Python
  over a few elements per group (measured in ``docs/fused_optimizer.md``). torch.optim's own
  optimizers skip it (``fused_optimizer.TORCH_ELEMENTWISE``).
* **Compiled steps** (:func:`graph_findings`, when a graph is compiled; nothing per step): Dynamo
  guards the branch, so the step that takes it compiles a new graph, which ``CompiledStep._backend``
  is handed before anything of that step runs. Followed from the flat runs' tensors (matched by
  their sizes), an operation that mixes them refuses the graph (raising :class:`LateReduction`
  through Dynamo); the fused step then runs the dry run as the arbiter: only what was accepted --
  the graph is compiled as it is; anything new -- :class:`LateReduction`.

On a :class:`LateReduction` nothing of the step has run; ``Fusion._replan`` probes the group again,
seeded with its current state (its step count past the warm-up included), lays it out on the path
the probes now choose (segmented, or its own per-tensor step; or refuses with
``LateReductionError`` under ``on_unsupported="raise"``), and the step runs on that path.
"""

from __future__ import annotations

import copy
import functools
import operator
from collections import Counter, defaultdict
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ._nested_state import tensor_leaves, with_leaves
from ._optimizer_copy import optimizer_like
from ._torch_compat import aten_operator_packet, exception_chain, size_hint
from ._verify import _rng_devices

__all__ = ["LateReduction", "graph_findings", "DryRun", "find_late_reduction", "function_kind", "watched", "RAISED"]

KEEPS, POINTWISE, MIXES = "keeps", "pointwise", "mixes"
RAISED = "raised "  # a finding that is an exception of the dry run, not an operation

_T = torch.Tensor
# Reading one of these of a flat tensor gives the whole buffer's size, not one parameter's.
_SIZE_READS = {_T.numel, _T.nelement, _T.__len__, _T.size, _T.shape.__get__}

# ATen operators (and Dynamo-graph method names) that keep each element apart without being
# tagged pointwise: views and copies that keep the elements' order, fills, creations shaped like
# a tensor, torch's fused optimizer kernels (elementwise by construction) and metadata.
_KEEPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "alias", "detach", "detach_",
    "squeeze", "squeeze_", "unsqueeze", "unsqueeze_", "flatten", "unflatten", "contiguous", "clone",
    "copy", "copy_", "_to_copy", "to", "type", "type_as", "float", "double", "half", "bfloat16",
    "lift_fresh", "lift_fresh_copy", "requires_grad_",
    "empty_like", "zeros_like", "ones_like", "full_like", "fill", "fill_", "zero", "zero_",
    "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
    "_fused_adam", "_fused_adam_", "_fused_adamw", "_fused_adamw_", "_fused_sgd", "_fused_sgd_",
    "_fused_adagrad", "_fused_adagrad_",
    "sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "is_same_size",
    # metadata (Python helpers the optimizers call on their tensors)
    "is_complex", "is_floating_point", "is_tensor", "result_type", "dim", "ndimension", "element_size",
    "get_device", "is_contiguous", "stride", "storage_offset", "_group_tensors_by_device_and_dtype",
})
# Reads of a run's size in a Dynamo graph (traced with dynamic shapes); eager steps: _SIZE_READS.
_SIZE_METHODS = frozenset({"size", "numel", "nelement", "__len__"})
# Python operators in a Dynamo graph, by the ATen operator they stand for.
_OPERATORS = {
    operator.add: "add", operator.iadd: "add_", operator.sub: "sub", operator.isub: "sub_",
    operator.mul: "mul", operator.imul: "mul_", operator.truediv: "div", operator.itruediv: "div_",
    operator.floordiv: "floor_divide", operator.mod: "remainder", operator.pow: "pow", operator.ipow: "pow_",
    operator.neg: "neg", operator.pos: "positive", operator.abs: "abs", operator.invert: "bitwise_not",
    operator.gt: "gt", operator.ge: "ge", operator.lt: "lt", operator.le: "le", operator.eq: "eq", operator.ne: "ne",
    operator.and_: "bitwise_and", operator.or_: "bitwise_or", operator.xor: "bitwise_xor",
    operator.matmul: "matmul", operator.getitem: "index", operator.setitem: "index_put_",
}


class LateReduction(Exception):
    """Internal: the step about to run would mix the elements of a flat run of a group planned
    elementwise (nothing of it has run). ``groups``: the param group indices involved."""

    def __init__(self, groups: Iterable[int], what: str, findings: Optional[Dict[int, Counter]] = None,
                 templates: Optional[Dict[int, List[torch.Tensor]]] = None):
        self.groups = frozenset(groups)
        self.what = what
        self.findings = findings or {}  # the dry run's, per group (the most of any of its runs)
        self.templates = templates or {}  # per group: a parameter of each run that did it (its state)
        super().__init__(f"param group(s) {sorted(self.groups)}: {what}")


def find_late_reduction(exc: BaseException) -> Optional[LateReduction]:
    """The :class:`LateReduction` behind ``exc`` (Dynamo wraps what a backend raises), or None."""
    return next((e for e in exception_chain(exc) if isinstance(e, LateReduction)), None)


# ---------------------------------------------------------------------- which operations mix elements
@functools.lru_cache(maxsize=None)
def _name_kind(name: str) -> str:
    """KEEPS, POINTWISE or MIXES for an ATen operator name (``_foreach_`` forms: their base)."""
    base = name[len("_foreach_"):] if name.startswith("_foreach_") else name
    candidates = (base, base.rstrip("_") or base)
    if any(c in _KEEPS for c in candidates):
        return KEEPS
    for candidate in candidates:
        packet = aten_operator_packet(candidate)
        if packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()):
            return POINTWISE
    return MIXES


def _target_name(node) -> Optional[str]:
    """The ATen operator a Dynamo graph node stands for, by name (None: not an operation on tensors)."""
    if node.op == "call_method":
        name = node.target
        return _DUNDERS.get(name[2:-2], name) if name.startswith("__") and name.endswith("__") else name
    if node.op != "call_function":
        return None
    target = node.target
    if target in _OPERATORS:
        return _OPERATORS[target]
    return getattr(target, "__name__", None) or repr(target)


def _value(node) -> Any:
    """The example value Dynamo traced ``node`` with (a fake tensor, a list of them, a SymInt...)."""
    meta = getattr(node, "meta", None)
    if meta is None:
        return node  # a constant argument
    return meta.get("example_value", meta.get("val"))


def _numel(value) -> Optional[int]:
    if isinstance(value, torch.Tensor):
        return size_hint(value.numel())
    return None


def _tensors(value) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


# ---------------------------------------------------------------------- compiled steps: the graph
def graph_findings(gm, watched: Dict[int, FrozenSet[int]]) -> List[Tuple[str, FrozenSet[int]]]:
    """What in Dynamo's graph ``gm`` mixes the elements of a flat run: ``(description, groups)``.

    ``watched`` maps the length of each flat run to check (a run of several parameters of a group
    planned elementwise) to the param groups holding a run of that length. The graph's inputs of
    such a length (placeholders and the optimizer's tensors Dynamo keeps as attributes) are the
    runs' parameters, gradients and state; every value computed from them without mixing their
    elements carries them on, and an operation that mixes them is a finding.
    """
    if not watched:
        return []
    carried: Dict[Any, FrozenSet[int]] = {}  # node -> the groups whose runs it is computed from
    findings = []
    for node in gm.graph.nodes:
        value = _value(node)
        if node.op in ("placeholder", "get_attr"):
            sizes = [_numel(t) for t in _tensors(value)]
            groups = frozenset().union(*(watched.get(n, frozenset()) for n in sizes if n is not None)) if sizes else frozenset()
            if groups:
                carried[node] = groups
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        inputs = [a for a in node.all_input_nodes if a in carried]
        if not inputs:
            continue
        groups = frozenset().union(*(carried[a] for a in inputs))
        name = _target_name(node)
        if node.target is operator.getitem and not isinstance(_value(node.args[0]), torch.Tensor):
            carried[node] = groups  # an item of a list of results (a _foreach_ call's), not indexing
            continue
        kind = MIXES if name in _SIZE_METHODS else (_name_kind(name) if name else MIXES)
        what = None
        if kind == MIXES:
            what = f"{'reads the size of' if name in _SIZE_METHODS else name + ' over'} a whole flat run"
        elif kind == POINTWISE and _shrinks(node, inputs, value):
            what = f"{name} reduces a whole flat run"
        if what is not None:
            findings.append((f"{what} (graph node {node.name!r})", groups))
            continue
        carried[node] = groups
    return findings


def _shrinks(node, inputs, value) -> bool:
    """A pointwise-named overload whose result has fewer elements than a run-sized input (``max()``)."""
    outputs = [n for n in (_numel(t) for t in _tensors(value)) if n is not None]
    if not outputs:
        return False  # in place (a _foreach_ call returns None)
    if isinstance(value, (list, tuple)):  # a _foreach_ call: position by position
        first = next((a for a in node.args if isinstance(a, (list, tuple))), None)
        if first is not None:
            ins = [_numel(_value(a)) for a in first]
            return any(i is not None and o < i for i, o in zip(ins, outputs))
    ins = [n for a in inputs for n in (_numel(t) for t in _tensors(_value(a))) if n is not None]
    return bool(ins) and min(outputs) < max(ins)


# ---------------------------------------------------------------------- eager steps and probes: watched runs
# Tensor dunders, by the ATen operator they stand for ("" : metadata, never a finding).
_DUNDERS = {
    "add": "add", "radd": "add", "iadd": "add_", "sub": "sub", "rsub": "rsub", "isub": "sub_",
    "mul": "mul", "rmul": "mul", "imul": "mul_", "truediv": "div", "rtruediv": "div", "itruediv": "div_",
    "div": "div", "rdiv": "div", "idiv": "div_", "floordiv": "floor_divide", "rfloordiv": "floor_divide",
    "ifloordiv": "floor_divide_", "mod": "remainder", "rmod": "remainder", "imod": "remainder_",
    "pow": "pow", "rpow": "pow", "ipow": "pow_", "neg": "neg", "pos": "positive", "abs": "abs",
    "invert": "bitwise_not", "and": "bitwise_and", "rand": "bitwise_and", "iand": "bitwise_and_",
    "or": "bitwise_or", "ror": "bitwise_or", "ior": "bitwise_or_", "xor": "bitwise_xor", "rxor": "bitwise_xor",
    "ixor": "bitwise_xor_", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne",
    "matmul": "matmul", "rmatmul": "matmul", "getitem": "index", "setitem": "index_put_",
    "hash": "", "repr": "", "str": "", "format": "", "reduce_ex": "", "deepcopy": "", "dir": "",
    # reading values into Python
    "bool": "item", "float": "item", "int": "item", "index": "item", "complex": "item", "iter": "item",
    "contains": "item", "array": "item",
}
# Properties that reorder a tensor's elements (everything else a property reads is metadata or a view).
_REORDERING_PROPERTIES = frozenset({"T", "mT", "H", "mH"})
SIZE_READ = "a read of its size"


def _function_name(func) -> str:
    """The ATen operator name a torch function (as a torch function mode is handed it) stands for;
    ``""`` for metadata (property reads, hashing)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.grad.__get__ and the like
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        return "permute" if prop in _REORDERING_PROPERTIES else ""
    if name.startswith("__") and name.endswith("__"):
        return _DUNDERS.get(name[2:-2], name)
    return name


_FUNCTION_KINDS: Dict[Any, Tuple[str, str]] = {}


def function_kind(func) -> Tuple[str, str]:
    """``(kind, name)`` of a torch function: kind KEEPS, POINTWISE, MIXES or SIZE_READ."""
    known = _FUNCTION_KINDS.get(func)
    if known is None:
        if func in _SIZE_READS:
            known = (SIZE_READ, SIZE_READ)
        else:
            name = _function_name(func)
            known = (KEEPS, name) if name == "" else (_name_kind(name), name)
        _FUNCTION_KINDS[func] = known
    return known


class _Watch(TorchFunctionMode):
    """Counts, per watched run, what a step does that mixes the elements of a run-sized tensor
    (``findings[run][operation]``): see the module docstring. Entered *before* (outside) any other
    torch function mode, so that its own reads of sizes are not seen by them.

    ``carried`` maps the sizes of the watched tensors (a distinct size per run) to the runs (keys)
    they stand for; results of another size computed from them (a broadcast) are added as they appear."""

    def __init__(self, carried: Dict[int, Set[int]]):
        super().__init__()
        self.carried = carried
        self.findings: Dict[int, Counter] = defaultdict(Counter)

    def _groups(self, args, kwargs) -> Set[int]:
        found = set()
        carried = self.carried
        for group in (args, kwargs.values()) if kwargs else (args,):
            for a in group:
                if isinstance(a, torch.Tensor):
                    n = a.numel()
                    if n in carried:
                        found.update(carried[n])
                elif isinstance(a, (list, tuple)):
                    for t in a:
                        if isinstance(t, torch.Tensor):
                            n = t.numel()
                            if n in carried:
                                found.update(carried[n])
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind, name = _FUNCTION_KINDS.get(func) or function_kind(func)
        if kind is POINTWISE:
            out = func(*args, **kwargs) if kwargs else func(*args)
            if out is None or (isinstance(out, torch.Tensor) and out.numel() in self.carried):
                return out  # (the usual case: in place, or a run-sized result)
            self._pointwise_result(name, args, kwargs or {}, out)
            return out
        if kind is KEEPS:  # (a view, copy or fill keeps a run's size)
            return func(*args, **kwargs) if kwargs else func(*args)
        groups = self._groups(args, kwargs or {})
        for group in groups:
            self.findings[group][name] += 1
        return func(*args, **kwargs) if kwargs else func(*args)

    def _pointwise_result(self, name, args, kwargs, out) -> None:
        """A pointwise call whose result is not run-sized: a reduction (``Tensor.max()``) if it is
        smaller than a run-sized input, a broadcast (carried on) if larger."""
        groups = self._groups(args, kwargs)
        if not groups:
            return
        carried = self.carried
        outs = _tensors(out)
        if name.startswith("_foreach_"):
            first = next((a for a in args if isinstance(a, (list, tuple))), ())
            shrinks = any(i.numel() in carried and o.numel() < i.numel() for i, o in zip(_tensors(first), outs))
        else:
            largest = max((t.numel() for a in args for t in _tensors(a) if t.numel() in carried), default=0)
            shrinks = bool(outs) and min(t.numel() for t in outs) < largest
        if shrinks:
            for group in groups:
                self.findings[group][name] += 1
            return
        for t in outs:  # a result of another size computed from a run carries it on
            n = t.numel()
            if n > 1 and n not in carried:
                carried[n] = set(groups)


def watched(carried: Dict[int, Set[int]]) -> _Watch:
    """``with watched({size: {key}}) as watch:`` -- run a step; ``watch.findings[key]`` says what it
    did that mixes the elements of the tensors of that size. (The probes watch their flat tensor: what
    they found exact is accepted later, see ``Fusion._check_dry``.) Enter it before other modes."""
    return _Watch(carried)


_IMMUTABLE = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)


def _copied(value: Any) -> Any:
    """A copy the dry run may change: tensors cloned, containers deep-copied, immutables as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, tuple) and all(isinstance(v, _IMMUTABLE) for v in value):
        return value
    return copy.deepcopy(value)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


# Sizes of the dry run's runs: distinct primes from 29 on, one per checked run, so that a tensor
# of such a size was computed from that run, and an ``.item()``-style read fails as on a real run.
_SIZES = [n for n in range(29, 2000, 2) if _is_prime(n)]

def _copy_public_containers(attributes: Dict[str, Any]) -> Dict[str, Any]:
    """Public containers the step may change in place (``self.norms = {}``) are copied; the rest
    (``defaults``, private attributes) is shared."""
    return {key: copy.deepcopy(value) if not key.startswith("_") and key != "defaults"
            and isinstance(value, (dict, list, set)) else value for key, value in attributes.items()}


class DryRun:
    """The optimizer's own step on small copies of chosen runs, watched (see the module docstring)."""

    def findings(self, optimizer, raw_step, runs: Sequence[Tuple[int, Any]], replay=None) -> Dict[int, Counter]:
        """What ``raw_step`` would do that mixes the elements of each of ``runs`` (``(group index,
        run)`` pairs of the plan being stepped; the optimizer's param groups and state are the
        swapped ones of that step, and the caller set the step's grad mode), by position in
        ``runs``. Nothing real is changed: the step runs on copies."""
        carried: Dict[int, Set[int]] = {}
        params_by_group: Dict[int, List[torch.Tensor]] = defaultdict(list)
        state: Dict[Any, Any] = defaultdict(dict)
        for key, value in optimizer.state.items():
            if not isinstance(key, torch.Tensor):  # optimizer-level state (``self.state["k"]``)
                state[key] = _copied(value)
        for k, ((index, run), size) in enumerate(zip(runs, _SIZES)):
            carried[size] = {k}
            proxy = run.proxy
            dry = torch.nn.Parameter(torch.zeros(size, dtype=proxy.dtype, device=proxy.device),
                                     requires_grad=proxy.requires_grad)
            dry.grad = torch.zeros(size, dtype=proxy.grad.dtype, device=proxy.grad.device)
            length = proxy.numel()
            entry = state[dry]
            for key, value in run.state.items():
                leaves = tensor_leaves(value)  # a container of run-shaped tensors: each one of the dry size
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == length:
                    entry[key] = torch.zeros(size, dtype=value.dtype, device=value.device)
                elif leaves is not None and all(leaf.dim() > 0 and leaf.numel() == length for _, leaf in leaves):
                    entry[key] = with_leaves(value, {path: torch.zeros(size, dtype=leaf.dtype, device=leaf.device)
                                                     for path, leaf in leaves}, copy=True)
                else:
                    entry[key] = _copied(value)
            params_by_group[index].append(dry)
        clone = optimizer_like(
            optimizer,
            [dict({k: _copied(v) for k, v in g.items() if k != "params"}, params=params_by_group[i])
             for i, g in enumerate(optimizer.param_groups)],
            state, _copy_public_containers)
        watch = watched(carried)
        with torch.random.fork_rng(devices=_rng_devices(run.proxy for _, run in runs)):
            try:
                with watch:
                    if replay is None:
                        raw_step(clone)
                    else:
                        raw_step(clone, replay)
            except Exception as exc:  # the step cannot run on the copies: never accepted (see Fusion)
                for k in range(min(len(runs), len(_SIZES))):
                    watch.findings[k][f"{RAISED}{type(exc).__name__}: {exc}"] += 1
        return watch.findings

