"""A fused model's and a fused optimizer's ``state_dict()``, saved like unfused ones.

After :func:`fuse_optimizer` every fused parameter is a view of one flat buffer, and every
parameter-shaped state tensor (``exp_avg``, ...) a view of a flat state buffer. A view
pickles (``torch.save``) as its whole storage: one layer's ``state_dict`` would write the
whole model, a loaded tensor would keep the whole loaded buffer alive, and safetensors
refuses tensors that share a storage. So:

* **Model**: every module that owns a fused parameter gets a state-dict post-hook
  (:func:`compact_fused_parameters`) that replaces the parameter's detached view in the
  returned dict with a compact copy (``keep_vars=True`` still returns the parameters
  themselves). ``fuse_optimizer`` knows only the parameters, so the owning modules are found
  once by a scan of the live objects (:func:`owning_modules`), and again when a param group
  is laid out anew. ``load_state_dict`` copies into the parameters as always: they stay views.
* **Optimizer**: :func:`compact_flat_state` copies the views of a flat state buffer only when
  the state dict does not cover nearly all of that buffer (parameters without state yet,
  frozen slots): a fully covered buffer is written once by ``torch.save``, as compact as the
  unfused tensors, without doubling the optimizer's memory on every checkpoint.

The copy costs one extra copy of the parameters (model) while the state dict is alive: the
price of writing each tensor on its own, which safetensors requires anyway.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

from ._nested_state import leaf_at, tensor_leaves, with_leaves
from ._torch_compat import register_state_dict_post_hook

__all__ = [
    "StateDictHooks",
    "compact_fused_parameters",
    "compact_flat_state",
    "owning_modules",
]

# The flat layouts of live fusions: parameters that are views of their flat buffers are the
# ones the module hooks copy. Weak: a fusion whose optimizer is gone stops counting.
_LIVE_LAYOUTS: "weakref.WeakSet" = weakref.WeakSet()
# A flat state buffer whose views in a state dict leave at most this share of its bytes
# uncovered (alignment padding) is saved as it is.
UNCOVERED_SHARE = 1 / 32

_StorageKey = Tuple[torch.device, int]


def _storage_key(t: torch.Tensor) -> _StorageKey:
    return (t.device, t.untyped_storage().data_ptr())


def _is_partial(t: torch.Tensor) -> bool:
    """True when ``t`` is a view of a larger storage (it would be saved with all of it)."""
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def _flat_param_storages() -> Set[_StorageKey]:
    return {_storage_key(buffer.param) for layout in list(_LIVE_LAYOUTS) for buffer in layout.buffers()}


def _flat_state_storages(layout) -> Set[_StorageKey]:
    return {_storage_key(flat) for buffer in layout.buffers() for flat in buffer.state.values()}


def _compact(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- model
# One parameter registered under two names (tied embeddings) is saved once by an unfused
# model: both names hold the same storage. Its two names are filled by the hooks of two
# modules, so the first copy is remembered per state dict: by id, while the state dict lives
# (a plain dict cannot be weakly referenced: a copy per name then), and weakly, so a caller
# that pops tensors off the state dict while writing them frees them as it goes.
_COPIES: Dict[int, Tuple["weakref.ref", Dict[Any, Tuple[str, "weakref.ref"]]]] = {}


def _view_key(t: torch.Tensor):
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())


def _copies_of(state_dict) -> Optional[Dict[Any, Tuple[str, "weakref.ref"]]]:
    ident = id(state_dict)
    entry = _COPIES.get(ident)
    if entry is not None and entry[0]() is state_dict:
        return entry[1]

    def forget(ref, ident=ident):
        if _COPIES.get(ident, (None,))[0] is ref:
            del _COPIES[ident]

    try:
        ref = weakref.ref(state_dict, forget)
    except TypeError:
        return None
    copies: Dict[Any, Tuple[str, "weakref.ref"]] = {}
    _COPIES[ident] = (ref, copies)
    return copies


def _copy_for(state_dict, key: str, view: torch.Tensor) -> torch.Tensor:
    copies = _copies_of(state_dict)
    if copies is None:
        return _compact(view)
    vkey = _view_key(view)
    known = copies.get(vkey)
    # Valid only when made during this call: its name still holds it (a reused state dict
    # had that name overwritten with a fresh view before the hooks ran).
    if known is not None and known[0] != key:
        copy = known[1]()
        if copy is not None and state_dict.get(known[0]) is copy:
            return copy
    copy = _compact(view)
    copies[vkey] = (key, weakref.ref(copy))
    return copy


def compact_fused_parameters(module: torch.nn.Module, state_dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook: this module's fused parameters as compact copies.

    Only detached views (``keep_vars=False``) of a live fused flat buffer are replaced; with
    ``keep_vars=True`` the dict holds the parameters themselves, which are left alone.
    """
    if not _LIVE_LAYOUTS:
        return
    flat = None
    for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
        key = prefix + name
        value = state_dict.get(key)
        if value is None or value is param or not isinstance(value, torch.Tensor):
            continue
        if value.device.type == "meta" or value.layout != torch.strided or not _is_partial(value):
            continue
        if flat is None:
            flat = _flat_param_storages()
        if _storage_key(value) in flat:
            state_dict[key] = _copy_for(state_dict, key, value)


def _subclasses(cls: type) -> Set[type]:
    found, todo = {cls}, [cls]
    while todo:
        for sub in type.__subclasses__(todo.pop()):
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def owning_modules(params: Iterable[torch.Tensor]) -> List[torch.nn.Module]:
    """The live modules that hold any of ``params`` as a parameter.

    A parameter does not know its module, so this scans the objects the garbage collector
    tracks (every module is one): about 0.1 s per 300,000 live objects, once per fusion.
    """
    wanted = {id(p) for p in params}
    if not wanted:
        return []
    owners = []
    # filtered in C: a Python loop over every live object would cost half as much again
    module_types = _subclasses(torch.nn.Module)
    objects = gc.get_objects()
    modules = list(itertools.compress(objects, map(module_types.__contains__, map(type, objects))))
    del objects
    for obj in modules:
        try:
            own = [p for _, p in obj.named_parameters(recurse=False, remove_duplicate=False)]
        except Exception:  # noqa: BLE001 - a module still being built, or a broken one: not ours
            continue
        if any(id(p) in wanted for p in own):
            owners.append(obj)
    return owners


class StateDictHooks:
    """The state-dict hooks of one fusion: on the modules owning its parameters, and its optimizer.

    Holds no reference to the optimizer or the modules (only removable handles), so it can be
    cleared when the optimizer is garbage-collected.
    """

    def __init__(self):
        self.module_handles: Dict[int, Any] = {}  # id(module) -> handle
        self._modules: Dict[int, "weakref.ref"] = {}
        self._covered: Set[int] = set()  # id(param) of parameters whose owners are hooked
        self.optimizer_handle = None

    def install(self, optimizer: torch.optim.Optimizer, layout) -> None:
        _LIVE_LAYOUTS.add(layout)
        self.optimizer_handle = optimizer.register_state_dict_post_hook(compact_flat_state)
        self.cover(layout)

    def cover(self, layout) -> None:
        """Hook the modules owning fused parameters not seen before (new or rebuilt groups)."""
        params = [slot.param for buffer in layout.buffers() for slot in buffer.slots]
        new = [p for p in params if id(p) not in self._covered]
        if not new:
            return
        for module in owning_modules(new):
            ref = self._modules.get(id(module))
            if ref is not None and ref() is module:
                continue
            self.module_handles[id(module)] = register_state_dict_post_hook(module, compact_fused_parameters)
            self._modules[id(module)] = weakref.ref(module)
        self._covered = {id(p) for p in params}

    def remove(self, layout: Optional[Any] = None) -> None:
        if layout is not None:
            _LIVE_LAYOUTS.discard(layout)
        for handle in self.module_handles.values():
            handle.remove()
        self.module_handles.clear()
        self._modules.clear()
        self._covered.clear()
        if self.optimizer_handle is not None:
            self.optimizer_handle.remove()
            self.optimizer_handle = None


# ----------------------------------------------------------------------------- optimizer
def compact_flat_state(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Optimizer state-dict post-hook: views of a flat state buffer the dict does not cover, copied.

    ``state_dict["state"]`` holds the optimizer's own per-parameter dicts, so changed entries
    get new dicts; the optimizer's state is untouched.
    """
    state = state_dict.get("state")
    if not state:
        return None
    flat = set().union(*(_flat_state_storages(layout) for layout in list(_LIVE_LAYOUTS) if layout.optimizer is optimizer))
    if not flat:
        return None
    views: Dict[_StorageKey, Dict[Tuple[int, int], List[Tuple[Any, str]]]] = {}
    storages: Dict[_StorageKey, torch.Tensor] = {}
    for index, entry in state.items():
        if not isinstance(entry, dict):
            continue
        for name, value in entry.items():
            # a tensor, or each tensor of a container of them (nested state, e.g. AggMo's {beta: buffer})
            for path, leaf in [((), value)] if isinstance(value, torch.Tensor) else tensor_leaves(value) or ():
                if leaf.layout == torch.strided and _is_partial(leaf):
                    skey = _storage_key(leaf)
                    if skey in flat:
                        span = (leaf.data_ptr(), leaf.numel() * leaf.element_size())
                        views.setdefault(skey, {}).setdefault(span, []).append((index, name, path))
                        storages[skey] = leaf
    copied: Dict[Any, Dict[str, Any]] = {}
    for skey, spans in views.items():
        total = storages[skey].untyped_storage().nbytes()
        covered = sum(length for _, length in spans)  # slots do not overlap
        if total - covered <= total * UNCOVERED_SHARE:
            continue  # torch.save writes this buffer once: as compact as the unfused tensors
        for places in spans.values():
            copy = None
            for index, name, path in places:
                entry = copied.get(index)
                if entry is None:
                    entry = copied[index] = dict(state[index])
                if copy is None:
                    copy = _compact(leaf_at(entry[name], path))
                # (a container is copied, not changed: it is the optimizer's own)
                entry[name] = with_leaves(entry[name], {path: copy}, copy=True) if path else copy
    if copied:
        state_dict["state"] = {index: copied.get(index, entry) for index, entry in state.items()}
    return None
