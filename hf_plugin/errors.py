"""Named errors of the HuggingFace plugin.

Each one says what is wrong and what to change, so a misconfigured run stops at setup with a
message instead of hanging in a collective or silently training with different math.
"""

from __future__ import annotations


class HFPluginError(RuntimeError):
    """Base class of the errors raised by ``hf_plugin``."""


class UnsupportedSetupError(HFPluginError, ValueError):
    """The Trainer / Accelerate configuration cannot host a fused optimizer or a Bagua algorithm.

    Examples: DeepSpeed or FSDP (they own the optimizer and the parameter storage), a model that
    is already wrapped in ``DistributedDataParallel``, an optimizer already wrapped by
    ``accelerator.prepare`` (its step was captured before fusing).
    """


class UnsupportedOptimizerError(HFPluginError, ValueError):
    """The optimizer chosen by ``TrainingArguments.optim`` cannot be built as a plain optimizer class.

    Factories (Muon, Dion), layer-wise or low-rank optimizers (GaLore, Apollo, LOMO) build their
    own parameter groups; pass ``optimizer_cls=`` explicitly instead.
    """


class AlgorithmSetupError(HFPluginError, ValueError):
    """A Bagua algorithm was asked for but cannot be attached (unknown name, no DDP model, ...)."""


class DistributedCoreMissingError(HFPluginError, ImportError):
    """``bagua_integrations.distributed`` (the algorithms) is not importable in this installation."""
