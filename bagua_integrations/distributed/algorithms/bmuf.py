"""``bmuf``: blockwise model-update filtering, step for step the numbers of fairseq's FairseqBMUF.

Ranks train locally (gradients are never exchanged). Every ``global_sync_iter`` updates the
ranks average how far they moved since the last synchronisation (the "block gradient"),
filter it with block momentum, and all continue from the same new global model.
"""

from __future__ import annotations

import copy
import math
from typing import List, Optional

import torch

from .. import comm
from ..errors import AlgorithmConfigError
from ..sync import allreduce_optimizer_state
from .base import ModelAlgorithm
from .registry import register_algorithm

__all__ = ["BMUF"]


def _number(name: str, value, what: str, valid) -> float:
    """``value`` as a float, or AlgorithmConfigError saying it must be ``what``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or not valid(number):
        raise AlgorithmConfigError(f"{name} must be {what}, got {value!r}")
    return number


@register_algorithm("bmuf")
class BMUF(ModelAlgorithm):
    """Blockwise model-update filtering (Chen & Huo, ICASSP 2016), as fairseq runs it.

    After optimizer update number ``n`` (counting from 1):

    * ``n == warmup_iterations``: rank 0's weights are broadcast, the optimizer state is
      averaged (``average_sync``) or reset to what it was at :meth:`attach`, and the block
      state restarts from the broadcast weights;
    * ``n > warmup_iterations`` and ``n % global_sync_iter == 0``: block sync. With
      ``block_momentum == 0`` the weights are simply averaged. Otherwise, with ``global``
      the weights of the last sync and ``w`` the local ones::

          block_grad = average over ranks of (global - w)
          smoothed   = block_momentum * smoothed + block_lr * block_grad
          w          = global - smoothed            (minus block_momentum * smoothed with use_nbm)
          global     = w

      and the optimizer state is averaged when ``average_sync`` is set.

    Args mirror fairseq's ``--block-lr --block-momentum --global-sync-iter
    --warmup-iterations --use-nbm --average-sync``. ``hierarchical`` is accepted for
    interface symmetry but BMUF always averages over the whole group (False by default).

    :meth:`attach` must run before the first optimizer step (it records the starting
    weights and optimizer state, as fairseq does when the optimizer is built).

    Under ``Join`` (uneven inputs) a rank that ran out of data contributes nothing to the block
    gradient (nor to averaged optimizer state) and the mean is over the ranks that still have
    data; it applies the same block update, so after each sync every replica holds the same
    global model. The warmup broadcast comes from the lowest rank that has data.
    """

    name = "bmuf"
    hierarchical_default = False
    supports_join = True

    def __init__(
        self,
        block_lr: float = 1.0,
        block_momentum: float = 0.875,
        global_sync_iter: int = 50,
        warmup_iterations: int = 500,
        use_nbm: bool = False,
        average_sync: bool = False,
        hierarchical: Optional[bool] = None,
        timeout=None,
    ):
        super().__init__(hierarchical=hierarchical, timeout=timeout)
        self.validate_hierarchy()
        if not isinstance(global_sync_iter, int) or global_sync_iter < 1:
            raise AlgorithmConfigError(f"global_sync_iter must be an integer >= 1, got {global_sync_iter!r}")
        if not isinstance(warmup_iterations, int) or warmup_iterations < 0:
            raise AlgorithmConfigError(f"warmup_iterations must be an integer >= 0, got {warmup_iterations!r}")
        self.block_lr = _number("block_lr", block_lr, "a finite number > 0 (fairseq's default: 1.0)",
                                lambda v: math.isfinite(v) and v > 0)
        self.block_momentum = _number("block_momentum", block_momentum, "a number in [0, 1) (fairseq's default: 0.875; "
                                      "1 or more makes the block updates grow without bound)", lambda v: 0 <= v < 1)
        self.global_sync_iter = global_sync_iter
        self.warmup_iterations = warmup_iterations
        self.use_nbm = bool(use_nbm)
        self.average_sync = bool(average_sync)
        self.global_params: List[torch.Tensor] = []
        self.smoothed_grads: List[torch.Tensor] = []
        self.initial_optimizer_state = None

    def hyperparameters(self):
        return dict(
            super().hyperparameters(),
            block_lr=self.block_lr,
            block_momentum=self.block_momentum,
            global_sync_iter=self.global_sync_iter,
            warmup_iterations=self.warmup_iterations,
            use_nbm=self.use_nbm,
            average_sync=self.average_sync,
        )

    # ------------------------------------------------------------------ lifecycle
    def validate_hierarchy(self) -> None:
        if self.hierarchical:
            raise AlgorithmConfigError("bmuf synchronises over the whole group; pass hierarchical_reduce=False (or None)")

    def attach(self, params, optimizer=None, group=None) -> "BMUF":
        needs_optimizer = self.average_sync or self.warmup_iterations > 0
        if optimizer is None and needs_optimizer:
            raise AlgorithmConfigError(
                "bmuf needs the optimizer (attach(params, optimizer)) because it "
                + ("averages its state at every sync (average_sync=True)" if self.average_sync
                   else f"resets its state when warmup ends (warmup_iterations={self.warmup_iterations})")
            )
        return super().attach(params, optimizer, group)

    def on_attach(self) -> None:
        self.initial_optimizer_state = (
            copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        )
        self._reset_block()

    def reattach(self, params, optimizer, group) -> None:
        if self.pack is not None:
            raise AlgorithmConfigError(
                "bmuf.after_step got different parameters from the ones attached; bmuf keeps the "
                "weights of the last sync per parameter, so attach(params, optimizer) once and pass the same ones"
            )
        raise AlgorithmConfigError(
            "bmuf.after_step was called before bmuf.attach(params, optimizer): attach before the first "
            "optimizer step so the block starts from the initial weights"
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """The update counter, the global model of the last sync and the block momentum, per parameter.

        Before warmup ends it also holds the optimizer state recorded at :meth:`attach` (what the
        warmup sync resets to). The same on every rank; the weights and optimizer state of each
        rank, which differ between syncs, belong in that rank's own checkpoint.
        """
        state = super().state_dict()
        state["global_params"] = [t.clone() for t in self._per_tensor(self.global_params)]
        state["smoothed_grads"] = [t.clone() for t in self._per_tensor(self.smoothed_grads)]
        if self.num_updates < self.warmup_iterations and self.initial_optimizer_state is not None:
            state["initial_optimizer_state"] = copy.deepcopy(self.initial_optimizer_state)
        return state

    @torch.no_grad()
    def restore(self, state) -> None:
        super().restore(state)
        for key, flats in (("global_params", self.global_params), ("smoothed_grads", self.smoothed_grads)):
            saved = state.get(key)
            if saved is None:
                continue
            tensors = self._per_tensor(flats)
            if len(saved) != len(tensors) or any(a.shape != b.shape for a, b in zip(saved, tensors)):
                from ..errors import CheckpointError

                raise CheckpointError(
                    f"bmuf's checkpointed {key} hold {len(saved)} tensors of shapes "
                    f"{[tuple(t.shape) for t in saved][:4]}..., the attached parameters {len(tensors)} of shapes "
                    f"{[tuple(t.shape) for t in tensors][:4]}...: resume with the model the checkpoint was saved from"
                )
            for mine, theirs in zip(tensors, saved):
                mine.copy_(theirs)
        if state.get("initial_optimizer_state") is not None:
            self.initial_optimizer_state = copy.deepcopy(state["initial_optimizer_state"])

    def weights_loaded(self) -> None:
        """Weights loaded after :meth:`attach` without bmuf's own state: the block restarts from them.

        (``wrapped.module.load_state_dict(...)`` after ``bagua_init``, the usual DDP order.) Once
        :meth:`load_state_dict` restored the global model, it is kept.
        """
        if self.pack is not None and not self.restored:
            self._reset_block()

    @torch.no_grad()
    def _reset_block(self) -> None:
        flats = self.pack.gather()
        self.global_params = [flat.clone() for flat in flats]
        self.smoothed_grads = [torch.zeros_like(flat) for flat in flats]

    # ------------------------------------------------------------------ one update
    def update(self, step: int, group) -> bool:
        if not comm.is_distributed(group):
            return False
        if step == self.warmup_iterations:
            self._warmup_sync(group)
            return True
        if step > self.warmup_iterations and step % self.global_sync_iter == 0:
            self._block_sync(group)
            return True
        return False

    @torch.no_grad()
    def _warmup_sync(self, group) -> None:
        flats = self.pack.gather()
        root = self.join_state.src if self.join_state is not None else comm.group_ranks(group)[0]
        self.run([_broadcast(flat, root, group) for flat in flats], "warmup broadcast")
        self.pack.scatter()
        if self.average_sync:
            self._average_optimizer_state(group)
        else:
            # fairseq resets the optimizer's *state* here; the groups' settings stay as they are now
            # (fairseq sets its lr again every update; a torch scheduler such as StepLR, which
            # builds on the current lr, would otherwise lose its progress)
            settings = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            self.optimizer.load_state_dict(copy.deepcopy(self.initial_optimizer_state))
            for g, kept in zip(self.optimizer.param_groups, settings):
                g.update(kept)
        self._reset_block()

    @torch.no_grad()
    def _block_sync(self, group) -> None:
        join = self.join_state
        flats = self.pack.gather()  # averaged like fairseq: divided before summing, same bits
        if self.block_momentum == 0:
            if join is not None:
                for flat in flats:
                    join.contribute(flat)
            self.run([comm.average(flat, group) for flat in flats], "block sync")
            self.pack.scatter()
        else:
            block_grads = [global_flat - flat for global_flat, flat in zip(self.global_params, flats)]
            if join is not None:
                for grad in block_grads:
                    join.contribute(grad)
            self.run([comm.average(grad, group) for grad in block_grads], "block sync")
            for index, (flat, global_flat, grad) in enumerate(zip(flats, self.global_params, block_grads)):
                smoothed = self.block_momentum * self.smoothed_grads[index] + self.block_lr * grad
                flat.copy_(global_flat - smoothed)
                if self.use_nbm:
                    flat.copy_(flat - self.block_momentum * smoothed)
                self.smoothed_grads[index] = smoothed
                global_flat.copy_(flat)
            self.pack.scatter()
        if self.average_sync:
            self._average_optimizer_state(group)

    def _average_optimizer_state(self, group) -> None:
        allreduce_optimizer_state(self.optimizer, group=group, timeout=self.timeout, join=self.join_state)


def _broadcast(flat: torch.Tensor, root: int, group) -> comm.Stages:
    yield comm.broadcast(flat, root, group)
