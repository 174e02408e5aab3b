"""Adapter between the HF integration and ``bagua_integrations.distributed`` (the Bagua algorithms).

What the HF side uses of an algorithm (``bagua_integrations.distributed.Algorithm``):

* ``kind``: ``"gradient"`` -- it averages gradients: ``algorithm.ddp_comm_hook`` becomes the
  communication hook of the DDP model Trainer / Accelerate built; ``"model"`` -- gradients stay
  local (a hook that communicates nothing replaces DDP's allreduce) and ``algorithm.after_step``
  changes the weights right after every optimizer step;
* ``attach(params, optimizer, group)``, once, on every rank, before the first step.

Everything that touches the distributed core goes through this module.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .errors import AlgorithmSetupError, DistributedCoreMissingError
from .optimizer import is_fused, unwrap_optimizer

__all__ = [
    "load_algorithm",
    "attach_algorithm",
    "AlgorithmAttachment",
    "BaguaAlgorithmWarning",
    "available_algorithms",
    "find_ddp",
]

_KINDS = ("gradient", "model")


class BaguaAlgorithmWarning(UserWarning):
    """A Bagua algorithm was requested where there is nothing to communicate (a single process)."""


def _core():
    """``(get_algorithm, list_algorithms)`` of the distributed core."""
    try:
        from bagua_integrations import distributed as core

        return core.get_algorithm, core.list_algorithms
    except (ImportError, AttributeError):
        pass
    try:
        from bagua_integrations.distributed.algorithms import get_algorithm, list_algorithms
    except ImportError as error:
        raise DistributedCoreMissingError(
            "Bagua algorithms need bagua_integrations.distributed, which this installation does not have "
            f"({error}); update bagua-integrations, or train without bagua_algorithm= / algorithm="
        ) from error
    return get_algorithm, list_algorithms


def _consistency_check():
    try:
        from bagua_integrations.distributed import check_same_on_all_ranks, describe_model
    except ImportError:  # pragma: no cover - older core: no cross-rank check
        return None, None
    return check_same_on_all_ranks, describe_model


def available_algorithms() -> List[str]:
    """Names accepted by ``bagua_algorithm=`` / ``algorithm=``."""
    return list(_core()[1]())


def load_algorithm(spec: Any, **kwargs: Any):
    """An algorithm object from a registered name (built with ``kwargs``) or an algorithm object.

    Unknown names and bad keyword arguments raise the core's ``UnknownAlgorithmError`` /
    ``AlgorithmConfigError`` (both ``ValueError``) listing what is accepted.
    """
    get_algorithm, _ = _core()
    algorithm = get_algorithm(spec, **kwargs)
    kind = getattr(algorithm, "kind", None)
    if kind not in _KINDS:
        raise AlgorithmSetupError(
            f"{type(algorithm).__name__} has kind {kind!r}; the HF integration runs algorithms of kind {_KINDS}"
        )
    return algorithm


def find_ddp(model: Any) -> Optional[torch.nn.parallel.DistributedDataParallel]:
    """The DistributedDataParallel module in ``model`` (looking through ``torch.compile`` wrappers)."""
    current = model
    for _ in range(4):
        if isinstance(current, torch.nn.parallel.DistributedDataParallel):
            return current
        current = getattr(current, "_orig_mod", None)
        if current is None:
            return None
    return None


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def keep_local_gradients(state, bucket):
    """DDP communication hook that communicates nothing: each rank keeps its own gradients.

    Used under model algorithms (decentralized, bmuf), which exchange weights, not gradients.
    """
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class AlgorithmAttachment:
    """One algorithm attached to one DDP model (created by :func:`attach_algorithm`).

    ``after_optimizer_step(step)`` must be called on every rank after every optimizer update
    (Trainer: ``on_optimizer_step``; Accelerate: the wrapped ``optimizer.step``). It is called
    even when a GradScaler skipped the local update, so every rank runs the same collectives.
    """

    def __init__(self, algorithm: Any, ddp: torch.nn.parallel.DistributedDataParallel, optimizer: Any = None):
        self.algorithm = algorithm
        self.kind = algorithm.kind
        self.ddp = ddp
        self.optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        # None means the default group to the core (and to DDP's hook state)
        self.group = None if ddp.process_group is dist.group.WORLD else ddp.process_group
        self.updates = 0  # after_step calls made (model kind)
        self._check_ranks_agree()
        params = self._params()
        algorithm.attach(params, self.optimizer, self.group)
        if self.kind == "gradient":
            ddp.register_comm_hook(self.group, algorithm.ddp_comm_hook)
        else:
            ddp.register_comm_hook(self.group, keep_local_gradients)

    def _params(self) -> List[torch.Tensor]:
        # As the core does: the optimizer's parameters (fairseq's BMUF acts on those), else the model's.
        if self.optimizer is not None:
            return [p for group in self.optimizer.param_groups for p in group["params"]]
        return [p for p in self.ddp.module.parameters() if p.requires_grad]

    def _check_ranks_agree(self) -> None:
        """Same model, optimizer and algorithm on every rank, or a named error on every rank (no hang)."""
        check, describe = _consistency_check()
        if check is None:
            return
        lines = list(describe(self.ddp.module))
        signature = getattr(self.algorithm, "signature", None)
        lines.append(f"algorithm {signature() if callable(signature) else type(self.algorithm).__name__}")
        if self.optimizer is not None:
            lines.append(f"optimizer {type(self.optimizer).__name__}{' fused' if is_fused(self.optimizer) else ''}")
        timeout = getattr(self.algorithm, "timeout", None)
        check(lines, "model, optimizer or Bagua algorithm", group=self.group, timeout=timeout)

    @property
    def needs_step_callback(self) -> bool:
        return self.kind == "model"

    def wraps(self, model: Any) -> bool:
        return find_ddp(model) is self.ddp

    def after_optimizer_step(self, step: Optional[int] = None) -> bool:
        """Model algorithms communicate weights here; returns whether they did. No-op for gradient ones."""
        if self.kind != "model":
            return False
        self.updates += 1
        return bool(self.algorithm.after_step(step=step))


def attach_algorithm(algorithm: Any, wrapped_model: Any, optimizer: Any = None) -> Optional[AlgorithmAttachment]:
    """Attach ``algorithm`` to the DDP module inside ``wrapped_model``; ``None`` in a single process."""
    ddp = find_ddp(wrapped_model)
    world = _world_size()
    if ddp is None:
        if world > 1:
            raise AlgorithmSetupError(
                f"{world} processes but the model is a {type(wrapped_model).__name__}, not DistributedDataParallel; "
                "Bagua algorithms run on the DDP model that Trainer / accelerator.prepare build (not under "
                "DeepSpeed, FSDP or DataParallel)"
            )
        warnings.warn(
            f"Bagua algorithm {getattr(algorithm, 'name', type(algorithm).__name__)!r} does nothing here: a single "
            "process has nothing to communicate",
            BaguaAlgorithmWarning,
            stacklevel=3,
        )
        return None
    return AlgorithmAttachment(algorithm, ddp, optimizer)
