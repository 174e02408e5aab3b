"""The rest of the API a Bagua script calls: ``with_bagua`` and the process-group helpers.

A Bagua script moves here by changing ``import bagua.torch_api as bagua`` into
``import bagua_integrations as bagua``:

* ``bagua.init_process_group()``, ``bagua.get_rank()``, ``get_world_size()``, ``get_local_rank()``,
  ``get_local_size()``: thin wrappers over ``torch.distributed`` and torchrun's environment.
* ``model = bagua.with_bagua(model, [optimizer], algorithm, do_flatten=False)``, or, after the
  explicit opt-in ``bagua.enable_module_with_bagua()``, Bagua's method form
  ``model.with_bagua([optimizer], algorithm)``. ``torch.nn.Module`` is never patched at import.
"""

from __future__ import annotations

import enum
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._flat import ALIGN_BYTES
from .errors import AlgorithmConfigError, NotApplicableError
from .module import BaguaModule, Optimizers, bagua_init

__all__ = [
    "BucketType",
    "OverlappingWrapper",
    "with_bagua",
    "enable_module_with_bagua",
    "init_process_group",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_size",
]


def with_bagua(module: torch.nn.Module, optimizers: Optimizers, algorithm: Any = "gradient_allreduce",
               process_group=None, do_flatten: bool = True, **bagua_init_kwargs) -> BaguaModule:
    """Bagua's ``module.with_bagua(optimizers, algorithm, process_group, do_flatten)``: :func:`bagua_init`,
    returning the wrapped module (the optimizers are used in place).

    ``algorithm``: a registered name, one of Bagua's names (``"GradientAllReduce"``,
    ``DistributedAlgorithm.Decentralize``, ...) or an algorithm object. ``do_flatten`` is accepted
    with either value and changes nothing: gradient buckets never move parameters here. With a
    fused optimizer (``fuse_optimizer`` first) the buckets are slices of its flat buffers, which is
    what Bagua's ``do_flatten=False`` after fusing asks for; without one, each bucket's gradients
    are packed for the collective and unpacked after it.
    """
    if not isinstance(do_flatten, bool):
        raise TypeError(f"do_flatten must be True or False, got {do_flatten!r}")
    wrapped, _ = bagua_init(module, optimizers, algorithm, process_group=process_group, **bagua_init_kwargs)
    return wrapped


class _MethodHandle:
    """Removes ``torch.nn.Module.with_bagua`` again (what :func:`enable_module_with_bagua` added)."""

    def __init__(self, previous):
        self.previous = previous

    def remove(self) -> None:
        if self.previous is None:
            if getattr(torch.nn.Module, "with_bagua", None) is _module_with_bagua:
                del torch.nn.Module.with_bagua
        else:
            torch.nn.Module.with_bagua = self.previous


def _module_with_bagua(self, optimizers, algorithm="gradient_allreduce", process_group=None, do_flatten=True, **kwargs):
    return with_bagua(self, optimizers, algorithm, process_group=process_group, do_flatten=do_flatten, **kwargs)


_module_with_bagua.__doc__ = with_bagua.__doc__


def enable_module_with_bagua() -> _MethodHandle:
    """Give every ``torch.nn.Module`` Bagua's ``with_bagua`` method; returns a handle whose ``remove()`` undoes it.

    An explicit opt-in: importing this package never patches torch.
    """
    previous = torch.nn.Module.__dict__.get("with_bagua")
    torch.nn.Module.with_bagua = _module_with_bagua
    return _MethodHandle(previous if previous is not _module_with_bagua else None)


def init_process_group(backend: Optional[str] = None, **kwargs) -> None:
    """Bagua's ``init_process_group()``: join the job torchrun started (``env://``), once.

    ``backend`` defaults to NCCL when CUDA is available, else gloo; other keyword arguments go to
    ``torch.distributed.init_process_group``. A no-op if a process group exists already.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(get_local_rank())
    dist.init_process_group(backend=backend, **kwargs)


def get_rank() -> int:
    """This process's rank in the world (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_local_size() -> int:
    """Processes per node (torchrun's ``LOCAL_WORLD_SIZE``; the world size when unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", get_world_size()))


class BucketType(enum.Enum):
    """Bagua's ``BucketType``: what a communication bucket holds."""

    Gradient = "gradient"  # gradients, averaged before the step (gradient_allreduce)
    Weight = "weight"  # weights, averaged after the step (decentralized)
    Param = "param"




class OverlappingWrapper(torch.nn.Module):
    """Bagua's communication-computation overlap wrapper, as a thin adapter over :func:`bagua_init`.

    Arguments, with their meaning here:

    * ``delay_reduce``: as in :func:`bagua_init` (reduce only after backward; no overlap).
    * ``bucket_type`` / ``decentralize_reduce``: ``BucketType.Gradient`` averages gradients
      (``gradient_allreduce``); ``decentralize_reduce=True`` or ``BucketType.Weight`` averages
      weights after each step (``decentralized``). ``BucketType.Param`` is refused.
    * ``hierarchical_reduce``: reduce within each node first (``LOCAL_WORLD_SIZE`` ranks).
    * ``align_bytes``: accepted when it divides the 64-byte alignment of parameters in this
      package's flat buffers (Bagua's default 8 does).
    * ``fusion``: accepted either way: parameters are never moved, and a fused optimizer's flat
      buffers are the buckets (``fusion=False`` cannot un-fuse them).
    * ``chunking=True`` (per-rank chunks for all-to-all) is what the ``bytegrad`` algorithm does:
      refused here with that advice. ``parameter_manager`` has no counterpart: refused.

    Other keyword arguments go to the algorithm (e.g. ``message_size``, ``communication_interval``).
    """

    def __init__(self, module: torch.nn.Module, optimizers: Optimizers, delay_reduce: bool = False,
                 bucket_type: BucketType = BucketType.Gradient, hierarchical_reduce: bool = False,
                 decentralize_reduce: bool = False, parameter_manager=None, align_bytes: int = 8,
                 chunking: bool = False, fusion: bool = True, **kwargs):
        super().__init__()
        if parameter_manager is not None:
            raise NotApplicableError("OverlappingWrapper(parameter_manager=...) has no counterpart here; leave it None")
        if chunking:
            raise NotApplicableError(
                "OverlappingWrapper(chunking=True) is the per-rank chunking of all-to-all algorithms: use "
                "with_bagua(model, optimizers, 'bytegrad'), whose buckets are chunked per rank"
            )
        if not isinstance(align_bytes, int) or align_bytes <= 0 or ALIGN_BYTES % align_bytes:
            raise AlgorithmConfigError(
                f"align_bytes={align_bytes!r}: buckets here are aligned to {ALIGN_BYTES} bytes; use a divisor of it"
            )
        if not isinstance(fusion, bool):
            raise TypeError(f"fusion must be True or False, got {fusion!r}")
        bucket_type = BucketType(bucket_type) if not isinstance(bucket_type, BucketType) else bucket_type
        if bucket_type is BucketType.Param:
            raise NotApplicableError("BucketType.Param buckets are not supported; use Gradient or Weight")
        decentralized = decentralize_reduce or bucket_type is BucketType.Weight
        self.algorithm_name = "decentralized" if decentralized else "gradient_allreduce"
        self.optimizers = optimizers
        self.options = dict(delay_reduce=delay_reduce, hierarchical_reduce=hierarchical_reduce, **kwargs)
        self.wrapped = bagua_init(module, optimizers, self.algorithm_name, **self.options)[0]
        self.module = module

    def reset_reducer(self, hierarchical_reduce: Optional[bool] = None, buckets=None) -> None:
        """Rebuild the communication with another ``hierarchical_reduce`` (``buckets`` are built from
        ``message_size`` here and cannot be given)."""
        if buckets is not None:
            raise NotApplicableError("reset_reducer(buckets=...): buckets are built from message_size; pass message_size instead")
        if hierarchical_reduce is not None:
            self.options["hierarchical_reduce"] = hierarchical_reduce
        self.wrapped.close()
        self.wrapped = bagua_init(self.module, self.optimizers, self.algorithm_name, **self.options)[0]

    def create_hooks(self) -> None:
        """A no-op: the hooks are installed when the wrapper is made."""

    def unwrap(self) -> torch.nn.Module:
        return self.module

    def forward(self, *inputs, **kwargs):
        return self.wrapped(*inputs, **kwargs)

    def close(self) -> None:
        self.wrapped.close()
