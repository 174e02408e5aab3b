"""Bagua's ``bagua.torch_api.contrib`` names, for scripts that change only their import.

``import bagua_integrations as bagua`` then ``bagua.contrib.fuse_optimizer(optimizer,
do_flatten=True)`` and ``optimizer.fuse_step()`` work as on Bagua's fused-optimizer page.
"""

import torch

from . import fused_optimizer as _fused
from .fused_optimizer import fusion_report, is_fused_optimizer, unfuse

__all__ = ["fuse_optimizer", "fusion_report", "is_fused_optimizer", "unfuse"]


def fuse_optimizer(optimizer: torch.optim.Optimizer, do_flatten: bool = True, check_flatten: bool = True,
                   **kwargs) -> torch.optim.Optimizer:
    """Bagua's ``fuse_optimizer(optimizer, do_flatten=True, check_flatten=True)``: the package's
    :func:`~bagua_integrations.fuse_optimizer` (keyword arguments go to it).

    ``check_flatten`` is accepted with either value and changes nothing: every fused step checks
    that the parameters, gradients and state are still views of the flat buffers, whatever this
    flag says (a parameter moved or cast after fusing raises ``LayoutChangedError``).
    """
    if not isinstance(check_flatten, bool):
        raise TypeError(f"check_flatten must be True or False, got {check_flatten!r}")
    return _fused.fuse_optimizer(optimizer, do_flatten, **kwargs)
