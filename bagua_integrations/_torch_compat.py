"""Every use of torch's private API, in one place.

Each function here reaches into something torch does not promise to keep. They are
collected so that a new torch release breaks *this* module, loudly, instead of silently
changing the math somewhere else: ``tests/test_torch_compat.py`` exercises each one on the
installed torch and fails with the function's name if the private API moved.

The tested releases are ``noxfile.py``'s ``TORCH_VERSIONS`` (2.5.1 - 2.14.1; each runs the core
suites in its own venv, ``python -m nox``); ``CHECKED_ON`` is the newest of them. Version branches
compare ``_RELEASE`` (the installed release without its
local ``+cpu``/``+cu130`` part) and name the releases they cover.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import math
import operator
import os
import re
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch

CHECKED_ON = "2.14.1"

_RELEASE = torch.torch_version.TorchVersion(torch.__version__.split("+")[0])

__all__ = [
    "CHECKED_ON",
    "compiled_steps_unsupported",
    "start_cpu_vector_isa_checks",
    "start_precompiling_cpu_kernel_header",
    "inductor_checked_cpu_vector_isas",
    "unwrapped_step",
    "forget_float_specializations",
    "floats_need_a_direct_use",
    "floats_used_directly",
    "queue_end_of_backward",
    "inductor_backend",
    "inductor_reads_thresholds_raised",
    "inductor_with_post_grad_pass",
    "block_loops_pass",
    "cpu_kernels_truncate_float_min_max",
    "symbolic_sqrt_functions",
    "mark_placeholder_without_source",
    "compiled_kernels_may_fuse_multiply_add",
    "dynamo_recompile_limit",
    "ints_symbolic_from_the_first_graph",
    "step_keeping_lr_scheduler_marker",
    "mark_step_taken",
    "tensor_version",
    "tensor_versions",
    "math_pow_kept_symbolic",
    "register_state_dict_post_hook",
    "dynamo_dispatches_foreach_to_modes",
    "default_store",
    "process_group_timeout",
    "gloo_honours_collective_timeouts",
    "all_reduce_with_timeout",
    "drop_group_defaults_kept_by_torch",
    "aten_operator_packet",
    "size_hint",
    "exception_chain",
    "dtensor_over",
    "fsdp2_shard_pointers",
]


def compiled_steps_unsupported(path: str = "elementwise") -> "str | None":
    """Why this torch release cannot compile the fused steps of ``path`` sanely, or None.

    ``path`` is a param group's path (``_paths``): "elementwise" (the optimizer's own step over
    flat runs), "segmented" (the same under ``_segmented.SegmentedMode``, a torch function mode)
    or "per-tensor" (its own step, one parameter per call). Decided from the release, before any
    step; the exact eager step of that path runs instead. Checked on 2.5.1, 2.6.0, 2.8.0, 2.9.1,
    2.10.0, 2.11.0:

    * before 2.6, every path: Dynamo specializes every Python float a compiled function reads
      (``torch._dynamo.config.specialize_float``), so each new learning rate of a schedule
      compiles a new graph; its ``specialize_float=False`` mode fails its own guards on floats.
    * "segmented" before 2.11: Dynamo does not trace the mode's ``func in <set of functions>``
      (before 2.9), nor ``torch._C._group_tensors_by_device_and_dtype`` inside a mode (what
      ``clip_grad_norm_(foreach=True)`` calls: BertAdam; before 2.11).
    * "per-tensor" before 2.10: Dynamo does not trace ``Tensor.item()`` without
      ``capture_scalar_outputs``, which the optimizers on that path read (``torch.optim.Adafactor``).
    """
    if _RELEASE < "2.6":
        return (f"torch {_RELEASE} recompiles for every new float hyper-parameter (a learning-rate "
                "schedule would recompile each step); compiled fused steps need torch >= 2.6")
    if path == "segmented" and _RELEASE < "2.11":
        return (f"torch {_RELEASE} cannot compile a step under the segmented path's torch function mode "
                "(clip_grad_norm_'s foreach grouping, set lookups); compiled segmented steps need torch >= 2.11")
    if path == "per-tensor" and _RELEASE < "2.10":
        return (f"torch {_RELEASE} cannot compile a step that reads Tensor.item(); compiled per-tensor steps "
                "need torch >= 2.10")
    return None


def unwrapped_step(cls) -> Tuple[Callable, bool]:
    """``cls.step`` without torch's profiling/hook wrapper and its grad-mode wrapper.

    Returns ``(step, strips_grad_mode)``. Private: torch marks its hook wrapper with
    ``hooked`` (``Optimizer._patch_step_function``) and the grad-mode wrapper is the inner
    function ``_use_grad`` of ``torch/optim/optimizer.py``, recognised by its code name.
    The grad-mode wrapper graph-breaks on purpose (so that Dynamo traces an inference graph);
    callers get the same effect by setting the grad mode themselves, which keeps
    ``fullgraph=True`` possible.
    """
    fn = cls.step
    if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_name == "_use_grad" and code.co_filename.endswith(os.path.join("optim", "optimizer.py")):
        return fn.__wrapped__, True
    return fn, False


def forget_float_specializations() -> None:
    """Clear Dynamo's process-wide memory of floats it had to specialize.

    Private: ``torch._dynamo.symbolic_convert.TensorifyState`` remembers, by symbolic name
    ("zf0", ...), floats that once had to be specialized and applies that to every later
    frame: one optimizer whose step branches on a float would make every other optimizer
    recompile on each new learning rate. Torch releases without it need nothing.
    """
    try:
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:
        return
    TensorifyState.clear()


# Torch 2.6 - 2.12: the tensorify pass counts a float input as tensorified only where the float
# itself is an argument of a tensor op (2.13 counts the free symbols of the argument). Checked on
# 2.6.0 and 2.11.0 (and fixed on 2.13.0, 2.14.1); 2.12 unchecked, where a direct use is harmless.
_TENSORIFY_MISSES_FLOATS_IN_EXPRESSIONS = "2.6" <= _RELEASE < "2.13"


def floats_need_a_direct_use() -> bool:
    """Whether compiled steps must call :func:`floats_used_directly` (torch 2.6 - 2.12)."""
    return _TENSORIFY_MISSES_FLOATS_IN_EXPRESSIONS


def floats_used_directly(values, device=None) -> "torch.Tensor | None":
    """Called inside a compiled step with the step's float hyper-parameters (``lr``, ``betas``...):
    on torch 2.6 - 2.12, a 0-dim tensor that uses each of them directly (the step returns it, so it
    stays in the graph); elsewhere None, doing nothing.

    Private: Inductor's ``torch.fx.passes._tensorify_python_scalars`` turns a float input that
    Dynamo made symbolic into a 0-dim tensor input, but before torch 2.13 it records as
    tensorified only floats that are themselves an argument of a tensor op. A float reached only
    through an expression (SGD's ``alpha=-lr``, ``1 - lr * weight_decay``) is specialized by the
    restart that follows: every new learning rate compiles a new graph and the compiled step
    switches itself off. One direct use (``0 * lr``, a few scalar flops per step) marks the float
    as tensorified; the expressions are tensorified as before.

    The tensor is made on ``device``, the step's: a CPU one in a GPU step's graph is a C++ kernel,
    and its first compile in a process builds Inductor's whole CPU toolchain (checks of the
    host's vector instructions, a precompiled header, a dozen compiler runs: about 30 s of a
    45-70 s first compiled step on an H200 with torch 2.11).
    """
    if not _TENSORIFY_MISSES_FLOATS_IN_EXPRESSIONS or not values:
        return None
    anchor = torch.zeros((), device=device)
    for value in values:
        anchor = torch.mul(anchor, value)
    return anchor


def _math_pow_as_operator(x, y):
    # float ** float is C pow, as math.pow is; Dynamo traces it symbolically
    return float(x) ** float(y)


@contextmanager
def math_pow_kept_symbolic():
    """While a compiled step is traced and run, ``math.pow`` is ``float(x) ** float(y)``.

    Dynamo evaluates ``math.pow`` on the traced values and guards on the result, so an optimizer
    that keeps its step count as a Python int in its param group and computes a bias correction
    with ``math.pow(beta, group["step"])`` (pytorch-optimizer's ``debias``, for one) recompiles
    on every step and switches the compiled step off after a few. ``**`` stays symbolic. Both
    call C ``pow`` on doubles, so the values are the same; ``math.pow``'s errors (a negative base
    with a fractional exponent) are not raised inside the compiled step. The attribute is set
    around every call of the compiled step (Dynamo's guards see it on each call) and restored
    after; another thread calling ``math.pow`` meanwhile gets the same value.
    """
    original = math.pow
    math.pow = _math_pow_as_operator
    try:
        yield
    finally:
        math.pow = original


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (what DDP's reducer does).

    Private: ``Variable._execution_engine.queue_callback``; only valid inside backward.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def inductor_backend() -> Callable:
    """Inductor's ``compile_fx``, used as a counting ``torch.compile`` backend (private module path)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


def inductor_with_post_grad_pass(compile_graph: Callable, graph_pass, scheduler_pass=None) -> Callable:
    """``compile_graph`` (``compile_fx``, possibly called with ``config_patches=``) that runs
    ``graph_pass`` as Inductor's ``post_grad_custom_pre_pass`` on the functional graph, and
    ``scheduler_pass`` as its ``_pre_fusion_custom_pass`` on the scheduler's nodes. A pass that is
    None, or whose place holds a pass the user set (which is kept), is left out."""
    from torch._inductor import config

    patches = {}
    if graph_pass is not None and getattr(config, "post_grad_custom_pre_pass", None) is None:
        patches["post_grad_custom_pre_pass"] = graph_pass
    if scheduler_pass is not None and getattr(config, "_pre_fusion_custom_pass", None) is None:
        patches["_pre_fusion_custom_pass"] = scheduler_pass
    if not patches:
        return compile_graph

    def compile_with_pass(gm, example_inputs, config_patches=None):
        return compile_graph(gm, example_inputs, config_patches=dict(config_patches or {}, **patches))

    return compile_with_pass


@functools.lru_cache(maxsize=None)  # one pass object for every graph (it keeps no state between calls)
def block_loops_pass():
    """An Inductor scheduler pass (``_pre_fusion_custom_pass``) that lets a CPU kernel store what
    it computes in the same loop that reduces it per block; None where torch has no such pass.

    A segmented step reduces each *block* of a run (``(blocks, block)``: one value per block) and
    also stores values of the run's length (LAMB's moments, read again by its norms). Inductor's C++
    backend merges a contiguous pointwise loop into one loop of the run's length, which it cannot
    fuse with the ``(blocks)`` x ``(block)`` reduction: the moments are then computed twice and their
    inputs read twice from memory. This pass gives each such pointwise loop the reduction's shape
    (``(blocks, block)``, kept from merging), so Inductor fuses both into one loop over the blocks,
    the block's values still in the L1 cache when they are stored. The values and their rounding are
    unchanged (the same expressions, evaluated once); only which loop evaluates them moves.

    Private: Inductor's scheduler nodes (``group``, ``get_default_sizes_body``,
    ``recompute_size_and_body`` with ``recompute_sizes_body_func``, as the C++ backend's own loop
    split uses them), ``LoopBody`` and ``CustomSchedulerPass`` (which keys the FX graph cache by
    :meth:`uuid`). A node this cannot reshape is left as Inductor built it. Checked on torch 2.13 and
    2.14; torch 2.11 lacks ``CustomSchedulerPass`` (its loops stay as Inductor builds them).
    """
    try:
        from torch._inductor import config, dependencies, ir
        from torch._inductor.custom_graph_pass import CustomSchedulerPass
        from torch._inductor.scheduler import SchedulerNode
    except ImportError:
        return None
    if not hasattr(config, "_pre_fusion_custom_pass") or not hasattr(SchedulerNode, "snapshot_loop_state"):
        return None

    def constant(size) -> Optional[int]:
        try:
            return int(size)
        except TypeError:  # symbolic
            return None

    def block_shapes(nodes) -> dict:
        """Run length -> (blocks, block) of the one-dimensional per-block reductions on the CPU."""
        found: dict = {}
        for node in nodes:
            if type(node) is SchedulerNode and node.is_reduction() and node.get_device().type == "cpu":
                _, (index, reduce) = node.group
                if len(index) == 1 and len(reduce) == 1:
                    blocks, block = constant(index[0]), constant(reduce[0])
                    if blocks and block and block >= 16:
                        found.setdefault(blocks * block, set()).add((blocks, block))
        return {length: shapes.pop() for length, shapes in found.items() if len(shapes) == 1}

    def split_into(blocks: int, block: int):
        def split(sizes, body, variables):
            (index_size, reduce_size), (_, reduce_vars) = sizes, variables
            (new_vars, _), var_ranges = dependencies.index_vars_no_squeeze([blocks, block], reduce_size, prefix="y")
            flat = block * new_vars[0] + new_vars[1]
            # the default loop's one dimension of the run's length (size-1 dimensions index 0)
            old_vars = [flat if constant(size) != 1 else 0 for size in index_size]
            body = ir.LoopBody(body, [old_vars, reduce_vars], var_ranges, new_vars, reduce_vars)
            return ([blocks, block], reduce_size), body, (new_vars, reduce_vars)

        return split

    def reshape(node, blocks: int, block: int) -> None:
        (index_size, reduce_size), _, _ = node.node.get_default_sizes_body()
        if reduce_size or [constant(size) for size in index_size].count(1) != len(index_size) - 1:
            return
        (new_vars, _), var_ranges = dependencies.index_vars_no_squeeze([blocks, block], [], prefix="y")
        # the extra index ``y0`` (one value per block) keeps Inductor from merging the two loops again
        # (torch >= 2.14 takes them as ``ExtraIndexingConstraints``, earlier as a tuple)
        constraints = getattr(ir, "ExtraIndexingConstraints", lambda *args: args)(var_ranges, [new_vars[0]])
        state = node.snapshot_loop_state()
        try:
            node.recompute_size_and_body(extra_indexing_constraints=constraints,
                                         recompute_sizes_body_func=split_into(blocks, block))
            # Its reads named again as the scheduler named them: a read of a buffer written earlier
            # in the graph (an input stored early, ``stores_early``) is a read of that write.
            # ``recompute_size_and_body`` renames only nodes that also have fake dependencies; without
            # this, the node read the input as it was before the write, and the scheduler put it in
            # a loop before the store (pytorch-optimizer's FAdam and LARS, compiled: silent errors).
            node.set_read_writes(node.read_writes.rename(node.mutation_renames))
            ok = tuple(constant(size) for size in node.group[1][0]) == (blocks, block)
        except Exception:  # an Inductor whose nodes differ: keep its own loop
            ok = False
        if not ok:
            node.restore_loop_state(state)

    class BlockLoops(CustomSchedulerPass):
        def __call__(self, nodes):
            shapes = block_shapes(nodes)
            for node in nodes if shapes else ():
                if type(node) is SchedulerNode and not node.is_reduction() and node.get_device().type == "cpu" \
                        and isinstance(node.node, ir.ComputedBuffer):
                    _, (index, reduce) = node.group
                    if len(index) == 1 and not reduce and constant(index[0]) in shapes:
                        reshape(node, *shapes[constant(index[0])])
            return nodes

        def uuid(self):
            return "bagua-block-loops-2"  # (2: reads keep the scheduler's names)

    return BlockLoops()


def inductor_reads_thresholds_raised(extra_reads: int) -> dict:
    """``compile_fx`` config patches that let each kernel read ``extra_reads`` more buffers before
    Inductor stores an intermediate instead of recomputing it.

    Private: Inductor's ``realize_reads_threshold`` (a pointwise value used twice is stored when
    it reads more than 4 buffers) and ``realize_acc_reads_threshold`` (its CPU default:
    ``realize_cpu_acc_reads_threshold``). Hoisted scalars (``_scalar_prologue``) are 0-dim
    inputs that used to be computed in place and counted as no read; without this, LAMB's update
    (4 reads + 2 bias corrections) is written to a fresh 350 MB buffer every step instead of
    being recomputed in the two kernels that use it. Checked on torch 2.13.
    """
    from torch._inductor import config

    acc = config.realize_acc_reads_threshold
    if acc is None:
        acc = getattr(config, "realize_cpu_acc_reads_threshold", config._realize_acc_reads_threshold_default)
    return {
        "realize_reads_threshold": config.realize_reads_threshold + extra_reads,
        "realize_acc_reads_threshold": acc + extra_reads,
    }


def mark_placeholder_without_source(node, index: int) -> None:
    """Mark a graph input our compile backend adds (the ``index``-th hoisted scalar) as holding no
    user value.

    Private: Dynamo's ``_dynamo_source`` on FX placeholders, read by AOTAutograd, which requires it
    on every placeholder. Torch >= 2.6 (``_functorch/_aot_autograd/frontend_utils.py``) accepts
    ``None`` for any number of them (as DDPOptimizer's split graphs have); torch 2.5 refuses a
    second ``None``, so there each gets a source of its own name (used only to name it)."""
    try:
        importlib.import_module("torch._functorch._aot_autograd.frontend_utils")
    except ImportError:
        from torch._dynamo.source import LocalSource

        node._dynamo_source = LocalSource(f"bagua_hoisted_scalar_{index}")
        return
    node._dynamo_source = None


def cpu_kernels_truncate_float_min_max() -> bool:
    """Whether Inductor's C++ kernels evaluate a symbolic ``min``/``max`` of floats in int64 (torch < 2.13).

    Private: ``torch.utils._sympy.printers.CppPrinter._print_Max`` / ``_print_Min`` cast both
    operands to int64, float or not, before torch 2.13 (which casts non-integer ones to double).
    BertAdam's warmup-linear decay ``max(0.0, (1 - progress) / (1 - warmup))`` of a symbolic step
    count, inlined into a CPU kernel, was truncated to 0: no update after the warmup (checked on
    2.6.0 and 2.11.0). Where True, ``_scalar_prologue`` computes such scalars in Python instead.
    """
    return _RELEASE < "2.13"


def symbolic_sqrt_functions() -> frozenset:
    """The functions Dynamo records for ``math.sqrt`` of a symbolic number, besides ``math.sqrt``.

    Private: ``torch._sym_sqrt``, which Dynamo's graphs call for ``math.sqrt(step)`` of a dynamic
    step count (pytorch-optimizer's AdaFactor: ``min(1e-2, 1 / math.sqrt(step))``).
    ``_scalar_prologue`` replays it like ``math.sqrt``. Empty where it does not exist.
    """
    sym_sqrt = getattr(torch, "_sym_sqrt", None)
    return frozenset() if sym_sqrt is None else frozenset({sym_sqrt})


def dynamo_recompile_limit(limit: int, graphs: Optional[int] = None):
    """A context in which Dynamo keeps up to ``limit`` graphs per code object (its default: 8).

    Private: ``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` before torch 2.6),
    read when a frame is about to be compiled again. The per-tensor compiled step
    (``_per_tensor.py``) builds one graph per distinct parameter shape on its private code
    object, bounded by its own budget; Dynamo's default would stop it at 8. Checked on torch 2.13.

    ``graphs``: how many graphs the code object has now. While Dynamo's own limit still allows
    one more, nothing is patched (a config patch costs ~20 us, paid on every call otherwise).
    """
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    current = getattr(dynamo_config, name)
    if graphs is not None and graphs < current:
        return nullcontext()
    return dynamo_config.patch({name: max(limit, current)})


def ints_symbolic_from_the_first_graph(places: Iterable[Tuple[str, Any, str]]):
    """A context in which Dynamo traces the optimizer's Python ints at ``places`` as symbols.

    ``places``: ``("group", index, key)`` for ``optimizer.param_groups[index][key]`` and
    ``("state", None, key)`` for ``key`` in every state entry. Dynamo makes an int symbolic
    only once it has seen it change: a first graph with the value as a constant, then a
    recompile, which this spares for step counts.

    ``torch.compiler.config.dynamic_sources`` (torch 2.7 and later; checked on 2.11, 2.13 and
    2.14) matches Dynamo's names of the values: ``L['optimizer']`` is the compiled function's
    argument (``_compile._step_with_scalars_as_operands``); the state is named through the
    dict's keys, matched by a pattern. Where the config or the names differ, nothing matches
    and Dynamo recompiles once, as without this context.
    """
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "dynamic_sources"):
        return nullcontext()
    patterns = []
    for where, index, key in places:
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_]+", key):
            continue  # (the config splits entries at commas and drops spaces; a colon names a dim)
        if where == "group":
            patterns.append(rf"L\['optimizer'\]\.param_groups\[{int(index)}\]\['{key}'\]$")
        else:
            patterns.append(rf"L\['optimizer'\]\.state\[.*\]\['{key}'\]$")
    if not patterns:
        return nullcontext()
    current = config.dynamic_sources
    return config.patch(dynamic_sources=",".join(([current] if current else []) + patterns))


def step_keeping_lr_scheduler_marker(optimizer: torch.optim.Optimizer, new_step: Callable) -> Callable:
    """``new_step`` made fit to replace ``optimizer.step`` after an LR scheduler wrapped it.

    Private: a scheduler built before ``step`` is replaced tags its wrapper with
    ``_wrapped_by_lr_sched`` and sets ``optimizer._opt_called`` when called; without them it
    warns "optimizer.step() has been overridden" / "lr_scheduler.step() before
    optimizer.step()". Returns ``new_step`` itself when no scheduler wrapped ``step``.
    """
    if not getattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched", False):
        return new_step

    def step(*args, **kwargs):
        optimizer._opt_called = True
        return new_step(*args, **kwargs)

    step._wrapped_by_lr_sched = True
    step.__doc__ = new_step.__doc__
    return step


def mark_step_taken(optimizer: torch.optim.Optimizer) -> None:
    """Tell LR schedulers that ``optimizer`` stepped (``fuse_step()`` bypasses their wrapper).

    Private: schedulers read ``optimizer._opt_called`` to warn about ``scheduler.step()``
    before ``optimizer.step()``.
    """
    optimizer._opt_called = True


def tensor_version(tensor: torch.Tensor) -> int:
    """Autograd's in-place modification counter of ``tensor`` (underscored attribute ``_version``)."""
    return tensor._version


_VERSION = operator.attrgetter("_version")


def tensor_versions(tensors: Iterable[torch.Tensor]) -> List[int]:
    """:func:`tensor_version` of each of ``tensors``, read in one C-level pass (``map`` with an
    ``attrgetter``, no Python call per tensor): the fused step reads a few hundred per step."""
    return list(map(_VERSION, tensors))


def register_state_dict_post_hook(module: torch.nn.Module, hook: Callable) -> "torch.utils.hooks.RemovableHandle":
    """``module.register_state_dict_post_hook(hook)``; ``hook(module, state_dict, prefix, metadata)``
    changes ``state_dict`` in place and returns None.

    Public from torch 2.3 (there it runs for every submodule's ``state_dict`` call); before,
    the private ``_register_state_dict_hook`` does the same for a hook that returns None.
    """
    public = getattr(module, "register_state_dict_post_hook", None)
    if public is not None:
        return public(hook)
    return module._register_state_dict_hook(hook)


def dynamo_dispatches_foreach_to_modes() -> None:
    """Make Dynamo hand ``torch._foreach_*`` calls to an active torch function mode, as eager does.

    Eager torch dispatches ``torch._foreach_norm`` & co. to ``__torch_function__`` modes; Dynamo
    (checked on 2.13) only dispatches functions in its private cached set
    ``torch._dynamo.variables.torch.get_overridable_functions()``, which lacks them, so a traced
    mode silently misses ``clip_grad_norm_``'s foreach calls. Adding them changes nothing for
    code traced without a mode. Idempotent; a torch without that set needs nothing.
    """
    try:
        from torch._dynamo.variables.torch import get_overridable_functions
    except ImportError:
        return
    funcs = get_overridable_functions()
    if isinstance(funcs, set):
        funcs.update(getattr(torch, n) for n in dir(torch) if n.startswith("_foreach_"))


def default_store():
    """The key-value store of the default process group (``init_process_group``'s rendezvous store).

    Private: ``torch.distributed.distributed_c10d._get_default_store``. The stall watchdog of
    ``distributed/comm.py`` writes one key per rank there when a collective waits long, to
    tell which ranks have not arrived; callers treat any error as "unknown".
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


#: torch's default timeout of a process group's collectives (where a group's own cannot be read)
DEFAULT_PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


def process_group_timeout(group=None, default: Optional[datetime.timedelta] = DEFAULT_PROCESS_GROUP_TIMEOUT):
    """The timeout (a ``timedelta``) the CPU backend of ``group`` (default: the world) runs its collectives with.

    Private: ``ProcessGroup._get_backend(device).options._timeout``. Where that cannot be read,
    ``default`` (torch's own default), or the error with ``default=None``.
    """
    import torch.distributed as dist

    pg = dist.group.WORLD if group is None else group
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private torch API
        if default is None:
            raise
        return default


def inductor_checked_cpu_vector_isas() -> bool:
    """Whether Inductor has checked the CPU's vector instruction sets in this process, which it does
    before its first CPU kernel. On a GPU machine that means a CUDA step's graph held a CPU kernel
    (torch.optim's step counts are CPU tensors): the checks and the C++ compiler then add seconds
    to its first compile. Private: ``torch._inductor.cpu_vec_isa.valid_vec_isa_list`` (a
    ``functools.cache``); False where that is missing."""
    try:
        from torch._inductor import cpu_vec_isa

        return cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
    except Exception:
        return False


def start_cpu_vector_isa_checks(then: Optional[Callable[[], None]] = None) -> Callable[[], bool]:
    """Start Inductor's check of the best vector instruction set the CPU reports, in a thread;
    return the function that waits for it and says whether it built and loaded its test program
    (so the C++ compiler Inductor uses works, with torch's headers: False when none was started).

    Before its first CPU kernel, Inductor compiles and loads a test program for every instruction
    set the CPU reports, one after the other, although it uses only the best of them: AMX,
    AVX512-VNNI, AVX512 and AVX2 on a Sapphire Rapids VM, two programs each for the AVX512 family
    (with and without AVX512-BF16), 7 compiler runs and 9-12 s of a cold fused step's start on 2
    cores. Here only the best is checked, while the caller does other work (imports the rest of
    Inductor) until it waits. When it built, the others are answered from it without compiling:
    their flags are subsets of its flags (``-mavx512f`` implies ``-mavx2``), on the same compiler
    and CPU; their AVX512-BF16 answer is its answer. Inductor caches each answer, so its own pass
    then finds them all. When the best one does not build, nothing else is answered and Inductor
    checks the rest in turn, as without this. Private: ``torch._inductor.cpu_vec_isa``
    (``supported_vec_isa_list``, best first; ``x86_isa_checker``; each ISA's cached ``__bool__``,
    which calls ``self.check_build``); checked on torch 2.5.1-2.14.1. Anything unexpected: nothing
    is started, and Inductor checks them in turn as before.

    ``then`` runs in the checks' thread once they built and the others are answered (never when
    they did not): work that needs the instruction set Inductor will pick.
    """
    try:
        from concurrent.futures import ThreadPoolExecutor

        from torch._inductor import cpu_vec_isa
        from torch._inductor import config as inductor_config

        if inductor_config.cpp.vec_isa_ok is not None or inductor_checked_cpu_vector_isas():
            return _nothing_to_wait_for  # decided by the user's setting, or already checked in this process
        reported = cpu_vec_isa.x86_isa_checker()
        candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                      if str(isa).split() and all(flag in reported for flag in str(isa).split())]
        if len(candidates) < 2:
            return _nothing_to_wait_for
        for module in ("torch._inductor.codecache",  # what VecISA.check_build imports
                       "torch._inductor.cpp_builder",
                       "torch.utils.cpp_extension"):  # imported by the first build: setuptools
            importlib.import_module(module)

        best, others = candidates[0], candidates[1:]
        base_code = cpu_vec_isa.VecISA._avx_code
        further = _further_vector_isa_programs(best, base_code)
    except Exception:
        return _nothing_to_wait_for

    def check() -> bool:
        try:
            if not best:  # (its cached __bool__ builds and loads its test programs)
                return False
            bf16 = bool(getattr(best, "_is_avx512_bf16_supported", False))
            for isa in others:
                isa.check_build = lambda code: code == base_code or bf16  # (read by its cached __bool__)
                try:
                    bool(isa)
                finally:
                    del isa.check_build
        except Exception:
            return False  # Inductor checks what is left itself, and meets the error there
        if then is not None:
            try:
                then()
            except Exception:
                pass  # its own failure: the checks built all the same
        return True

    try:
        pool = ThreadPoolExecutor(2, thread_name_prefix="vec-isa-check")
        future = pool.submit(check)
        if further:
            pool.submit(_build_quietly, further)
        pool.shutdown(wait=False)
    except Exception:
        return _nothing_to_wait_for

    def wait() -> bool:
        try:
            return bool(future.result())
        except Exception:
            return False

    return wait


def start_precompiling_cpu_kernel_header() -> None:
    """Start building, in a daemon thread, the precompiled header every Inductor CPU kernel includes.

    Why: before its first CPU kernel on a machine, Inductor precompiles ``cpp_prefix.h`` (torch's
    vectorized-math headers, a 150 MB ``.gch``) and every kernel of that first graph waits for it:
    7 of a fused BertAdam's 13 s first compiled step on 2 cores. Started as soon as the vector
    instruction set is known (the header's flags depend on it), the build runs beside the rest of
    ``fuse_optimizer``, the first (eager) step and the tracing of the second, and the kernels find
    it built or nearly so. Inductor's own file lock makes a kernel wait for a build in progress,
    and a header already built (a later run on the machine) is only checked, not rebuilt.

    How: ``CppPythonBindingsCodeCache.load_pybinding_async`` of an empty kernel, without a function
    to submit its compile to: that precompiles the header with the flags it gives every kernel,
    and builds nothing else. Private: ``torch._inductor.codecache`` (checked on torch 2.11-2.14; 2.5
    has no precompiled headers, and a torch whose Inductor does not want one gets nothing). Any
    error: nothing is started, or the thread stops, and Inductor builds the header when it needs it.
    """
    try:
        import threading

        from torch._inductor import config as inductor_config
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        if not getattr(inductor_config, "cpp_cache_precompile_headers", False):
            return
        uncompiled_header = getattr(CppPythonBindingsCodeCache, "_get_uncompiled_header", None)
        if uncompiled_header is None or not uncompiled_header("cpu"):
            return
    except Exception:
        return

    def build() -> None:
        try:
            CppPythonBindingsCodeCache.load_pybinding_async(["long"], _HEADER_WARM_UP_KERNEL)
        except Exception:
            pass  # Inductor builds the header itself when its first kernel needs it

    # A daemon: a short script that fuses and exits does not wait for the build at exit.
    threading.Thread(target=build, name="inductor-header-precompile", daemon=True).start()


_HEADER_WARM_UP_KERNEL = """
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(long x) {}
"""


def _nothing_to_wait_for() -> bool:
    return False


def _further_vector_isa_programs(best, base_code: str) -> list:
    """The test programs the check of ``best`` compiles after its base program, each with a copy of
    ``best`` in the state the check gives it then: ``[(isa, code), ...]``.

    Why: the best ISA's check compiles its programs one after the other (on a Sapphire Rapids VM:
    the base program, 2.7 s, then AVX512-BF16, AVX512-VNNI and AMX, 0.5-0.8 s each), and only the
    base one is slow. Built beforehand beside it, into Inductor's cache, the check then finds them
    built and only loads them (its ``check_build`` compiles a program only when its library is
    missing, under a file lock). Found by running the check once on a stand-in that records each
    program instead of building it, and answers "built". The copies are built with the flags and
    macros ``best`` would have at that point, so they are the programs the real check asks for;
    any that is not is merely built in vain. Private:
    ``VecISA.check_build`` and the cached ``__bool__`` chain of ``torch._inductor.cpu_vec_isa``.
    """
    import copy

    # Every instance of an ISA class equals every other (a dataclass without fields), so the stand-in
    # is of a subclass: unequal to best, its answers cached apart from best's.
    stand_in = copy.copy(best)
    stand_in.__class__ = type("VectorIsaStandIn", (type(best),), {})
    recorded = []

    def record(code: str) -> bool:
        if code != base_code:
            snapshot = copy.copy(stand_in)
            snapshot.__class__ = type(best)
            del snapshot.check_build
            recorded.append((snapshot, code))
        return True

    stand_in.check_build = record
    bool(stand_in)
    return recorded


def _build_quietly(programs: list) -> None:
    """Build each ``(isa, code)`` into Inductor's cache; the answers are not used (the check's own
    call of ``check_build`` then loads each and decides)."""
    for isa, code in programs:
        try:
            isa.check_build(code)
        except Exception:
            pass


def compiled_kernels_may_fuse_multiply_add(device_type: str) -> bool:
    """Whether Inductor's kernels for ``device_type`` may turn ``a * b + c`` into one fused
    multiply-add (rounded once, so not the eager result's bits).

    Private: ``torch._inductor.config.cpp.enable_floating_point_contract_flag`` (the C++ compiler's
    ``-ffp-contract``; "off" on torch 2.13). Triton contracts by default. Unknown: assume it may.
    """
    if device_type != "cpu":
        return True
    try:
        import torch._inductor.config as inductor_config
    except Exception:
        return True
    return getattr(getattr(inductor_config, "cpp", None), "enable_floating_point_contract_flag", "fast") != "off"


# pytorch/pytorch#158128 (torch 2.9): ProcessGroupGloo applies a collective's own timeout
# (``AllreduceOptions.timeout``); before, it ignored it and used the group's.
_GLOO_COLLECTIVE_TIMEOUTS = _RELEASE >= "2.9"


def gloo_honours_collective_timeouts() -> bool:
    """Whether gloo ends a collective at the timeout :func:`all_reduce_with_timeout` gives it
    (torch >= 2.9; checked: 2.10.0, 2.11.0, 2.13.0 and 2.14.1 do, 2.5.1 and 2.6.0 use the
    process group's timeout instead)."""
    return _GLOO_COLLECTIVE_TIMEOUTS


def all_reduce_with_timeout(tensor: torch.Tensor, op, group, timeout):
    """``dist.all_reduce(tensor, op, group, async_op=True)`` whose collective itself fails after
    ``timeout`` (a ``timedelta``), not only a wait on it (where
    :func:`gloo_honours_collective_timeouts`; elsewhere the group's timeout applies).

    Why: ``work.wait(timeout)`` only stops *waiting*; gloo keeps running the collective until the
    process group's own timeout (``init_process_group(timeout=...)``, 30 minutes by default), and
    destroying the group (``destroy_process_group``, or the interpreter's teardown at exit) joins
    gloo's worker thread, so a process that gave up on a peer at ``timeout`` still cannot exit
    before the group's timeout. With the timeout on the collective, gloo ends it then.

    Private: ``AllreduceOptions.timeout`` (an undocumented field of the options ``dist.all_reduce``
    builds; unset, the group's timeout applies), set here and handed to ``ProcessGroup.allreduce``
    as ``dist.all_reduce`` does. Plain tensors only (no complex views, no coalescing context).
    """
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if hasattr(opts, "asyncOp"):  # torch >= 2.10; the caller waits for the work
        opts.asyncOp = True
    opts.timeout = timeout
    pg = dist.group.WORLD if group is None else group
    return pg.allreduce([tensor], opts)


def drop_group_defaults_kept_by_torch(group) -> int:
    """Replace ``group`` by None (torch's "the default group") where torch.distributed's own
    functions keep it as a default argument; how many defaults that was.

    Why: ``dist.destroy_process_group`` joins gloo's worker threads only when it drops the last
    reference to the group, and torch keeps one: ``torch.distributed.nn.functional`` binds
    ``group=group.WORLD`` when it is imported, which constructing any ``torch.optim`` optimizer
    does (``add_param_group`` imports Dynamo, which imports FSDP, which imports it). A training
    script that initializes the process group before it builds its optimizer (most do) keeps
    the default group, and its gloo threads, alive into the interpreter's teardown. Only for
    the exit: afterwards those functions use whichever group is the default then.

    Private: function ``__defaults__`` / ``__kwdefaults__`` of the ``torch.distributed`` modules
    already imported. Checked on torch 2.13.0 and 2.14.1 (the gloo threads of a 2-rank run are
    joined before the teardown only with it).
    """
    import sys
    import types

    dropped = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for function in [value for value in vars(module).values() if type(value) is types.FunctionType]:
            positional, keyword = function.__defaults__ or (), function.__kwdefaults__ or {}
            found = sum(value is group for value in (*positional, *keyword.values()))
            if found:
                dropped += found
                function.__defaults__ = tuple(None if value is group else value for value in positional) or None
                function.__kwdefaults__ = {key: None if value is group else value for key, value in keyword.items()} or None
    return dropped


def aten_operator_packet(name: str):
    """``torch.ops.aten.<name>`` (an ``OpOverloadPacket``: its overloads carry ``torch.Tag``s), or None."""
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    return packet if hasattr(packet, "overloads") else None


def size_hint(value) -> "int | None":
    """``value`` (an int or a ``torch.SymInt`` of a graph traced with dynamic shapes) as the int it
    stands for in the call being compiled; None when that is not known.

    Private: ``SymInt.node.hint``, the example value Dynamo traced with. Checked on torch 2.13.
    """
    if isinstance(value, int):
        return value
    node = getattr(value, "node", None)
    hint = getattr(node, "hint", None)
    return hint if isinstance(hint, int) else None


def exception_chain(exc: BaseException, implicit: bool = True):
    """``exc`` and the exceptions it wraps: Dynamo wraps a backend's exception in
    ``BackendCompilerFailed`` (private attribute ``inner_exception``), others chain ``__cause__``
    (and, with ``implicit``, ``__context__``: the exception being handled when it was raised)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or (exc.__context__ if implicit else None)


# ----------------------------------------------------------------------------- FSDP2 shards
# A fused optimizer over FSDP2's sharded parameters (_sharded.py) keeps each rank's shards in its
# flat buffers and points FSDP2 at them. FSDP2 keeps, per parameter, an ``FSDPParam`` whose
# ``_sharded_param_data`` (the padded shard, 1-D) is what it all-gathers, and whose
# ``sharded_param`` is the DTensor parameter, a view of the unpadded part (``_local_tensor``).
# FSDP2's own ``reset_sharded_param`` (after ``load_state_dict(assign=True)``) re-points them the
# same way; nothing public does it for another storage. Checked on 2.6 to 2.14.


def _fsdp_param_class():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # torch < 2.6
        try:
            from torch.distributed._composable.fsdp._fsdp_param import FSDPParam
        except ImportError:
            return None
    return FSDPParam


def fsdp2_params(params) -> dict:
    """``{id(parameter): FSDPParam}`` for those of ``params`` that FSDP2 shards. FSDP2 keeps no
    reference from a parameter to its ``FSDPParam``: found by one scan of the live objects
    (as ``_state_dict.owning_modules`` finds a parameter's modules), at fuse time only."""
    import gc

    cls = _fsdp_param_class()
    if cls is None:
        return {}
    wanted = {id(p) for p in params}
    found = {}
    for obj in gc.get_objects():
        if type(obj) is cls:  # (type, not isinstance: some live objects warn when asked their class)
            param = obj.__dict__.get("sharded_param")
            if id(param) in wanted:
                found[id(param)] = obj
    return found


def fsdp2_padded_numel(fsdp_param) -> int:
    """Elements of the rank's padded shard (equal on every rank)."""
    return fsdp_param._sharded_param_data.numel()


def local_shard(tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (not a differentiable view of it: ``to_local()`` makes one
    under grad mode)."""
    return tensor._local_tensor


def dtensor_over(local: torch.Tensor, like) -> Any:
    """A DTensor laid out as the DTensor ``like`` (mesh, placements, global shape and stride) whose
    local tensor is ``local`` itself, on ``local``'s device. ``DTensor.from_local`` would copy a
    local tensor off the mesh's device onto it: under FSDP2's CPU offloading (a CUDA mesh, shards
    and gradients on the host) that made every gradient and state a GPU copy. FSDP2 builds its own
    offloaded DTensors this way (its ``_from_local_no_grad``). Private: ``DTensor._spec`` and the
    ``DTensor(local, spec, requires_grad=...)`` constructor."""
    from torch.distributed.tensor import DTensor

    spec = like._spec
    if spec.tensor_meta is not None and spec.tensor_meta.dtype != local.dtype:
        spec = dataclasses.replace(spec, tensor_meta=spec.tensor_meta._replace(dtype=local.dtype))
    return DTensor(local, spec, requires_grad=False)


def fsdp2_point_shard_at(fsdp_param, padded: torch.Tensor, local: torch.Tensor) -> None:
    """Make FSDP2 all-gather ``padded`` (1-D, the padded shard) and its parameter's local tensor
    ``local`` (a view of ``padded``'s first elements)."""
    fsdp_param._sharded_param_data = padded
    fsdp_param.sharded_param._local_tensor = local


_SHARDED_DATA, _SHARDED_PARAM, _LOCAL_TENSOR = (operator.attrgetter("_sharded_param_data"),
                                                operator.attrgetter("sharded_param"), operator.attrgetter("_local_tensor"))


def fsdp2_shard_pointers(fsdp_params) -> List[int]:
    """Where each FSDP2 parameter's padded shard and its local tensor start (C-level passes: a step
    checks that nothing re-pointed them)."""
    data_ptr = torch.Tensor.data_ptr
    return (list(map(data_ptr, map(_SHARDED_DATA, fsdp_params)))
            + list(map(data_ptr, map(_LOCAL_TENSOR, map(_SHARDED_PARAM, fsdp_params)))))


def fsdp2_shard_points_at(fsdp_param, padded: torch.Tensor) -> bool:
    data = fsdp_param._sharded_param_data
    return data.data_ptr() == padded.data_ptr() and fsdp_param.sharded_param._local_tensor.data_ptr() == padded.data_ptr()
