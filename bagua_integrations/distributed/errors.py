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


class ReducerStateError(DistributedError):
    """The reducer was used in a way that would silently skip or corrupt a reduction."""
