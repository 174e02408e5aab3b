"""A thin layer over ``torch.distributed``: group sizes, staged async collectives, node groups.

Everything here degrades to a no-op when there is no process group (or it has one rank),
so single-process users and tests never need ``init_process_group``.
"""

from __future__ import annotations

import datetime
import os
from collections import Counter
from typing import Callable, Generator, List, Optional, Union

import torch
import torch.distributed as dist

from .errors import AlgorithmConfigError, CommunicationError, DistributedError

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
    if timeout <= 0:
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


# ---------------------------------------------------------------------- async collectives
def all_reduce(tensor, group=None, op=None):
    collective_log.record("all_reduce", tensor)
    return dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group, async_op=True)


def reduce(tensor, dst: int, group=None):
    collective_log.record("reduce", tensor)
    return dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)


def average(flat: torch.Tensor, group=None) -> Stages:
    """Average ``flat`` in place over ``group``, as stages: divide by the group size, then sum-allreduce.

    Dividing first (as DDP and fairseq do) keeps half-precision sums in range and gives the
    same bits as fairseq's own averaging. The one place this is written.
    """
    flat.div_(world_size(group))
    yield all_reduce(flat, group)


def broadcast(tensor, src: int, group=None):
    collective_log.record("broadcast", tensor)
    return dist.broadcast(tensor, src=src, group=group, async_op=True)


def all_to_all(output, inp, group=None):
    collective_log.record("all_to_all", inp)
    return dist.all_to_all_single(output, inp, group=group, async_op=True)


_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(output, inp, group=None):
    collective_log.record("all_gather", inp)
    return _all_gather_flat(output, inp, group=group, async_op=True)


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group=None):
    """Send ``send`` to global rank ``peer`` and receive its tensor into ``recv``."""
    collective_log.record("exchange", send)
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    return _AllOf(dist.batch_isend_irecv(ops))


class _AllOf:
    """Several work handles waited on as one."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True


# ---------------------------------------------------------------------- waiting with a deadline
def wait(work, timeout: Timeout, what: str) -> None:
    """Wait for ``work``; a peer failure or timeout becomes a :class:`CommunicationError`."""
    delta = as_timedelta(timeout)
    try:
        if delta is None:
            work.wait()
        else:
            work.wait(delta)
    except DistributedError:
        raise
    except RuntimeError as error:
        raise _communication_error(what, error, delta) from error


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
        self._work = self._next()

    def _next(self):
        try:
            return next(self._stages, None)
        except DistributedError:
            raise
        except RuntimeError as error:
            raise _communication_error(self.what, error, as_timedelta(self.timeout)) from error

    @property
    def done(self) -> bool:
        return self._work is None

    def wait(self) -> None:
        while self._work is not None:
            wait(self._work, self.timeout, self.what)
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

    def __init__(self, group=None, local_size: Optional[int] = None, timeout: Timeout = None):
        ranks = group_ranks(group)
        size = len(ranks)
        if local_size is None:
            local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
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

    @classmethod
    def of(cls, group=None, local_size: Optional[int] = None, timeout: Timeout = None) -> "NodeGroups":
        """The node groups of ``group``, created once per process (new groups are costly)."""
        if local_size is None:
            local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size(group)))
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
