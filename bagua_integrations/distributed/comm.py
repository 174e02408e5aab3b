"""A thin layer over ``torch.distributed``: group sizes, staged async collectives, node groups.

Everything here degrades to a no-op when there is no process group (or it has one rank),
so single-process users and tests never need ``init_process_group``.

Every collective this package issues is launched and waited for here, so this is also where
a stuck collective is noticed (:func:`wait`): a CPU (gloo) collective that has waited longer
than the stall interval (``BAGUA_STALL_WARNING_SECONDS``, default 60 s, or
:func:`set_stall_warning`) emits a :class:`CollectiveStallWarning` naming the collective and
the ranks that have not arrived, and keeps waiting: it raises :class:`CommunicationError` only
at the timeout (``bagua_init(timeout=...)``, else the process group's).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import threading
import time
import warnings
from collections import Counter
from typing import Callable, Dict, Generator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import _torch_compat
from .errors import AlgorithmConfigError, CollectiveStallWarning, CommunicationError, DistributedError

__all__ = [
    "is_distributed",
    "world_size",
    "rank",
    "as_timedelta",
    "average",
    "Pending",
    "Stages",
    "NodeGroups",
    "hierarchical",
    "collective_log",
    "WireMeter",
    "STALL_WARNING_ENV",
    "set_stall_warning",
    "stall_warning_seconds",
]

Timeout = Union[None, float, int, datetime.timedelta]
# A communication written as a generator: it launches an async collective, yields its work
# handle and, when resumed, post-processes and launches the next one.
Stages = Generator["dist.Work", None, None]


def is_distributed(group=None) -> bool:
    """True when ``group`` (default: the world) exists and has more than one rank."""
    return world_size(group) > 1


def world_size(group=None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group=None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def group_ranks(group=None) -> List[int]:
    """Global ranks of ``group`` in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(world_size()))
    return list(dist.get_process_group_ranks(group))


def small_tensor_device(group=None) -> torch.device:
    """Where flags and digests must live for the group's backend (NCCL only moves GPU tensors)."""
    if world_size(group) > 1 and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_timedelta(timeout: Timeout) -> Optional[datetime.timedelta]:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise AlgorithmConfigError(f"timeout must be positive seconds or a timedelta, got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))


class CollectiveLog:
    """Counts collectives this process launched, by kind: lets tests see which path ran."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


collective_log = CollectiveLog()


# ---------------------------------------------------------------------- which collective, on which group
class _GroupInfo:
    """What the stall watchdog needs to know about a process group: a name every rank agrees
    on, its global ranks, and how many collectives of this package were launched on it."""

    __slots__ = ("group", "key", "ranks", "seq")

    def __init__(self, group):
        self.group = group
        pg = dist.group.WORLD if group is None else group
        self.key = str(getattr(pg, "group_name", None) or ",".join(map(str, group_ranks(group))))
        self.ranks = group_ranks(group)
        self.seq = 0  # the same count on every rank of the group: collectives are launched in one order


_groups: Dict[object, Tuple[object, _GroupInfo]] = {}
# (id(work), group info, sequence number) of the newest collective launched by this process
_last_launch: Optional[Tuple[int, _GroupInfo, int]] = None


def release_group(group=None) -> None:
    """Drop what this module keeps of ``group`` (None: of every group), before it is destroyed.

    Why: ``dist.destroy_process_group`` joins gloo's worker threads only when it drops the last
    reference to the group; a reference kept here would leave them running into the
    interpreter's teardown (see :func:`destroy_process_groups_at_exit`)."""
    global _last_launch
    _last_launch = None
    if group is None:
        _groups.clear()
        NodeGroups._cache.clear()
        return
    _groups.pop(group, None)
    for key, (_, nodes) in list(NodeGroups._cache.items()):
        if group is nodes.intra_group or group is nodes.leader_group:
            del NodeGroups._cache[key]


def _launched(work, group, tensor: torch.Tensor):
    """Number the collective ``work`` on its group, for the stall watchdog (CPU collectives only)."""
    global _last_launch
    if tensor.device.type != "cpu":  # waits on GPU collectives do not block the CPU; NCCL has its own watchdog
        _last_launch = None
        return work
    if group is dist.group.WORLD:
        group = None
    cached = _groups.get(group)
    if cached is None or cached[0] is not dist.group.WORLD:  # a new process group since
        cached = (dist.group.WORLD, _GroupInfo(group))
        _groups[group] = cached
    info = cached[1]
    info.seq += 1
    _last_launch = (id(work), info, info.seq)
    return work


# ---------------------------------------------------------------------- async collectives
def all_reduce(tensor, group=None, op=None, timeout: Timeout = None):
    """Launch a sum (or ``op``) allreduce of ``tensor`` over ``group``.

    ``timeout``: for a CPU (gloo) tensor, the collective itself fails after it, not only a wait
    on it. A collective that :func:`wait` gave up on otherwise keeps gloo busy until the process
    group's own timeout (30 minutes by default), and destroying the group, which the interpreter
    does at exit, waits for it: a process that gave up on a peer could not exit before then.
    Gloo honours it from torch 2.9 (``_torch_compat.all_reduce_with_timeout``); before, the
    group's timeout still ends the collective.
    """
    collective_log.record("all_reduce", tensor)
    op = op or dist.ReduceOp.SUM
    delta = as_timedelta(timeout)
    if (delta is not None and tensor.device.type == "cpu" and not tensor.is_complex()
            and _torch_compat.gloo_honours_collective_timeouts()):
        work = _torch_compat.all_reduce_with_timeout(tensor, op, group, delta)
    else:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return _launched(work, group, tensor)


def reduce(tensor, dst: int, group=None):
    collective_log.record("reduce", tensor)
    return _launched(dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True), group, tensor)


def average(flat: torch.Tensor, group=None, timeout: Timeout = None) -> Stages:
    """Average ``flat`` in place over ``group``, as stages: divide by the group size, then sum-allreduce.

    Dividing first (as DDP and fairseq do) keeps half-precision sums in range and gives the
    same bits as fairseq's own averaging. The one place this is written. ``timeout``: as
    :func:`all_reduce`'s.
    """
    flat.div_(world_size(group))
    yield all_reduce(flat, group, timeout=timeout)


def broadcast(tensor, src: int, group=None):
    collective_log.record("broadcast", tensor)
    return _launched(dist.broadcast(tensor, src=src, group=group, async_op=True), group, tensor)


def all_to_all(output, inp, group=None):
    collective_log.record("all_to_all", inp)
    return _launched(dist.all_to_all_single(output, inp, group=group, async_op=True), group, inp)


_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(output, inp, group=None):
    collective_log.record("all_gather", inp)
    return _launched(_all_gather_flat(output, inp, group=group, async_op=True), group, inp)


def gather(inp: torch.Tensor, outputs: Optional[List[torch.Tensor]], dst: int, group=None):
    """Gather ``inp`` from every rank into ``outputs`` (one per rank) on global rank ``dst``
    (``outputs`` is None elsewhere)."""
    collective_log.record("gather", inp)
    return _launched(dist.gather(inp, gather_list=outputs, dst=dst, group=group, async_op=True), group, inp)


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group=None):
    """Send ``send`` to global rank ``peer`` and receive its tensor into ``recv``."""
    collective_log.record("exchange", send)
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    return _launched(_Transfers(dist.batch_isend_irecv(ops)), group, send)


def ring_exchange(send: torch.Tensor, from_left: torch.Tensor, from_right: torch.Tensor, left: int, right: int,
                  group=None):
    """Send ``send`` to global ranks ``left`` and ``right``; receive theirs into ``from_left`` / ``from_right``."""
    collective_log.record("ring_exchange", send)
    ops = [dist.P2POp(dist.isend, send, left, group), dist.P2POp(dist.isend, send, right, group),
           dist.P2POp(dist.irecv, from_left, left, group), dist.P2POp(dist.irecv, from_right, right, group)]
    return _launched(_Transfers(dist.batch_isend_irecv(ops)), group, send)


class _Transfers:
    """Point-to-point sends and receives, waited on as one.

    Why :meth:`poll` waits in a thread: on gloo, a wait on a send or receive cannot give up and
    be tried again. When a wait with a timeout expires, gloo closes every connection of the
    process group (this rank fails with "Application timeout caused pair closure", its peers
    with "Connection closed by peer"), and ``is_completed()`` stays False until a wait has
    returned. The stall watchdog's short waits (:func:`_watched_wait`) would so kill a job
    whose neighbour is a second late, e.g. compiling its first step. :meth:`poll` hands the
    transfers to a thread that waits on them once, up to the real timeout, and watches it.
    """

    def __init__(self, works):
        self.works = works
        self._waiter: Optional[Tuple[threading.Event, list]] = None  # (done, [its error]) once poll() started it

    def _wait_each(self, timeout) -> None:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)

    def wait(self, timeout=None):
        if self._waiter is None:  # one wait in full: when it expires, the transfers have failed
            self._wait_each(timeout)
            return True
        if not self.poll(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"timed out after {timeout.total_seconds():g}s")
        return True

    def poll(self, seconds: Optional[float], timeout=None) -> bool:
        """True once every transfer completed, False if still running after ``seconds`` (None: until
        then); a failure raises.

        The first call starts the thread that waits, which gives up at ``timeout`` (a timedelta;
        None: the process group's timeout)."""
        if self._waiter is None:
            done, failure = threading.Event(), []

            def wait_all():
                try:
                    self._wait_each(timeout)
                except BaseException as error:  # noqa: BLE001 - raised again by poll() / wait()
                    failure.append(error)
                finally:
                    done.set()

            self._waiter = (done, failure)
            threading.Thread(target=wait_all, name="bagua-transfers-wait", daemon=True).start()
        done, failure = self._waiter
        if not done.wait(None if seconds is None else max(seconds, 0.0)):
            return False
        if failure:
            raise failure[0]
        return True


# ---------------------------------------------------------------------- waiting with a deadline
STALL_WARNING_ENV = "BAGUA_STALL_WARNING_SECONDS"
DEFAULT_STALL_WARNING_SECONDS = 60.0
ARRIVAL_MARK_SECONDS = 1.0  # a wait longer than this tells the store that this rank has arrived
_ARRIVAL_KEY = "bagua_integrations/arrived/{group}/{rank}"
_UNSET = object()
_stall_override = _UNSET
_stall_from_env = _UNSET  # BAGUA_STALL_WARNING_SECONDS, read at the first wait (and again after set_stall_warning())


def _non_negative_or_none(seconds) -> Optional[float]:
    if seconds is None:
        return None
    seconds = float(seconds)
    if seconds != seconds or seconds < 0:
        raise AlgorithmConfigError(f"the stall warning interval must be >= 0 seconds (0: off), got {seconds!r}")
    return seconds or None


def set_stall_warning(seconds: Union[None, float, int, datetime.timedelta] = _UNSET) -> None:
    """Warn (:class:`CollectiveStallWarning`) when a collective has waited ``seconds`` for its peers.

    ``0`` or ``None`` turns the warning off; calling it without an argument goes back to
    ``BAGUA_STALL_WARNING_SECONDS`` (read again; default 60). Process-wide; nothing is ever
    aborted by it: a stuck collective raises :class:`CommunicationError` only at the timeout.
    """
    global _stall_override, _stall_from_env
    if isinstance(seconds, datetime.timedelta):
        seconds = seconds.total_seconds()
    _stall_override = _UNSET if seconds is _UNSET else _non_negative_or_none(seconds)
    _stall_from_env = _UNSET


def stall_warning_seconds() -> Optional[float]:
    """The current stall warning interval in seconds (None: off)."""
    global _stall_from_env
    if _stall_override is not _UNSET:
        return _stall_override
    if _stall_from_env is _UNSET:
        raw = os.environ.get(STALL_WARNING_ENV, "").strip()
        try:
            _stall_from_env = _non_negative_or_none(raw) if raw else DEFAULT_STALL_WARNING_SECONDS
        except (ValueError, AlgorithmConfigError):
            raise AlgorithmConfigError(
                f"{STALL_WARNING_ENV}={raw!r}: expected seconds >= 0 (0 turns the stall warning off)"
            ) from None
    return _stall_from_env


def _site_of(work) -> Optional[Tuple[_GroupInfo, int]]:
    """The group and number of ``work`` if it is the collective launched last (else None: not watched).

    Consumes the record, so a later work that was not launched here is never mistaken for it.
    """
    global _last_launch
    last, _last_launch = _last_launch, None
    if work is None or last is None or last[0] != id(work):
        return None
    return last[1], last[2]


def wait(work, timeout: Timeout, what: str, site: Optional[Tuple[_GroupInfo, int]] = None) -> None:
    """Wait for ``work``; a peer failure or timeout becomes a :class:`CommunicationError`.

    With ``site`` (the group and number :class:`Pending` got at launch) a wait longer than the
    stall interval warns first, naming ``what`` and the ranks that have not arrived.
    """
    delta = as_timedelta(timeout)
    try:
        warn_after = stall_warning_seconds() if site is not None else None
        if warn_after is None or (delta is not None and delta.total_seconds() <= warn_after):
            if delta is None:
                work.wait()
            else:
                work.wait(delta)
        else:
            _watched_wait(work, delta, what, site, warn_after)
    except DistributedError:
        raise
    except RuntimeError as error:
        raise _communication_error(what, error, delta) from error


def _wait_for(work, seconds: float, timeout=None) -> bool:
    """Wait up to ``seconds``; True once done, False if still running; a failure raises.

    ``timeout``: when the whole wait gives up (for point-to-point transfers, see :class:`_Transfers`)."""
    if isinstance(work, _Transfers):
        return work.poll(seconds, timeout)
    try:
        work.wait(datetime.timedelta(seconds=max(seconds, 0.001)))
        return True
    except RuntimeError:
        if not work.is_completed():
            return False  # only this wait timed out; the collective goes on
    work.wait()  # completed meanwhile, or failed: returns, or raises the real error
    return True


def _watched_wait(work, delta, what: str, site, warn_after: float) -> None:
    start = time.monotonic()
    mark = min(ARRIVAL_MARK_SECONDS, warn_after / 2)
    if _wait_for(work, mark, delta):
        return
    info, seq = site
    store = _mark_arrival(info, seq)
    if _wait_for(work, warn_after - (time.monotonic() - start), delta):
        return
    waited = time.monotonic() - start
    warnings.warn(CollectiveStallWarning(_stall_message(what, info, seq, store, waited, delta)), stacklevel=4)
    if delta is None:
        work.wait()  # the backend raises at the process group's timeout
    else:
        remaining = delta.total_seconds() - (time.monotonic() - start)
        work.wait(datetime.timedelta(seconds=max(remaining, 0.001)))


def _mark_arrival(info: _GroupInfo, seq: int):
    """Tell the other ranks (through the rendezvous store) that this rank waits in collective ``seq``."""
    try:
        store = _torch_compat.default_store()
        store.set(_ARRIVAL_KEY.format(group=info.key, rank=rank()), str(seq))
        return store
    except Exception:  # noqa: BLE001 - the warning then says "unknown"
        return None


def _missing_ranks(store, info: _GroupInfo, seq: int) -> Optional[List[int]]:
    if store is None:
        return None
    try:
        missing = []
        for peer in info.ranks:
            key = _ARRIVAL_KEY.format(group=info.key, rank=peer)
            if not store.check([key]) or store.get(key).decode() != str(seq):
                missing.append(peer)
        return missing
    except Exception:  # noqa: BLE001
        return None


def _stall_message(what: str, info: _GroupInfo, seq: int, store, waited: float, delta) -> str:
    missing = _missing_ranks(store, info, seq)
    if missing is None:
        who = "which ranks have not arrived is unknown (no rendezvous store)"
    elif missing:
        who = f"rank(s) {missing} of {info.ranks} have not arrived"
    else:
        who = f"every rank of {info.ranks} has arrived, the transfer itself is slow or broken"
    if delta is not None:
        limit = f"at the timeout, {delta.total_seconds():g}s after it started (bagua_init(timeout=...))"
    else:
        try:
            limit = f"at the process group's timeout ({_torch_compat.process_group_timeout(info.group, default=None).total_seconds():g}s)"
        except Exception:  # noqa: BLE001
            limit = "at the process group's timeout"
    return (
        f"{what} has waited {waited:.0f}s on rank {rank()} (collective #{seq} of bagua_integrations on process "
        f"group {info.key!r}): {who}. A rank that is still computing (compiling its first step, loading or "
        "saving a checkpoint) arrives late; one that ran out of data and waits elsewhere (dist.barrier(), "
        "an all_reduce of a metric, the end of the script) never will: train under `with model.join():` "
        f"for uneven inputs. Nothing is aborted; it raises CommunicationError {limit}. "
        f"{STALL_WARNING_ENV} (now {stall_warning_seconds():g}s) sets when this warning comes, 0 turns it off."
    )


def _communication_error(what: str, error: BaseException, delta) -> CommunicationError:
    limit = f" within {delta.total_seconds():g}s" if delta is not None else ""
    return CommunicationError(
        f"{what} did not complete{limit}: {error}. A peer rank probably raised, exited or is stuck; "
        "look at the other ranks' logs for the first error. If steps are legitimately this slow, "
        "pass a larger timeout= to bagua_init (or to init_process_group)."
    )


class Pending:
    """A communication of one or more collective stages, advanced only by :meth:`wait`.

    The first stage is launched at construction; later stages run inside ``wait``. Since
    callers wait on pendings in a fixed order, every rank issues every stage in the same
    order on each process group, which gloo and NCCL require.
    """

    def __init__(self, stages: Stages, what: str, timeout: Timeout = None):
        self.what = what
        self.timeout = timeout
        self._stages = stages
        self._site = None
        self._work = self._next()

    def _next(self):
        try:
            work = next(self._stages, None)
            self._site = _site_of(work)
            return work
        except DistributedError:
            raise
        except RuntimeError as error:
            raise _communication_error(self.what, error, as_timedelta(self.timeout)) from error

    @property
    def done(self) -> bool:
        return self._work is None

    def wait(self) -> None:
        while self._work is not None:
            self.advance()

    def advance(self) -> None:
        """Wait for the collective in flight and run the next stage (its compute, and the launch
        of its collective). Callers advance at points that are the same on every rank (the
        reducer: when the next bucket is launched), so every rank issues collectives in the same
        order."""
        if self._work is not None:
            wait(self._work, self.timeout, self.what, self._site)
            self._work = self._next()


def run(stages: Stages, what: str, timeout: Timeout = None) -> None:
    """Run a staged communication to completion."""
    Pending(stages, what, timeout).wait()


# ---------------------------------------------------------------------- nodes
class NodeGroups:
    """Ranks split into nodes of ``LOCAL_WORLD_SIZE`` ranks: one group per node, one of node leaders.

    A node's leader is its first rank. Every rank creates every group, in the same order,
    because ``new_group`` is collective.
    """

    _cache = {}

    @staticmethod
    def local_size_of(group=None) -> int:
        """Ranks per node: ``LOCAL_WORLD_SIZE``, else all of ``group`` (one node)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size(group)))

    def __init__(self, group=None, local_size: Optional[int] = None, timeout: Timeout = None):
        ranks = group_ranks(group)
        size = len(ranks)
        if local_size is None:
            local_size = self.local_size_of(group)
        if local_size <= 0 or size % local_size:
            raise AlgorithmConfigError(
                f"hierarchical_reduce needs every node to hold the same number of ranks, but the "
                f"world has {size} ranks and LOCAL_WORLD_SIZE is {local_size}; launch with torchrun "
                "--nproc_per_node equal on every node, or pass hierarchical_reduce=False"
            )
        self.local_size = local_size
        self.num_nodes = size // local_size
        me = ranks.index(rank())
        node = me // local_size
        self.node_ranks = ranks[node * local_size : (node + 1) * local_size]
        self.leaders = ranks[::local_size]
        self.leader = self.node_ranks[0]
        self.is_leader = rank() == self.leader
        self.intra_group = None
        self.leader_group = None
        if not self.active:
            return
        delta = as_timedelta(timeout)
        for index in range(self.num_nodes):
            created = dist.new_group(ranks[index * local_size : (index + 1) * local_size], timeout=delta)
            if index == node:
                self.intra_group = created
        created = dist.new_group(self.leaders, timeout=delta)
        if self.is_leader:
            self.leader_group = created

    @property
    def active(self) -> bool:
        """Whether there is a hierarchy at all (more than one node, more than one rank per node)."""
        return self.num_nodes > 1 and self.local_size > 1

    @staticmethod
    def possible(group=None) -> bool:
        """Whether ``group``'s ranks split into equal nodes of ``LOCAL_WORLD_SIZE`` ranks with a
        hierarchy to use (more than one node of more than one rank); unlike :meth:`of`, a world
        that does not split (3 ranks, 2 per node) is an answer (False), not an error."""
        size, local_size = world_size(group), NodeGroups.local_size_of(group)
        return 1 < local_size < size and size % local_size == 0

    @classmethod
    def of(cls, group=None, local_size: Optional[int] = None, timeout: Timeout = None) -> "NodeGroups":
        """The node groups of ``group``, created once per process (new groups are costly)."""
        if local_size is None:
            local_size = cls.local_size_of(group)
        key = (id(group), local_size)
        cached = cls._cache.get(key)
        if cached is None or cached[0] is not dist.group.WORLD:
            cached = (dist.group.WORLD, cls(group, local_size, timeout))
            cls._cache[key] = cached
        return cached[1]

    def describe(self) -> str:
        return f"{self.num_nodes}x{self.local_size}"


def hierarchical(inner: Callable[[torch.Tensor, object], Stages], flat: torch.Tensor, nodes: NodeGroups) -> Stages:
    """Sum inside the node to its leader, let ``inner`` average among leaders, broadcast back."""
    yield reduce(flat, nodes.leader, nodes.intra_group)
    if nodes.is_leader:
        flat.div_(nodes.local_size)
        yield from inner(flat, nodes.leader_group)
    yield broadcast(flat, nodes.leader, nodes.intra_group)


# ---------------------------------------------------------------------- leaving the process
_destroy_registered = False
_exit_releases: List[Callable[[], None]] = []


def destroy_process_groups_at_exit(release: Optional[Callable[[], None]] = None) -> None:
    """Destroy torch.distributed's process groups when the interpreter exits (registered once).

    Why: a race between gloo and Python's shutdown. A gloo worker thread that finishes a
    collective after Python began finalizing drops the last reference to a Python-backed
    tensor, needs the GIL, and Python ends such a thread; the unwind hits a noexcept C++ frame
    and the rank dies with ``terminate called without an active exception`` (SIGABRT) after its
    training is done (seen in gdb on a core of a 2-rank fairseq run). Plain torch reproduces it:
    4 of 20 ``torchrun`` runs of a 2-rank all_reduce loop that exits normally. Destroying the
    groups first, as torch itself advises, joins those threads while Python still runs: 0 of
    20. Handlers registered later (``async``'s exit abort) run before this one.

    Destroying a group joins its threads only when that drops the last reference to it, so
    first: this module's records of groups go (:func:`release_group`); so does the one torch
    keeps when ``torch.distributed.nn`` is imported after ``init_process_group``, which building
    any torch optimizer does (``_torch_compat.drop_group_defaults_kept_by_torch``); and ``release``
    callbacks drop others' (fairseq's cached group). After the destroy a garbage collection frees
    groups held only by garbage cycles (a finished loop's model and its hooks). Without these,
    the groups' gloo threads ran into the teardown in every 2-rank fairseq-train run and in a
    script that builds its optimizer after initializing (seen: 1 ``async`` exit in ~60 aborted on
    torch 2.14.1). A group the program itself still references at exit keeps its threads.

    ``release``: called at exit before the destroy, to drop a reference to a group that code
    outside this package keeps (fairseq's cached global group: ``fairseq_plugin``).
    """
    global _destroy_registered
    if release is not None and release not in _exit_releases:
        _exit_releases.append(release)
    if not _destroy_registered:
        atexit.register(_destroy_process_groups)
        _destroy_registered = True


def _destroy_process_groups() -> None:
    for release in _exit_releases:
        try:
            release()
        except Exception as error:  # noqa: BLE001 - leaving anyway; the destroy still runs
            warnings.warn(f"dropping a process group reference at exit failed: {error}", stacklevel=1)
    release_group(None)
    if dist.is_available() and dist.is_initialized():
        try:
            _torch_compat.drop_group_defaults_kept_by_torch(dist.group.WORLD)
            dist.destroy_process_group()
            gc.collect()  # a group held only by garbage (a finished loop's model, fairseq's trainer) goes now
        except Exception as error:  # noqa: BLE001 - leaving anyway; say why the exit may be noisy
            warnings.warn(f"destroying the process groups at exit failed: {error}", stacklevel=1)


# ---------------------------------------------------------------------- measuring the wire
def _written_bytes() -> Optional[int]:
    try:
        with open("/proc/self/io") as handle:
            for line in handle:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class WireMeter:
    """Bytes this process wrote (Linux ``/proc/self/io``), i.e. what gloo put on its sockets.

    ``with WireMeter() as meter: ...`` then ``meter.bytes``; ``None`` where /proc is missing.
    Everything the process writes counts, so keep logging out of the measured region.
    """

    def __init__(self):
        self.bytes: Optional[int] = None
        self._start: Optional[int] = None

    def __enter__(self) -> "WireMeter":
        self._start = _written_bytes()
        return self

    def __exit__(self, *exc) -> None:
        end = _written_bytes()
        self.bytes = None if end is None or self._start is None else end - self._start
