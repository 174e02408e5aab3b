"""Write each updated state back where it is computed, so later kernels read it instead of recomputing it.

A compiled step's functional graph writes its updated inputs back at its very end (``copy_`` into
a graph input, as functionalization places them). Inductor then recomputes an updated value in
every kernel that uses it, reading its inputs again each time, and stores it in whichever kernel
comes last. LAMB computes its moments, reduces the update they give per parameter (the trust
ratio's norm), then applies the update: with the write-back at the end, the update kernel reads
the old moments and the gradient a second time to recompute the new moments (read 4 tensors, then
read 4 and write 3), where storing the moments in the first kernel lets the second read them
(read 4 and write 2, then read 3 and write 1: the least traffic of an exact LAMB).

:func:`stores_early` moves each write-back to just after its value is computed and the input's old
value was last read, and lets later nodes read the written input. The values are the same (a
value and its write-back have one dtype, shape and strides, or the write-back stays where it is);
only where they are stored and read moves. Inductor fuses the early store into the kernel that
computes the value, where the per-block reductions' loops have the same shape
(``_torch_compat.block_loops_pass``). That pass must keep the scheduler's name for a read of a
written input (the write's, not the input's): without it, a reshaped loop read the input as it was
before the write, and pytorch-optimizer's LARS and FAdam stepped wrong, silently, compiled.
"""

from __future__ import annotations

from typing import List

import torch

__all__ = ["stores_early", "is_input_mutation"]


def is_input_mutation(node: torch.fx.Node) -> bool:
    """A ``copy_`` into a graph input: how a functional graph writes an updated input back."""
    return (node.op == "call_function" and node.target is torch.ops.aten.copy_.default
            and node.args[0].op == "placeholder")


def _returns_alias(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(ret.alias_info is not None for ret in schema.returns)


def _readers(tensor: torch.fx.Node, write: torch.fx.Node) -> List[torch.fx.Node]:
    """The nodes that read ``tensor``'s memory, directly or through views of it (``write`` aside).
    A node whose target has no schema counts as a view: its users read the memory too."""
    found, todo = [], [user for user in tensor.users if user is not write]
    while todo:
        node = todo.pop()
        found.append(node)
        if node.op == "call_function" and _returns_alias(node):
            todo.extend(node.users)
    return found


def _same_layout(a: torch.fx.Node, b: torch.fx.Node, device_type: str) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.shape == vb.shape and va.stride() == vb.stride() and va.device == vb.device
            and va.device.type == device_type)


def stores_early(graph: torch.fx.Graph, device_type: str = "cpu") -> int:
    """Move ``graph``'s write-backs of inputs on ``device_type`` early (see the module docstring);
    the number moved."""
    nodes = list(graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    writes = [node for node in nodes if is_input_mutation(node)]
    targets = [write.args[0] for write in writes]
    moved = 0
    for write in writes:
        target, value = write.args[0], write.args[1]
        if (targets.count(target) != 1 or not isinstance(value, torch.fx.Node) or value.op != "call_function"
                or len(write.args) != 2 or write.kwargs or not _same_layout(target, value, device_type)):
            continue
        later_uses = [user for user in value.users if user is not write]
        if not later_uses:
            continue  # nothing reads it again: where it is stored changes nothing
        # after the value and after every read of the input's old value
        place = max([value] + _readers(target, write), key=position.__getitem__)
        if position[place] >= position[write]:
            continue
        place.append(write)
        position[write] = position[place]  # (nodes moved past it below keep their later places)
        for user in later_uses:
            if position[user] > position[place]:
                user.replace_input_with(value, write)  # ``copy_`` returns its target, now written
        moved += 1
    if moved:
        graph.lint()
    return moved
