"""Algorithms by name: ``get_algorithm("bytegrad", ...)``, ``list_algorithms()``, ``register_algorithm``."""

from __future__ import annotations

import enum
import inspect
from typing import Callable, Dict, List, Optional, Union

from ..errors import AlgorithmConfigError, UnknownAlgorithmError
from .base import Algorithm

__all__ = [
    "register_algorithm",
    "get_algorithm",
    "list_algorithms",
    "accepted_kwargs",
    "algorithm_parameters",
    "DistributedAlgorithm",
    "canonical_name",
]

_REGISTRY: Dict[str, Callable[..., Algorithm]] = {}


class DistributedAlgorithm(str, enum.Enum):
    """Bagua's names for the built-in algorithms (each value is a registered name)."""

    GradientAllReduce = "gradient_allreduce"
    ByteGrad = "bytegrad"
    Decentralize = "decentralized"
    LowPrecisionDecentralize = "low_precision_decentralized"
    BMUF = "bmuf"
    QAdam = "qadam"
    AsyncModelAverage = "async"


def register_algorithm(name: str, factory: Optional[Callable[..., Algorithm]] = None, *, overwrite: bool = False):
    """Register ``factory`` (an :class:`Algorithm` subclass or a function returning one) under ``name``.

    Usable as a decorator: ``@register_algorithm("my_algo")``.
    """

    def register(factory: Callable[..., Algorithm]):
        key = name.lower()
        if key in _REGISTRY and _REGISTRY[key] is not factory and not overwrite:
            raise AlgorithmConfigError(
                f"an algorithm named {name!r} is already registered ({_REGISTRY[key]!r}); pick another "
                "name or pass overwrite=True"
            )
        _REGISTRY[key] = factory
        return factory

    return register if factory is None else register(factory)


def list_algorithms() -> List[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def canonical_name(name: str) -> str:
    """The registered name for ``name``: itself (any case), or one of Bagua's
    :class:`DistributedAlgorithm` member names (``"GradientAllReduce"``, ``"Decentralize"``, ...)."""
    key = name.lower()
    if key not in _REGISTRY:
        for member in DistributedAlgorithm:
            if member.name.lower() == key:
                return member.value
    return key


def _factory(name) -> Optional[Callable[..., Algorithm]]:
    if isinstance(name, enum.Enum):
        name = name.value
    return _REGISTRY.get(canonical_name(name)) if isinstance(name, str) else None


def algorithm_parameters(name) -> Optional[List[str]]:
    """The keyword arguments the algorithm registered as ``name`` takes; None when unknown or open-ended."""
    factory = _factory(name)
    if factory is None:
        return None
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a factory that cannot be inspected
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return [p for p in parameters if p not in ("self", "args")]


def accepted_kwargs(name, kwargs: Dict) -> Dict:
    """The subset of ``kwargs`` the algorithm registered as ``name`` takes (all of them if unknown)."""
    accepted = algorithm_parameters(name)
    if accepted is None:
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in accepted}


def get_algorithm(name_or_obj: Union[str, Algorithm], **kwargs) -> Algorithm:
    """An algorithm object from a registered name (built with ``kwargs``) or the object itself."""
    if isinstance(name_or_obj, Algorithm):
        if kwargs:
            raise AlgorithmConfigError(
                f"got an algorithm object ({name_or_obj!r}) and extra arguments {sorted(kwargs)}; set them "
                "when building the object, or pass the algorithm by name"
            )
        return name_or_obj
    if isinstance(name_or_obj, enum.Enum):
        name_or_obj = name_or_obj.value
    if not isinstance(name_or_obj, str):
        raise UnknownAlgorithmError(
            f"distributed_algorithm must be a registered name or an Algorithm object, got "
            f"{type(name_or_obj).__name__}; registered names: {', '.join(list_algorithms())}"
        )
    factory = _factory(name_or_obj)
    if factory is None:
        raise UnknownAlgorithmError(
            f"no distributed algorithm named {name_or_obj!r}; registered names: {', '.join(list_algorithms())} "
            f"(Bagua's names {', '.join(m.name for m in DistributedAlgorithm)} work too; add your own with "
            "register_algorithm)"
        )
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as error:
        accepted = [p for p in inspect.signature(factory).parameters if p not in ("self", "args", "kwargs")]
        raise AlgorithmConfigError(
            f"{name_or_obj} does not accept {sorted(kwargs)} ({error}); it accepts: {', '.join(accepted)}"
        ) from None
    return factory(**kwargs)
