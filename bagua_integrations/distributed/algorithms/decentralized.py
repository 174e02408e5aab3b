"""``decentralized``: ranks average weights with peers instead of exchanging gradients."""

from __future__ import annotations

from typing import Optional

import torch

from .. import comm
from ..errors import AlgorithmConfigError
from .base import ModelAlgorithm
from .registry import register_algorithm

__all__ = ["Decentralized", "shift_one_peer"]

PEER_SELECTION_MODES = ("all", "shift_one")


def shift_one_peer(rank: int, size: int, round_index: int) -> int:
    """The partner of ``rank`` in round ``round_index``: the first half of the ranks pairs with
    the second half, shifted by one more each round, so partners change every round."""
    half = size // 2
    shift = round_index % half
    if rank < half:
        return half + (rank + shift) % half
    return (rank - half - shift) % half


@register_algorithm("decentralized")
class Decentralized(ModelAlgorithm):
    """Decentralized SGD: after every ``communication_interval`` optimizer steps each rank
    replaces its weights by an average with its peers.

    Args:
        peer_selection_mode: ``"all"`` averages with every rank (an allreduce of the weights);
            ``"shift_one"`` averages with one partner, a different one each round (needs an
            even number of ranks, or of nodes when hierarchical).
        communication_interval: communicate after every this many optimizer steps.
        hierarchical: average inside each node first and run the peer exchange among node
            leaders only. Default True (as in Bagua); flat on a single node.
        timeout: how long to wait for a peer before raising ``CommunicationError``.

    Unlike Bagua's overlapped implementation (which averages the weights of the previous
    step while the next forward runs), the averaging here happens right after the optimizer
    step, so it can be driven from any training loop through :meth:`after_step`.
    """

    name = "decentralized"
    hierarchical_default = True
    supports_join = True

    def __init__(
        self,
        peer_selection_mode: str = "all",
        communication_interval: int = 1,
        hierarchical: Optional[bool] = None,
        timeout=None,
    ):
        super().__init__(hierarchical, timeout)
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise AlgorithmConfigError(
                f"peer_selection_mode must be one of {PEER_SELECTION_MODES}, got {peer_selection_mode!r}"
            )
        if (isinstance(communication_interval, bool) or not isinstance(communication_interval, int)
                or communication_interval < 1):
            raise AlgorithmConfigError(
                f"communication_interval must be an integer >= 1, got {communication_interval!r}"
            )
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval
        self.rounds = 0

    def hyperparameters(self):
        return dict(
            super().hyperparameters(),
            peer_selection_mode=self.peer_selection_mode,
            communication_interval=self.communication_interval,
        )

    def validate(self, group) -> None:
        if self.peer_selection_mode != "shift_one" or not comm.is_distributed(group):
            return
        nodes = self.nodes(group)
        peers = nodes.num_nodes if nodes is not None else comm.world_size(group)
        if peers % 2:
            where = "nodes" if nodes is not None else "ranks"
            raise AlgorithmConfigError(
                f"peer_selection_mode='shift_one' pairs {where} up and needs an even number of them, got "
                f"{peers}; use peer_selection_mode='all' or an even world size"
            )

    def on_attach(self) -> None:
        self.rounds = 0

    @property
    def weights_differ(self) -> bool:
        # "all" every step leaves every rank the same weights; otherwise they differ in between
        return self.peer_selection_mode != "all" or self.communication_interval > 1

    def state_dict(self):
        """The update counter (when the next averaging is due) and the peer round (who is next)."""
        return dict(super().state_dict(), rounds=self.rounds)

    def restore(self, state) -> None:
        super().restore(state)
        self.rounds = int(state.get("rounds", self.rounds))

    def update(self, step: int, group) -> bool:
        if not comm.is_distributed(group) or step % self.communication_interval:
            return False
        if self.join_state is not None and self.peer_selection_mode == "shift_one":
            return self._shift_one_under_join(self.join_state, group)
        flats = self.pack.gather()
        if self.join_state is not None:  # "all": the mean over the ranks with data, which every rank takes
            for flat in flats:
                self.join_state.contribute(flat)
        nodes = self.nodes(group)
        if nodes is not None:
            stages = [comm.hierarchical(self._average_with_peers, flat, nodes) for flat in flats]
        else:
            stages = [self._average_with_peers(flat, group) for flat in flats]
        self.run(stages, f"weight averaging (round {self.rounds})")
        self.pack.scatter()
        self.rounds += 1
        return True

    def _shift_one_under_join(self, join, group) -> bool:
        """``shift_one`` when some ranks ran out of data: only ranks (nodes) that both have data average."""
        nodes = self.nodes(group)
        me = comm.rank()
        communicated = False
        if nodes is None:
            if join.is_active(me) and join.is_active(self.peer(group)):
                flats = self.pack.gather()
                self.run([self._average_with_peers(flat, group) for flat in flats], f"weight averaging (round {self.rounds})")
                self.pack.scatter()
                communicated = True
        else:
            flats = self.pack.gather()
            mine = flats if join.is_active(me) else [torch.zeros_like(flat) for flat in flats]
            ranks = comm.group_ranks(group)
            self.run([self._node_shift_one_under_join(flat, nodes, join, ranks) for flat in mine],
                     f"weight averaging (round {self.rounds})")
            if any(join.is_active(r) for r in nodes.node_ranks):  # else the node has nothing to average
                if mine is not flats:
                    for flat, averaged in zip(flats, mine):
                        flat.copy_(averaged)
                self.pack.scatter()
            communicated = True
        self.rounds += 1
        return communicated

    def _node_shift_one_under_join(self, flat: torch.Tensor, nodes: comm.NodeGroups, join, ranks) -> comm.Stages:
        yield comm.reduce(flat, nodes.leader, nodes.intra_group)  # joined ranks sent zeros
        if nodes.is_leader:
            here = sum(join.is_active(r) for r in nodes.node_ranks)
            if here:
                flat.div_(here)
            partner = self.peer(nodes.leader_group)
            first = ranks.index(partner)
            there = sum(join.is_active(r) for r in ranks[first : first + nodes.local_size])
            if here and there:
                received = torch.empty_like(flat)
                yield comm.exchange(flat, received, partner, nodes.leader_group)
                flat.add_(received).div_(2)
        yield comm.broadcast(flat, nodes.leader, nodes.intra_group)

    def peer(self, group) -> int:
        """This rank's shift_one partner this round, as a global rank."""
        partner = shift_one_peer(comm.rank(group), comm.world_size(group), self.rounds)
        return comm.group_ranks(group)[partner]

    def _average_with_peers(self, flat: torch.Tensor, group) -> comm.Stages:
        if self.peer_selection_mode == "all":
            yield from comm.average(flat, group)
            return
        received = torch.empty_like(flat)
        yield comm.exchange(flat, received, self.peer(group), group)
        flat.add_(received).div_(2)
