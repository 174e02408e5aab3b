"""``bagua_init``, the wrapped model it returns, and ``ModelSwitchWrapper``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, List, Optional, Sequence, Union

import torch

from . import comm
from .algorithms import Algorithm, accepted_kwargs, get_algorithm
from .errors import AlgorithmConfigError, DistributedError
from .reducer import Reducer
from .session import AlgorithmSession
from .sync import allreduce_optimizer_state, allreduce_parameters, broadcast_buffers, broadcast_parameters

__all__ = ["BaguaModule", "DistributedModule", "bagua_init", "ModelSwitchWrapper"]

Optimizers = Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


def _as_list(optimizer: Optimizers) -> List[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise AlgorithmConfigError(
                f"optimizer must be a torch.optim.Optimizer (or a list of them), got {type(opt).__name__}"
            )
    return optimizers


class StepHooks:
    """Calls ``before`` / ``after`` once around every optimizer step, plain or fused.

    Torch's public step hooks: a fused step (``fuse_step()``, or ``step()`` with
    ``replace_step=True``) runs them exactly like an ordinary step, whenever it was fused.
    A public helper for custom loops; :class:`BaguaModule` registers the same hooks itself
    (:meth:`AlgorithmSession.install_step_hook` for the algorithm).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, before: Optional[Callable[[], None]] = None,
                 after: Optional[Callable[[], None]] = None):
        self.handles = []
        if before is not None:
            self.handles.append(optimizer.register_step_pre_hook(lambda *_: before()))
        if after is not None:
            self.handles.append(optimizer.register_step_post_hook(lambda *_: after()))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class BaguaModule(torch.nn.Module):
    """A model replicated over ranks and kept consistent by one distributed algorithm.

    Built by :func:`bagua_init`. ``forward`` runs the wrapped module (broadcasting buffers
    from rank 0 first when ``broadcast_buffers``); gradient algorithms average during
    ``backward``; model algorithms act right after ``optimizer.step()`` / ``fuse_step()``.
    ``.module`` / :meth:`unwrap` give the plain model back; :meth:`no_sync` accumulates
    gradients locally.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        algorithm: Algorithm,
        *,
        broadcast_buffers: bool = True,
        delay_reduce: bool = False,
        message_size: int = 10_000_000,
        process_group=None,
        find_unused_parameters: bool = True,
        timeout: comm.Timeout = None,
        sync_initial_weights: bool = True,
    ):
        super().__init__()
        if isinstance(module, (BaguaModule, ModelSwitchWrapper)):
            raise AlgorithmConfigError(
                "this model is already wrapped by bagua_init; pass wrapped.unwrap(), or use "
                "ModelSwitchWrapper(...).switch_to(...) to change algorithms"
            )
        self.module = module
        self.algorithm = algorithm
        self.optimizers = list(optimizers)
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.timeout = comm.as_timedelta(timeout)
        self.reducer: Optional[Reducer] = None
        self.session: Optional[AlgorithmSession] = None
        self._handles: list = []
        self.distributed = comm.is_distributed(process_group)
        if algorithm.kind == "model" and len(self.optimizers) != 1:
            raise AlgorithmConfigError(
                f"{algorithm.name} acts after the optimizer step and needs exactly one optimizer, got "
                f"{len(self.optimizers)}"
            )
        if not self.distributed:
            return  # one process: the model runs plainly
        if algorithm.kind == "gradient":
            self.reducer = Reducer(
                module.parameters(),
                algorithm,
                optimizers=self.optimizers,
                message_size=message_size,
                delay_reduce=delay_reduce,
                group=process_group,
                find_unused_parameters=find_unused_parameters,
                timeout=self.timeout,
            )
        try:
            self.session = AlgorithmSession(
                algorithm,
                optimizer=self.optimizers,
                model=module,
                group=process_group,
                timeout=self.timeout,
                extra_description=[self.reducer.describe()] if self.reducer is not None else [],
                before_attach=(lambda: broadcast_parameters(module, broadcast_buffers, group=process_group,
                                                            timeout=self.timeout)) if sync_initial_weights else None,
            )
        except BaseException:
            self.close()
            raise
        for opt in self.optimizers:
            if self.reducer is not None:  # keeps a rank that skipped backward in step with the others
                self._handles.append(opt.register_step_pre_hook(lambda *_: self.reducer.before_step()))
            if self.session.acts_after_step:
                self._handles.append(self.session.install_step_hook(opt))

    # ------------------------------------------------------------------ nn.Module
    def forward(self, *args, **kwargs):
        if self.distributed and torch.is_grad_enabled():
            if self.broadcast_buffers and self.module.training:
                broadcast_buffers(self.module, group=self.process_group, timeout=self.timeout)
            if self.reducer is not None and self.reducer.enabled and self.module.training:
                self.reducer.check_not_interrupted()
                self.reducer.expecting_backward = True
        return self.module(*args, **kwargs)

    def unwrap(self) -> torch.nn.Module:
        """The plain model."""
        return self.module

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block averages them all."""
        if self.reducer is None:
            yield
            return
        previous = self.reducer.enabled
        self.reducer.enabled = False
        try:
            yield
        finally:
            self.reducer.enabled = previous

    def close(self) -> None:
        """Remove every hook this wrapper installed (used when switching algorithms)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.reducer is not None:
            self.reducer.detach()
            self.reducer = None
        if self.session is not None:
            self.session.close()
            self.session = None
        else:
            self.algorithm.detach()
        self.distributed = False


DistributedModule = BaguaModule  # the seed's name for the wrapped-model base class


def _configure(distributed_algorithm, hierarchical_reduce, message_size, algorithm_kwargs) -> Algorithm:
    built_here = not isinstance(distributed_algorithm, Algorithm)
    algorithm = get_algorithm(distributed_algorithm, **algorithm_kwargs)
    if hierarchical_reduce is not None:
        algorithm.hierarchical = bool(hierarchical_reduce)
        algorithm.validate_hierarchy()
    if built_here and hasattr(algorithm, "message_size"):
        algorithm.message_size = int(message_size)
    return algorithm


def bagua_init(
    module: torch.nn.Module,
    optimizer: Optimizers,
    distributed_algorithm: Union[str, Algorithm] = "gradient_allreduce",
    broadcast_buffers: bool = True,
    delay_reduce: bool = False,
    hierarchical_reduce: Optional[bool] = None,
    message_size: int = 10_000_000,
    *,
    process_group=None,
    find_unused_parameters: bool = True,
    timeout: comm.Timeout = None,
    **algorithm_kwargs,
):
    """Make ``module`` data parallel with ``distributed_algorithm``; return ``(wrapped_model, optimizer)``.

    Call it on every rank after ``init_process_group`` (and after ``fuse_optimizer``, so that
    gradient buckets are slices of the fused flat buffers). Checks that every rank has the
    same model, optimizer layout and algorithm, broadcasts rank 0's weights, and installs
    the hooks. The training loop stays ``loss.backward(); optimizer.step()``.

    Args:
        distributed_algorithm: a registered name (see :func:`list_algorithms`) or an
            :class:`Algorithm` object; ``algorithm_kwargs`` go to its constructor.
        broadcast_buffers: broadcast rank 0's buffers before each training forward (and at init).
        delay_reduce: average gradients only when backward has finished (no overlap).
        hierarchical_reduce: reduce through node leaders (``LOCAL_WORLD_SIZE`` ranks per
            node); ``None`` keeps the algorithm's default.
        message_size: minimum bytes per gradient bucket.
        process_group: the group to train over (default: the world).
        find_unused_parameters: DDP's semantics for parameters without a gradient (one extra
            tiny allreduce per backward); with False they receive averaged zeros.
        timeout: longest wait for any collective (seconds or timedelta) before raising
            :class:`CommunicationError`; default: the process group's timeout.

    Without a process group (or with one rank) the model runs plainly.
    """
    algorithm = _configure(distributed_algorithm, hierarchical_reduce, message_size, algorithm_kwargs)
    wrapped = BaguaModule(
        module,
        _as_list(optimizer),
        algorithm,
        broadcast_buffers=broadcast_buffers,
        delay_reduce=delay_reduce,
        message_size=message_size,
        process_group=process_group,
        find_unused_parameters=find_unused_parameters,
        timeout=timeout,
    )
    return wrapped, optimizer


class ModelSwitchWrapper(torch.nn.Module):
    """A model whose distributed algorithm can change mid-training.

    ``ModelSwitchWrapper(model, optimizer, ...).switch_to("gradient_allreduce")`` wraps it;
    a later ``switch_to("decentralized", peer_selection_mode="shift_one")`` removes the old
    algorithm's hooks, averages weights, buffers and the optimizer's parameter-shaped state
    (momentum, Adam moments) over ranks, since model algorithms let them drift apart, and
    installs the new algorithm. Every rank must switch at the same step to the same
    algorithm; a mismatch raises :class:`ModelMismatchError` on every rank.
    ``state_dict`` / ``load_state_dict`` are the plain model's.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: Optimizers,
        broadcast_buffers: bool = True,
        delay_reduce: bool = False,
        hierarchical_reduce: Optional[bool] = None,
        message_size: int = 10_000_000,
        intra_comm_root_rank: int = 0,
        *,
        process_group=None,
        find_unused_parameters: bool = True,
        timeout: comm.Timeout = None,
        **algorithm_kwargs,
    ):
        super().__init__()
        if intra_comm_root_rank != 0:
            raise AlgorithmConfigError(
                f"intra_comm_root_rank={intra_comm_root_rank} is not supported: each node's first rank leads it"
            )
        self.module = module
        self.optimizers = _as_list(optimizer)
        self.settings = dict(
            broadcast_buffers=broadcast_buffers,
            delay_reduce=delay_reduce,
            message_size=message_size,
            process_group=process_group,
            find_unused_parameters=find_unused_parameters,
            timeout=timeout,
        )
        self.hierarchical_reduce = hierarchical_reduce
        self.algorithm_kwargs = algorithm_kwargs
        self._set_current(None)

    def _set_current(self, wrapped: Optional[BaguaModule]) -> None:
        # Not a registered submodule: ``.module`` already is, and state_dict keys stay the plain model's.
        object.__setattr__(self, "_current", wrapped)

    @property
    def algorithm(self) -> Optional[Algorithm]:
        return None if self._current is None else self._current.algorithm

    @property
    def wrapped(self) -> BaguaModule:
        if self._current is None:
            raise DistributedError("call switch_to(algorithm) before using the ModelSwitchWrapper")
        return self._current

    def switch_to(self, distributed_algorithm: Union[str, Algorithm], **algorithm_kwargs) -> "ModelSwitchWrapper":
        """Use ``distributed_algorithm`` from now on; returns ``self``.

        The algorithm is built from ``algorithm_kwargs`` on top of the constructor's extra
        keyword arguments that it accepts (those are shared defaults for every algorithm).
        """
        if isinstance(distributed_algorithm, Algorithm):
            kwargs = algorithm_kwargs
        else:  # the constructor's kwargs are defaults each algorithm takes what it understands of
            kwargs = {**accepted_kwargs(distributed_algorithm, self.algorithm_kwargs), **algorithm_kwargs}
        algorithm = _configure(distributed_algorithm, self.hierarchical_reduce, self.settings["message_size"], kwargs)
        first = self._current is None
        if not first:
            self._current.close()
            self._set_current(None)
            group, timeout = self.settings["process_group"], self.settings["timeout"]
            allreduce_parameters(self.module, group=group, timeout=timeout)
            for optimizer in self.optimizers:
                allreduce_optimizer_state(optimizer, group=group, timeout=timeout)
        self._set_current(BaguaModule(self.module, self.optimizers, algorithm, sync_initial_weights=first, **self.settings))
        return self

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    def no_sync(self):
        return self.wrapped.no_sync()

    def unwrap(self) -> torch.nn.Module:
        return self.module

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
