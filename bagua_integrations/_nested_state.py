"""State entries that hold several parameter-shaped tensors in one container.

Most optimizers keep one tensor per state key (``exp_avg``). Some keep a dict or a list of them
under one key: AggMo one momentum buffer per beta (``state["momentum_buffer"] = {0.0: b0, 0.9: b1,
0.99: b2}``), others a list of buffers. Each such tensor is a **leaf**, named by its **path** in
the container (``(0.9,)``, ``(1, "m")``). A fused step keeps each leaf in a flat state buffer of
its own, under the key ``(state key, *path)``, and every parameter's container holds its views,
as plain entries hold theirs (``_planner.py``).

Only containers made of dicts, lists and tuples whose leaves are all tensors qualify; anything
else in them (a number, a deque that grows by a new tensor every step) leaves the entry as it
is, and the planner's signature keeps such parameters on their own step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["tensor_leaves", "with_leaves", "leaf_at", "structure"]

Path = Tuple[Any, ...]
_CONTAINERS = (dict, list, tuple)


def _is_plain(value: Any) -> bool:
    # a namedtuple or a dict subclass may carry meaning its type would lose when rebuilt
    return type(value) in _CONTAINERS


def tensor_leaves(value: Any) -> Optional[List[Tuple[Path, torch.Tensor]]]:
    """``(path, tensor)`` for each tensor of a non-empty container of tensors (dicts, lists and tuples,
    nested), in a fixed order; None for anything else (a tensor itself included)."""
    if not _is_plain(value) or not value:
        return None
    found: List[Tuple[Path, torch.Tensor]] = []

    def walk(node: Any, path: Path) -> bool:
        if isinstance(node, torch.Tensor):
            found.append((path, node))
            return True
        if not _is_plain(node) or not node:
            return False
        items = node.items() if type(node) is dict else enumerate(node)
        return all(walk(child, path + (key,)) for key, child in items)

    return found if walk(value, ()) else None


def structure(value: Any) -> Any:
    """What two containers must share to hold their leaves alike: types, keys, and each leaf's dtype."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if type(value) is dict:
        return "dict", tuple((key, structure(child)) for key, child in value.items())
    return type(value).__name__, tuple(structure(child) for child in value)


def leaf_at(value: Any, path: Path) -> Any:
    """The leaf of ``value`` at ``path`` (None where there is none)."""
    for key in path:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def with_leaves(value: Any, leaves: Dict[Path, torch.Tensor], copy: bool = False) -> Any:
    """``value`` with the leaves at the paths of ``leaves`` replaced: in place where every container
    on the way is mutable (the same object then; a copy of what holds an immutable one), or in new
    containers throughout (``copy=True``: one container per parameter from a run's)."""

    def put(node: Any, path: Path) -> Any:
        if isinstance(node, torch.Tensor):
            return leaves.get(path, node)
        items = list(node.items()) if type(node) is dict else list(enumerate(node))
        new = [(key, put(child, path + (key,))) for key, child in items]
        if copy or type(node) is tuple:
            return dict(new) if type(node) is dict else type(node)(child for _, child in new)
        for (key, child), (_, old) in zip(new, items):
            if child is not old:
                node[key] = child
        return node

    return put(value, ())
