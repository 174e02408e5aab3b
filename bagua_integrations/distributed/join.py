"""Uneven inputs: ``with Join([model]):`` (or ``with model.join():``) over a :class:`BaguaModule`.

torch's generic join context (``torch.distributed.algorithms.Join``) runs a *main hook* on each
rank that has run out of data, once for every ``Join.notify_join_context`` call of the ranks
that still have data; the hook must issue the collectives those ranks issue. A ``BaguaModule``
notifies at two *events*:

* a training forward that communicates (buffer broadcast; a gradient reduction follows in
  backward, or before the optimizer step when backward reached no parameter);
* an optimizer step of a model algorithm (its weight averaging / block sync after the step).

Right after notifying, every rank takes part in one small all-reduce, the *header*: each rank
with data marks itself active and states the event, the update number and whether gradients
are averaged this iteration (``no_sync`` or not); joined ranks send nothing. Everyone then
knows the active ranks and the event, and the joined ranks shadow that event's collectives:

* averages are over the active ranks: a joined rank contributes zeros and the active ranks
  scale their contribution by ``world / active`` before the collective
  (:meth:`JoinState.contribute`), so the collective's usual division by the world size gives
  the mean over active ranks (DDP's ``divide_by_initial_world_size=False``). The joined rank
  receives the same mean: its gradients, and under model averaging its weights, follow the
  active ranks;
* broadcasts (buffers, BMUF's warmup) come from the lowest active rank instead of rank 0;
* pairwise exchanges (``decentralized`` with ``shift_one``) only happen between active ranks.

Ranks that disagree about the event or the update number get :class:`JoinError` on every rank.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.distributed.algorithms.join import JoinHook

from . import comm
from .errors import JoinError

__all__ = ["JoinState", "BaguaJoinHook", "FORWARD", "STEP"]

FORWARD, STEP = 1, 2
_EVENTS = {FORWARD: "a training forward", STEP: "an optimizer step"}
_ABSENT = -(1 << 40)  # what a joined rank sends where active ranks state something (the reduction is MAX)


class JoinState:
    """One event under ``Join`` as every rank sees it: which ranks still have data, and what they do.

    ``active`` holds global ranks; ``joined`` says whether this rank is one of the others.
    """

    def __init__(self, active: List[int], size: int, joined: bool, event: int, sync: bool, step: int,
                 divide_by_initial_world_size: bool = False):
        self.active = active
        self.size = size
        self.joined = joined
        self.event = event
        self.sync = sync
        self.step = step
        self.divide_by_initial_world_size = divide_by_initial_world_size

    @property
    def num_active(self) -> int:
        return len(self.active)

    @property
    def src(self) -> int:
        """The global rank broadcasts come from: the lowest rank that still has data."""
        return self.active[0]

    def is_active(self, global_rank: int) -> bool:
        return global_rank in self.active

    def contribute(self, flat: torch.Tensor, *, mean: bool = True) -> None:
        """Prepare ``flat`` for an averaging collective that divides by the world size.

        A joined rank contributes zeros; an active rank scales by ``world / active`` so the
        result is the mean over active ranks (not with ``mean=False``: gradients under
        ``divide_by_initial_world_size=True`` keep DDP's division by the initial world size).
        """
        if self.joined:
            flat.zero_()
        elif mean and self.num_active < self.size:
            flat.mul_(self.size / self.num_active)

    def __repr__(self) -> str:
        return (f"JoinState(active={self.active}, joined={self.joined}, event={_EVENTS.get(self.event)}, "
                f"sync={self.sync}, step={self.step})")


def exchange_header(group, timeout, *, event: int = 0, sync: bool = False, step: int = 0, joined: bool = False,
                    divide_by_initial_world_size: bool = False) -> JoinState:
    """The header all-reduce of one event (see the module docstring); the same :class:`JoinState` on every rank."""
    ranks = comm.group_ranks(group)
    size = len(ranks)
    header = torch.zeros(size + 5, dtype=torch.int64)
    if joined:
        header[size:size + 4] = _ABSENT
    else:
        header[comm.rank(group)] = 1
        header[size:size + 5] = torch.tensor([event, -event, step, -step, int(sync)])
    header = header.to(comm.small_tensor_device(group))

    def stages():
        yield comm.all_reduce(header, group, op=torch.distributed.ReduceOp.MAX)

    comm.run(stages(), "join header (what the ranks that still have data do next)", timeout)
    values = header.tolist()
    active = [ranks[i] for i in range(size) if values[i] > 0]
    first, last = values[size], -values[size + 1]
    high, low = values[size + 2], -values[size + 3]
    if not active or first != last or high != low:
        seen = f"{_EVENTS.get(first, first)} and {_EVENTS.get(last, last)}" if first != last else f"steps {low} and {high}"
        raise JoinError(
            f"under Join the ranks that still have data disagree on what comes next ({seen}; active ranks "
            f"{active}); every rank must run the same loop: a training forward per iteration and, for model "
            "algorithms, one optimizer step after it, the same number of updates so far on every rank"
        )
    return JoinState(active, size, joined, first, bool(values[size + 4]), high, divide_by_initial_world_size)


class BaguaJoinHook(JoinHook):
    """The join hook of a :class:`BaguaModule`: shadows each event, then syncs the final model.

    ``main_hook`` runs on a rank that ran out of data, once per event of the others;
    ``post_hook`` runs on every rank once all have joined: under a gradient algorithm the ranks
    that joined early take the weights of one of the last ones (DDP's final model sync); model
    algorithms keep the weights their averaging gave each replica.
    """

    def __init__(self, wrapped, divide_by_initial_world_size: bool = False):
        self.wrapped = wrapped
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        self.wrapped._shadow_join_event(self.divide_by_initial_world_size)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.wrapped._finish_join(is_last_joiner)


def last_joiner(group, timeout, is_last_joiner: bool) -> Optional[int]:
    """The highest global rank among the last joiners, or None if every rank joined last (nobody is behind)."""
    flags = torch.tensor([comm.rank() if is_last_joiner else -1, 0 if is_last_joiner else 1], dtype=torch.int64)
    flags = flags.to(comm.small_tensor_device(group))

    def stages():
        yield comm.all_reduce(flags, group, op=torch.distributed.ReduceOp.MAX)

    comm.run(stages(), "join: final model sync", timeout)
    src, behind = flags.tolist()
    return int(src) if behind else None
