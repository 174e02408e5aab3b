"""Per-tensor optimizers of BERT training, written plainly: the seed's BertAdam and LAMB.

Both are not elementwise (per-parameter clipping, trust ratios) and fuse exactly on the
segmented path of :func:`bagua_integrations.fuse_optimizer`.
"""

from .bert_adam import BertAdam
from .lamb import Lamb

__all__ = ["BertAdam", "Lamb"]
