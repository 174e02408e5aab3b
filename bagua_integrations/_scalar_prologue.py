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
every call; Inductor then sees a plain load. CPU kernels only (see ``_hoistable``). The values are the ones eager computes (a Python
float in double precision, rounded to the compute type where the kernel uses it), and the rest
of the graph is unchanged.

Torch before 2.13 also gets a ``min``/``max`` of floats hoisted, for correctness: its C++
kernels evaluate them in int64 (``_torch_compat.cpu_kernels_truncate_float_min_max``).
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from ._torch_compat import cpu_kernels_truncate_float_min_max, inductor_reads_thresholds_raised

__all__ = ["with_scalar_prologue"]

# scalar math that is expensive per element
_TRANSCENDENTAL = {operator.pow, math.pow, math.exp, math.log, math.sqrt, math.sin, math.cos, math.tanh, math.log1p,
                   math.expm1}
# pure scalar arithmetic a prologue may replay
_PURE = _TRANSCENDENTAL | {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.floordiv,
                           operator.mod, abs, float, int, min, max, torch.sym_float, torch.sym_max, torch.sym_min}
# min/max of floats, which some torch releases' C++ kernels evaluate in int64 (wrong, not slow)
_MIN_MAX = {min, max, torch.sym_max, torch.sym_min}


def _is_symbolic_scalar(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), (torch.SymFloat, torch.SymInt, float, int))


def _big_tensor(node: torch.fx.Node) -> Optional[torch.Tensor]:
    value = node.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def _is_float_scalar(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), (torch.SymFloat, float))


def _hoistable(gm: torch.fx.GraphModule) -> List[torch.fx.Node]:
    """Scalar nodes to compute in the prologue, in graph order."""
    truncating_min_max = cpu_kernels_truncate_float_min_max()
    replayable: Dict[torch.fx.Node, bool] = {}
    expensive: Dict[torch.fx.Node, bool] = {}
    for node in gm.graph.nodes:  # topological order
        if node.op == "placeholder":
            replayable[node] = _is_symbolic_scalar(node)
            expensive[node] = False
        elif node.op == "call_function" and node.target in _PURE and _is_symbolic_scalar(node):
            inputs = node.all_input_nodes
            replayable[node] = all(replayable.get(a, False) for a in inputs)
            expensive[node] = (node.target in _TRANSCENDENTAL or any(expensive.get(a, False) for a in inputs)
                               or (truncating_min_max and node.target in _MIN_MAX and _is_float_scalar(node)))
        else:
            replayable[node] = expensive[node] = False
    chosen = []
    for node in gm.graph.nodes:
        if replayable[node] and expensive[node] and node.op != "placeholder":
            # CPU only: a GPU kernel evaluates such a scalar per thread at no memory cost, and a
            # prologue there would add a host-to-device copy per value (unmeasured on GPUs so far)
            feeds_tensor_op = any(user.op in ("call_function", "call_method") and _big_tensor(user) is not None
                                  and _big_tensor(user).device.type == "cpu" for user in node.users)
            if feeds_tensor_op:
                chosen.append(node)
    return chosen


def _prologue(gm: torch.fx.GraphModule, outputs: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
    """A graph over the same inputs that computes ``outputs`` (and nothing else)."""
    graph = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    needed = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


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


def _compute_dtype(user: torch.fx.Node) -> torch.dtype:
    value = _big_tensor(user)
    return torch.float64 if value is not None and value.dtype == torch.float64 else torch.float32


def with_scalar_prologue(compile_graph: Callable, gm: torch.fx.GraphModule, example_inputs: List) -> Callable:
    """``compile_graph(gm, example_inputs)`` with expensive scalar expressions moved to a Python prologue."""
    chosen = _hoistable(gm)
    if not chosen:
        return compile_graph(gm, example_inputs)
    prologue = _prologue(gm, chosen)
    gm, chosen = _copy(gm, chosen)  # Dynamo reads its own graph again after the backend returns
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs)
    graph = gm.graph
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    dtypes: List[Optional[torch.dtype]] = []
    extra_examples = []
    anchor = last_placeholder
    for index, node in enumerate(chosen):
        uses = [u for u in node.users if u.op in ("call_function", "call_method") and _big_tensor(u) is not None
                and _big_tensor(u).device.type == "cpu"]
        dtype = _compute_dtype(uses[0])
        device = _big_tensor(uses[0]).device
        dtypes.append(dtype)
        example = torch.zeros((), dtype=dtype, device=device)
        if fake_mode is not None:
            example = fake_mode.from_tensor(example)
        extra_examples.append(example)
        with graph.inserting_after(anchor):
            placeholder = graph.placeholder(f"bagua_hoisted_scalar_{index}")
        placeholder.meta["example_value"] = example
        placeholder._dynamo_source = None  # not a user value (as the graphs torch's DDP optimizer splits off)
        anchor = placeholder
        for user in uses:
            user.replace_input_with(node, placeholder)
    # (no eliminate_dead_code: FX would drop the step's in-place updates, which have no users;
    # the scalar nodes left unused are dropped by AOT/Inductor)
    graph.lint()
    gm.recompile()
    devices = [e.device for e in extra_examples]
    # the new inputs replace scalars that were computed in place (no buffer read): keep Inductor's
    # store-vs-recompute choices as they were without them
    patches = inductor_reads_thresholds_raised(len(chosen))
    compiled = compile_graph(gm, list(example_inputs) + extra_examples, config_patches=patches)

    def scalars_for(args) -> List[torch.Tensor]:
        values = prologue(*args)
        return [torch.tensor(float(v), dtype=d, device=dev) for v, d, dev in zip(values, dtypes, devices)]


    def run(*args):  # called like any backend's result (Dynamo boxes it itself)
        full = [*args, *scalars_for(args)]
        return compiled(*full)

    return run
