"""Accelerate integration: ``hf_plugin.prepare(accelerator, model, optimizer, algorithm=...)``.

A drop-in for ``accelerator.prepare(model, optimizer, ...)`` that

1. moves the model to ``accelerator.device`` and fuses the optimizer *before* Accelerate wraps it
   (``AcceleratedOptimizer`` captures ``optimizer.step`` at construction when a GradScaler is used,
   and round-trips ``state_dict()``; both are fine once the optimizer is fused with
   ``replace_step=True``, which this does);
2. calls ``accelerator.prepare`` unchanged;
3. registers ``save_state`` / ``load_state`` pre-hooks so Accelerate's default safetensors
   checkpoints work (fused parameters are disjoint views of one storage, which safetensors would
   otherwise take for tied weights and refuse);
4. attaches a Bagua algorithm to the DDP model Accelerate created: gradient algorithms as its DDP
   communication hook, model algorithms after ``optimizer.step()`` of the returned optimizer
   (see :func:`_run_after_step` for why that one wraps ``step`` instead of a step hook).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Dict, Optional

import torch

from ._algorithms import attach_algorithm, check_gradient_handling, load_algorithm
from .errors import UnsupportedSetupError
from .optimizer import fuse_for_frameworks, is_fused, require_step_fused, unwrap_optimizer

__all__ = ["prepare"]

_OWN_STORAGE = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def _distributed_type_name(accelerator) -> str:
    kind = getattr(accelerator, "distributed_type", None)
    return str(getattr(kind, "value", kind) or "NO").upper()


def prepare(
    accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *others: Any,
    algorithm: Any = None,
    algorithm_kwargs: Optional[Dict[str, Any]] = None,
    fuse: bool = True,
    **fuse_kwargs: Any,
):
    """``accelerator.prepare(model, optimizer, *others)`` with a fused optimizer and an optional Bagua algorithm.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        model, optimizer: the bare model and its optimizer (fused or not yet fused).
        *others: anything else for ``accelerator.prepare`` (dataloaders, schedulers), returned in order.
        algorithm: a name from ``bagua_integrations.distributed.list_algorithms()`` or an algorithm
            object; ``None`` keeps Accelerate's plain DDP allreduce.
        algorithm_kwargs: keyword arguments of the algorithm.
        fuse: fuse ``optimizer`` (with ``replace_step=True``) when it is not fused already.
        **fuse_kwargs: passed to :func:`bagua_integrations.fuse_optimizer`.

    Returns what ``accelerator.prepare`` returns: ``(model, optimizer, *others)``.
    """
    try:
        from accelerate import Accelerator
    except ImportError as error:  # pragma: no cover - accelerate is an install requirement of the hf extra
        raise ImportError("hf_plugin.prepare needs accelerate: pip install 'bagua-integrations[hf]'") from error
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"prepare expects an accelerate.Accelerator first, got {type(accelerator).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare expects the model second (a torch.nn.Module), got {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise UnsupportedSetupError(
            "the model is already wrapped in DistributedDataParallel (already prepared?); call "
            "hf_plugin.prepare instead of accelerator.prepare, with the bare model"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"prepare expects the optimizer third (a torch.optim.Optimizer), got {type(optimizer).__name__}"
        )
    if unwrap_optimizer(optimizer) is not optimizer:
        raise UnsupportedSetupError(
            f"the optimizer is already wrapped ({type(optimizer).__name__}); call hf_plugin.prepare instead of "
            "accelerator.prepare, with the bare optimizer: the wrapper captures step() when it is built"
        )
    if "replace_step" in fuse_kwargs:
        raise ValueError("replace_step cannot be set: Accelerate only calls step(), so it is always True")
    kind = _distributed_type_name(accelerator)
    # Resolve the algorithm before touching anything: a typo fails at once, on every rank.
    resolved = load_algorithm(algorithm, **dict(algorithm_kwargs or {})) if algorithm is not None else None

    if fuse and not is_fused(optimizer):
        if any(name in kind for name in _OWN_STORAGE):
            raise UnsupportedSetupError(
                f"Accelerate runs with {kind}, which owns the parameter storage and the optimizer; a fused "
                "optimizer cannot be used there. Pass fuse=False or use DDP / a single process."
            )
        # Fuse on the final device: Accelerate would move the model after we flattened it otherwise.
        if getattr(accelerator, "device_placement", True) and getattr(model, "hf_device_map", None) is None:
            device = accelerator.device
            if any(p.device != device for p in model.parameters()):
                model.to(device)
        fuse_for_frameworks(optimizer, **fuse_kwargs)
    require_step_fused(optimizer, "Accelerate")
    _register_checkpoint_hooks(accelerator)

    prepared = accelerator.prepare(model, optimizer, *others)
    if not isinstance(prepared, tuple):
        prepared = (prepared,)
    if resolved is not None:
        # clipping is the loop's own call here: refused when it comes (_refuse_clipping)
        check_gradient_handling(resolved, loss_scaling=getattr(accelerator, "mixed_precision", "no") == "fp16",
                                clipping=False)
        wrapped_model, wrapped_optimizer = prepared[0], prepared[1]
        attachment = attach_algorithm(resolved, wrapped_model, optimizer=wrapped_optimizer)
        if attachment is not None and getattr(resolved, "needs_unscaled_gradients", False):
            _refuse_clipping(accelerator, resolved)
        if attachment is not None and attachment.needs_step_callback:
            _run_after_step(wrapped_optimizer, attachment)
        wrapped_model.bagua_attachment = attachment
        if attachment is not None:
            # save_state / load_state write and read every rank's own algorithm state (and, where
            # replicas differ, its optimizer state and weights): custom_checkpoint_{i}.pkl per process
            accelerator.register_for_checkpointing(attachment)
    return prepared


def _run_after_step(accelerated_optimizer, attachment) -> None:
    """Run the model algorithm's communication after every update of the AcceleratedOptimizer.

    The one place the integrations do not use torch's public step post-hook
    (``AlgorithmSession.install_step_hook``), because such a hook only runs when the optimizer's
    ``step`` runs: when a GradScaler finds inf/NaN gradients, ``scaler.step`` skips
    ``optimizer.step()`` on that rank alone (model algorithms keep gradients local, so ranks skip
    differently), and a post-hook would leave that rank out of the weight averaging the others
    enter, which hangs them. So the AcceleratedOptimizer *instance*'s ``step`` is wrapped (not
    the inner optimizer's, which Accelerate's GradScaler path swaps in and out): an update counts
    whenever Accelerate syncs gradients, skipped or not; accumulation micro-steps do not.
    """
    original = accelerated_optimizer.step
    gradient_state = getattr(accelerated_optimizer, "gradient_state", None)

    @functools.wraps(original)
    def step(*args, **kwargs):
        result = original(*args, **kwargs)
        if gradient_state is None or gradient_state.sync_gradients:
            attachment.after_optimizer_step()
        return result

    accelerated_optimizer.step = step


def _refuse_clipping(accelerator, algorithm) -> None:
    """Make this accelerator's ``clip_grad_norm_`` / ``clip_grad_value_`` raise: under an algorithm
    that communicates momentum in place of gradients (qadam), the loop's clip would clip the
    momentum. The Trainer refuses ``max_grad_norm > 0`` up front; a custom loop only shows its
    clipping when it calls it, so the refusal comes then, on every rank alike (before any
    communication)."""

    def refuse(*args, **kwargs):
        check_gradient_handling(algorithm, loss_scaling=False, clipping=True)

    accelerator.clip_grad_norm_ = refuse
    accelerator.clip_grad_value_ = refuse


_HOOKED: "weakref.WeakSet" = weakref.WeakSet()


def _register_checkpoint_hooks(accelerator) -> None:
    """Make ``accelerator.save_state`` / ``load_state`` (safetensors by default) work with flat-buffer views."""
    if accelerator in _HOOKED:
        return
    accelerator.register_save_state_pre_hook(_before_save_state)
    accelerator.register_load_state_pre_hook(_before_load_state)
    _HOOKED.add(accelerator)


def split_flat_views(state_dict: Dict[str, Any]) -> None:
    """Give every tensor that is only part of its storage a storage of its own, in place.

    safetensors treats tensors sharing a storage as tied weights: it keeps one name and refuses
    tensors that do not cover their whole storage. Fused parameters are disjoint views of one
    flat buffer, so each distinct view is copied; true aliases (the same memory under two names)
    stay aliases of one copy and are deduplicated as before, and whole tensors are left alone.
    """
    by_storage: Dict[Any, list] = {}
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            by_storage.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(name)
    for names in by_storage.values():
        views: Dict[Any, list] = {}
        for name in names:
            tensor = state_dict[name]
            views.setdefault((tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype), []).append(name)
        if len(views) == 1:
            tensor = state_dict[names[0]]
            if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
                continue  # whole storage, possibly under several names (tied weights)
        for aliases in views.values():
            copy = state_dict[aliases[0]].detach().clone()
            for name in aliases:
                state_dict[name] = copy


def _before_save_state(models, weights, output_dir) -> None:
    # Only the dictionaries about to be written change; the model keeps its views.
    for state_dict in weights:
        if isinstance(state_dict, dict):
            split_flat_views(state_dict)


def _has_partial_views(model: torch.nn.Module) -> bool:
    return any(p.untyped_storage().nbytes() != p.numel() * p.element_size() for p in model.parameters())


def _before_load_state(models, input_dir) -> None:
    """Let safetensors' ``load_model`` load into a model whose parameters are flat-buffer views.

    ``load_model`` inspects ``model.state_dict()`` for shared storage before loading and refuses
    partial views. For each model with a safetensors file, that one ``state_dict()`` call is answered
    with split views (a one-shot state-dict hook); the weights are then copied into the real
    parameters by ``load_state_dict`` as usual, so the views stay in place.
    """
    try:
        from accelerate.utils.constants import SAFE_MODEL_NAME
    except ImportError:  # pragma: no cover
        SAFE_MODEL_NAME = "model"
    for index, model in enumerate(models):
        suffix = f"_{index}" if index > 0 else ""
        if not os.path.exists(os.path.join(str(input_dir), f"{SAFE_MODEL_NAME}{suffix}.safetensors")):
            continue
        if isinstance(model, torch.nn.Module) and _has_partial_views(model):
            _answer_next_state_dict_with_split_views(model)


def _answer_next_state_dict_with_split_views(model: torch.nn.Module) -> None:
    handle = None

    def hook(module, state_dict, prefix, local_metadata):
        handle.remove()
        split_flat_views(state_dict)

    handle = model.register_state_dict_post_hook(hook)
