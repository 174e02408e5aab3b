"""``async``: ranks average their weights in the background and never wait for each other.

Bagua's asynchronous model averaging, the answer to stragglers: each rank trains on its own
and, every ``sync_interval_ms``, hands a snapshot of its weights to a background thread that
averages it with the other ranks' over a process group of its own. A slow rank delays the
averages, never the fast ranks' steps.

**No data race, by construction.** The background thread owns two private buffers and never
touches the model: the training thread takes the snapshot and applies the result, both right
after an optimizer step (the algorithm's step hook), so weights only ever change between
steps, never while a forward, backward or optimizer step reads them. A finished round is
applied as a *correction*, ``w += average(snapshots) - own snapshot``, which keeps the local
updates made while the round was in flight; the corrections of one round sum to zero over the
ranks, so no update is lost or counted twice.

**Stopping.** :meth:`AsyncModelAverage.abort` (around evaluation and checkpointing, and at the
end of training) lets every rank finish the same number of rounds, then averages the weights
once synchronously: every rank then holds the same weights. :meth:`AsyncModelAverage.resume`
starts the background rounds again. A process that exits with rounds running aborts the same
way at exit (``atexit``; each collective waits at most a minute, or ``timeout`` if shorter, for
its peers, then warns), so gloo is never torn down under a waiting round; after :meth:`abort`
with no round since, or after a failure, the exit waits for no peer. A dead or stuck peer ends a
round, or a collective of the stop protocol, with
:class:`~bagua_integrations.distributed.CommunicationError` after ``timeout``; the training
thread raises it at its next step or abort, never hangs on it. The collective given up ends in
gloo then too (torch >= 2.9), so the exit does not wait for the process group's own timeout
(before torch 2.9 it does: gloo runs the collective to that timeout, 30 minutes by default).

The first ``warmup_steps`` steps average weights synchronously after every step (every rank
starts from the same point, as Bagua's warm-up does with synchronous gradient averaging).
Rounds are timing-dependent, so two runs (or a resumed and an uninterrupted run) differ;
checkpoints keep every rank's own weights and optimizer state. Every point where all ranks
act together settles the rounds in flight first (a small collective): a checkpoint
(``state_dict``) and new parameters apply them, weights loaded into the model drop them.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import queue
import threading
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..._torch_compat import process_group_timeout
from .. import comm
from ..errors import AlgorithmConfigError, CommunicationError, DistributedError
from .base import ModelAlgorithm
from .registry import register_algorithm

__all__ = ["AsyncModelAverage", "AsyncModelAverageAlgorithm"]

_STOP = object()
EXIT_TIMEOUT_S = 60.0  # longest each collective of the exit-time abort waits for a peer


class _Averager(threading.Thread):
    """Averages the flat tensors it is handed over ``group``, one round at a time, in order."""

    def __init__(self, group, timeout):
        super().__init__(name="bagua-async-model-average", daemon=True)
        self.group = group
        self.timeout = timeout
        self.requests: "queue.Queue" = queue.Queue()
        self.results: "queue.Queue" = queue.Queue()

    def run(self) -> None:
        while True:
            request = self.requests.get()
            if request is _STOP:
                return
            index, flats = request
            try:
                pendings = [comm.Pending(comm.average(flat, self.group, self.timeout), f"async model average round "
                                         f"{index} ({i + 1}/{len(flats)})", self.timeout) for i, flat in enumerate(flats)]
                for pending in pendings:
                    pending.wait()
            except BaseException as error:  # noqa: BLE001 - handed to the training thread
                self.results.put((index, error))
                return
            self.results.put((index, None))


@register_algorithm("async")
class AsyncModelAverage(ModelAlgorithm):
    """Asynchronous model averaging (Bagua's ``AsyncModelAverageAlgorithm``).

    Args:
        peer_selection_mode: ``"all"``, the only mode (as in Bagua): each round averages over
            every rank.
        sync_interval_ms: start a round at the first step at least this long after the last
            round started (0: as soon as the previous one is done).
        warmup_steps: steps averaged synchronously after every step before the rounds start.
        timeout: how long a round (or the stop protocol) may wait for a peer before
            :class:`CommunicationError`; default: the session's, else the process group's.
            After a failed round, or a failed collective of the stop protocol (an abort, or the
            settling of a checkpoint, re-attach or weights load), averaging is over: every later
            step, abort or checkpoint raises :class:`CommunicationError` (restart from a checkpoint).
    """

    name = "async"
    hierarchical_default = False

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0,
                 timeout=None):
        super().__init__(hierarchical=False, timeout=timeout)
        if peer_selection_mode != "all":
            raise AlgorithmConfigError(
                f"async averages over every rank; peer_selection_mode must be 'all', got {peer_selection_mode!r}"
            )
        if (isinstance(sync_interval_ms, bool) or not isinstance(sync_interval_ms, (int, float))
                or not math.isfinite(sync_interval_ms) or sync_interval_ms < 0):
            raise AlgorithmConfigError(f"sync_interval_ms must be a finite number of milliseconds >= 0, got {sync_interval_ms!r}")
        if (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, float))
                or not math.isfinite(warmup_steps) or warmup_steps < 0 or int(warmup_steps) != warmup_steps):
            raise AlgorithmConfigError(f"warmup_steps must be a whole number of steps >= 0, got {warmup_steps!r}")
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = int(warmup_steps)
        self.averaging_group = None
        self.worker: Optional[_Averager] = None
        self.aborted = False
        self.rounds_started = self.rounds_applied = 0
        self._in_flight = None  # (snapshot, buffer) of the round the worker is averaging
        self._round_memory = None  # (snapshots, buffers) every round reuses: see _destroy_group
        self._last_start = 0.0
        self._exit_hook = None
        self._failed: Optional[CommunicationError] = None  # a round failed: averaging is over

    def hyperparameters(self):
        return dict(super().hyperparameters(), peer_selection_mode=self.peer_selection_mode,
                    sync_interval_ms=self.sync_interval_ms, warmup_steps=self.warmup_steps)

    def validate_hierarchy(self) -> None:
        if self.hierarchical:
            raise AlgorithmConfigError("async has no hierarchical form; pass hierarchical=False")

    # ------------------------------------------------------------------ lifecycle
    def on_attach(self) -> None:
        self._stop_worker()
        self._destroy_group()
        self.aborted = False
        self.rounds_started = self.rounds_applied = 0
        self._in_flight = None
        self._failed = None
        if comm.is_distributed(self.group):
            # every rank attaches at the same point of its program: the one place to make a group
            self.averaging_group = dist.new_group(comm.group_ranks(self.group), backend="gloo",
                                                  timeout=datetime.timedelta(seconds=self._timeout_seconds()))

    def reattach(self, params, optimizer, group) -> None:
        """New parameters (``after_step(params=...)``, on every rank at the same step): finish and
        apply the rounds in flight on the old ones first, or a round one rank has applied and
        another has not would be lost, and the mean of the weights would move."""
        self._settle(apply=True, what="async re-attach")
        super().reattach(params, optimizer, group)

    def detach(self) -> None:
        """Stop the background rounds (after finishing them on every rank, as :meth:`abort`;
        not after a failed round, whose peers are gone)."""
        try:
            if self.worker is not None and self.worker.is_alive() and self._failed is None:
                self.abort()
        finally:
            self._stop_worker()
            self._destroy_group()
            super().detach()

    def _destroy_group(self) -> None:
        """Our own group goes with us: its gloo threads must not outlive Python (see comm's exit note).

        The rounds' buffers are dropped only after the group: a gloo thread lets go of a finished
        collective's tensors just *after* the waiting thread has woken, and if it held a tensor's
        last reference, freeing it needs the GIL, which this thread holds while the group's
        destructor joins that gloo thread: a deadlock (torch 2.5.1, seen in gdb, within ~100
        re-attaches with rounds running; torch >= 2.8 releases the GIL in that destructor). With
        the buffers still referenced here, gloo's release frees nothing."""
        group, self.averaging_group = self.averaging_group, None
        memory, self._round_memory = self._round_memory, None
        if group is not None:
            comm.release_group(group)  # else our record of it outlives the destroy, and so do its threads
            if dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except Exception:  # noqa: BLE001 - already destroyed with the default group
                    pass
            del group  # the last reference: joins the group's gloo threads, `memory` still alive
        del memory

    def _stop_worker(self) -> None:
        if self.worker is not None:
            self.worker.requests.put(_STOP)
            # after a failure the worker has ended, or waits in a collective its peers never
            # joined (until gloo's timeout ends it): waiting for it would only delay the exit
            self.worker.join(timeout=5.0 if self._failed is None else 0.1)
            self.worker = None
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None

    def _abort_at_exit(self) -> None:
        """A process leaving with rounds running (a loop that never called abort, fairseq): end them
        the same way on every rank, or the interpreter tears gloo down under a waiting round.

        Nothing to end after :meth:`abort` (no round since: every rank holds the same weights),
        nor after a failure (the peers are gone): those exits wait for no peer. Otherwise each
        collective waits at most ``EXIT_TIMEOUT_S`` (or ``timeout``, if shorter), then a warning;
        the collective given up ends in gloo then too (:func:`comm.all_reduce`'s ``timeout``), so
        the interpreter's teardown of the process group does not wait for the group's timeout."""
        if (self.worker is None or not dist.is_initialized() or self._failed is not None
                or (self.aborted and self._in_flight is None)):
            self._stop_worker()
            self._destroy_group()
            return
        saved, self.timeout = self.timeout, datetime.timedelta(seconds=EXIT_TIMEOUT_S)
        if saved is not None and saved < self.timeout:
            self.timeout = saved
        try:
            self.abort()
        except DistributedError as error:
            warnings.warn(f"async model averaging could not finish its rounds at exit: {error}", stacklevel=1)
        finally:
            self.timeout = saved
            self._stop_worker()
            self._destroy_group()

    # ------------------------------------------------------------------ after every step
    def update(self, step: int, group) -> bool:
        if not comm.is_distributed(group):
            return False
        self._raise_if_failed()
        if step <= self.warmup_steps:
            self._average_now(group, f"async warm-up average (step {step})")
            return True
        applied = self._collect(block=False)
        if not self.aborted and self._in_flight is None and self._interval_passed():
            self._start_round()
        return applied

    def _interval_passed(self) -> bool:
        return (time.monotonic() - self._last_start) * 1000.0 >= self.sync_interval_ms

    def _start_round(self) -> None:
        """Snapshot the weights (training thread, between steps) and hand a copy to the worker."""
        if self.worker is None:
            self.worker = _Averager(self.averaging_group, self.timeout)
            self.worker.start()
            # A strong reference, on purpose: while the worker runs, the exit must end its rounds
            # with the peers. A script whose training function returns drops the model and this
            # algorithm; if the garbage collector then freed them (a weak reference), the exit
            # would skip the abort: its peers waited out their timeouts, and the worker's gloo
            # threads ran into the interpreter's teardown (a SIGABRT, 1 exit in ~60 on a loaded
            # machine; every exit once a collection ran). :meth:`_stop_worker` (abort, close) lets go.
            self._exit_hook = self._abort_at_exit
            atexit.register(self._exit_hook)
        flats = self.pack.gather()
        if self._round_memory is None:  # the same two buffers for every round (see _destroy_group)
            self._round_memory = ([torch.empty_like(flat) for flat in flats], [torch.empty_like(flat) for flat in flats])
        snapshot, buffers = self._round_memory
        with torch.no_grad():
            for flat, old, sent in zip(flats, snapshot, buffers):
                old.copy_(flat)
                sent.copy_(flat)
        self.rounds_started += 1
        self._in_flight = (snapshot, buffers)
        self._last_start = time.monotonic()
        self.worker.requests.put((self.rounds_started, buffers))

    def _collect(self, block: bool, apply: bool = True) -> bool:
        """Apply the finished round, if any (waiting for it when ``block``; dropping it unless
        ``apply``); True if one was applied."""
        if self._in_flight is None:
            return False
        try:
            index, error = self.worker.results.get(block=block, timeout=self._timeout_seconds() if block else None)
        except queue.Empty:
            if block:
                self._failed = CommunicationError(
                    f"async model average round {self.rounds_started} did not finish within {self._timeout_seconds():g} s "
                    "(a peer is stuck or gone); restart from a checkpoint"
                )
                raise self._failed from None
            return False
        if error is not None:
            self._in_flight = None
            if not isinstance(error, CommunicationError):
                wrapped = CommunicationError(f"async model average round {index} failed: {error}")
                wrapped.__cause__, error = error, wrapped
            self._failed = error  # the worker has ended: no later round can start or finish
            self._stop_worker()
            raise error
        snapshot, averaged = self._in_flight
        self._in_flight = None
        if not apply:
            return False
        flats = self.pack.gather()
        with torch.no_grad():
            for flat, old, new in zip(flats, snapshot, averaged):
                flat.add_(new.sub_(old))  # keep the local updates made while the round was in flight
        self.pack.scatter()
        self.rounds_applied += 1
        return True

    def _timeout_seconds(self) -> float:
        """The round timeout: the algorithm's, else the process group's (as every other collective
        of the package), else torch's default of 30 minutes.

        Also how long the training thread waits for a round's result: the round was launched
        before it waits, with this timeout (the averaging group's, and its collectives' own), so
        the worker reports the failure by then; at exit (a shorter timeout) it gives up first."""
        if self.timeout is not None:
            return self.timeout.total_seconds()
        return process_group_timeout(self.group).total_seconds()

    def _average_now(self, group, what: str) -> None:
        flats = self.pack.gather()
        self.run([comm.average(flat, group, self.timeout) for flat in flats], what)
        self.pack.scatter()

    # ------------------------------------------------------------------ around evaluation, checkpoints
    def abort(self, model=None) -> None:
        """Stop starting rounds; every rank finishes the same rounds, then all average once.

        Call it on every rank (it communicates). Afterwards every rank holds the same weights;
        :meth:`resume` starts the background rounds again. ``model`` is accepted for Bagua's
        signature ``algorithm.abort(model)``.
        """
        self.aborted = True
        if self.pack is None or not comm.is_distributed(self.group):
            return
        self._settle(apply=True, what="async abort")
        with self._failing():
            self._average_now(self.group, "async abort: final synchronous average")
        # No round left to finish: the worker goes (resume() starts another), and with it the exit
        # hook's hold on this algorithm, so a model dropped after abort() is freed (one per trial of
        # a search), as a model whose rounds still run is not (see _start_round).
        self._stop_worker()

    def _settle(self, apply: bool, what: str) -> None:
        """Finish, on every rank, every round any rank has started (a collective), applying their
        corrections (``apply``) or dropping them. A round's corrections sum to zero over the ranks
        only once every rank has applied it, and the ranks are usually one round apart."""
        if self.pack is None or not comm.is_distributed(self.group):
            return
        self._raise_if_failed()
        with self._failing():
            started = torch.tensor([self.rounds_started], dtype=torch.int64, device=comm.small_tensor_device(self.group))
            comm.run(iter([comm.all_reduce(started, self.group, op=dist.ReduceOp.MAX, timeout=self.timeout)]),
                     f"{what}: rounds started", self.timeout)
            target = int(started.item())
            while True:
                self._collect(block=True, apply=apply)
                if self.rounds_started >= target:
                    break
                self._start_round()  # a peer started one more round than this rank: join it

    @contextlib.contextmanager
    def _failing(self):
        """A collective of the stop protocol that fails ends averaging, as a failed round does:
        the ranks may now be a round apart, and the exit waits for no peer."""
        try:
            yield
        except CommunicationError as error:
            if self._failed is None:
                self._failed = error
            raise

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise CommunicationError(
                f"async model averaging stopped after a failed collective ({self._failed}); its peers may hold "
                "other weights: restart every rank from a checkpoint"
            ) from self._failed

    def state_dict(self):
        """Also settles the rounds in flight (a collective: every rank saves, as the integrations
        do), so that a checkpoint holds no round that one rank has applied and another has not."""
        self._settle(apply=True, what="async checkpoint")
        return super().state_dict()

    def weights_loaded(self) -> None:
        """Weights replaced on every rank (a checkpoint, HF's best model): the rounds in flight
        averaged the old ones, so they are finished and dropped, not added to the new weights."""
        self._settle(apply=False, what="async weights loaded")

    def resume(self, model=None) -> None:
        """Start the background rounds again after :meth:`abort` (on every rank)."""
        self.aborted = False
        self._last_start = 0.0


#: Bagua's name.
AsyncModelAverageAlgorithm = AsyncModelAverage
