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
        if not isinstance(communication_interval, int) or communication_interval < 1:
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

    def update(self, step: int, group) -> bool:
        if not comm.is_distributed(group) or step % self.communication_interval:
            return False
        flats = self.pack.gather()
        nodes = self.nodes(group)
        if nodes is not None:
            stages = [comm.hierarchical(self._average_with_peers, flat, nodes) for flat in flats]
        else:
            stages = [self._average_with_peers(flat, group) for flat in flats]
        self.run(stages, f"weight averaging (round {self.rounds})")
        self.pack.scatter()
        self.rounds += 1
        return True

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
