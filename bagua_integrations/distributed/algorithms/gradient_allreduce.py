"""``gradient_allreduce``: every rank gets the average gradient (what DDP does)."""

from __future__ import annotations

import torch

from .. import comm
from .base import GradientAlgorithm
from .registry import register_algorithm

__all__ = ["GradientAllReduce"]


@register_algorithm("gradient_allreduce")
class GradientAllReduce(GradientAlgorithm):
    """Sum-allreduce of pre-divided gradients: exact, one collective per bucket.

    Args:
        hierarchical: reduce inside each node, allreduce among node leaders, broadcast
            inside the node (a node is ``LOCAL_WORLD_SIZE`` ranks). Default False.
        message_size: bytes per bucket for :meth:`allreduce_gradients` (the reducer gets
            its own from ``bagua_init``).
        timeout: how long to wait for one bucket before raising ``CommunicationError``.
    """

    name = "gradient_allreduce"
    hierarchical_default = False

    def average(self, flat: torch.Tensor, group) -> comm.Stages:
        return comm.average(flat, group)
