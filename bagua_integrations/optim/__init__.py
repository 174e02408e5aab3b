"""Optimizers written plainly: the seed's BertAdam and LAMB (per-tensor), and QAdam (the optimizer
half of the ``qadam`` distributed algorithm).

BertAdam and LAMB are not elementwise (per-parameter clipping, trust ratios) and fuse exactly
on the segmented path of :func:`bagua_integrations.fuse_optimizer`; QAdam is elementwise.
"""

from .bert_adam import BertAdam
from .lamb import Lamb
from .qadam import QAdam, QAdamOptimizer

__all__ = ["BertAdam", "Lamb", "QAdam", "QAdamOptimizer"]
