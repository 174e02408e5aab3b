"""The algorithm interface: what an integration calls, and when.

An algorithm keeps model replicas consistent. Its ``kind`` says where it acts:

* ``"gradient"`` algorithms average gradients between backward and the optimizer step.
  The :class:`~bagua_integrations.distributed.Reducer` feeds them buckets while backward
  runs; frameworks with their own loop call :meth:`GradientAlgorithm.allreduce_gradients`
  or register :meth:`GradientAlgorithm.ddp_comm_hook` on a DDP model.
* ``"model"`` algorithms change the weights right after the optimizer step
  (:meth:`ModelAlgorithm.after_step`); gradients are never exchanged.

New algorithms (async model averaging, QAdam, ...) subclass one of the two and register
a name with :func:`~bagua_integrations.distributed.register_algorithm`.
"""

from __future__ import annotations

import numbers

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..._flat import Packs, pack_tensors
from ..._torch_compat import queue_end_of_backward
from .. import comm
from ..errors import AlgorithmConfigError, CheckpointError

__all__ = ["Algorithm", "GradientAlgorithm", "ModelAlgorithm", "Members"]

#: a bucket's parameters, each with the view of the bucket's flat tensor that holds its gradient
Members = Sequence[Tuple[torch.Tensor, torch.Tensor]]


def _no_stages():
    return
    yield  # pragma: no cover - makes this a generator



def as_flag(name: str, value) -> bool:
    """``value`` as a bool: True/False or 1/0; anything else (``"false"`` would be True) is refused."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise AlgorithmConfigError(f"{name} must be True or False, got {value!r}")


def as_message_size(value) -> int:
    """``value`` as a bucket size in bytes: a whole number >= 1 (``10_000_000``, ``2**22``)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise AlgorithmConfigError(f"message_size must be a whole number of bytes >= 1 (e.g. 10_000_000), got {value!r}")

class Algorithm:
    """Base class: hyper-parameters, the node hierarchy, and the hooks every integration may call."""

    name: str = ""
    kind: str = ""
    #: whether ``hierarchical_reduce=None`` means True (as in Bagua: all but gradient_allreduce)
    hierarchical_default: bool = False
    #: whether BaguaModule should call :meth:`after_step` after every optimizer step
    wants_step_hook: bool = False
    #: under ``Join`` (uneven inputs), the :class:`~bagua_integrations.distributed.join.JoinState`
    #: of the step :meth:`after_step` runs for: which ranks still have data, whether this one has
    #: joined. None otherwise. Model algorithms shadow their collectives with it.
    join_state = None

    def __init__(self, hierarchical: Optional[bool] = None, timeout: comm.Timeout = None):
        self.hierarchical = self.hierarchical_default if hierarchical is None else as_flag("hierarchical", hierarchical)
        self.timeout = comm.as_timedelta(timeout)
        self.group = None

    # ------------------------------------------------------------------ description
    def hyperparameters(self) -> Dict[str, Any]:
        """The settings every rank must agree on (checked at ``bagua_init``)."""
        return {"hierarchical": self.hierarchical}

    def signature(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in sorted(self.hyperparameters().items()))
        return f"{self.name}({params})"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.signature()}>"

    # ------------------------------------------------------------------ topology
    def validate_hierarchy(self) -> None:
        """Refuse ``hierarchical`` where the algorithm has no hierarchical form (after it was set)."""

    def validate_join(self, group=None) -> None:
        """Refuse (``JoinError``) a setup that cannot run under ``Join``; called on every rank at each event.

        Gradient algorithms can (the reducer shadows their buckets) unless they also communicate
        after the step; an algorithm that acts after the step must read :attr:`join_state` there
        and say so with ``supports_join = True``, else it refuses.
        """
        if (self.kind == "model" or self.wants_step_hook) and not getattr(self, "supports_join", False):
            from ..errors import JoinError

            raise JoinError(
                f"{self.name} has no uneven-input (Join) form: give every rank the same number of batches "
                "(e.g. DistributedSampler(drop_last=True))"
            )

    def nodes(self, group=None) -> Optional[comm.NodeGroups]:
        """The node groups to reduce through, or None for a flat reduction."""
        if not self.hierarchical or not comm.is_distributed(group):
            return None
        nodes = comm.NodeGroups.of(group, timeout=self.timeout)
        return nodes if nodes.active else None

    # ------------------------------------------------------------------ lifecycle
    def attach(self, params: Iterable[torch.Tensor], optimizer=None, group=None) -> "Algorithm":
        """Bind to the parameters (and optimizer) it will act on; called once by ``bagua_init``.

        Creates the node groups now, while every rank is at the same place in its program.
        """
        self.validate_hierarchy()
        self.group = group
        self.nodes(group)
        return self

    def after_step(self, params=None, step: Optional[int] = None, *, optimizer=None, group=None) -> bool:
        """Called after each optimizer step; returns whether it communicated. No-op by default."""
        return False

    def detach(self) -> None:
        """Forget the attached parameters (called when switching algorithms)."""

    # ------------------------------------------------------------------ checkpoints
    @property
    def weights_differ(self) -> bool:
        """Whether ranks' weights may legitimately differ between two steps (so a checkpoint needs
        every rank's weights, and a resume must not broadcast rank 0's)."""
        return False

    @property
    def replicas_differ(self) -> bool:
        """Whether ranks' weights *or optimizer state* may differ (model algorithms keep gradients
        local, so e.g. each rank's Adam moments are its own): a checkpoint must then hold every
        rank's own model and optimizer state."""
        return self.weights_differ

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint must carry to resume this algorithm on schedule; stateless by default.

        ``gradient_allreduce`` and ``bytegrad`` have no state (bytegrad has no error feedback:
        each bucket is quantized afresh). An algorithm with error-feedback or momentum buffers
        returns them here.
        """
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, before or after :meth:`attach`."""

    def weights_loaded(self) -> None:
        """The model's weights were replaced (``load_state_dict``) after :meth:`attach`; no-op by default."""


class GradientAlgorithm(Algorithm):
    """Averages gradients across ranks, one flat bucket at a time."""

    kind = "gradient"
    #: False when the reduction is lossy, so alignment padding must be re-zeroed afterwards
    exact = True
    #: True when :meth:`average` launches a single collective (so a DDP hook can stay async)
    single_collective = True
    #: for multi-stage algorithms: whether the reducer runs a bucket's next stage when it launches
    #: the next bucket (during backward) rather than after backward; False while the buckets are
    #: single-stage (qadam's exact warm-up), where waiting early would only stall backward
    stages_overlap = True

    def __init__(self, hierarchical: Optional[bool] = None, timeout: comm.Timeout = None, message_size: int = 10_000_000):
        super().__init__(hierarchical, timeout)
        self.message_size = as_message_size(message_size)
        self._ddp_buckets: list = []  # (pending, future, flat) of this backward's multi-stage DDP buckets
        self._ddp_last_index = -1  # the index of the last DDP bucket call (-1: after a last bucket)

    def average(self, flat: torch.Tensor, group) -> comm.Stages:
        """Average the 1-D ``flat`` in place over ``group`` (more than one rank), as staged collectives."""
        raise NotImplementedError

    def advances_early(self, group=None) -> bool:
        """Whether a bucket's next stage may run when the next bucket is launched (during backward).

        Only where every rank runs the same stages: through the node hierarchy a node leader runs
        the leaders' stages between the node's reduce and broadcast, which the other ranks skip,
        so advancing one stage at each launch put a non-leader's broadcast of bucket k before the
        reduce of bucket k + 2 and the leader's after it. With three or more buckets the node's
        collectives crossed: a hang, or gloo's "Received data size doesn't match" (bytegrad's
        default, 2 nodes x 2 ranks). There the stages run after backward, in bucket order.
        """
        return self.stages_overlap and self.nodes(group) is None

    def stages(self, flat: torch.Tensor, group=None, average=None) -> comm.Stages:
        """The whole communication for one bucket: flat, or through the node hierarchy.

        ``average`` replaces :meth:`average` (an algorithm that averages some buckets another way).
        """
        if not comm.is_distributed(group) or flat.numel() == 0:
            return _no_stages()
        average = self.average if average is None else average
        nodes = self.nodes(group)
        if nodes is not None:
            return comm.hierarchical(average, flat, nodes)
        return average(flat, group)

    def bucket_stages(self, flat: torch.Tensor, members: Optional[Members], group=None) -> comm.Stages:
        """The communication for one bucket whose ``flat`` holds the gradients of known parameters.

        ``members`` pairs each parameter with the view of ``flat`` that holds its gradient
        (None where the caller averages bare tensors). Every entry point hands its buckets
        over here: the reducer, :meth:`allreduce_parameter_gradients` and the DDP hook. Most
        algorithms only need the numbers (:meth:`stages`); one that reads per-parameter
        optimizer state before communicating (``qadam`` turns gradients into momentum)
        overrides this.
        """
        return self.stages(flat, group)

    # ------------------------------------------------------------------ framework entry points
    def allreduce_gradients(
        self, tensors: Sequence[Optional[torch.Tensor]], group=None, timeout: comm.Timeout = None
    ) -> None:
        """Average ``tensors`` (gradients or flat gradient buffers) across ``group``, in place.

        Synchronous. Tensors are packed into buckets of ``message_size`` bytes (views when
        they already share flat memory, e.g. a fused optimizer's gradients; copies otherwise);
        buckets go out together and are waited on in order. Every rank must pass tensors of
        the same shapes in the same order; ``None`` entries are skipped, so they must be None
        on every rank (else use :meth:`allreduce_parameter_gradients`).
        """
        if not comm.is_distributed(group):
            return
        self._allreduce(tensors, {}, group, timeout)

    def _allreduce(self, tensors, owners: Dict[int, torch.Tensor], group, timeout) -> None:
        """:meth:`allreduce_gradients`, with ``owners`` mapping ``id(gradient)`` to its parameter."""
        timeout = self.timeout if timeout is None else timeout
        grads = [getattr(t, "grad", t) if not isinstance(t, torch.Tensor) else t for t in tensors]
        grads = [g for g in grads if g is not None and g.numel() > 0]
        for g in grads:
            if g.layout != torch.strided:
                raise AlgorithmConfigError(
                    f"{self.name} averages dense gradients only, got a {g.layout} gradient of shape "
                    f"{tuple(g.shape)}; use a dense embedding (sparse=False) or average it yourself"
                )
        buckets = pack_tensors(grads, self.message_size)
        pendings = []
        for i, bucket in enumerate(buckets):
            flat = bucket.gather()
            members = _members_of(bucket, flat, owners) if owners else None
            pendings.append(comm.Pending(self.bucket_stages(flat, members, group),
                                         f"{self.name} gradient bucket {i + 1}/{len(buckets)}", timeout))
        for bucket, pending in zip(buckets, pendings):
            pending.wait()
            bucket.scatter()

    def allreduce_parameter_gradients(
        self, params: Iterable[torch.Tensor], group=None, timeout: comm.Timeout = None
    ) -> None:
        """Average the gradients of ``params`` in place; a missing gradient counts as zeros.

        Unlike :meth:`allreduce_gradients` this cannot desynchronise ranks when a parameter
        went unused on some of them: every parameter that requires grad gets a (zero) gradient
        first, as fairseq's own legacy DDP does. Pass the same parameters on every rank.
        """
        if not comm.is_distributed(group):
            return
        grads, owners = [], {}
        for p in params:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
            owners[id(p.grad)] = p
        self._allreduce(grads, owners, group, timeout)

    def ddp_comm_hook(self, state, bucket):  # no annotations: DDP compares them with real types
        """A DDP communication hook: ``ddp_model.register_comm_hook(state, algorithm.ddp_comm_hook)``.

        ``state`` is the process group to use (None: the default one, or an object with a
        ``process_group`` attribute); ``bucket`` is DDP's ``dist.GradBucket``. Returns a
        ``torch.futures.Future`` of the averaged bucket tensor. Single-collective flat
        reductions stay asynchronous (overlapping backward). Multi-stage ones (bytegrad, qadam,
        hierarchical) go as in the reducer: each call launches its bucket's first collective, then
        takes the previous bucket's next stage, and the last bucket's call (``bucket.is_last()``)
        finishes them all, in bucket order. DDP calls the hook in bucket order on every rank and
        waits for the futures only after the last call, so collectives keep one order everywhere
        (chaining them from future callbacks would not) and still overlap backward.
        """
        group = state if state is None or isinstance(state, dist.ProcessGroup) else getattr(state, "process_group", None)
        flat = bucket.buffer()
        stages = self.bucket_stages(flat, list(zip(bucket.parameters(), bucket.gradients())), group)
        what = f"{self.name} DDP bucket {bucket.index()}"
        if not (self.single_collective and self.nodes(group) is None):
            return self._staged_ddp_bucket(stages, flat, what, bucket.index(), bucket.is_last(), group)
        work = next(stages, None)
        if work is None:
            return _completed(flat)

        def finish(future):
            future.value()  # re-raises a failed collective
            for _ in stages:  # only post-processing may follow a single collective
                raise AlgorithmConfigError(f"{self.name} declares single_collective but launched a second collective")
            return flat

        return work.get_future().then(finish)

    def _staged_ddp_bucket(self, stages, flat: torch.Tensor, what: str, index: int, last: bool,
                           group=None) -> torch.futures.Future:
        """One multi-stage DDP bucket (see :meth:`ddp_comm_hook`): its future, completed by the
        last bucket's call, or earlier where DDP's calls leave the usual order.

        Usually DDP calls buckets 0, 1, ..., n-1, the last with ``is_last()``. Three other
        orders exist, and none may leave a future that nothing completes (DDP would wait on it
        forever):

        * ``static_graph=True``, first backward: DDP calls every bucket *as index 0* (so none is
          last) and waits right after the calls. A repeated index finishes what is queued and
          runs its own bucket to completion in the call.
        * ``skip_all_reduce_unused_params=True``: a bucket of unused parameters gets no call, so
          the last call may never come. The first call of a backward also queues the finishing
          of all buckets at the end of backward (autograd's final callbacks, which run before
          DDP's own, queued once every bucket is ready).
        * A backward that raised before its last bucket: the next backward starts again at 0.
          Its queued futures (nobody waits on them) end with an error.
        """
        queue = self._ddp_buckets
        previous, self._ddp_last_index = self._ddp_last_index, index
        repeated = index == previous  # queued or not: the repeat before it may have run in its call
        if queue and index == 0 and not repeated:
            _fail(queue, AlgorithmConfigError(f"{self.name}: a DDP backward ended before its last bucket was reduced"))
        elif queue and index != previous + 1:
            self._finish_ddp_buckets()
        try:
            pending = comm.Pending(stages, what, self.timeout)
            if repeated:
                pending.wait()
                return _completed(flat)
            if not queue:
                try:
                    queue_end_of_backward(self._finish_ddp_buckets)
                except RuntimeError:  # not inside backward (Join's shadow calls): is_last() ends them
                    pass
            queue.append((pending, torch.futures.Future(), flat))
            if len(queue) > 1 and self.advances_early(group):
                queue[-2][0].advance()
            if last:
                self._finish_ddp_buckets()
                self._ddp_last_index = -1  # the next backward's bucket 0 is no repeat
        except BaseException as error:
            _fail(queue, error)
            raise
        return queue[-1][1] if queue else _completed(flat)

    def _finish_ddp_buckets(self) -> None:
        """Run every queued DDP bucket to completion, in bucket order, and complete its future."""
        queue = self._ddp_buckets
        try:
            for pending, future, done in queue:
                pending.wait()
                future.set_result(done)
        except BaseException as error:
            _fail(queue, error)
            raise
        queue.clear()


def _members_of(pack, flat: torch.Tensor, owners: Dict[int, torch.Tensor]) -> Optional[Members]:
    """Each packed gradient's parameter with its range of ``flat`` (a view of the gradients, or the
    pack's private copy of them); None when some gradient's parameter is unknown."""
    members, offset = [], 0
    base = None if pack.copied else flat.storage_offset()
    for grad in pack.tensors:
        param = owners.get(id(grad))
        if param is None:
            return None
        start = offset if base is None else grad.storage_offset() - base
        members.append((param, flat[start : start + grad.numel()].view(grad.shape)))
        offset += grad.numel()
    return members


def _fail(queue, error: BaseException) -> None:
    """End every unfinished future of ``queue`` with ``error``, and empty it."""
    for _, future, _ in queue:
        if not future.done():
            future.set_exception(error)
    queue.clear()


def _completed(value: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(value)
    return future


class ModelAlgorithm(Algorithm):
    """Changes the weights right after the optimizer step (model averaging, block updates)."""

    kind = "model"
    wants_step_hook = True

    def __init__(self, hierarchical: Optional[bool] = None, timeout: comm.Timeout = None):
        super().__init__(hierarchical, timeout)
        self.pack: Optional[Packs] = None
        self.optimizer = None
        self.num_updates = 0
        self._pending_state: Optional[Dict[str, Any]] = None
        self.restored = False

    @property
    def weights_differ(self) -> bool:
        return True

    @property
    def replicas_differ(self) -> bool:
        return True  # gradients stay local: optimizer state (momentum, Adam moments) is per rank

    def attach(self, params: Iterable[torch.Tensor], optimizer=None, group=None) -> "ModelAlgorithm":
        params = list(params)
        super().attach(params, optimizer, group)
        self.pack = pack_tensors(params)
        self.optimizer = optimizer
        self.num_updates = 0
        self.restored = False
        self.validate(group)
        self.on_attach()
        if self._pending_state is not None:  # load_state_dict before attach: applied now
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        return self

    def validate(self, group) -> None:
        """Refuse settings that cannot work with this group (e.g. odd world sizes)."""

    def on_attach(self) -> None:
        """Set up per-run state after :meth:`attach` (subclasses)."""

    def detach(self) -> None:
        self.pack = None
        self.optimizer = None

    def state_dict(self) -> Dict[str, Any]:
        # The update counter decides when the next communication happens (every N updates).
        return {"num_updates": self.num_updates}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; before :meth:`attach` it is kept and applied there."""
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.name}'s state must be the dict its state_dict() returned, got "
                                  f"{type(state).__name__}")
        if self.pack is None:
            self._pending_state = dict(state)
            return
        self.restore(state)
        self.restored = True

    def restore(self, state: Dict[str, Any]) -> None:
        """Apply a checkpoint's state to the attached algorithm (subclasses extend it)."""
        self.num_updates = int(state.get("num_updates", self.num_updates))

    @property
    def has_pending_state(self) -> bool:
        """Whether :meth:`load_state_dict` ran before :meth:`attach` (a resume)."""
        return self._pending_state is not None

    def after_step(self, params=None, step: Optional[int] = None, *, optimizer=None, group=None) -> bool:
        """Run after each optimizer step with the model's parameters; returns whether it communicated.

        ``step`` is the number of optimizer updates completed *including* this one (1 after
        the first step); without it the algorithm counts calls itself. ``params``,
        ``optimizer`` and ``group`` default to what :meth:`attach` got; passing new
        parameters re-attaches (allowed for algorithms without per-run state).
        """
        if params is not None:
            params = list(params)
        if params is not None and (self.pack is None or not self.pack.same_tensors(params)):
            self.reattach(
                params,
                optimizer if optimizer is not None else self.optimizer,
                group if group is not None else self.group,
            )
        elif self.pack is None:
            raise AlgorithmConfigError(
                f"{self.name}.after_step got no parameters and none are attached; pass params= or "
                f"call {self.name}.attach(params, optimizer) once before training"
            )
        if optimizer is not None:
            self.optimizer = optimizer
        self.num_updates = self.num_updates + 1 if step is None else int(step)
        return self.update(self.num_updates, group if group is not None else self.group)

    def reattach(self, params, optimizer, group) -> None:
        self.attach(params, optimizer, group)

    def update(self, step: int, group) -> bool:
        """Communicate after update number ``step`` (subclasses); return whether it did."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for subclasses
    def _per_tensor(self, flats: List[torch.Tensor]) -> List[torch.Tensor]:
        """Views of ``flats`` (one per pack, laid out like ``self.pack.gather()``) shaped like each
        parameter: what checkpoints hold, so that they do not depend on the flat layout."""
        out = []
        for pack, flat in zip(self.pack, flats):
            base = None if pack.copied else pack.flat.storage_offset()
            offset = 0
            for t in pack.tensors:
                start = offset if base is None else t.storage_offset() - base
                out.append(flat[start : start + t.numel()].view(t.shape))
                offset += t.numel()
        return out

    def run(self, stages_per_flat: List[comm.Stages], what: str) -> None:
        """Launch one staged communication per flat tensor, then wait for them in order."""
        pendings = [comm.Pending(stages, f"{self.name} {what} {i + 1}/{len(stages_per_flat)}", self.timeout)
                    for i, stages in enumerate(stages_per_flat)]
        for pending in pendings:
            pending.wait()
