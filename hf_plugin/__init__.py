"""HuggingFace integration of bagua-integrations: fused optimizers and Bagua algorithms in Trainer and Accelerate.

Trainer, one line::

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizers=(hf_plugin.create_fused_optimizer(model, args), None))
    # or: trainer = hf_plugin.BaguaTrainer(model=model, args=args, train_dataset=ds, bagua_algorithm="bytegrad")

Accelerate, one line::

    model, optimizer, loader = hf_plugin.prepare(accelerator, model, optimizer, loader, algorithm="bytegrad")

See docs/hf.md.
"""

from __future__ import annotations

from ._algorithms import AlgorithmAttachment, BaguaAlgorithmWarning, available_algorithms
from .accelerator import prepare
from .errors import (
    AlgorithmSetupError,
    DistributedCoreMissingError,
    HFPluginError,
    UnsupportedOptimizerError,
    UnsupportedSetupError,
)
from .optimizer import (
    FusedOptimizer,
    create_fused_optimizer,
    fused_optimizer_cls_and_kwargs,
    fusion_report,
    is_fused,
    step_is_fused,
    trainer_param_groups,
    unwrap_optimizer,
)

# The Trainer classes import transformers' Trainer (slow); load them on first use.
_TRAINER_NAMES = ("BaguaTrainer", "BaguaAlgorithmCallback", "use_bagua_algorithm")


def __getattr__(name):
    if name in _TRAINER_NAMES:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hf_plugin' has no attribute {name!r}")


__all__ = [
    "create_fused_optimizer",
    "fused_optimizer_cls_and_kwargs",
    "FusedOptimizer",
    "trainer_param_groups",
    "prepare",
    "BaguaTrainer",
    "BaguaAlgorithmCallback",
    "use_bagua_algorithm",
    "available_algorithms",
    "AlgorithmAttachment",
    "fusion_report",
    "is_fused",
    "step_is_fused",
    "unwrap_optimizer",
    "HFPluginError",
    "UnsupportedSetupError",
    "UnsupportedOptimizerError",
    "AlgorithmSetupError",
    "DistributedCoreMissingError",
    "BaguaAlgorithmWarning",
]
