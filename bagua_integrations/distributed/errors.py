"""Named errors of the distributed core.

Each one says what went wrong and what to do, so a mistake on one rank surfaces as an
exception on every rank instead of a silent divergence or a hang.
"""


class DistributedError(RuntimeError):
    """Base class of every error raised by ``bagua_integrations.distributed``."""


class UnknownAlgorithmError(DistributedError, ValueError):
    """``distributed_algorithm`` names no registered algorithm."""


class AlgorithmConfigError(DistributedError, ValueError):
    """An algorithm got hyper-parameters or a setup it cannot work with."""


class ModelMismatchError(DistributedError):
    """Ranks disagree on the model, the optimizer layout or the algorithm.

    Raised on every rank at ``bagua_init`` / ``switch_to`` time, before any gradient is
    exchanged, because mismatched collectives would otherwise hang or mix up tensors.
    """


class CommunicationError(DistributedError):
    """A collective did not complete: a peer failed, exited or is stuck past the timeout."""


class JoinError(DistributedError):
    """Uneven inputs under ``Join`` / ``model.join()`` cannot be shadowed consistently.

    Raised on every rank before the collective that would have mismatched: the wrapped model
    is not the first joinable of the context, the ranks that still have data disagree on what
    the iteration does, or the algorithm has no uneven-input form for this setup.
    """


class CollectiveStallWarning(UserWarning):
    """A collective of this package has waited longer than the stall interval for its peers.

    Only a warning: nothing is aborted until the timeout (``bagua_init(timeout=...)`` or the
    process group's), which then raises :class:`CommunicationError`. The interval is
    ``BAGUA_STALL_WARNING_SECONDS`` (default 60) or :func:`set_stall_warning`.
    """


class ReducerStateError(DistributedError):
    """The reducer was used in a way that would silently skip or corrupt a reduction."""


class CheckpointError(DistributedError):
    """A checkpoint cannot resume this run exactly.

    Raised (on every rank where the decision depends only on the checkpoint) when resuming would
    silently diverge: one rank's state loaded on every rank of an algorithm whose replicas
    differ (each rank's weights or optimizer state are its own), a per-rank checkpoint from
    another rank or world size, or algorithm state that does not fit the parameters.
    """


class NotApplicableError(DistributedError, NotImplementedError):
    """A Bagua API call that has no meaning on ``torch.distributed`` here; the message says what to use."""
