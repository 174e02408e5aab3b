"""``qadam``: full-precision gradient averaging during warm-up, then uint8-compressed *momentum*.

The algorithm half of Bagua's QAdam; the optimizer half is
:class:`bagua_integrations.optim.QAdam`, and the two only work as a pair::

    optimizer = QAdam(model.parameters(), lr=1e-3, warmup_steps=100)
    model, optimizer = bagua_init(model, optimizer, "qadam")

For each bucket of gradients, right before it is communicated:

* while its parameters are in warm-up, the gradients are averaged exactly
  (``gradient_allreduce``), so the optimizer takes plain Adam steps on the averaged gradient;
* once they are past it, every gradient ``g`` is replaced in place by the momentum it makes,
  ``beta1 * m + (1 - beta1) * g`` (``m`` is the optimizer's ``exp_avg``, equal on every rank),
  and the ranks average those with ``bytegrad``'s uint8 min-max codec (about 2 bytes on the
  wire per element instead of 8), its levels shifted so that 0 stays exactly 0 (an element
  with no gradient yet has ``m = v = 0``, and noise there would be divided by ``eps``). Every rank decodes the same bytes, so every rank's momentum
  stays equal; the optimizer copies it into ``exp_avg`` (:attr:`QAdam.momentum_in_grad`). On a
  fused QAdam's compiled CPU buckets the encoder folds instead, as it reads the gradients and the
  flat ``exp_avg`` (one pass fewer; see :meth:`QAdamAlgorithm._momentum_for_encoder`).

A bucket whose parameters are in different phases (one joined the optimizer late, or is not
in it) is averaged exactly, with the momentum fold applied only to the parameters past warm-up.
A parameter the optimizer never stepped (no rank has used it yet) does not count; if it is
first used after warm-up, its own first steps see compressed gradients.
The phase is read from each parameter's own step count in the optimizer state, which every
rank has in common, so every rank makes the same choice without communicating.

There is no error feedback: each bucket is quantized afresh (as in Bagua's QAdam); momentum
is smooth enough that the rounding error (at most 1/510 of a chunk's range) does not
accumulate into drift. The algorithm keeps no state of its own: the warm-up counters and both
moments are the optimizer's, and go into checkpoints with it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..._flat import PackedTensors
from ...optim.qadam import QAdam
from .. import comm
from ..sync import check_same_on_all_ranks
from ..errors import AlgorithmConfigError, JoinError
from .base import GradientAlgorithm, Members
from .bytegrad import ByteGrad
from .registry import register_algorithm

__all__ = ["QAdamAlgorithm"]


def _find_qadam(optimizer) -> Optional[QAdam]:
    """The QAdam inside ``optimizer``: itself, one of a list, or wrapped (``.optimizer``) by a framework."""
    seen = set()
    pending = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    while pending:
        candidate = pending.pop(0)
        if candidate is None or id(candidate) in seen:
            continue
        seen.add(id(candidate))
        if isinstance(candidate, QAdam):
            return candidate
        pending.append(getattr(candidate, "optimizer", None))
    return None


def _momenta_laid_out_as(flat: torch.Tensor, grads, momenta) -> Optional[PackedTensors]:
    """``momenta`` as one flat view in which each lies where its gradient lies in ``flat``, or None."""
    pack = PackedTensors(momenta)
    view = pack.flat
    if pack.copied or view.numel() != flat.numel() or view.dtype != flat.dtype or view.device != flat.device:
        return None
    for grad, momentum in zip(grads, momenta):
        if (grad.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
                or grad.storage_offset() - flat.storage_offset() != momentum.storage_offset() - view.storage_offset()):
            return None
    return pack


def _not_qadam(optimizer) -> str:
    return (f"qadam communicates the momentum of a QAdam optimizer and got {type(optimizer).__name__}; "
            "build the optimizer as bagua_integrations.optim.QAdam(params, lr=..., warmup_steps=...) "
            "(Bagua's QAdamOptimizer), or pick another algorithm (e.g. bytegrad) for other optimizers")


@register_algorithm("qadam")
class QAdamAlgorithm(GradientAlgorithm):
    """Bagua's QAdam algorithm (``QAdamAlgorithm(optimizer, hierarchical=True)`` in Bagua).

    Args:
        optimizer: the :class:`~bagua_integrations.optim.QAdam` to pair with; by default the
            one ``bagua_init`` (or the fairseq / HF integration) passes. ``q_adam_optimizer=`` (Bagua's
            name) is the same argument.
        hierarchical: average in full precision inside each node and compress only between
            node leaders. Default True (as in Bagua); flat on a single node.
        message_size, timeout: as for :class:`GradientAllReduce`.
    """

    name = "qadam"
    hierarchical_default = True
    exact = False
    single_collective = False
    #: gradients must be unscaled when they are communicated: the momentum fold mixes them with
    #: the optimizer's unscaled momentum (a loss scaler that unscales after averaging cannot work)
    needs_unscaled_gradients = True

    def __init__(self, optimizer: Optional[QAdam] = None, hierarchical=None, timeout=None, message_size: int = 10_000_000,
                 *, q_adam_optimizer: Optional[QAdam] = None):
        super().__init__(hierarchical, timeout, message_size)
        if q_adam_optimizer is not None:  # Bagua's name for the argument
            if optimizer is not None and optimizer is not q_adam_optimizer:
                raise AlgorithmConfigError("qadam got two optimizers (optimizer and q_adam_optimizer); pass one")
            optimizer = q_adam_optimizer
        self.optimizer = _find_qadam(optimizer) if optimizer is not None else None
        if optimizer is not None and self.optimizer is None:
            raise AlgorithmConfigError(_not_qadam(optimizer))
        self._group_of = {}  # id(param) -> its param group, as the optimizer holds them now
        self._groups_seen = None  # what _group_of was built from (see _groups)
        # ids of the parameters whose gradient was folded since the optimizer's last step (the step's
        # post-hook empties it): a second fold before the step would fold a momentum twice
        self._folded = set()
        self._step_hook = None
        self._momentum_packs = {}  # flat.data_ptr() -> (what it was built from, its momenta's pack or None)
        # bytegrad's uint8 average (inside our hierarchy), 0 kept exact: see MinMaxUInt8
        self._compressed = ByteGrad(hierarchical=False)

    def average(self, flat: torch.Tensor, group) -> comm.Stages:
        """The exact average (warm-up, and buckets in mixed phases)."""
        return comm.average(flat, group)

    def attach(self, params, optimizer=None, group=None) -> "QAdamAlgorithm":
        qadam = _find_qadam(optimizer) if optimizer is not None else None
        if self.optimizer is not None and qadam is not None and qadam is not self.optimizer:
            raise AlgorithmConfigError(
                "qadam was built with one QAdam optimizer and attached with another; pass the optimizer "
                "you train with to both (or to bagua_init only)"
            )
        qadam = qadam or self.optimizer
        if qadam is None:
            raise AlgorithmConfigError(_not_qadam(optimizer))
        super().attach(params, optimizer, group)
        self._remove_step_hook()
        self.optimizer = qadam
        self._groups_seen, self._folded = None, set()
        # Not the parameters' step counts: a parameter no rank used this round keeps its count (the
        # step skips it, grad None) although its bucket was folded, and its next fold is legitimate
        self._step_hook = qadam.register_step_post_hook(lambda *args: self._folded.clear())
        self._groups(group)
        # One process communicates no bucket, so no gradient is folded: the optimizer folds its own.
        # The same flag decides whether bucket_stages folds (a 1-rank DDP still calls its hook).
        qadam.momentum_in_grad = comm.is_distributed(group)
        return self

    def _groups(self, group) -> dict:
        """``id(param) -> param group`` from the optimizer's groups as they are now.

        Read afresh whenever the groups change (``add_param_group``; ``load_state_dict``, which
        replaces them, as fairseq and Accelerate do after the algorithm is attached): a group
        added later must be folded too, and a checkpoint's warm-up is the one that counts. Each
        time, the ranks check that they agree on what the phase depends on: if one compressed a
        bucket while another did not, their collectives would cross.
        """
        groups = self.optimizer.param_groups
        seen = tuple((id(g), id(g["params"]), len(g["params"])) for g in groups)
        if seen != self._groups_seen:
            lines = [f"group {i}: warmup_steps={g['warmup_steps']} betas={tuple(g['betas'])} params={len(g['params'])}"
                     for i, g in enumerate(groups)]
            lines.append(f"steps taken {sorted({int(s['step']) for s in self.optimizer.state.values() if 'step' in s})}")
            check_same_on_all_ranks(lines, "QAdam optimizer (warm-up and steps taken)", group=group, timeout=self.timeout)
            self._group_of = {id(p): g for g in groups for p in g["params"]}
            self._groups_seen, self._folded = seen, set()  # (a loaded checkpoint starts afresh)
            self._momentum_packs = {}
        return self._group_of

    def detach(self) -> None:
        self._remove_step_hook()
        if self.optimizer is not None:
            self.optimizer.momentum_in_grad = False  # alone again, it folds its gradients itself

    def _remove_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def validate_join(self, group=None) -> None:
        raise JoinError(
            "qadam has no uneven-input (Join) form: a rank out of data would miss the momentum update and "
            "its optimizer state would leave the others'; give every rank the same number of batches"
        )

    # ------------------------------------------------------------------ one bucket
    def _phase(self, param: torch.Tensor, groups: dict) -> Optional[bool]:
        """True past warm-up, False in it (or not in the optimizer: plain gradients, averaged
        exactly), None for a parameter the optimizer never stepped (no rank ever used it), which
        does not decide how its bucket is averaged."""
        group = groups.get(id(param))
        if group is None:
            return False
        state = self.optimizer.state.get(param)
        return QAdam.past_warmup(group, state) if state else None

    def bucket_stages(self, flat: torch.Tensor, members: Optional[Members], group=None) -> comm.Stages:
        if self.optimizer is None:
            raise AlgorithmConfigError("qadam is not attached to a QAdam optimizer; use bagua_init(model, QAdam(...), 'qadam')")
        if members is None:
            raise AlgorithmConfigError(
                "qadam needs to know which parameter each gradient belongs to (it reads the optimizer's "
                "momentum); average with allreduce_parameter_gradients(params), the reducer or the DDP hook, "
                "not allreduce_gradients(tensors)"
            )
        if not self.optimizer.momentum_in_grad:  # one process: nothing to fold or average
            return self.stages(flat, group)
        groups = self._groups(group)
        phases = [self._phase(param, groups) for param, _ in members]
        folding = [(param, grad) for (param, grad), past in zip(members, phases) if past]
        for param, _ in folding:  # before any gradient changes: refuse a second fold before the step
            if id(param) in self._folded:
                raise AlgorithmConfigError(
                    "qadam exchanged a parameter's momentum twice for the same optimizer step (gradients "
                    "accumulated over several backward passes, or a step skipped): it folds each gradient "
                    "into the momentum once per step. Accumulate micro-batches under model.no_sync() and "
                    "exchange only on the last one, then call optimizer.step()"
                )
        deciding = [past for past in phases if past is not None]
        self.stages_overlap = bool(deciding) and all(deciding)  # compressed: two stages (see GradientAlgorithm)
        momentum = self._momentum_for_encoder(flat, folding, members, groups, group) if self.stages_overlap else None
        for param, grad in folding:  # grad <- beta1 * m + (1 - beta1) * grad, the momentum this step makes
            self._folded.add(id(param))
            if momentum is None:
                grad.lerp_(self.optimizer.state[param]["exp_avg"], groups[id(param)]["betas"][0])
        if self.stages_overlap:
            return self.stages(flat, group, average=functools.partial(self._compressed.average, momentum=momentum))
        return self.stages(flat, group)

    def _momentum_for_encoder(self, flat, folding, members, groups, group):
        """``(m, beta1)`` for the encoder to fold the whole bucket while it reads it, or None to
        fold each gradient in place first.

        The encoder folds where it compiles (a CPU bucket of a fused QAdam, large enough, see
        :meth:`MinMaxUInt8.folds_momentum`): it saves a pass over the bucket. That needs one
        ``beta1``, every gradient of the bucket folded, no averaging inside nodes before the
        encoder, and the momenta laid out exactly as the gradients are (``m``: one view of the
        fused optimizer's flat ``exp_avg``). It computes the fold as ``m - (m - g) * (1 - beta1)``,
        which may differ from ``lerp_`` in the last bit; every rank still decodes the same bytes.
        """
        if len(folding) != len(members) or self.nodes(group) is not None:
            return None
        betas = {groups[id(param)]["betas"][0] for param, _ in folding}
        folds = getattr(self._compressed.codec, "folds_momentum", None)
        if len(betas) != 1 or folds is None or not folds(flat):
            return None
        momenta = [self.optimizer.state[param]["exp_avg"] for param, _ in folding]
        key = (flat.data_ptr(), flat.numel(), tuple(m.data_ptr() for m in momenta))
        cached = self._momentum_packs.get(flat.data_ptr())
        if cached is None or cached[0] != key:
            cached = (key, _momenta_laid_out_as(flat, [grad for _, grad in folding], momenta))
            self._momentum_packs[flat.data_ptr()] = cached
        pack = cached[1]
        if pack is None:
            return None
        # the padding between momenta: the gradients' is 0, so the fold must read 0 there too (a
        # flat state buffer's padding may hold anything; the fused step ignores it)
        pack.zero_gaps()
        return pack.flat, betas.pop()
