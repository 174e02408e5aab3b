"""fairseq integration of bagua-integrations: ``--optimizer bagua_fused``.

fairseq loads this package with its plugin flag::

    fairseq-train ... --user-dir $(python -m fairseq_plugin) --optimizer bagua_fused \\
        --bagua-base-optimizer adam --adam-betas '(0.9, 0.98)'

Importing it registers the ``bagua_fused`` optimizer in fairseq's optimizer registry
(see :mod:`fairseq_plugin.optimizer`). ``USER_DIR`` is the path to give ``--user-dir``.
"""

import os

USER_DIR = os.path.dirname(os.path.abspath(__file__))

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "fairseq_plugin needs fairseq; install it with `pip install bagua-integrations[fairseq]`"
    ) from exc

from bagua_integrations.distributed import comm as _comm  # noqa: E402

from ._fairseq_compat import forget_global_group as _forget_global_group  # noqa: E402
from .optimizer import BaguaFusedConfig, BaguaFusedOptimizer  # noqa: E402  (registers "bagua_fused")
from .qadam import FairseqQAdam  # noqa: E402  (registers "qadam", the optimizer of --bagua-algorithm qadam)

# fairseq-train never destroys its process groups; a gloo rank could then abort at exit (see there).
# fairseq's cached group is dropped first, or the destroy could not join its threads.
_comm.destroy_process_groups_at_exit(release=_forget_global_group)

__all__ = ["USER_DIR", "BaguaFusedConfig", "BaguaFusedOptimizer", "FairseqQAdam"]
