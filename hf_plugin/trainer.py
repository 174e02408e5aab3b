"""``transformers.Trainer`` integration: a fused optimizer and Bagua algorithms, Trainer's loop untouched.

* :class:`BaguaTrainer` is ``Trainer`` with two keyword arguments more: the optimizer Trainer builds
  is fused (``fuse_optimizer=True``), and ``bagua_algorithm="bytegrad"`` (or any registered name)
  attaches a Bagua algorithm to the DDP model Trainer creates.
* :class:`BaguaAlgorithmCallback` / :func:`use_bagua_algorithm` attach an algorithm to a plain
  ``Trainer`` (for instance one built with ``optimizers=(create_fused_optimizer(...), None)``).

Why a callback and not ``DistributedDataParallelKwargs``: Trainer builds its own DDP kwargs
handler and overwrites Accelerate's, and Accelerate only knows its built-in hooks; so the hook is
registered on ``trainer.model_wrapped`` at ``on_train_begin``, after Trainer wrapped the model and
before the first backward.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, Optional

import torch
from transformers import Trainer, TrainerCallback

from ._algorithms import (
    AlgorithmAttachment,
    attach_algorithm,
    check_gradient_handling,
    check_model_selection,
    load_algorithm,
)
from ._hf_compat import trainer_run_dir
from .errors import UnsupportedSetupError
from .optimizer import fuse_for_frameworks, is_fused, require_step_fused, unwrap_optimizer

__all__ = ["BaguaTrainer", "BaguaAlgorithmCallback", "use_bagua_algorithm"]


class BaguaAlgorithmCallback(TrainerCallback):
    """Attach a Bagua algorithm to the model a ``Trainer`` trains.

    Gradient algorithms (``gradient_allreduce``, ``bytegrad``) become the DDP communication hook
    of ``trainer.model_wrapped``; model algorithms (``decentralized``, ``bmuf``) keep gradients
    local and run their weight communication right after every optimizer update
    (``on_optimizer_step``, numbered by Trainer's global step so that a resumed run continues the
    count). In a single process there is nothing to communicate and the callback does nothing
    (one warning).

    The callback needs the trainer (the unwrapped model handed to callbacks does not lead to its
    DDP wrapper): pass ``trainer=`` or use :func:`use_bagua_algorithm` / :class:`BaguaTrainer`.
    """

    def __init__(self, algorithm: Any, trainer: Optional[Trainer] = None, *, autotune: Optional[Dict[str, Any]] = None,
                 **algorithm_kwargs: Any):
        # Resolve now: an unknown name or bad keyword fails when the Trainer is built, on every rank,
        # not in the middle of the first collective.
        self.algorithm = load_algorithm(algorithm, **algorithm_kwargs)
        # Bagua's autotuner: Trainer's DDP fixes its buckets (ddp_bucket_cap_mb), so what is tuned
        # here is decentralized's communication_interval, every `interval` updates (default 20)
        self.autotune = None if autotune is None else dict(autotune)
        self.trainer = None
        self.attachment: Optional[AlgorithmAttachment] = None
        self.resume_from_checkpoint: Any = None  # what the current train() call was given
        if trainer is not None:
            self.bind(trainer)

    def bind(self, trainer: Trainer) -> None:
        """Set the trainer, and record the ``resume_from_checkpoint`` of each of its ``train()`` calls.

        Callbacks never see that argument, and the checkpoint may lie outside ``output_dir``: the
        per-rank files are read from the folder Trainer resumes from, not a guess.
        """
        self.trainer = trainer
        train = trainer.train
        if getattr(train, "_bagua_callback", None) is self:
            return

        @functools.wraps(train)
        def tracked_train(resume_from_checkpoint=None, *args: Any, **kwargs: Any):
            self.resume_from_checkpoint = resume_from_checkpoint
            try:
                return train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self.resume_from_checkpoint = None

        tracked_train._bagua_callback = self
        trainer.train = tracked_train

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer is None:
            raise UnsupportedSetupError(
                "BaguaAlgorithmCallback was added without its trainer; use "
                "hf_plugin.use_bagua_algorithm(trainer, algorithm) or BaguaTrainer(..., bagua_algorithm=...)"
            )
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise UnsupportedSetupError(
                "Bagua algorithms run as DDP communication hooks; DeepSpeed and FSDP do their own gradient "
                "communication. Train with plain DDP (torchrun without deepspeed/fsdp)."
            )
        check_gradient_handling(self.algorithm, loss_scaling=bool(args.fp16), clipping=(args.max_grad_norm or 0) > 0)
        check_model_selection(self.algorithm, load_best_model_at_end=bool(args.load_best_model_at_end))
        wrapped = trainer.model_wrapped
        if self.attachment is not None and self.attachment.wraps(wrapped):
            if hasattr(self.attachment.algorithm, "resume"):
                self.attachment.algorithm.resume()  # async: background rounds again after on_train_end's abort
            return  # a second train() call on the same DDP model: the hook is already in place
        self.attachment = attach_algorithm(self.algorithm, wrapped, optimizer=trainer.optimizer)
        if self.attachment is not None and self.autotune is not None:
            self._start_autotune()
        if self.attachment is not None and state.global_step > 0:
            self._resume(args, state)

    def _start_autotune(self) -> None:
        from bagua_integrations.distributed import AlgorithmConfigError

        options = dict(self.autotune)
        options.setdefault("interval", 20)
        try:
            self.attachment.session.enable_autotune(settings=("communication_interval",), **options)
        except AlgorithmConfigError as error:
            raise UnsupportedSetupError(
                f"bagua_autotune: {error}. Under Trainer, DDP builds its gradient buckets once "
                "(TrainingArguments.ddp_bucket_cap_mb); the autotuner tunes decentralized's communication_interval"
            ) from None

    # Trainer writes its checkpoint (model, optimizer.pt) from rank 0 only; under an algorithm whose
    # replicas differ each rank's weights and optimizer state are its own, so every rank also writes
    # ``bagua_rank{r}.pt`` into the checkpoint folder, and reads it back when training resumes.
    def on_save(self, args, state, control, **kwargs):
        if self.attachment is None:
            return
        folder = _checkpoint_folder(self.trainer, state)
        os.makedirs(folder, exist_ok=True)
        torch.save(self.attachment.rank_state_dict(), os.path.join(folder, _rank_file()))

    def _resume(self, args, state) -> None:
        path = os.path.join(self._resume_folder(args, state), _rank_file())
        if os.path.exists(path):
            self.attachment.load_rank_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        elif self.attachment.session.replicas_differ:
            from bagua_integrations.distributed import CheckpointError

            raise CheckpointError(
                f"resuming at step {state.global_step} under {self.attachment.session.name}, whose ranks' weights "
                f"and optimizer state differ, but {path} (this rank's own state) is missing: Trainer saved only "
                "rank 0's. Resume from a checkpoint written with the Bagua callback attached, or start afresh"
            )

    def _resume_folder(self, args, state) -> str:
        resume = self.resume_from_checkpoint
        if resume is None or resume is False:
            resume = args.resume_from_checkpoint
        if isinstance(resume, bool) and resume:  # Trainer's own rule for train(resume_from_checkpoint=True)
            from transformers.trainer_utils import get_last_checkpoint

            resume = get_last_checkpoint(args.output_dir)
        if isinstance(resume, (str, os.PathLike)):
            return os.fspath(resume)
        return _checkpoint_folder(self.trainer, state)  # resumed some other way: where Trainer saved this step

    def on_train_end(self, args, state, control, **kwargs):
        # async averaging: end the background rounds with one synchronous average (Bagua's
        # algorithm.abort), so every rank evaluates and saves the same weights after train()
        if self.attachment is not None and hasattr(self.attachment.algorithm, "abort"):
            self.attachment.algorithm.abort()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.attachment is None:
            return
        # Called on every rank after every update, also one a GradScaler skipped on this rank only
        # (model algorithms keep gradients local, so ranks may skip differently): the collectives
        # must match. Trainer increments global_step after this event, so this is update n+1.
        self.attachment.after_optimizer_step(step=state.global_step + 1)


def _checkpoint_folder(trainer: Trainer, state) -> str:
    """The folder of Trainer's checkpoint at this step: under ``output_dir``, or during
    ``hyperparameter_search`` under the trial's ``output_dir/run-<trial>``, so that each
    trial's per-rank files sit beside that trial's checkpoint instead of overwriting each other."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(trainer_run_dir(trainer), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def _rank_file() -> str:
    from bagua_integrations.distributed import comm

    return f"bagua_rank{comm.rank()}.pt"


def use_bagua_algorithm(trainer: Trainer, algorithm: Any, **algorithm_kwargs: Any) -> BaguaAlgorithmCallback:
    """Attach a Bagua algorithm to an existing ``Trainer`` (one line before ``trainer.train()``)."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"use_bagua_algorithm expects a transformers.Trainer, got {type(trainer).__name__}")
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, BaguaAlgorithmCallback):
            raise UnsupportedSetupError("this Trainer already has a Bagua algorithm; attach one algorithm per Trainer")
    callback = BaguaAlgorithmCallback(algorithm, trainer=trainer, **algorithm_kwargs)
    trainer.add_callback(callback)
    return callback


class BaguaTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer is fused and, optionally, whose DDP runs a Bagua algorithm.

    Args (on top of Trainer's):
        fuse_optimizer: fuse the optimizer Trainer creates (or the one passed in ``optimizers``)
            before Accelerate wraps it. Default True.
        fuse_kwargs: extra arguments of :func:`bagua_integrations.fuse_optimizer`
            (``on_unsupported``, ``assume_elementwise``, ``do_flatten``).
        bagua_algorithm: a name from ``bagua_integrations.distributed.list_algorithms()`` or an
            algorithm object; ``None`` keeps Trainer's plain DDP allreduce.
        bagua_algorithm_kwargs: keyword arguments of the algorithm (e.g. ``{"global_sync_iter": 4}``
            for ``bmuf``).
        bagua_autotune: ``True`` or a dict (``max_trials``, ``interval`` in updates, ``intervals``,
            ``seed``): Bagua's autotuner on ``decentralized``'s communication interval, scored by
            the updates/s it measures (Trainer's DDP fixes the bucket size itself).
    """

    def __init__(
        self,
        *args: Any,
        fuse_optimizer: bool = True,
        fuse_kwargs: Optional[Dict[str, Any]] = None,
        bagua_algorithm: Any = None,
        bagua_algorithm_kwargs: Optional[Dict[str, Any]] = None,
        bagua_autotune: Any = None,
        **kwargs: Any,
    ):
        fuse_kwargs = dict(fuse_kwargs or {})
        if "replace_step" in fuse_kwargs:
            raise ValueError("fuse_kwargs cannot set replace_step: Trainer only calls step(), so it is always True")
        self.bagua_fuse_optimizer = bool(fuse_optimizer)
        self.bagua_fuse_kwargs = fuse_kwargs
        # Resolve the algorithm before Trainer's (slow) setup so a typo fails at once.
        callback = None
        if bagua_algorithm is not None:
            autotune = {} if bagua_autotune is True else (dict(bagua_autotune) if bagua_autotune else None)
            callback = BaguaAlgorithmCallback(bagua_algorithm, autotune=autotune, **dict(bagua_algorithm_kwargs or {}))
        elif bagua_autotune:
            raise ValueError("bagua_autotune tunes a Bagua algorithm: pass bagua_algorithm too")
        super().__init__(*args, **kwargs)
        fsdp2 = self.is_fsdp_enabled and getattr(self.accelerator, "is_fsdp2", False)
        if self.bagua_fuse_optimizer and (self.is_deepspeed_enabled or (self.is_fsdp_enabled and not fsdp2)):
            raise UnsupportedSetupError(
                "BaguaTrainer(fuse_optimizer=True) cannot run under DeepSpeed or FSDP1: they own the optimizer's "
                "parameter storage. Use FSDP2 (fsdp_config={'fsdp_version': 2}: Trainer builds the optimizer over "
                "the shards, which are fused then), pass fuse_optimizer=False, or train with DDP."
            )
        self.bagua_callback = callback
        if callback is not None:
            callback.bind(self)
            self.add_callback(callback)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        require_step_fused(optimizer, "Trainer")
        if self.bagua_fuse_optimizer and not is_fused(optimizer):
            inner = unwrap_optimizer(optimizer)
            if inner is not optimizer:
                raise UnsupportedSetupError(
                    f"the optimizer is already wrapped ({type(optimizer).__name__}) and was not fused; wrappers "
                    "capture step() when they are built. Pass the bare optimizer, or fuse it first with "
                    "hf_plugin.create_fused_optimizer."
                )
            fuse_for_frameworks(inner, **self.bagua_fuse_kwargs)
        return self.optimizer
