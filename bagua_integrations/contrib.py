"""Bagua's ``bagua.torch_api.contrib`` names, for scripts that change only their import.

``import bagua_integrations as bagua`` then ``bagua.contrib.fuse_optimizer(optimizer,
do_flatten=True)`` and ``optimizer.fuse_step()`` work as on Bagua's fused-optimizer page.
"""

from .fused_optimizer import fuse_optimizer, fusion_report, is_fused_optimizer, unfuse

__all__ = ["fuse_optimizer", "fusion_report", "is_fused_optimizer", "unfuse"]
