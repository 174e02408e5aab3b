"""The compiled fused step: the optimizer's own ``step`` over flat tensors, as Inductor kernels.

Flattening alone makes a step *slower* on CPU: each elementwise op becomes a full pass over
the whole buffer with full-size temporaries. Compiling the optimizer's own step with
``torch.compile`` fuses its ops into one kernel per flat buffer (C++/OpenMP on CPU, Triton on
CUDA): one read of param, grad and state, one write.

Three details make this work for *any* elementwise optimizer:

* ``fullgraph=True``: the whole step is one graph or compilation fails before anything runs,
  so falling back to the eager fused step never sees a half-applied update.
* Scalar hyper-parameters passed as ``alpha=`` / ``value=`` / ``lerp`` weights are specialized
  by Dynamo (a recompile for every new learning rate). :class:`ScalarsAsOperands` rewrites
  those calls into multiplications at trace time, which Dynamo keeps symbolic. ``_foreach_*``
  calls carrying Python scalars run element by element through the same rewrites: left as
  foreach calls, their scalars recompile each step on CPU and, on CUDA (torch 2.11, Triton),
  were baked into the first graph with no guard at all (a schedule silently ignored).
* torch.optim groups run their single-tensor implementation (``foreach=None`` too, which picks
  foreach on CUDA): with one flat tensor per buffer, ``foreach`` buys nothing. ``fused=True``
  groups keep torch's hand-written kernel (already one kernel per flat tensor) and are not compiled.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import sys
import time
import types
import warnings
from contextlib import contextmanager
from typing import Dict, FrozenSet, Optional

import torch
from torch.overrides import TorchFunctionMode

from ._torch_compat import (
    compiled_kernels_may_fuse_multiply_add,
    compiled_steps_unsupported,
    default_store,
    dynamo_dispatches_foreach_to_modes,
    dynamo_recompile_limit,
    exception_chain,
    floats_need_a_direct_use,
    floats_used_directly,
    forget_float_specializations,
    inductor_backend,
    inductor_reads_thresholds_raised,
    inductor_with_post_grad_pass,
    block_loops_pass,
    ints_symbolic_from_the_first_graph,
    math_pow_kept_symbolic,
    process_group_timeout,
    start_cpu_vector_isa_checks,
    start_precompiling_cpu_kernel_header,
)
from . import _batched_combines, _early_stores
from ._batched_combines import batch_combines
from ._early_stores import stores_early
from ._foreach import element_calls, in_place, is_python_number
from ._late_reductions import LateReduction, find_late_reduction, graph_findings
from ._scalar_prologue import with_scalar_prologue
from .errors import CompileFallbackWarning, ShardCollectiveError, first_line

_T = torch.Tensor
_ADD_LIKE = {_T.add_: _T.add_, _T.add: torch.add, torch.add: torch.add, _T.sub_: _T.sub_, _T.sub: torch.sub, torch.sub: torch.sub}
_ADDC = {
    _T.addcmul_: (_T.add_, torch.mul),
    _T.addcmul: (torch.add, torch.mul),
    torch.addcmul: (torch.add, torch.mul),
    _T.addcdiv_: (_T.add_, torch.div),
    _T.addcdiv: (torch.add, torch.div),
    torch.addcdiv: (torch.add, torch.div),
}
_LERP = {_T.lerp_: _T.add_, _T.lerp: torch.add, torch.lerp: torch.add}
# Elementwise ``_foreach_*`` calls that may carry Python scalars (an ``lr``): expanded per element
# where they do (``_foreach.element_calls``).
_FOREACH_SCALAR_OPS = {
    getattr(torch, f"_foreach_{base}{suffix}")
    for base in ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "clamp_min", "clamp_max", "addcmul",
                 "addcdiv", "lerp")
    for suffix in ("", "_")
    if hasattr(torch, f"_foreach_{base}{suffix}")
}


def _carries_python_numbers(args, kwargs) -> bool:
    values = list(args) + list(kwargs.values())
    return any(is_python_number(v) or (isinstance(v, (list, tuple)) and v and is_python_number(v[0])) for v in values)


# Graph count after which the compiled step is abandoned for the eager fused step: the
# first compile, one recompile when Dynamo makes changing scalars symbolic, and slack for
# a run structure that changes once (e.g. a parameter that gets its first gradient late).
MAX_GRAPHS = 4
# Segmented steps on the CPU: loops of a run's length in the shape of its per-block reductions
# (``block_loops_pass``) and write-backs where their values are computed (``stores_early``), so
# that a value is stored in the loop that reduces it. Off only to measure what they change.
BLOCK_LOOPS = True
# Below this many flat elements, compile time outweighs the gain ("auto" stays eager).
AUTO_MIN_ELEMENTS = 1 << 20


def _is_python_float(value) -> bool:
    return isinstance(value, (float, torch.SymFloat))


_WIDE_FLOATS = (torch.float32, torch.float64)
_CLAMPS = {_T.clamp, _T.clamp_, torch.clamp, _T.clip, _T.clip_, torch.clip}
_CLAMP_ONE_SIDE = {_T.clamp_min: "min", _T.clamp_min_: "min", torch.clamp_min: "min",
                   _T.clamp_max: "max", _T.clamp_max_: "max", torch.clamp_max: "max"}


def _float_scalars_as_operands(func, args, kwargs):
    """A fill value or clamp bound that is a Python float, as a 0-dim tensor operand; the call's
    result, or None where ``func`` is not such a call.

    Why: a float in those places (pytorch-optimizer's AdaBound and AdaMod: ``torch.full((),
    lr * ...)``, then ``clamp_(min=lower_bound, max=upper_bound)`` of the learning rate) is a
    Scalar argument, which Inductor's tensorify pass cannot make an input. torch 2.13 and 2.14
    then specialize it (a recompile per new rate: AdaBound's compiled step switched itself off);
    2.6 - 2.12, where :func:`floats_used_directly` keeps the rate symbolic, compiled the value
    it had when traced into the kernel, with no guard (AdaBound under LambdaLR on 2.11: 2e-1
    from unfused, silently). A 0-dim tensor of the same dtype gives the same bits (aten rounds
    a Scalar to the tensor's dtype too); float32 and float64 tensors only, where the bound is
    compared in that dtype."""
    if func is torch.full or func is torch.full_like:
        kwargs = dict(kwargs)
        fill = args[1] if len(args) == 2 else kwargs.pop("fill_value", None)
        like = args[0] if func is torch.full_like and args and isinstance(args[0], _T) else None
        dtype = kwargs.get("dtype") or (like.dtype if like is not None else torch.get_default_dtype())
        if args and len(args) <= 2 and _is_python_float(fill) and "out" not in kwargs and dtype in _WIDE_FLOATS:
            ones = torch.ones(args[0], **kwargs) if like is None else torch.ones_like(like, **kwargs)
            return ones.mul(fill)
        return None
    if func is _T.fill_ and len(args) == 2 and not kwargs and _is_python_float(args[1]) \
            and isinstance(args[0], _T) and args[0].dtype in _WIDE_FLOATS:
        return args[0].fill_(_float_operand(args[1], args[0]))
    if (func in _CLAMPS or func in _CLAMP_ONE_SIDE) and args and isinstance(args[0], _T) \
            and args[0].dtype in _WIDE_FLOATS and set(kwargs) <= {"min", "max"}:
        names = ("min", "max") if func in _CLAMPS else (_CLAMP_ONE_SIDE[func],)
        bounds = dict(zip(names, args[1:]), **kwargs)
        if any(_is_python_float(b) for b in bounds.values()) and len(args) <= 1 + len(names):
            bounds = {k: _float_operand(b, args[0]) if is_python_number(b) else b for k, b in bounds.items()}
            if func in _CLAMP_ONE_SIDE:
                return func(args[0], bounds[names[0]])
            return func(args[0], **bounds)
    return None


def _float_operand(value, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-dim tensor of ``like``'s dtype and device, made by a multiplication (kept
    symbolic, as :func:`_number_as_tensor`), without a method call on ``like``: a segmented step's
    tensors are per-run stand-ins, which make no tensors of other shapes."""
    return torch.ones((), dtype=like.dtype, device=like.device).mul(value)


def _number_as_tensor(value, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a Python number, symbolic in a compiled step) as a 0-dim tensor of ``like``'s dtype
    and device, made by a multiplication: the one use of a symbolic float that Inductor's tensorify
    pass keeps symbolic (``torch.scalar_tensor(value)`` is specialized to its first value). Of
    ``like`` (``new_ones``) and without keyword arguments, so that the scalar prologue still
    replays a constant base (``pow(0.9, step_t)``) outside the kernel."""
    return like.new_ones(()).mul(value)


class ScalarsAsOperands(TorchFunctionMode):
    """Rewrite scalar-keyword arithmetic into tensor-times-scalar so Dynamo keeps scalars dynamic."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}  # (dict() of an empty one: calls a compiled step's trace inlines)
        if func in _ADD_LIKE and "alpha" in kwargs and len(args) == 2 and isinstance(args[1], _T):
            alpha = kwargs.pop("alpha")
            return _ADD_LIKE[func](args[0], args[1] * alpha, **kwargs)
        if func in _ADDC and "value" in kwargs and len(args) == 3:
            add, combine = _ADDC[func]
            value = kwargs.pop("value")
            return add(args[0], combine(args[1], args[2]) * value, **kwargs)
        if func in _LERP and len(args) + len(kwargs) == 3 and len(args) >= 2 and set(kwargs) <= {"weight"}:
            start, end = args[:2]
            weight = args[2] if len(args) == 3 else kwargs["weight"]  # (AdaBelief: weight=1.0 - beta1)
            if not isinstance(weight, _T):
                return _LERP[func](start, (end - start) * weight)
        # A symbolic Python float raised to a tensor's power (Adam's ``1 - beta1 ** step_t``): Inductor
        # compiled the base of ``pow(Scalar, Tensor)`` as the value it had when traced, with no
        # guard (torch 2.13: under OneCycleLR's changing betas the compiled AdamW kept the first
        # beta1 in its bias correction). As a 0-dim tensor of the power's dtype (the base is
        # rounded to it as the kernel did), it is read on every call.
        if (func is _T.__rpow__ or func is torch.pow) and len(args) == 2 and not kwargs:
            base, exponent = (args[1], args[0]) if func is _T.__rpow__ else args
            if is_python_number(base) and isinstance(exponent, _T):
                return torch.pow(_number_as_tensor(base, exponent), exponent)
        rewritten = _float_scalars_as_operands(func, args, kwargs)
        if rewritten is not None:
            return rewritten
        # ``_foreach_*`` calls too: a Python scalar there (``_foreach_mul_(params, 1 - lr * wd)``,
        # ``alpha=-lr``) is specialized, and was seen specialized with no guard (pytorch-optimizer's
        # Lamb under LambdaLR kept its first graph's rate). A foreach op is a loop over its lists:
        # each element runs as its per-tensor op, through the rewrites above.
        if func in _FOREACH_SCALAR_OPS and _carries_python_numbers(args, kwargs):
            calls = element_calls(func, args, kwargs)
            if calls is not None:
                # a mode is paused while it handles a call: route each element through it explicitly
                results = [self.__torch_function__(op, (), element, element_kwargs)
                           for op, element, element_kwargs in calls]
                return args[0] if in_place(func) else results  # in place: its list, as torch
        return func(*args, **kwargs)


_COMPILER_WORKS: Dict[str, bool] = {}  # per device type: probed once per process


def compiler_available(device_type: str = "cpu") -> bool:
    """Whether ``torch.compile`` with Inductor works here for tensors on ``device_type``: a C++
    compiler for CPU tensors, Triton for CUDA ones. Probed on that device, once: a CPU probe on a
    GPU machine would make Inductor check the host's vector instructions by compiling test programs
    (40 s of a 45 s startup of a fused BertAdam on an H200), which CUDA kernels never need.

    On an x86 CPU those checks themselves answer for CPU tensors: one that built and loaded its
    test program (Inductor's compiler, flags and torch's headers) shows the compiler works, and
    the probe's own compile (0.7 s of a cold start) is skipped. Should a kernel still fail to
    build (a compiler without OpenMP), the step that needed it runs eagerly, with one warning."""
    works = _COMPILER_WORKS.get(device_type)
    if works is None:
        works = (device_type == "cpu" and _cpu_vector_isa_checked()) or _probe_compile(device_type)
        _COMPILER_WORKS[device_type] = works
    return works


def _cpu_vector_isa_checked() -> bool:
    """Whether Inductor's check of the CPU's vector instructions built and loaded its test program."""
    # Once the instruction set is known, the header every CPU kernel includes is precompiled beside
    # the rest of the build (7 s of a 2-core machine's first compiled step when kernels wait for it).
    isa_checks = start_cpu_vector_isa_checks(then=start_precompiling_cpu_kernel_header)
    # The rest of Inductor's imports (about 1 s) while the checks' compilers run. By name: a plain
    # ``import torch._inductor...`` in a function makes ``torch`` one of its local names.
    try:
        importlib.import_module("torch._inductor.compile_fx")
    except Exception:
        pass  # the probe meets it
    return bool(isa_checks())


def _probe_compile(device_type: str) -> bool:
    """Whether Inductor compiles and runs a small function on a ``device_type`` tensor."""
    try:
        probe = torch.compile(lambda x: x * 2 + 1, fullgraph=True)
        return bool(probe(torch.ones(8, device=device_type))[0] == 3)
    except Exception:  # any failure means "not here"
        return False


def compile_unavailable_reason(path: str = "elementwise", device_type: str = "cpu") -> Optional[str]:
    """Why no compiled step of ``path`` ("elementwise", "segmented", "per-tensor") can run here on
    ``device_type`` tensors, decided before any step (the torch release, then a working compiler), or None."""
    unsupported = compiled_steps_unsupported(path)
    if unsupported is not None:
        return unsupported
    if not compiler_available(device_type):
        compiler = "Triton" if device_type == "cuda" else "a C++ compiler"
        return f"torch.compile is not usable here for {device_type} tensors (it needs a working {compiler})"
    return None


_ABSENT = object()


@contextmanager
def _groups_keep_capturable(optimizer):
    """Each param group's ``capturable`` as it was before the compiled step ran.

    Dynamo traces an optimizer's ``param_groups`` with ``capturable=True`` (its own choice for
    compiled CUDA steps), and writes that into the real groups when the step writes to a group
    (pytorch-optimizer's ``group["step"] += 1``): the group gained a key the eager step never
    adds, which the next call's guard on the group's length saw, so every such optimizer compiled
    its step twice (pytorch-optimizer's Lamb on BERT-base: seconds of its first three steps), and
    the key reached its ``state_dict``."""
    kept = [(group, group.get("capturable", _ABSENT)) for group in optimizer.param_groups]
    try:
        yield
    finally:
        for group, value in kept:
            if value is _ABSENT:
                group.pop("capturable", None)
            elif group.get("capturable", _ABSENT) is not value:
                group["capturable"] = value


@contextmanager
def _single_tensor_groups(optimizer):
    """torch.optim groups take their single-tensor code path while the compiled step runs.

    ``foreach=None`` counts too: torch.optim then picks its foreach implementation for CUDA
    tensors, and that path compiled on CUDA (torch 2.11, Triton) kept the first graph's learning
    rate with no recompile (AdamW under LambdaLR drifted from the unfused step). Other optimizers'
    ``foreach=None`` keeps its meaning (their own choice), ``foreach=True`` is turned off for all.
    """
    torch_optim = type(optimizer).__module__.startswith("torch.optim")
    changed = []
    for group in optimizer.param_groups:
        if "foreach" in group and (group["foreach"] or (torch_optim and group["foreach"] is None)):
            changed.append((group, group["foreach"]))
            group["foreach"] = False
    try:
        yield
    finally:
        for group, value in changed:
            group["foreach"] = value


def _float_hyperparameters(optimizer) -> tuple:
    """Where the param groups hold floats: ``(group index, key, index in a tuple or None)``."""
    found = []
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if type(value) is float:
                found.append((i, key, None))
            elif type(value) in (tuple, list) and len(value) <= 8:
                found.extend((i, key, j) for j, v in enumerate(value) if type(v) is float)
    return tuple(found)


# The param-group floats schedules change between steps, which compiled steps follow: the learning
# rate (every scheduler), momentum and betas (OneCycleLR and CyclicLR cycle them with the rate) and
# the weight decay (weight-decay schedules). Tested on every optimizer of pytorch-optimizer under
# OneCycleLR's momentum cycle (tests/_optimizer_sweep.py, torch 2.11, 2.13 and 2.14.1) and on torch's
# and this package's optimizers (tests/test_compiled_step.py). Any other float that changes (a
# hand-set ``eps``) switches the compiled step off: untested uses of it may be compiled as constants.
FOLLOWED_WHEN_CHANGED = frozenset({"lr", "momentum", "betas", "weight_decay"})


def _changed_hyperparameter(optimizer, seen: Dict[tuple, float]) -> Optional[str]:
    """The first param-group float outside :data:`FOLLOWED_WHEN_CHANGED` (an ``eps``) that changed
    since the last call, described; None if none. Records the values (up to that one: the compiled
    step is off from then on).

    Why: once such a float changes, Dynamo makes it a graph input, and Inductor has compiled uses
    of such inputs as the value they had when traced, with no guard: a base of ``pow``, a ``lerp``
    weight, a fill value or a clamp bound (pytorch-optimizer's AdaBelief and Adan under OneCycleLR's
    momentum cycle drifted 1-2e-2 from unfused, silently; AdaBound under LambdaLR on torch 2.11,
    2e-1). :class:`ScalarsAsOperands` passes those as tensors, and the floats schedules change are
    tested; another float's uses are not. The eager fused step is exact."""
    groups = optimizer.param_groups
    for i, key, index in _float_hyperparameters(optimizer):
        group = groups[i]  # keyed by the group itself: per-tensor steps show one group at a time
        value = group[key] if index is None else group[key][index]
        where = (id(group), key, index)
        before, seen[where] = seen.get(where), value
        if before is not None and before != value and key not in FOLLOWED_WHEN_CHANGED:
            name = key if index is None else f"{key}[{index}]"
            return f"its param group's {name!r} changed from {before!r} to {value!r}"
    return None


def _python_scalars(optimizer, kind: type):
    """``((where, index or id(param), key), value)`` for each value of exactly type ``kind`` (a
    bool is not an int) in the param groups (``"param group"``) and in the state entries of their
    parameters (``"state"``). Only the groups' parameters: per-tensor steps call this once per
    parameter, and a scan of the whole state there was quadratic in the parameter count."""
    state = optimizer.state
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if type(value) is kind:
                yield ("param group", i, key), value
        for param in group["params"]:
            entry = state.get(param)
            if isinstance(entry, dict):
                for key, value in entry.items():
                    if type(value) is kind:
                        yield ("state", id(param), key), value


def _python_floats(optimizer) -> Dict[tuple, float]:
    """The Python floats a step may write, by where they are (:func:`_python_scalars`)."""
    return dict(_python_scalars(optimizer, float))


def _python_ints(optimizer) -> set:
    """Where the optimizer holds Python ints, as ``_torch_compat.ints_symbolic_from_the_first_graph``
    takes them: ``("group", index, key)``, and ``("state", None, key)`` for a key of any entry."""
    return {("group", ident, key) if where == "param group" else ("state", None, key)
            for (where, ident, key), _ in _python_scalars(optimizer, int)}


def _floats_written(before: Dict[tuple, float], after: Dict[tuple, float]) -> list:
    """Where ``after`` holds a float object that ``before`` did not: a new key, or a float written
    there (a new object, even of the same value: a running sum that adds 0.0 for a while is written
    all the same)."""
    return sorted({(where, key) for (where, ident, key), value in after.items()
                   if before.get((where, ident, key)) is not value})


def _step_device(groups) -> Optional[torch.device]:
    """The device of the step's first parameter (None: no tensor)."""
    for group in groups:
        for p in group["params"]:
            if isinstance(p, torch.Tensor):
                return p.device
    return None


def _step_with_scalars_as_operands(optimizer, raw_step, mode=None, floats=()):
    groups = optimizer.param_groups
    kept = floats_used_directly([groups[i][k] if j is None else groups[i][k][j] for i, k, j in floats],
                                device=_step_device(groups))
    if mode is None:
        with ScalarsAsOperands():
            raw_step(optimizer)
    else:  # a segmented step: per-parameter reductions (see _segmented.SegmentedMode)
        with mode, ScalarsAsOperands():  # (dynamo_dispatches_foreach_to_modes ran: foreach calls reach mode)
            raw_step(optimizer)
    return kept


def _describe(exc: BaseException) -> str:
    """``Type: first line`` of the innermost cause (Dynamo wraps backend errors)."""
    *_, exc = exception_chain(exc, implicit=False)
    return first_line(exc)


def _private_copy(fn, name: str):
    """``fn`` with its own code object named ``name``. Dynamo caches compiled graphs (and counts
    recompiles against its limit) per code object: a private copy per user keeps one optimizer's
    or codec's graphs from crowding out another's."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@functools.lru_cache(maxsize=None)
def post_grad_pass(early_stores: bool = False):
    """Our passes over the functional graph Inductor compiles, as its ``post_grad_custom_pre_pass``
    (one ``CustomGraphPass``, keyed by the passes' source so that Inductor's FX graph cache stays
    on), or None where torch has no such class: the combines over shards batched
    (``batch_combines``), then, with ``early_stores``, each input's write-back moved to where its
    value is computed (``stores_early``; after the first, which requires them last), in segmented
    steps on the CPU: early stores pay only where Inductor then stores in the loop that reduces
    (``block_loops_pass``)."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return None
    digest = hashlib.sha256(str(early_stores).encode())
    for module in (_batched_combines, _early_stores, sys.modules[__name__]):
        with open(module.__file__, "rb") as handle:
            digest.update(handle.read())
    source_hash = digest.hexdigest()
    ops = torch.ops.bagua_integrations
    combines = (ops.segment_combine.default, ops.segment_combine_many.default)

    class StepGraphPasses(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            batch_combines(graph)
            if early_stores and any(node.target in combines for node in graph.nodes):
                stores_early(graph, device_type="cpu")  # (a segmented step's: it reduces per block)

        def uuid(self):
            return source_hash

    return StepGraphPasses()


_AGREEMENTS: Dict[tuple, int] = {}  # ranks of a shard group -> first compiles agreed on so far


class PeerCompileFailed(RuntimeError):
    """Another rank of the shard group could not compile its first step: this rank takes the eager step too."""


def agree_on_the_first_compile(group, failure: Optional[str]) -> Optional[str]:
    """Tell the other ranks of ``group`` whether this rank's first compile of a step succeeded
    (``failure`` None) and, if it did, wait for theirs: the first failure of a peer, or None.

    Why: a compiled step over FSDP2 shards combines every run's reductions in one all-reduce, the
    eager step one per run. A rank whose compile failed alone (a compiler crash, a memory limit)
    went eager and its all-reduces no longer matched its peers': gloo aborted the process
    ("Received data size doesn't match"), NCCL would hang or read wrong bytes. So the ranks agree
    before the first compiled step runs, through the rendezvous store (a collective cannot: the
    failed rank never reaches the compiled one). A failed rank only posts. Every rank compiles a
    group's first step at the same fused step, in the same order: the n-th agreement of a group
    is the same one on every rank."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    number = _AGREEMENTS.get(ranks, 0)
    _AGREEMENTS[ranks] = number + 1
    prefix = f"bagua_integrations/first-compile/{'-'.join(map(str, ranks))}/{number}/"
    store = default_store()
    store.set(prefix + str(dist.get_rank()), failure or "")
    if failure is not None:
        return None
    timeout = process_group_timeout(group)
    try:
        store.wait([prefix + str(rank) for rank in ranks], timeout)
    except Exception as exc:  # noqa: BLE001 - the store's timeout or a peer gone
        raise ShardCollectiveError(
            f"a peer rank of the FSDP2 shard group {list(ranks)} did not reach its first compiled optimizer step "
            f"within {timeout.total_seconds():g} s ({first_line(exc)}); it stopped, crashed, or was built with "
            "compile=False (every rank must fuse with the same settings)") from exc
    for rank in ranks:
        said = store.get(prefix + str(rank)).decode()
        if said:
            return f"rank {rank}: {said}"
    return None


class CompiledStep:
    """Runs the optimizer's step compiled; counts graphs and compile time; falls back to eager.

    ``agree_over``: the process group of a step over FSDP2 shards whose compiled form makes other
    collectives than its eager one: the ranks take the first compiled step together or none does
    (:func:`agree_on_the_first_compile`)."""

    _instances = 0

    def __init__(self, max_graphs: int = MAX_GRAPHS, dynamic: Optional[bool] = None, agree_over=None):
        self.max_graphs = max_graphs
        self.graphs = 0
        self.compile_seconds = 0.0
        self.compiled_steps = 0
        self.disabled_reason = None
        self.agree_over = agree_over
        self._agreed = agree_over is None
        # run length -> param groups: the flat runs whose elements a new graph must not mix (set
        # by the caller before each call; empty for segmented and per-tensor steps)
        self.watched: Dict[int, FrozenSet[int]] = {}
        self._hyperparameters: Dict[tuple, float] = {}  # see _changed_hyperparameter
        CompiledStep._instances += 1
        private = _private_copy(_step_with_scalars_as_operands, f"fused_step_{CompiledStep._instances}")
        self._compiled = torch.compile(private, backend=self._backend, fullgraph=True, dynamic=dynamic)
        dynamo_dispatches_foreach_to_modes()

    def _backend(self, graph_module, example_inputs):
        # A new graph is compiled before any of its step runs: when it would mix the elements of a
        # flat run of a group planned elementwise (a reduction that begins after the probes'
        # window), the step is refused here and the group's path chosen again (_late_reductions.py).
        for what, groups in graph_findings(graph_module, self.watched):
            raise LateReduction(groups, what)
        self.graphs += 1
        scheduler_pass = block_loops_pass() if BLOCK_LOOPS else None
        compile_graph = inductor_with_post_grad_pass(inductor_backend(), post_grad_pass(scheduler_pass is not None),
                                                     scheduler_pass)
        compiled = with_scalar_prologue(compile_graph, graph_module, example_inputs)
        if not self._agreed:  # compiled, and nothing of the step has run yet: the peers too?
            self._agreed = True
            failed = agree_on_the_first_compile(self.agree_over, None)
            if failed is not None:
                raise PeerCompileFailed(f"the compiled step failed on {failed}; every rank of the FSDP2 shard "
                                        "group takes the eager step, so that their all-reduces match")
        return compiled

    @staticmethod
    def eligible(optimizer) -> bool:
        if optimizer.defaults.get("differentiable"):
            return False
        return not any(group.get("fused") for group in optimizer.param_groups)

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        warnings.warn(
            f"the compiled fused step is off ({reason}); the eager fused step runs instead. "
            "Pass compile=False to fuse_optimizer to silence this.",
            CompileFallbackWarning,
            stacklevel=8,  # _disable <- _run_compiled <- __call__ <- _run_optimizer_step <- Fusion.step <- _fused_step <- hook wrapper <- user
        )

    def __call__(self, optimizer, raw_step, mode=None) -> bool:
        """Run ``raw_step`` compiled (under ``mode``, a torch function mode, if given); return
        False (having run nothing) if the eager step must run."""
        return self.disabled_reason is None and self._run_compiled(optimizer, raw_step, mode)

    def _run_compiled(self, optimizer, raw_step, mode) -> bool:
        changed = _changed_hyperparameter(optimizer, self._hyperparameters)
        if changed is not None:
            self._disable(f"{changed}, and compiled steps are known to follow only the floats schedules "
                          "change (lr, momentum, betas, weight_decay) exactly")
            return False
        graphs_before = self.graphs
        # Python ints (step counts) are symbols in the first graph: Dynamo would make a graph with
        # each as a constant, then another once it changed (1.5-2.8 s of BertAdam's and LAMB's first
        # three steps on BERT-base on a CPU, about a tenth; more on a GPU). Ints that never change
        # cost nothing as symbols: they are guarded as Dynamo would guard the constants.
        counters = list(_python_ints(optimizer)) if graphs_before == 0 else ()
        started = time.perf_counter()
        forget_float_specializations()
        floats_before = _python_floats(optimizer)
        try:
            with _groups_keep_capturable(optimizer), _single_tensor_groups(optimizer), torch.no_grad(), \
                    dynamo_recompile_limit(self.max_graphs + 1, self.graphs), \
                    math_pow_kept_symbolic(), ints_symbolic_from_the_first_graph(counters):
                floats = _float_hyperparameters(optimizer) if floats_need_a_direct_use() else ()
                self._compiled(optimizer, raw_step, mode, floats)
        except Exception as exc:  # fullgraph: a failure happens before any tensor is updated
            late = find_late_reduction(exc)
            if late is not None:  # refused by _backend: nothing ran; the caller plans the group again
                raise late from None
            failed = next((e for e in exception_chain(exc, implicit=False) if isinstance(e, ShardCollectiveError)),
                          None)
            if failed is not None:  # the ranks' all-reduce, not the compiler: the eager step would fail too
                raise failed from None
            peer = next((e for e in exception_chain(exc, implicit=False) if isinstance(e, PeerCompileFailed)), None)
            if peer is not None:
                self._disable(str(peer))
                return False
            if not self._agreed:  # this rank's first compile failed: the peers must not run theirs
                self._agreed = True
                agree_on_the_first_compile(self.agree_over, _describe(exc))
            self._disable(_describe(exc))
            return False
        written = _floats_written(floats_before, _python_floats(optimizer))
        if written:
            # Compiled code writes such floats back wrong once it has made them graph inputs, which
            # happens on a recompile (torch 2.13 and 2.14.1: a running sum ``group["weight_sum"] += w``
            # kept an old value from the third call on; 2.5.1: ``group["x"] = 1 / step`` read back
            # next step). The call that first shows the write has been right in every case seen (a
            # first graph, where the floats are constants); from the next step on, eager.
            places = ", ".join(f"{where} {key!r}" for where, key in written)
            self._disable(f"its step writes Python floats ({places}), which compiled code has been seen to "
                          "write back wrong on later steps")
        if self.graphs > graphs_before:
            self.compile_seconds += time.perf_counter() - started
            if self.graphs > self.max_graphs:
                self._disable(
                    f"it recompiled {self.graphs} times; some hyper-parameter or state value is "
                    "specialized by the compiler"
                )
        self.compiled_steps += 1
        return True


class CompiledFunction:
    """A pure tensor function run as Inductor kernels where that pays, else eagerly, same results.

    For code of our own that must run at memory speed (the communication codecs): ``fn`` is
    traced whole (``fullgraph=True``, so a failure happens before anything runs), compiled at
    most ``max_graphs`` times (one per distinct shape until Dynamo makes the shape dynamic),
    and replaced by ``fn`` itself, with one :class:`CompileFallbackWarning`, when compiling
    fails or keeps recompiling. ``fn`` must compute the same bits compiled and eager (no
    ``a * b + c`` whose rounding a fused multiply-add would change where results must agree
    across processes): a process that fell back then still agrees with one that did not.

    ``min_elements``: calls whose first tensor argument is smaller run eagerly (compile time
    outweighs the gain on small tensors); 0 compiles every call; None never compiles.

    ``recompute_reads``: let a kernel read that many more inputs before Inductor stores an
    intermediate that two loops use (a decoded mean that both the min/max loop and the quantize
    loop read) instead of computing it again in each. Only where compiled kernels keep ``a * b + c``
    as two roundings (CPU): two loops must compute the same bits, or a value could fall outside
    the range the first loop found.
    """

    _instances = 0

    def __init__(self, fn, min_elements: Optional[int] = AUTO_MIN_ELEMENTS, max_graphs: int = 8,
                 recompute_reads: int = 0):
        self.fn = fn
        self.min_elements = min_elements
        self.max_graphs = max_graphs
        self.recompute_reads = recompute_reads
        self.graphs = 0
        self.compiled_calls = 0
        self.last_ran_compiled = False  # whether the last call ran compiled (see ``like``)
        self.disabled_reason = None
        self._compilers_checked: set = set()  # device types whose compiler works
        CompiledFunction._instances += 1
        private = _private_copy(fn, f"{fn.__name__}_{CompiledFunction._instances}")
        self._compiled = torch.compile(private, backend=self._backend, fullgraph=True)

    def _backend(self, graph_module, example_inputs):
        self.graphs += 1
        if self.graphs > self.max_graphs:
            raise RuntimeError(f"{self.fn.__name__} recompiled {self.graphs} times")
        device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
        if self.recompute_reads and not compiled_kernels_may_fuse_multiply_add(device):
            patches = inductor_reads_thresholds_raised(self.recompute_reads)
            return inductor_backend()(graph_module, example_inputs, config_patches=patches)
        return inductor_backend()(graph_module, example_inputs)

    def wants_compiled(self, *args, like: Optional["CompiledFunction"] = None) -> bool:
        """Whether a call with ``args`` runs compiled: its first tensor has ``min_elements`` or more,
        or, with ``like``, ``like``'s last call ran compiled (see :meth:`__call__`)."""
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or self.min_elements is None:
            return False
        wanted = like.last_ran_compiled if like is not None else first.numel() >= self.min_elements
        return wanted and self._compiles_on(first.device.type)

    def _compiles_on(self, device_type: str) -> bool:
        if self.disabled_reason is not None:
            return False
        if device_type not in self._compilers_checked:  # decided by the release and the machine: asked once
            reason = compile_unavailable_reason(device_type=device_type)
            if reason is not None:
                self.disabled_reason = reason  # no warning
                return False
            self._compilers_checked.add(device_type)
        return True

    def __call__(self, *args, like: Optional["CompiledFunction"] = None):
        """``like``: run compiled where ``like``'s last call ran compiled, whatever the size of these
        arguments (the few small operations that finish a call of it, one compiled call rather than
        many eager ones)."""
        with torch.no_grad():
            wanted = self.wants_compiled(*args, like=like)
            self.last_ran_compiled = False
            if wanted:
                try:
                    with dynamo_recompile_limit(self.max_graphs + 1, self.graphs):
                        result = self._compiled(*args)
                    self.compiled_calls += 1
                    self.last_ran_compiled = True
                    return result
                except Exception as exc:  # fullgraph: nothing of this call ran
                    self.disabled_reason = _describe(exc)
                    warnings.warn(f"{self.fn.__name__} runs eagerly from now on (its compiled form failed: "
                                  f"{self.disabled_reason}); the results are the same", CompileFallbackWarning,
                                  stacklevel=3)
            return self.fn(*args)
