"""Bagua's distributed API on ``torch.distributed``: the reducer, the algorithms, ``bagua_init``.

Gradient algorithms (``gradient_allreduce``, ``bytegrad``, ``qadam``) average gradients in
buckets during backward; model algorithms (``decentralized``, ``low_precision_decentralized``,
``bmuf``, ``async``) change the weights after the optimizer step. Every algorithm also works without ``bagua_init`` for frameworks that own
their training loop (see ``docs/distributed.md``). Uneven inputs: ``with model.join():``
(torch's ``Join``); a collective stuck on a missing peer warns (``CollectiveStallWarning``)
before it fails (``CommunicationError``).
"""

from .algorithms import (
    BMUF,
    Algorithm,
    AsyncModelAverage,
    ByteGrad,
    Decentralized,
    DistributedAlgorithm,
    GradientAlgorithm,
    GradientAllReduce,
    LowPrecisionDecentralized,
    MinMaxUInt8,
    ModelAlgorithm,
    QAdamAlgorithm,
    get_algorithm,
    list_algorithms,
    register_algorithm,
)
from .comm import NodeGroups, WireMeter, collective_log, set_stall_warning, stall_warning_seconds
from .errors import (
    AlgorithmConfigError,
    CheckpointError,
    CollectiveStallWarning,
    CommunicationError,
    DistributedError,
    JoinError,
    ModelMismatchError,
    NotApplicableError,
    ReducerStateError,
    UnknownAlgorithmError,
)
from .module import BaguaModule, DistributedModule, ModelSwitchWrapper, StepHooks, bagua_init
from .seed_api import (
    BucketType,
    OverlappingWrapper,
    enable_module_with_bagua,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    with_bagua,
)
from .reducer import Reducer
from .session import AlgorithmSession
from .sync import (
    allreduce_parameters,
    broadcast_parameters,
    check_same_on_all_ranks,
    describe_model,
    describe_parameters,
    gather_states,
)

__all__ = [
    "with_bagua",
    "OverlappingWrapper",
    "BucketType",
    "enable_module_with_bagua",
    "init_process_group",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_size",
    "bagua_init",
    "BaguaModule",
    "DistributedModule",
    "ModelSwitchWrapper",
    "AlgorithmSession",
    "broadcast_parameters",
    "allreduce_parameters",
    "check_same_on_all_ranks",
    "gather_states",
    "describe_model",
    "describe_parameters",
    "Reducer",
    "Algorithm",
    "GradientAlgorithm",
    "ModelAlgorithm",
    "GradientAllReduce",
    "ByteGrad",
    "MinMaxUInt8",
    "Decentralized",
    "BMUF",
    "LowPrecisionDecentralized",
    "QAdamAlgorithm",
    "AsyncModelAverage",
    "DistributedAlgorithm",
    "register_algorithm",
    "get_algorithm",
    "list_algorithms",
    "StepHooks",
    "NodeGroups",
    "WireMeter",
    "collective_log",
    "set_stall_warning",
    "stall_warning_seconds",
    "DistributedError",
    "UnknownAlgorithmError",
    "AlgorithmConfigError",
    "ModelMismatchError",
    "CommunicationError",
    "ReducerStateError",
    "JoinError",
    "CheckpointError",
    "NotApplicableError",
    "CollectiveStallWarning",
]
