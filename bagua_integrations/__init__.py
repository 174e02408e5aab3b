"""bagua-integrations: a generic fused optimizer and Bagua's communication algorithms on torch.distributed."""

from .errors import (
    AlreadyFusedError,
    CompileFallbackWarning,
    EmptyOptimizerError,
    FusionError,
    FusionFallbackWarning,
    LayoutChangedError,
    NotAnOptimizerError,
    NotElementwiseError,
)
from .fused_optimizer import FusionReport, fuse_optimizer, fusion_report, is_fused_optimizer

__version__ = "0.1.0"

__all__ = [
    "fuse_optimizer",
    "is_fused_optimizer",
    "fusion_report",
    "FusionReport",
    "FusionError",
    "NotAnOptimizerError",
    "EmptyOptimizerError",
    "AlreadyFusedError",
    "NotElementwiseError",
    "LayoutChangedError",
    "FusionFallbackWarning",
    "CompileFallbackWarning",
]
