"""Adapter between the HF integration and ``bagua_integrations.distributed`` (the Bagua algorithms).

The core's :class:`AlgorithmSession` drives the algorithm (the cross-rank check, ``attach``,
update counting, model algorithms after each update); this module only connects it to the DDP
model Trainer / Accelerate built: a gradient algorithm's ``ddp_comm_hook`` becomes DDP's
communication hook, and under a model algorithm a hook that communicates nothing replaces DDP's
allreduce (gradients stay local).
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional

import torch

from bagua_integrations.distributed import AlgorithmSession, comm, get_algorithm, list_algorithms

from .errors import AlgorithmSetupError
from .optimizer import unwrap_optimizer

__all__ = [
    "check_gradient_handling",
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


def available_algorithms() -> List[str]:
    """Names accepted by ``bagua_algorithm=`` / ``algorithm=``."""
    return list_algorithms()


def load_algorithm(spec: Any, **kwargs: Any):
    """An algorithm object from a registered name (built with ``kwargs``) or an algorithm object.

    Unknown names and bad keyword arguments raise the core's ``UnknownAlgorithmError`` /
    ``AlgorithmConfigError`` (both ``ValueError``) listing what is accepted.
    """
    algorithm = get_algorithm(spec, **kwargs)
    if algorithm.kind not in _KINDS:
        raise AlgorithmSetupError(
            f"{type(algorithm).__name__} has kind {algorithm.kind!r}; the HF integration runs algorithms of kind {_KINDS}"
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


def keep_local_gradients(state, bucket):
    """DDP communication hook that communicates nothing: each rank keeps its own gradients.

    Used under model algorithms (decentralized, bmuf), which exchange weights, not gradients.
    """
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class AlgorithmAttachment:
    """One algorithm's :class:`AlgorithmSession` on one DDP model (created by :func:`attach_algorithm`).

    ``after_optimizer_step(step)`` must be called on every rank after every optimizer update
    (Trainer: ``on_optimizer_step``; Accelerate: the wrapped ``optimizer.step``), also one a
    GradScaler skipped, so every rank runs the same collectives.
    """

    def __init__(self, algorithm: Any, ddp: torch.nn.parallel.DistributedDataParallel, optimizer: Any = None):
        self.ddp = ddp
        optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        self.session = AlgorithmSession(algorithm, optimizer=optimizer, model=ddp.module, group=ddp.process_group)
        hook = algorithm.ddp_comm_hook if algorithm.kind == "gradient" else keep_local_gradients
        ddp.register_comm_hook(self.session.group, hook)

    @property
    def algorithm(self):
        return self.session.algorithm

    @property
    def kind(self) -> str:
        return self.session.kind

    @property
    def updates(self) -> int:
        """Optimizer updates counted so far."""
        return self.session.num_updates

    @property
    def needs_step_callback(self) -> bool:
        return self.session.acts_after_step

    def wraps(self, model: Any) -> bool:
        return find_ddp(model) is self.ddp

    # checkpoints: this rank's own state (algorithm counters, and where replicas differ its optimizer
    # state and weights), written by every rank; the logic is the core's AlgorithmSession
    def rank_state_dict(self) -> dict:
        """This rank's own state (the Trainer callback writes one file per rank)."""
        return self.session.rank_state_dict(self.ddp.module)

    def load_rank_state_dict(self, state: dict) -> bool:
        return self.session.load_rank_state_dict(state, self.ddp.module)

    def state_dict(self) -> dict:
        """Every rank's :meth:`rank_state_dict`, gathered (Accelerate's ``register_for_checkpointing``
        writes one file from the main process; ``save_state`` runs on every rank)."""
        ranks = [None] * comm.world_size(self.session.group)
        torch.distributed.all_gather_object(ranks, self.rank_state_dict(), group=self.session.group)
        return {"ranks": ranks}

    def load_state_dict(self, state: dict) -> bool:
        """This rank's entry of :meth:`state_dict` (refused by name if the world size changed)."""
        ranks = state["ranks"]
        if len(ranks) != comm.world_size(self.session.group):
            self.session.check_resume(ranks[0]["algorithm"])  # raises CheckpointError where replicas differ
            return self.load_rank_state_dict(ranks[0])
        return self.load_rank_state_dict(ranks[comm.rank(self.session.group)])

    def after_optimizer_step(self, step: Optional[int] = None) -> bool:
        """Count the update; model algorithms communicate weights here. Returns whether they did."""
        return self.session.after_update(step)


def check_gradient_handling(algorithm: Any, *, loss_scaling: bool, clipping: bool) -> None:
    """Refuse fp16 loss scaling and gradient clipping under an algorithm that mixes the gradients
    with optimizer state before communicating them (qadam: ``needs_unscaled_gradients``): the
    scaler would unscale the momentum, the clip would clip it."""
    if not getattr(algorithm, "needs_unscaled_gradients", False):
        return
    if loss_scaling:
        raise AlgorithmSetupError(
            f"{algorithm.name} folds each gradient into the optimizer's momentum before communicating, so the "
            "gradients must not be loss-scaled: train in bf16 or fp32 instead of fp16"
        )
    if clipping:
        raise AlgorithmSetupError(
            f"{algorithm.name} communicates momentum in place of gradients after its warm-up, so gradient "
            "clipping would clip the momentum: set TrainingArguments(max_grad_norm=0), or remove "
            "accelerator.clip_grad_norm_ / clip_grad_value_ from the loop"
        )


def check_model_selection(algorithm: Any, *, load_best_model_at_end: bool) -> None:
    """Refuse ``load_best_model_at_end`` under an algorithm whose ranks hold different weights
    between synchronizations (decentralized, bmuf, async): Trainer would rank checkpoints by
    rank 0's evaluation of its own replica and load rank 0's saved replica on every rank, which
    is neither the weights that were evaluated on each rank nor their average."""
    if load_best_model_at_end and getattr(algorithm, "weights_differ", False):
        raise AlgorithmSetupError(
            f"load_best_model_at_end=True under {algorithm.name}, whose ranks hold different weights between "
            "synchronizations: the best checkpoint would be rank 0's replica, loaded on every rank. Set "
            "load_best_model_at_end=False (evaluations during training measure rank 0's own replica), or use "
            "a gradient algorithm (gradient_allreduce, bytegrad, qadam), whose ranks hold the same weights"
        )


def attach_algorithm(algorithm: Any, wrapped_model: Any, optimizer: Any = None) -> Optional[AlgorithmAttachment]:
    """Attach ``algorithm`` to the DDP module inside ``wrapped_model``; ``None`` in a single process."""
    ddp = find_ddp(wrapped_model)
    world = comm.world_size()
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
