"""The reducer: averages gradients bucket by bucket while backward is still running."""

from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Sequence

import torch

from .._torch_compat import queue_end_of_backward
from ..fused_optimizer import is_fused_optimizer
from . import comm
from .algorithms.base import GradientAlgorithm
from .bucketing import Bucket, Entry, build_segments, make_buckets
from .errors import AlgorithmConfigError, NotApplicableError, ReducerStateError

__all__ = ["Reducer"]


def _max_flags(flags: torch.Tensor, group) -> comm.Stages:
    if comm.is_distributed(group):
        yield comm.all_reduce(flags, group, op=torch.distributed.ReduceOp.MAX)


def _weak_method(method):
    """``method`` as a hook that does not keep its object alive.

    Why: a parameter keeps its hooks where Python's garbage collector cannot see them, so a
    hook holding the reducer made a cycle (parameter -> hook -> reducer -> parameter) that is
    never collected: the model, its optimizer and its process group lived until the process
    ended (every model a program built, one per trial of a hyperparameter search), and at exit
    that group's gloo threads ran into the interpreter's teardown. Whoever uses the reducer
    keeps it (``bagua_init``'s wrapper does); a reducer that is dropped removes its hooks, as a
    dropped ``DistributedDataParallel`` does.
    """
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return hook


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()


class Reducer:
    """Hands each bucket of gradients to a gradient algorithm as soon as backward has filled it.

    A hook on every parameter marks its gradient ready; a bucket is launched once all its
    gradients are ready and every earlier bucket was launched, so all ranks issue the same
    collectives in the same order. At the end of backward (an autograd callback) the
    remaining buckets are launched, parameters without a gradient contribute zeros, and
    everything is waited for before ``backward()`` returns.

    Unused parameters follow ``DistributedDataParallel(find_unused_parameters=True)``: a
    parameter no rank used keeps ``grad=None``; one used on some ranks gets the average
    (with zeros from the others) on every rank. That costs one tiny extra allreduce per
    backward; with ``find_unused_parameters=False`` every parameter gets a gradient.

    Gradients live in flat memory: a fused optimizer's flat gradient buffers when one is
    given (the buckets are slices of them, nothing is copied), otherwise buffers allocated
    here with each ``param.grad`` a view (a fresh gradient is copied in once).

    Args:
        params: the parameters whose gradients to average (those not requiring grad are skipped).
        algorithm: a gradient algorithm (``kind == "gradient"``).
        optimizers: optimizers whose fused flat buffers the buckets should reuse.
        message_size: a bucket is closed once it holds at least this many bytes.
        delay_reduce: launch nothing during backward; reduce everything at its end.
        group: the process group (default: the world).
        timeout: longest wait for one bucket before raising ``CommunicationError``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        algorithm: GradientAlgorithm,
        *,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        message_size: int = 10_000_000,
        delay_reduce: bool = False,
        group=None,
        find_unused_parameters: bool = True,
        timeout: comm.Timeout = None,
    ):
        if getattr(algorithm, "kind", None) != "gradient":
            raise AlgorithmConfigError(
                f"the reducer averages gradients and needs a gradient algorithm, got {algorithm!r}; "
                "model algorithms run after the optimizer step (bagua_init wires that up)"
            )
        if message_size <= 0:
            raise AlgorithmConfigError(f"message_size must be a positive number of bytes, got {message_size!r}")
        seen, trainable, frozen = set(), [], []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                (trainable if p.requires_grad else frozen).append(p)
        if not trainable:
            raise AlgorithmConfigError("the model has no parameter that requires grad; there is nothing to reduce")
        self.params: List[torch.Tensor] = trainable
        # frozen when the buckets were built: one unfrozen later has no bucket and no hook, so its
        # gradient would stay this rank's own and the replicas would drift apart (before_step refuses it)
        self._frozen = frozen
        self.algorithm = algorithm
        self.group = group
        self.delay_reduce = delay_reduce
        self.find_unused_parameters = find_unused_parameters
        self.timeout = timeout if timeout is not None else algorithm.timeout
        self.optimizers = list(optimizers)
        self._fused_ids = {id(o) for o in self.optimizers if is_fused_optimizer(o)}
        self.segments = build_segments(self.params, self.optimizers)
        self.buckets: List[Bucket] = make_buckets(self.segments, message_size)
        self._entries: Dict[int, Entry] = {}
        for segment in self.segments:
            for entry in segment.entries:
                self._entries[id(entry.param)] = entry
        self._ordered = sorted(self._entries.values(), key=lambda e: e.position)
        self._flag_device = comm.small_tensor_device(group)
        self._what = [
            f"{algorithm.name} gradient bucket {b.index + 1}/{len(self.buckets)} ({b.nbytes} bytes)" for b in self.buckets
        ]
        self.enabled = True  # False inside no_sync(): gradients accumulate locally
        self.expecting_backward = False
        self.join_state = None  # under Join: who still has data this iteration (set at forward)
        self.rounds = 0  # completed reductions
        self.launched_during_backward = 0  # buckets launched from hooks in the last round (overlap)
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_method(self._on_grad)) for p in self.params]
        weakref.finalize(self, _remove_handles, self._hooks).atexit = False  # a dropped reducer stops averaging
        self._reset()

    # ------------------------------------------------------------------ description
    @property
    def zero_copy(self) -> bool:
        """True when every bucket is a slice of a fused optimizer's flat gradient buffer."""
        return all(segment.shared for segment in self.segments)

    def describe(self) -> str:
        buckets = " ".join(bucket.describe() for bucket in self.buckets)
        return f"reducer find_unused={self.find_unused_parameters} buckets=[{buckets}]"

    # ------------------------------------------------------------------ one backward
    def _reset(self) -> None:
        self._in_backward = False
        self._marked = set()
        self._remaining = [len(bucket.entries) for bucket in self.buckets]
        self._next = 0
        self._pendings: List[comm.Pending] = []
        self.expecting_backward = False
        self.join_state = None

    def _on_grad(self, param: torch.Tensor) -> None:
        entry = self._entries[id(param)]
        entry.adopt_grad()
        if not self.enabled:
            return
        if not self._in_backward:
            self._in_backward = True
            self.launched_during_backward = 0
            queue_end_of_backward(self._end_of_backward)
        if id(param) in self._marked:
            raise ReducerStateError(
                f"a parameter of shape {tuple(param.shape)} got its gradient twice in one backward; "
                "with reentrant activation checkpointing use use_reentrant=False"
            )
        self._marked.add(id(param))
        index = entry.bucket.index
        self._remaining[index] -= 1
        if self._remaining[index] == 0 and not self.delay_reduce:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._remaining[self._next] == 0:
            self._launch(self._next)
            self.launched_during_backward += 1

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        if self.join_state is not None:  # uneven inputs: the mean over the ranks that still have data
            self.join_state.contribute(bucket.flat, mean=not self.join_state.divide_by_initial_world_size)
        stages = self.algorithm.bucket_stages(bucket.flat, bucket.members, self.group)
        self._pendings.append(comm.Pending(stages, self._what[index], self.timeout))
        if len(self._pendings) > 1 and not self.algorithm.single_collective and self.algorithm.advances_early(self.group):
            # A multi-stage bucket (bytegrad, qadam: all-to-all, then average and all-gather) takes
            # its next stage now, while backward still runs, instead of after it; at the same
            # point on every rank, so collectives stay in the same order everywhere. This bucket's
            # first collective is launched before the previous bucket is waited for, so the link
            # carries this bucket while the rank waits (1 Gbit/s, 2 ranks: 0.39x -> 0.32x of DDP's step).
            self._pendings[-2].advance()
        self._next = index + 1

    def _end_of_backward(self) -> None:
        try:
            self._finish()
        finally:
            self._reset()

    def _finish(self) -> None:
        pending_entries = [
            entry
            for bucket in self.buckets[self._next :]
            for entry in bucket.entries
            if id(entry.param) not in self._marked
        ]
        for entry in pending_entries:
            if not entry.adopt_grad():
                entry.zero_unused()
        used = self._complete([e.param.grad is not None for e in self._ordered])
        for entry in pending_entries:
            if entry.param.grad is None and (used is None or used[entry.position]):
                entry.param.grad = entry.view  # used on another rank: it gets the average too
        self.rounds += 1

    def _complete(self, local_used: List[bool]):
        """Launch the buckets not launched yet and the unused-parameter flags, wait for everything.

        Returns the flags (which parameters some rank used), or None without
        ``find_unused_parameters``.
        """
        while self._next < len(self.buckets):
            self._launch(self._next)
        flags = None
        if self.find_unused_parameters:
            flags = torch.tensor(local_used, dtype=torch.int32, device=self._flag_device)
            flag_pending = comm.Pending(_max_flags(flags, self.group), "unused-parameter flags", self.timeout)
        for pending in self._pendings:
            pending.wait()
        if flags is not None:
            flag_pending.wait()
        if not self.algorithm.exact:
            for bucket in self.buckets:
                bucket.zero_gaps()
        return flags.tolist() if flags is not None else None

    def shadow(self, join_state) -> None:
        """On a rank that ran out of data (under ``Join``): the collectives of one reduction.

        It contributes zeros and used no parameter; its flat gradients receive the average of
        the ranks that still have data, like theirs.
        """
        self.check_not_interrupted()
        self.join_state = join_state
        try:
            self._complete([False] * len(self._ordered))
        finally:
            self._reset()

    # ------------------------------------------------------------------ around the optimizer step
    def check_not_interrupted(self) -> None:
        """Refuse to go on after a backward that died between its first hook and its end."""
        if self._in_backward:
            raise ReducerStateError(
                "an earlier backward was interrupted before its gradients were averaged; the ranks' "
                "gradients now differ. Restart from a checkpoint."
            )

    def before_step(self) -> None:
        """Keep ranks in lockstep if this rank ran a forward but no backward reached a parameter."""
        for optimizer in self.optimizers:
            if is_fused_optimizer(optimizer) and id(optimizer) not in self._fused_ids:
                raise ReducerStateError(
                    "the optimizer was fused after bagua_init, so the reducer's buckets are not its flat "
                    "buffers; call fuse_optimizer(optimizer) first, then bagua_init(model, optimizer)"
                )
        unfrozen = [p for p in self._frozen if p.requires_grad and p.grad is not None]
        if unfrozen:
            raise ReducerStateError(
                f"a parameter of shape {tuple(unfrozen[0].shape)} (and {len(unfrozen) - 1} more) was frozen "
                "(requires_grad=False) when bagua_init built the gradient buckets and has a gradient now: "
                "nothing averages it, so the replicas would drift apart. Set requires_grad before bagua_init, "
                "or after changing it wrap again (ModelSwitchWrapper(...).switch_to(...), or wrapped.close() "
                "and bagua_init(wrapped.unwrap(), optimizer, ...))"
            )
        self.flush()

    def flush(self) -> None:
        """Average now if a training forward ran but no backward reached a parameter since."""
        self.check_not_interrupted()
        if self.enabled and self.expecting_backward:
            try:
                self._finish()
            finally:
                self._reset()

    # Bagua's Reducer methods. Here buckets are built from ``message_size`` when the reducer is
    # made, and autograd hooks mark gradients ready; the manual protocol has nothing to drive.
    def _not_applicable(self, name: str):
        raise NotApplicableError(
            f"Reducer.{name}() is Bagua's manual bucket protocol; this Reducer builds its buckets from "
            "message_size when it is made and marks each gradient ready from an autograd hook, so there is "
            "nothing to call. Use bagua_init / with_bagua (or Reducer(params, algorithm, ...)) and backward()."
        )

    def add_param(self, param) -> None:
        self._not_applicable("add_param")

    def initialize_buckets(self):
        self._not_applicable("initialize_buckets")

    def register_bagua_buckets(self) -> None:
        self._not_applicable("register_bagua_buckets")

    def fill_slot(self, param):
        self._not_applicable("fill_slot")

    def mark_bucket_ready(self, bucket, bucket_idx) -> None:
        self._not_applicable("mark_bucket_ready")

    def mark_tensor_ready(self, param) -> None:
        self._not_applicable("mark_tensor_ready")

    def mark_on_complete(self) -> None:
        self._not_applicable("mark_on_complete")

    def detach(self) -> None:
        """Remove the hooks; gradients stay where they are."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._reset()
