"""Another instance of an optimizer's class, over other tensors: the one way this package makes one.

The probes step copies of an optimizer on synthetic tensors (``_probe``), the late-reduction check on
small copies of its runs (``_late_reductions.DryRun``), and a fused optimizer over FSDP2 shards steps
its class over stand-ins of the shards (``_sharded``). Each needs the optimizer's own ``step`` with
other ``param_groups`` and ``state``, without calling its constructor (which may validate, allocate
or register things) and without its step hooks or fusion. They differ only in how much of the rest
(the optimizer's own attributes: settings, counters, a wrapped optimizer) is copied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

# torch.optim.Optimizer's hook registries: every copy gets empty ones (a copy's step runs no hooks)
HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
              "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
              "_optimizer_load_state_dict_post_hooks")
# never carried over: what the copy gets anew, and what fuse_optimizer / LR schedulers put on the instance
_OWN = frozenset({"param_groups", "state", "fuse_step", "step", *HOOK_DICTS})


def optimizer_like(
    optimizer: torch.optim.Optimizer,
    param_groups: List[Dict[str, Any]],
    state: Any,
    copy_attributes: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
    skip: Iterable[str] = (),
) -> torch.optim.Optimizer:
    """An instance of ``optimizer``'s class holding ``param_groups`` and ``state``.

    Its other attributes are ``optimizer``'s (shared), or what ``copy_attributes`` makes of them all at
    once (one ``copy.deepcopy`` keeps attributes that refer to one object referring to one copy);
    ``skip`` names more attributes to leave out. Fusion's own attributes are never carried over."""
    skipped = _OWN | set(skip)
    rest = {k: v for k, v in vars(optimizer).items() if k not in skipped and not k.startswith("_bagua_")}
    clone = object.__new__(type(optimizer))
    clone.__dict__.update(rest if copy_attributes is None else copy_attributes(rest))
    for name in HOOK_DICTS:
        clone.__dict__[name] = OrderedDict()
    clone.param_groups = param_groups
    clone.state = state
    return clone
