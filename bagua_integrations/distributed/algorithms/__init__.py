"""Built-in algorithms; importing this package registers their names."""

from .base import Algorithm, GradientAlgorithm, ModelAlgorithm
from .registry import DistributedAlgorithm, accepted_kwargs, get_algorithm, list_algorithms, register_algorithm
from .gradient_allreduce import GradientAllReduce
from .bytegrad import ByteGrad, MinMaxUInt8
from .decentralized import Decentralized, shift_one_peer
from .bmuf import BMUF
from .low_precision_decentralized import LowPrecisionDecentralized
from .qadam import QAdamAlgorithm
from .async_model_average import AsyncModelAverage, AsyncModelAverageAlgorithm

__all__ = [
    "Algorithm",
    "GradientAlgorithm",
    "ModelAlgorithm",
    "DistributedAlgorithm",
    "register_algorithm",
    "get_algorithm",
    "list_algorithms",
    "accepted_kwargs",
    "GradientAllReduce",
    "ByteGrad",
    "MinMaxUInt8",
    "Decentralized",
    "shift_one_peer",
    "BMUF",
    "LowPrecisionDecentralized",
    "QAdamAlgorithm",
    "AsyncModelAverage",
    "AsyncModelAverageAlgorithm",
]
