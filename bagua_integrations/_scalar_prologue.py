"""Scalar expressions of the step count, computed once per step in Python instead of per element.

A bias correction such as ``1 - beta1 ** step`` (a symbolic float of the step count in a
compiled step) divides a whole flat buffer. Inductor inlines such a scalar into the elementwise
kernel, which then evaluates it for every vector: a double ``pow`` per 16 floats, which the C++
compiler does not hoist out of the loop (libm calls may set ``errno``). On BERT-base LAMB that
doubled the step time.

:func:`with_scalar_prologue` is a backend wrapper: in the graph Dynamo hands over, it finds the
scalars that (a) are computed with ``pow``, ``exp``, ``log``, ... (b) only from the graph's
inputs (symbolic ints and floats: the step count, hyper-parameters) and constants, and (c) feed
a tensor operation. Those become new graph inputs, 0-dim tensors of the compute type (float32;
float64 beside float64 tensors) that a small Python prologue computes from the real inputs on
every call; Inductor then sees a plain load. CPU kernels only (see ``_hoistable``). The values
are the ones eager computes (a Python float in double precision, rounded to the compute type
where the kernel uses it), and the rest of the graph is unchanged.

The same holds for 0-dim tensor math: torch.optim keeps each step count as a 0-dim tensor, and
compiled its AdamW computes ``1 - beta ** step_t`` from it (BERT-base AdamW on a flat buffer: 95
ms a step with it in the kernel, 66-75 ms hoisted, on a 2-core CPU). The prologue replays that
math with the same tensor operations, in double precision, as eager torch.optim computes it (it
reads the step count with ``.item()`` and does its scalar math in Python floats): float32 math
there was far from eager where it cancels (RAdam's rectification, see :func:`_in_double`). It is
hoisted from every CPU kernel, whatever its size, for those numbers; a few eager calls a step. A
graph may write such a tensor (``step_t += 1``) before reading it: the prologue follows the
graph's order, replays a known in-place update out of place, and replays nothing more of a
tensor written or viewed otherwise.

Torch before 2.13 also gets a ``min``/``max`` of floats hoisted, for correctness: its C++
kernels evaluate them in int64 (``_torch_compat.cpu_kernels_truncate_float_min_max``), also
where only 0-dim tensor math reads it (pytorch-optimizer's AdaFactor scales its 0-dim rate by one),
and where scalar math the prologue cannot replay reads it (``lr * min(1.0, step / warmup)`` with a
scheduled rate, which Dynamo makes an input): there every use reads it back as a Python float.

GPU steps get no prologue; their 0-dim step-count math is done in double precision inside the
graph instead (:func:`_device_step_math_in_double`).
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

from ._torch_compat import (cpu_kernels_truncate_float_min_max, inductor_reads_thresholds_raised,
                            mark_placeholder_without_source, symbolic_sqrt_functions)

__all__ = ["with_scalar_prologue"]

# scalar math that is expensive per element
_TRANSCENDENTAL = {operator.pow, math.pow, math.exp, math.log, math.sqrt, math.sin, math.cos, math.tanh, math.log1p,
                   math.expm1, *symbolic_sqrt_functions()}
# pure scalar arithmetic a prologue may replay
_PURE = _TRANSCENDENTAL | {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.floordiv,
                           operator.mod, abs, float, int, min, max, torch.sym_float, torch.sym_max, torch.sym_min}
# min/max of floats, which some torch releases' C++ kernels evaluate in int64 (wrong, not slow)
_MIN_MAX = {min, max, torch.sym_max, torch.sym_min}


def _is_symbolic_scalar(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), (torch.SymFloat, torch.SymInt, float, int))


def _is_float_scalar(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), (torch.SymFloat, float))


def _zero_dim_cpu(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu" \
        and not value.requires_grad


# 0-dim tensor math a prologue may replay (torch.optim keeps its step counts as 0-dim tensors, and
# compiled computes its bias corrections from them: ``1 - beta1 ** step``), by FX target:
# functions, and method names for ``call_method`` nodes
_TENSOR_TRANSCENDENTAL = {operator.pow, torch.pow, torch.sqrt, torch.rsqrt, torch.exp, torch.log, torch.log1p,
                          torch.expm1, "pow", "sqrt", "rsqrt", "exp", "log", "log1p", "expm1"}
_TENSOR_PURE = _TENSOR_TRANSCENDENTAL | {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add, torch.sub, torch.mul,
    torch.div, torch.neg, torch.reciprocal, torch.rsub, "add", "sub", "mul", "div", "neg", "reciprocal", "rsub",
    "new_ones"}  # (``x.new_ones(())``: how a compiled step makes a Python number a 0-dim tensor, _compile.py)
# in-place updates of a 0-dim tensor (``step_t += 1``): the prologue computes the new value without
# writing it (the compiled graph still does), and later reads of the tensor see that value
_TENSOR_IN_PLACE = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                    operator.itruediv: operator.truediv, "add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div"}
def _tensor_result(node: torch.fx.Node, zero_dim: bool) -> Optional[torch.Tensor]:
    value = node.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) and (zero_dim or value.dim() > 0) else None


# node.meta key: a hoisted scalar that replaces the Python scalar in 0-dim tensor operations too
_INTO_ZERO_DIM = "bagua_hoisted_into_zero_dim_ops"
# node.meta key: a hoisted scalar that every use reads back as a Python float (``.item()`` of a
# float64 input), where scalar math that cannot be replayed reads it (see _hoistable)
_AS_ITEM = "bagua_hoisted_as_item"


def _users_feeding_cpu_tensor_ops(node: torch.fx.Node, zero_dim: bool = False) -> List[torch.fx.Node]:
    """The tensor operations over CPU tensors (``zero_dim``: 0-dim ones too) that read ``node``.

    CPU only: a GPU kernel evaluates such a scalar per thread at no memory cost, and a prologue
    there would add a host-to-device copy per value (unmeasured on GPUs so far)."""
    return [user for user in node.users if user.op in ("call_function", "call_method")
            and (value := _tensor_result(user, zero_dim)) is not None and value.device.type == "cpu"]


_VIEWS = {"view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "squeeze", "unsqueeze", "flatten",
          "unflatten", "select", "narrow", "t", "transpose", "permute", "movedim", "detach", "to", "type", "type_as",
          "contiguous", "as_strided", "unbind", "split", "chunk", "__getitem__", "getitem", "alias", "diagonal",
          "view_as_real", "real", "imag", "requires_grad_", "share_memory_", "set_"}


def _name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _reaches_cpu_kernels_through_scalars(node: torch.fx.Node) -> bool:
    """Whether scalar math over ``node`` (not ``node`` itself) feeds CPU tensor operations."""
    pending = [user for user in node.users if _is_symbolic_scalar(user)]
    seen = set()
    while pending:
        user = pending.pop()
        if user in seen:
            continue
        seen.add(user)
        if _users_feeding_cpu_tensor_ops(user, zero_dim=True):
            return True
        pending.extend(u for u in user.users if _is_symbolic_scalar(u))
    return False


def _written_or_aliased(node: torch.fx.Node) -> List[torch.fx.Node]:
    """The nodes whose tensors ``node`` may write or take a view of (conservatively: an in-place
    call's first argument, ``out=``, a view's base)."""
    name = _name(node.target)
    first = node.args[0] if node.args else None
    touched = []
    if name.endswith("_") or name.startswith("__i") or name in _VIEWS:
        touched.append(first)
    touched.append(node.kwargs.get("out"))
    found = []
    for value in touched:
        torch.fx.node.map_arg(value, found.append)
    return found


def _in_double(prologue: torch.fx.Graph, value: torch.fx.Node, node: torch.fx.Node) -> torch.fx.Node:
    """``value`` (a 0-dim input of the prologue) as float64 where it is a lower-precision float.

    Why: eager torch.optim reads a step count with ``.item()`` and computes its scalars in Python
    floats, in double precision; compiled, they are 0-dim float32 tensor math. Where that math
    cancels, float32 is far from eager: RAdam's length of the approximated SMA,
    ``rho_inf - 2 * step * beta2 ** step / (1 - beta2 ** step)``, is about 6 at its first rectified
    step, a difference of two numbers near 2000, and its rectification came out ~1e-3 off (1.7e-4
    relative in the parameters after one step, as ``torch.compile(opt.step)`` gives). Replayed in
    double precision and rounded once where a kernel reads them, the values are eager's."""
    example = node.meta.get("example_value")
    if not example.is_floating_point() or example.dtype == torch.float64:
        return value
    return prologue.call_method("to", (value, torch.float64))


def _hoistable(gm: torch.fx.GraphModule) -> Tuple[List[torch.fx.Node], torch.fx.GraphModule]:
    """Scalar nodes to compute in the prologue, in graph order, and the prologue: a graph over the
    same inputs that computes them.

    Python scalars (symbolic ints and floats) cannot change inside the graph. 0-dim tensors can: the
    scan follows the graph in the order the step ran, replays a known in-place update of one
    (``step_t += 1``) out of place (the graph still writes it), so that later reads see the value
    the graph would, and stops replaying a tensor that anything else may write or take a view of.
    A tensor ever written is never hoisted itself (a hoisted value replaces every read of it)."""
    truncating_min_max = cpu_kernels_truncate_float_min_max()
    prologue = torch.fx.Graph()
    env: Dict[torch.fx.Node, Optional[torch.fx.Node]] = {}  # node -> its value in the prologue (None: not replayable)
    root: Dict[torch.fx.Node, torch.fx.Node] = {}  # an in-place call's result -> the tensor it updated
    expensive: Dict[torch.fx.Node, bool] = {}
    truncated: Dict[torch.fx.Node, bool] = {}  # a float min/max that C++ kernels would truncate, or of one
    tensors, written = set(), set()  # 0-dim tensor nodes; those written (or viewed) somewhere

    def value_of(arg):
        return env.get(root.get(arg, arg)) if isinstance(arg, torch.fx.Node) else arg

    def replayable(node) -> bool:
        return all(value_of(a) is not None for a in node.all_input_nodes)

    for node in gm.graph.nodes:  # topological order: the order the step ran in
        expensive[node] = False
        if node.op == "placeholder":
            env[node] = prologue.node_copy(node)  # (every input, so that the prologue takes the same arguments)
            if _zero_dim_cpu(node):
                tensors.add(node)
                env[node] = _in_double(prologue, env[node], node)
            elif not _is_symbolic_scalar(node):
                env[node] = None
            continue
        if node.op == "get_attr":  # a tensor Dynamo holds as an attribute (an optimizer's state, its step count)
            env[node] = _in_double(prologue, prologue.node_copy(node), node) if _zero_dim_cpu(node) else None
            if env[node] is not None:
                tensors.add(node)
            continue
        inputs = node.all_input_nodes
        target, is_call = node.target, node.op in ("call_function", "call_method")
        env[node] = None
        if node.op == "call_function" and target in _PURE and _is_symbolic_scalar(node) and replayable(node):
            env[node] = prologue.node_copy(node, value_of)
            truncated[node] = (truncating_min_max and target in _MIN_MAX and _is_float_scalar(node)) or any(
                truncated.get(a, False) for a in inputs)
            expensive[node] = target in _TRANSCENDENTAL or any(expensive.get(a, False) for a in inputs) \
                or truncated[node]
            continue
        if is_call and _zero_dim_cpu(node) and target in _TENSOR_PURE and not node.kwargs and replayable(node):
            env[node] = prologue.create_node(node.op, target, tuple(map(value_of, node.args)))
            expensive[node] = target in _TENSOR_TRANSCENDENTAL or any(expensive.get(a, False) for a in inputs)
            tensors.add(node)
            continue
        updated = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        updated = root.get(updated, updated)
        if (is_call and target in _TENSOR_IN_PLACE and updated in tensors and _zero_dim_cpu(node)
                and not node.kwargs and replayable(node)):
            # the new value, out of place; the call's result is the tensor it updated
            env[updated] = prologue.create_node(node.op, _TENSOR_IN_PLACE[target], tuple(map(value_of, node.args)))
            expensive[updated] = expensive[updated] or any(expensive.get(a, False) for a in inputs)
            root[node] = updated
            written.add(updated)
            continue
        for touched in _written_or_aliased(node):  # written or viewed otherwise: not replayed from here on
            touched = root.get(touched, touched)
            if touched in tensors:
                env[touched] = None
                written.add(touched)
    # A 0-dim tensor feeds a kernel directly or through more 0-dim math; where that math cannot be
    # replayed (it reads a learning rate that Dynamo made a graph input: ``lr_t.item()``), the values
    # it starts from are hoisted, and the cheap rest stays in the kernel.
    feeds: Dict[torch.fx.Node, bool] = {}
    for node in reversed(gm.graph.nodes):
        feeds[node] = bool(_users_feeding_cpu_tensor_ops(node)) or any(
            feeds.get(user, False) for user in node.users if _zero_dim_cpu(user))
    chosen, outputs = [], []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") or env.get(node) is None or not expensive[node] or node in written:
            continue
        if node in tensors:
            hoist = feeds[node] and any(env.get(user) is None for user in node.users)
        else:  # (a truncated min/max is wrong in any C++ kernel: 0-dim tensor math reads the hoisted value too)
            hoist = bool(_users_feeding_cpu_tensor_ops(node, zero_dim=truncated.get(node, False)))
            if hoist:
                node.meta[_INTO_ZERO_DIM] = truncated.get(node, False)
            if truncated.get(node, False) and _reaches_cpu_kernels_through_scalars(node):
                # Scalar math that cannot be replayed reads it (``lr * min(1.0, step / warmup)``, with a
                # learning rate Dynamo made an input): Inductor would inline the min/max into the
                # kernel with it. Every use reads the hoisted value back as a Python float instead.
                hoist = node.meta[_AS_ITEM] = True
        if hoist:
            chosen.append(node)
            outputs.append(env[node])
    prologue.output(tuple(outputs))
    prologue.eliminate_dead_code()  # (every node in it is pure)
    return chosen, torch.fx.GraphModule(gm, prologue)  # (its attributes: the very tensors of gm's)


def _copy(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]):
    """A new GraphModule with a copy of ``gm``'s graph (and Dynamo's attributes), and ``nodes`` in it."""
    graph = torch.fx.Graph()
    mapping: Dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, mapping)
    graph.output(out)
    for old, new in mapping.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    copy = torch.fx.GraphModule(gm, graph)
    for key, value in gm.__dict__.items():  # _param_name_to_source, shape_env, meta, ...
        copy.__dict__.setdefault(key, value)
    return copy, [mapping[n] for n in nodes]


def _compute_dtype(value: torch.Tensor) -> torch.dtype:
    return torch.float64 if value.dtype == torch.float64 else torch.float32


_COMPARISONS = {operator.gt, operator.lt, operator.ge, operator.le, torch.gt, torch.lt, torch.ge, torch.le,
                "gt", "lt", "ge", "le"}


def _zero_dim_float32_on_device(node) -> bool:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float32 \
        and value.device.type == "cuda" and not value.requires_grad  # (MPS has no float64)


def _device_step_math_in_double(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` (a copy, where anything changes) with 0-dim float32 math on GPU tensors done in float64.

    Why: Dynamo moves torch.optim's step counts to the parameters' GPU to trace a step (its
    ``capturable`` formulation), so the step-count math that eager torch.optim does in Python
    doubles is float32 0-dim tensor math inside the graph, which the prologue (CPU only: a GPU
    kernel reads a scalar per thread at no memory cost) does not replay. Where it cancels it is
    far from eager: RAdam's rectification, and its parameters 1.6e-6 of their largest value off
    unfused after 12 steps on an H200 (the CPU fix of :func:`_in_double`). Here each 0-dim float32
    value such math reads (a step count, a ``new_ones``) is read as float64, the pure math that
    follows is float64 by type promotion, and its result is rounded to float32 once, where
    anything else (a kernel over a buffer, a state write, the graph's outputs) reads it; a
    comparison reads the double. The values kernels read are eager's; no launch is added (the
    scalar math is a few more instructions per GPU thread). Left as it is where such a value is
    written in place or viewed."""
    pure, sources = [], set()
    for node in gm.graph.nodes:
        if (node.op in ("call_function", "call_method") and node.target in _TENSOR_PURE and not node.kwargs
                and _zero_dim_float32_on_device(node)
                and all(_zero_dim_float32_on_device(a) or not isinstance(a.meta.get("example_value"), torch.Tensor)
                        for a in node.all_input_nodes)):
            pure.append(node)
    if not pure:
        return gm
    promoted = set(pure)
    for node in pure:
        if any(user not in promoted and node in _written_or_aliased(user) for user in node.users):
            return gm  # written in place or viewed: its uses are not followed
        sources.update(a for a in node.all_input_nodes if a not in promoted and _zero_dim_float32_on_device(a))
    gm, mapping = _copy(gm, [*pure, *sources])
    graph = gm.graph
    new_pure = set(mapping[:len(pure)])
    for source in mapping[len(pure):]:
        for user in [u for u in source.users if u in new_pure]:
            with graph.inserting_before(user):
                as_double = graph.call_method("to", (source, torch.float64))
            user.replace_input_with(source, as_double)
    for node in new_pure:
        for user in [u for u in node.users if u not in new_pure and u.target not in _COMPARISONS]:
            with graph.inserting_before(user):
                rounded = graph.call_method("to", (node, torch.float32))
            user.replace_input_with(node, rounded)
    graph.lint()
    gm.recompile()
    return gm


def _reads_python_ints(node: torch.fx.Node) -> bool:
    """Whether ``node`` is computed from a symbolic Python int input (a step count). Only those are
    printed into a kernel as a symbolic min/max: one of floats read from tensors (torch.optim's
    Adafactor, ``min(lr, 1 / step_t.item() ** 0.5)``) becomes tensor math, computed right."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder" and isinstance(current.meta.get("example_value"), torch.SymInt):
            return True
        pending.extend(current.all_input_nodes)
    return False


class FloatMinMaxInKernel(RuntimeError):
    """A ``min``/``max`` of floats that a C++ kernel of this torch release would compute wrong."""


def _refuse_float_min_max_in_cpu_kernels(gm: torch.fx.GraphModule) -> None:
    """Raise :class:`FloatMinMaxInKernel` where a ``min``/``max`` of floats the prologue could not
    compute (one of the step count and a learning rate Dynamo made an input: ``min(lr * 10, step / 3)``)
    still reaches a CPU kernel of a torch release that evaluates it in int64 there (silently wrong:
    0.28 relative after six steps on torch 2.11). The compiled step falls back to the eager one."""
    if not cpu_kernels_truncate_float_min_max():
        return
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _MIN_MAX and _is_float_scalar(node) and _reads_python_ints(node) \
                and (_users_feeding_cpu_tensor_ops(node, zero_dim=True) or _reaches_cpu_kernels_through_scalars(node)):
            where = (node.meta.get("stack_trace") or "").strip().splitlines()[-1:] or [node.name]
            raise FloatMinMaxInKernel(
                f"torch {torch.__version__} computes a min()/max() of floats in its C++ kernels in int64, and this "
                f"step's `{where[0].strip()}` mixes the step count with a value the compiled step keeps as an input "
                "(a scheduled rate); torch 2.13 or later compiles it exactly")


def with_scalar_prologue(compile_graph: Callable, gm: torch.fx.GraphModule, example_inputs: List) -> Callable:
    """``compile_graph(gm, example_inputs)`` with expensive scalar expressions moved to a Python
    prologue (CPU kernels), and GPU step-count math in double precision."""
    gm = _device_step_math_in_double(gm)
    chosen, prologue = _hoistable(gm)
    if not chosen:
        _refuse_float_min_max_in_cpu_kernels(gm)
        return compile_graph(gm, example_inputs)
    gm, chosen = _copy(gm, chosen)  # Dynamo reads its own graph again after the backend returns
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs)
    graph = gm.graph
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    dtypes: List[torch.dtype] = []
    extra_examples = []
    anchor = last_placeholder
    for index, node in enumerate(chosen):
        zero_dim = node.meta.get("example_value")
        zero_dim = zero_dim if isinstance(zero_dim, torch.Tensor) else None
        if zero_dim is not None:  # every read of it takes the hoisted value (same dtype: promotion unchanged)
            uses, dtype, device = list(node.users), zero_dim.dtype, zero_dim.device
        elif node.meta.get(_AS_ITEM, False):  # every use reads it back, as the Python float it was
            uses, dtype, device = [], torch.float64, torch.device("cpu")
        else:  # a Python scalar becomes a tensor of the compute type, where tensor operations read it
            zero_dim_uses = node.meta.get(_INTO_ZERO_DIM, False)
            uses = _users_feeding_cpu_tensor_ops(node, zero_dim=zero_dim_uses)
            first = _tensor_result(uses[0], zero_dim_uses)
            dtype, device = _compute_dtype(first), first.device
        dtypes.append(dtype)
        example = torch.zeros((), dtype=dtype, device=device)
        if fake_mode is not None:
            example = fake_mode.from_tensor(example)
        extra_examples.append(example)
        with graph.inserting_after(anchor):
            placeholder = graph.placeholder(f"bagua_hoisted_scalar_{index}")
        placeholder.meta["example_value"] = example
        mark_placeholder_without_source(placeholder, index)  # not a user value (as the graphs torch's DDP optimizer splits off)
        anchor = placeholder
        for user in uses:
            user.replace_input_with(node, placeholder)
        if node.meta.get(_AS_ITEM, False):
            with graph.inserting_before(node):
                as_float = graph.call_method("item", (placeholder,))
            as_float.meta["example_value"] = node.meta.get("example_value")
            node.replace_all_uses_with(as_float)
    # (no eliminate_dead_code: FX would drop the step's in-place updates, which have no users;
    # the scalar nodes left unused are dropped by AOT/Inductor)
    graph.lint()
    gm.recompile()
    _refuse_float_min_max_in_cpu_kernels(gm)
    devices = [e.device for e in extra_examples]
    # the new inputs replace scalars that were computed in place (no buffer read): keep Inductor's
    # store-vs-recompute choices as they were without them
    patches = inductor_reads_thresholds_raised(len(chosen))
    compiled = compile_graph(gm, list(example_inputs) + extra_examples, config_patches=patches)

    def scalars_for(args) -> List[torch.Tensor]:
        values = prologue(*args)
        # (0-dim tensor math was replayed in double precision: rounded once, to the graph's dtype)
        return [v.to(d) if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=d, device=dev)
                for v, d, dev in zip(values, dtypes, devices)]


    def run(*args):  # called like any backend's result (Dynamo boxes it itself)
        full = [*args, *scalars_for(args)]
        return compiled(*full)

    return run
