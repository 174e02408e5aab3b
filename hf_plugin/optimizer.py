"""Fused optimizers for ``transformers.Trainer`` and Accelerate loops.

``create_fused_optimizer(model, args)`` builds the optimizer ``Trainer.create_optimizer`` would
build (same weight-decay / no-decay groups, same class and keyword arguments from
``TrainingArguments``), fuses it with :func:`bagua_integrations.fuse_optimizer` so that the plain
``optimizer.step()`` -- the only method Trainer, ``AcceleratedOptimizer`` and ``GradScaler`` ever
call -- runs the fused update, and returns it for ``Trainer(optimizers=(optimizer, None))``.

:class:`FusedOptimizer` does the same through ``Trainer(optimizer_cls_and_kwargs=...)``.

The plugin does no optimizer math: every update is the optimizer class's own ``step``.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple, Type

import torch

from bagua_integrations import fuse_optimizer, fusion_report as _core_fusion_report, is_fused_optimizer
from bagua_integrations.errors import NotAnOptimizerError

from .errors import UnsupportedOptimizerError, UnsupportedSetupError

__all__ = [
    "create_fused_optimizer",
    "fused_optimizer_cls_and_kwargs",
    "FusedOptimizer",
    "trainer_param_groups",
    "unwrap_optimizer",
    "fusion_report",
    "is_fused",
    "step_is_fused",
    "fuse_for_frameworks",
]

# Keys that ``Trainer.get_optimizer_cls_and_kwargs`` uses to hand over its own parameter
# structure (GaLore/Apollo "params", LOMO "model", layer-wise "optimizer_dict").
_OWN_PARAMS_KEYS = ("params", "model", "optimizer_dict")



# ---------------------------------------------------------------------------------- helpers
def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The real optimizer inside wrappers that keep it as ``.optimizer`` (``AcceleratedOptimizer``)."""
    current = optimizer
    for _ in range(8):
        if is_fused_optimizer(current):
            return current
        inner = getattr(current, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is current:
            return current
        current = inner
    return current


def is_fused(optimizer: Any) -> bool:
    """True when ``optimizer`` (or the optimizer an ``AcceleratedOptimizer`` wraps) is fused."""
    return is_fused_optimizer(unwrap_optimizer(optimizer))


def step_is_fused(optimizer: Any) -> bool:
    """True when a plain ``optimizer.step()`` runs the fused update (fused with ``replace_step=True``)."""
    inner = unwrap_optimizer(optimizer)
    return is_fused_optimizer(inner) and _core_fusion_report(inner).step_replaced


# fuse_optimizer's own arguments that these adapters fix: Trainer and Accelerate only call step()
_FIXED_FUSE_ARGS = ("replace_step", "do_flatten")


def _refuse_fixed_fuse_args(kwargs: Dict[str, Any]) -> None:
    """Refuse them where they arrive, not later as an unknown argument of the optimizer's constructor."""
    fixed = [name for name in _FIXED_FUSE_ARGS if name in kwargs]
    if fixed:
        raise ValueError(
            f"{', '.join(fixed)} cannot be set: Trainer and Accelerate only call step(), so the step is always "
            "the fused one (replace_step=True, do_flatten=True); drop the argument"
        )


def fuse_for_frameworks(optimizer: torch.optim.Optimizer, **fuse_kwargs: Any) -> torch.optim.Optimizer:
    """``fuse_optimizer(optimizer, replace_step=True, ...)``: Trainer and Accelerate only call ``step()``."""
    _refuse_fixed_fuse_args(fuse_kwargs)
    return fuse_optimizer(optimizer, replace_step=True, **fuse_kwargs)


def require_step_fused(optimizer: Any, where: str) -> None:
    """Refuse an optimizer fused without ``replace_step=True``: frameworks only ever call ``step()``."""
    if is_fused(optimizer) and not step_is_fused(optimizer):
        raise UnsupportedSetupError(
            f"this optimizer was fused with replace_step=False, but {where} only ever calls optimizer.step(), "
            "which would run the ordinary per-tensor update. Fuse it with fuse_optimizer(opt, replace_step=True) "
            "or build it with hf_plugin.create_fused_optimizer."
        )


def fusion_report(optimizer: Any):
    """:func:`bagua_integrations.fusion_report` that also accepts ``trainer.optimizer`` (an AcceleratedOptimizer)."""
    return _core_fusion_report(unwrap_optimizer(optimizer))


def _check_model(model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"create_fused_optimizer expects the model (a torch.nn.Module), got {type(model).__name__}")
    wrapper = type(model).__name__
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or wrapper in (
        "FullyShardedDataParallel",
        "DeepSpeedEngine",
        "DataParallel",
    ):
        raise UnsupportedSetupError(
            f"the model is already wrapped in {wrapper}; fusing moves every parameter into flat buffers, which "
            "must happen before the wrapper records them. Build the fused optimizer from the bare model "
            "(Trainer and accelerator.prepare wrap it afterwards)."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedSetupError("the model has no trainable parameters (requires_grad=True); nothing to optimize")


def _default_args():
    from transformers import TrainingArguments

    return TrainingArguments(report_to="none")


def _fsdp_version(args: Any) -> int:
    config = getattr(args, "fsdp_config", None) or {}
    return int(config.get("fsdp_version", config.get("version", 1)) or 1)


def _check_args(args: Any, trainer_builds_it: bool = False) -> None:
    """``trainer_builds_it``: Trainer builds the optimizer (``optimizer_cls_and_kwargs``), after FSDP2 sharded the model."""
    for name in ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"):
        if not hasattr(args, name):
            raise TypeError(
                f"args must be transformers.TrainingArguments (or have its optimizer fields); "
                f"{type(args).__name__} has no '{name}'"
            )
    if getattr(args, "deepspeed", None):
        raise UnsupportedSetupError(
            "DeepSpeed builds and steps its own optimizer over its own flat buffers; a fused optimizer "
            "cannot be handed to it. Drop args.deepspeed or use Trainer's default optimizer."
        )
    if getattr(args, "fsdp", None) and not (trainer_builds_it and _fsdp_version(args) >= 2):
        raise UnsupportedSetupError(
            "Trainer refuses optimizers passed in with FSDP (it shards the model first). Under FSDP2 "
            "(fsdp_config={'fsdp_version': 2}) let Trainer build the fused optimizer over the shards: "
            "Trainer(optimizer_cls_and_kwargs=hf_plugin.fused_optimizer_cls_and_kwargs(args)) or "
            "BaguaTrainer(fuse_optimizer=True). FSDP1 keeps its own flat parameters: use DDP there."
        )


def _place_model(model: torch.nn.Module, args: Any) -> None:
    """Put the model where Trainer would put it, *before* fusing (a later move would break the views)."""
    if getattr(model, "hf_device_map", None) is not None:
        return  # dispatched over several devices: Trainer does not move it either
    if getattr(args, "place_model_on_device", None) is False:
        return
    device = getattr(args, "device", None)
    if device is None:
        return
    device = torch.device(device)
    if any(p.device != device for p in model.parameters()):
        model.to(device)


def trainer_param_groups(model: torch.nn.Module, weight_decay: float):
    """The two parameter groups of ``Trainer.create_optimizer``: decayed weights, and biases/norms without decay."""
    from transformers import Trainer

    # get_decay_parameter_names does not use the Trainer instance; call it unbound so the plugin
    # follows whatever rule the installed transformers applies.
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def _takes(cls: type, name: str, like) -> bool:
    """Whether ``cls`` takes ``name`` in the form ``like`` tells (its default passes ``like``, or it
    has none): Adafactor's ``eps`` is a pair and Adan's ``betas`` three, which Adam's would break."""
    try:
        param = inspect.signature(cls).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and (param.default is param.empty or like(param.default))


def _a_pair(value) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2


def _a_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _resolve_cls_and_kwargs(
    args: Any, model: Optional[torch.nn.Module], optimizer_cls: Optional[type], overrides: Dict[str, Any]
) -> Tuple[type, Dict[str, Any]]:
    if optimizer_cls is None:
        from transformers import Trainer
        from transformers.trainer_optimizer import is_optimizer_factory

        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        own = [k for k in _OWN_PARAMS_KEYS if k in kwargs]
        if is_optimizer_factory(cls) or own:
            raise UnsupportedOptimizerError(
                f"args.optim={str(getattr(args, 'optim', '?'))!r} builds its own parameter structure "
                f"({'factory' if is_optimizer_factory(cls) else ', '.join(own)}), so it cannot be fused as one "
                "optimizer; pass optimizer_cls= (e.g. torch.optim.AdamW) instead"
            )
        kwargs = dict(kwargs)
    else:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise NotAnOptimizerError(
                f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}"
            )
        cls = optimizer_cls
        kwargs = {"lr": args.learning_rate}
        if _takes(cls, "betas", _a_pair):  # Adam-like: Trainer's adam_* arguments, as it gives its Adam family
            kwargs["betas"] = (args.adam_beta1, args.adam_beta2)
            if _takes(cls, "eps", _a_number):
                kwargs["eps"] = args.adam_epsilon
    _refuse_fixed_fuse_args(overrides)
    kwargs.update(overrides)
    return cls, kwargs


# ---------------------------------------------------------------------------------- public API
def create_fused_optimizer(
    model: torch.nn.Module,
    args: Any = None,
    optimizer_cls: Optional[Type[torch.optim.Optimizer]] = None,
    *,
    on_unsupported: str = "fallback",
    assume_elementwise: bool = False,
    compile: Any = "auto",
    place_model: bool = True,
    **optimizer_kwargs: Any,
) -> torch.optim.Optimizer:
    """Build the optimizer ``Trainer.create_optimizer`` would build, fused, for ``Trainer(optimizers=(opt, None))``.

    Args:
        model: the bare model (not yet wrapped in DDP); its trainable parameters are optimized.
        args: ``TrainingArguments`` (``None``: its defaults). ``learning_rate``, ``weight_decay``,
            ``adam_beta1/2`` and ``adam_epsilon`` are used exactly as Trainer uses them.
        optimizer_cls: any ``torch.optim.Optimizer`` subclass. ``None`` takes the class and keyword
            arguments ``args.optim`` selects (``adamw_torch_fused`` / ``adamw_torch``: ``torch.optim.AdamW``).
            An explicit class gets ``lr`` and, when its constructor takes them, ``betas`` and ``eps``.
        on_unsupported, assume_elementwise, compile: passed to :func:`bagua_integrations.fuse_optimizer`.
        place_model: move the model to ``args.device`` first, as Trainer would (fusing must happen on
            the final device).
        **optimizer_kwargs: override or add constructor arguments (e.g. ``foreach=False``).

    Returns the optimizer, an instance of its own class whose ``step()`` runs the fused update.
    """
    _check_model(model)
    if args is None:
        args = _default_args()
    _check_args(args)
    if place_model:
        _place_model(model, args)
    cls, kwargs = _resolve_cls_and_kwargs(args, model, optimizer_cls, optimizer_kwargs)
    optimizer = cls(trainer_param_groups(model, args.weight_decay), **kwargs)
    return fuse_for_frameworks(
        optimizer, on_unsupported=on_unsupported, assume_elementwise=assume_elementwise, compile=compile
    )


class FusedOptimizer(torch.optim.Optimizer):
    """An ``optimizer_cls`` for ``Trainer(optimizer_cls_and_kwargs=(FusedOptimizer, kwargs))``.

    Calling it builds ``kwargs["optimizer_cls"](params, **rest)`` (default ``torch.optim.AdamW``),
    fuses it with ``.step()`` on the fused path and returns *that* object -- an instance of the real
    optimizer class, never of ``FusedOptimizer``. It subclasses ``torch.optim.Optimizer`` only so that
    Trainer treats it as an optimizer class (not a factory) and passes its weight-decay groups.
    Use :func:`fused_optimizer_cls_and_kwargs` to fill ``kwargs`` from ``TrainingArguments``.
    """

    def __new__(
        cls,
        params,
        optimizer_cls: Optional[Type[torch.optim.Optimizer]] = None,
        *,
        on_unsupported: str = "fallback",
        assume_elementwise: bool = False,
        compile: Any = "auto",
        **kwargs: Any,
    ):
        real = torch.optim.AdamW if optimizer_cls is None else optimizer_cls
        if not (isinstance(real, type) and issubclass(real, torch.optim.Optimizer)) or issubclass(real, FusedOptimizer):
            raise NotAnOptimizerError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {real!r}")
        _refuse_fixed_fuse_args(kwargs)
        optimizer = real(params, **kwargs)
        return fuse_for_frameworks(
            optimizer, on_unsupported=on_unsupported, assume_elementwise=assume_elementwise, compile=compile
        )


def fused_optimizer_cls_and_kwargs(
    args: Any = None,
    optimizer_cls: Optional[Type[torch.optim.Optimizer]] = None,
    *,
    on_unsupported: str = "fallback",
    assume_elementwise: bool = False,
    compile: Any = "auto",
    **optimizer_kwargs: Any,
) -> Tuple[type, Dict[str, Any]]:
    """``(FusedOptimizer, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``.

    ``kwargs`` are the ones :func:`create_fused_optimizer` would use; Trainer adds its weight-decay
    groups and builds the optimizer after placing the model, so nothing is moved here.
    """
    if args is None:
        args = _default_args()
    _check_args(args, trainer_builds_it=True)
    cls, kwargs = _resolve_cls_and_kwargs(args, None, optimizer_cls, optimizer_kwargs)
    kwargs.update(optimizer_cls=cls, on_unsupported=on_unsupported, assume_elementwise=assume_elementwise,
                  compile=compile)
    return FusedOptimizer, kwargs
