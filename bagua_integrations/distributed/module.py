"""``bagua_init``, the wrapped model it returns, and ``ModelSwitchWrapper``."""

from __future__ import annotations

import contextlib
import copy
import os
import weakref
from contextlib import contextmanager
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable

from . import comm
from .algorithms import Algorithm, accepted_kwargs, get_algorithm
from .algorithms.base import as_flag, as_message_size
from .autotune import algorithm_setting, set_algorithm_settings
from .errors import AlgorithmConfigError, DistributedError, JoinError
from .join import FORWARD, STEP, BaguaJoinHook, exchange_header, last_joiner
from .reducer import Reducer
from .session import AlgorithmSession
from .sync import allreduce_optimizer_state, allreduce_parameters, broadcast_buffers, broadcast_parameters

__all__ = ["BaguaModule", "DistributedModule", "bagua_init", "ModelSwitchWrapper"]

Optimizers = Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


def _as_list(optimizer: Optimizers) -> List[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.nn.Module) or not isinstance(optimizer, (torch.optim.Optimizer, list, tuple)):
        raise AlgorithmConfigError(
            f"optimizer must be a torch.optim.Optimizer (or a list of them), got {type(optimizer).__name__}"
            + (" (the model comes first: bagua_init(model, optimizer, ...))" if isinstance(optimizer, torch.nn.Module)
               else ""))
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


# Bare models a live BaguaModule has hooks on (until its close()).
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def load_into_plain_model(module: torch.nn.Module, state_dict, strict: bool, assign: bool):
    """``module.load_state_dict``; a checkpoint whose keys all carry the ``module.`` prefix (saved from a
    DDP model) loads too, unless the model has a submodule named ``module``. (Without this, such a
    checkpoint loaded with ``strict=False`` would load nothing, silently.)"""
    prefixed = bool(state_dict) and all(key.startswith("module.") for key in state_dict)
    if prefixed and not hasattr(module, "module"):
        state_dict = copy.copy(state_dict)  # (with its _metadata: the modules' versions)
        consume_prefix_in_state_dict_if_present(state_dict, "module.")
    return module.load_state_dict(state_dict, strict=strict, assign=assign)


class BaguaModule(torch.nn.Module, Joinable):
    """A model replicated over ranks and kept consistent by one distributed algorithm.

    Built by :func:`bagua_init`. ``forward`` runs the wrapped module (broadcasting buffers
    from rank 0 first when ``broadcast_buffers``); gradient algorithms average during
    ``backward``; model algorithms act right after ``optimizer.step()`` / ``fuse_step()``.
    ``.module`` / :meth:`unwrap` give the plain model back; :meth:`no_sync` accumulates
    gradients locally.

    Uneven inputs: it is a torch ``Joinable``, so ``with model.join():`` (or
    ``with Join([model]):``) lets ranks run out of data at different times, as with DDP
    (see :mod:`.join`).
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
        algorithm_state: Optional[dict] = None,
    ):
        _check_model_and_group(module, process_group)
        super().__init__()
        Joinable.__init__(self)
        self._joining = False  # a join context built this module's hook and has not finished yet
        self._join_divide = False
        self._closed = False
        if isinstance(module, (BaguaModule, ModelSwitchWrapper)):
            raise AlgorithmConfigError(
                "this model is already wrapped by bagua_init; call wrapped.close() and pass wrapped.unwrap(), "
                "or use ModelSwitchWrapper(...).switch_to(...) to change algorithms"
            )
        if module in _ATTACHED:
            # The first wrapper's gradient hooks and step hooks are still installed: a second one
            # would average gradients twice (or under a model algorithm, at all).
            raise AlgorithmConfigError(
                "this model is still attached to an earlier bagua_init wrapper; call that wrapper's close() "
                "first, or use ModelSwitchWrapper(...).switch_to(...) to change algorithms"
            )
        on_meta = [name for name, t in list(module.named_parameters()) + list(module.named_buffers())
                   if t.device.type == "meta"]
        if on_meta:
            raise AlgorithmConfigError(
                f"{on_meta[0]} (and {len(on_meta) - 1} more) is on the meta device: bagua_init lays out its "
                "communication buffers on the parameters' device. Materialize the model first "
                "(model.to_empty(device=...) and initialize it), then call bagua_init"
            )
        self.module = module
        self.algorithm = algorithm
        self.optimizers = list(optimizers)
        trained = {id(p) for p in module.parameters() if p.requires_grad}
        stepped = {id(p) for opt in self.optimizers for group in opt.param_groups for p in group["params"]}
        if trained and self.optimizers and not trained & stepped:
            raise AlgorithmConfigError(
                "the optimizer holds none of this model's parameters (was it built over another model, or "
                "over a copy?): build it over this model's parameters, e.g. SGD(model.parameters(), ...)")
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.timeout = comm.as_timedelta(timeout)
        self.reducer: Optional[Reducer] = None
        self.session: Optional[AlgorithmSession] = None
        self.message_size = as_message_size(message_size)
        self._reducer_options = dict(delay_reduce=delay_reduce, find_unused_parameters=find_unused_parameters)
        self._own_weights: Optional[List[torch.Tensor]] = None  # see _sync_initial_weights
        self._broadcast_fingerprint: Optional[torch.Tensor] = None
        self.autotuner = None  # set by enable_autotune / the first ask_and_update_hyperparameters
        self._handles: list = []
        self.distributed = comm.is_distributed(process_group)
        if algorithm.kind == "model" and len(self.optimizers) != 1:
            raise AlgorithmConfigError(
                f"{algorithm.name} acts after the optimizer step and needs exactly one optimizer, got "
                f"{len(self.optimizers)}"
            )
        if not self.distributed:
            return  # one process: the model runs plainly
        self._src = comm.group_ranks(process_group)[0]  # broadcasts come from the group's first rank
        if algorithm.kind == "gradient":
            self.reducer = self._make_reducer()
        # A checkpoint of another algorithm is not restored (a fresh schedule): a fresh start
        resumed = algorithm_state is not None and algorithm_state.get("name") == algorithm.name
        if (resumed or getattr(algorithm, "has_pending_state", False)) and algorithm.replicas_differ:
            # A resume under an algorithm whose replicas legitimately differ: every rank loaded its
            # own weights, and rank 0's must not overwrite them. (At a fresh start they are broadcast.)
            sync_initial_weights = False
        try:
            self.session = AlgorithmSession(
                algorithm,
                state=algorithm_state,
                optimizer=self.optimizers,
                model=module,
                group=process_group,
                timeout=self.timeout,
                extra_description=[f"broadcast_buffers={bool(broadcast_buffers)}"]
                + ([self.reducer.describe()] if self.reducer is not None else []),
                before_attach=self._sync_initial_weights if sync_initial_weights else None,
            )
        except BaseException:
            self.close()
            raise
        _ATTACHED[module] = True
        for opt in self.optimizers:
            if self.reducer is not None:  # keeps a rank that skipped backward in step with the others
                self._handles.append(opt.register_step_pre_hook(lambda *_: self.reducer.before_step()))
            if self.session.acts_after_step:
                self._handles.append(opt.register_step_post_hook(lambda *_: self._after_step()))
        # weights loaded after bagua_init (wrapped.module.load_state_dict, the DDP order): e.g. BMUF's
        # global model follows them unless its own state is restored too
        self._handles.append(module.register_load_state_dict_post_hook(lambda *_: self._weights_loaded()))
        if self._own_weights is not None:  # kept until the first step, at most
            self._handles.append(self.optimizers[0].register_step_pre_hook(lambda *_: self._forget_own_weights()))

    # ------------------------------------------------------------------ this rank's own weights
    def _synced_tensors(self) -> List[torch.Tensor]:
        tensors = [p.detach() for p in self.module.parameters()]
        return tensors + (list(self.module.buffers()) if self.broadcast_buffers else [])

    def _sync_initial_weights(self) -> None:
        """Broadcast the first rank's weights, keeping this rank's own where replicas may differ.

        A resume in the natural order (``model.load_state_dict``, ``optimizer.load_state_dict``,
        ``bagua_init``, ``wrapped.load_algorithm_state_dict``) loaded this rank's own weights
        before the broadcast replaced them; under ``bmuf``/``decentralized`` they differ by rank,
        so :meth:`load_algorithm_state_dict` puts them back. The copy lives on the CPU and is
        dropped at the first step or when weights are loaded into the wrapped module.
        """
        if self.algorithm.replicas_differ:
            self._own_weights = [t.to("cpu", copy=True) for t in self._synced_tensors()]
        broadcast_parameters(self.module, self.broadcast_buffers, src=self._src, group=self.process_group,
                             timeout=self.timeout)
        if self._own_weights is not None:
            self._broadcast_fingerprint = self._fingerprint()

    def _fingerprint(self) -> torch.Tensor:
        """One float64 sum per tensor: tells whether the weights changed since the broadcast."""
        sums = [t.detach().double().sum().cpu() for t in self._synced_tensors()]
        return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64)

    def _forget_own_weights(self) -> None:
        self._own_weights = None
        self._broadcast_fingerprint = None

    def _weights_loaded(self) -> None:
        self._forget_own_weights()  # the weights just loaded are the ones to train
        self.algorithm.weights_loaded()

    @torch.no_grad()
    def _restore_own_weights(self) -> bool:
        """Put back the weights this rank had before the initial broadcast, if nothing changed them since."""
        own, self._own_weights = self._own_weights, None
        if own is None or not torch.equal(self._fingerprint(), self._broadcast_fingerprint):
            return False
        for tensor, saved in zip(self._synced_tensors(), own):
            tensor.copy_(saved)
        self.algorithm.weights_loaded()
        return True

    def _make_reducer(self) -> Reducer:
        """The gradient buckets over the module's parameters, with the current bucket size."""
        return Reducer(self.module.parameters(), self.algorithm, optimizers=self.optimizers,
                       message_size=self.message_size, group=self.process_group, timeout=self.timeout,
                       **self._reducer_options)

    # ------------------------------------------------------------------ checkpoints
    def algorithm_state_dict(self) -> dict:
        """This rank's algorithm state for a checkpoint (counters, peer round, BMUF's global model, ...).

        Save it with this rank's model and optimizer state: under algorithms whose replicas
        differ (``self.algorithm.replicas_differ``: decentralized, bmuf) **every rank** saves its
        own file, e.g. ``torch.save({"algorithm": wrapped.algorithm_state_dict(), "model":
        wrapped.module.state_dict(), "optimizer": optimizer.state_dict()}, f"ckpt.rank{rank}.pt")``.
        Restore with :meth:`load_algorithm_state_dict` after ``bagua_init`` (the model and
        optimizer loaded before or after it), or pass it as ``bagua_init(..., algorithm_state=...)``.
        Under ``async`` it settles the background rounds in flight (a collective: call it on
        every rank) and can change the weights: take it *before* the model's state_dict.
        """
        if self.session is None:
            return {"name": self.algorithm.name, "num_updates": 0, "algorithm": {}, "rank": 0, "world_size": 1,
                    "weights_differ": False, "replicas_differ": False}
        state = self.session.state_dict()
        if self.autotuner is not None:  # the settings it chose (the same on every rank): a resume keeps them
            state["autotuned"] = self.autotuner.current()
        return state

    def load_algorithm_state_dict(self, state: dict, *, shared: bool = False) -> bool:
        """Restore :meth:`algorithm_state_dict` (any time before the next step); returns whether it did.

        ``shared=True``: the same (one rank's) state is loaded on every rank; refused with
        :class:`CheckpointError` where the algorithm lets replicas differ. Without a process
        group there is nothing to restore.
        """
        if self.session is None:
            return False
        if not shared and state.get("weights_differ", True) and state.get("name") == self.algorithm.name:
            # loaded before bagua_init, then replaced by the first rank's: this rank's own come back
            self._restore_own_weights()
        tuned = state.get("autotuned")  # (applied here: a new bucket size or hierarchy rebuilds the buckets)
        restored = self.session.load_state_dict({k: v for k, v in state.items() if k != "autotuned"}, shared=shared)
        if restored and tuned:  # what the autotuner had chosen (a new search starts from it)
            self.apply_communication_settings(**tuned)
        return restored

    # ------------------------------------------------------------------ autotuning (Bagua's API)
    def communication_setting(self, key: str):
        """The value of a tunable setting: ``message_size``, ``hierarchical`` or the algorithm's ``communication_interval``."""
        if key == "message_size":
            return self.message_size
        return algorithm_setting(self.algorithm, key)

    def apply_communication_settings(self, message_size: Optional[int] = None,
                                     communication_interval: Optional[int] = None,
                                     hierarchical: Optional[int] = None) -> None:
        """Change settings between two steps, on every rank alike (the autotuner broadcasts them).

        ``message_size`` and ``hierarchical`` rebuild the gradient buckets (never during a backward).
        """
        rebuild = set_algorithm_settings(self.algorithm, communication_interval=communication_interval,
                                         hierarchical=hierarchical)
        if message_size is not None and int(message_size) != self.message_size:
            self.message_size = int(message_size)
            if hasattr(self.algorithm, "message_size"):
                self.algorithm.message_size = self.message_size
            rebuild = True
        if rebuild and self.reducer is not None:
            self.reducer.check_not_interrupted()
            self.reducer.detach()
            self.reducer = self._make_reducer()

    def enable_autotune(self, max_trials: int = 20, interval: Optional[int] = None, **search):
        """Start Bagua's autotuner (a collective: every rank, at the same point, between steps).

        ``interval``: also measure steps/s and tune by itself every ``interval`` optimizer steps
        (``bagua_init(..., autotune=True)``); without it, call :meth:`report_metrics` and
        :meth:`ask_and_update_hyperparameters` yourself. ``search``: ``message_sizes=``,
        ``intervals=``, ``seed=`` (see :class:`~bagua_integrations.distributed.autotune.Autotuner`).
        """
        from .autotune import Autotuner, AutotuneStepper

        if self.autotuner is not None:
            raise AlgorithmConfigError("the autotuner is already running on this model")
        self.autotuner = Autotuner(self, max_trials=max_trials, **search)
        if interval is not None:
            stepper = AutotuneStepper(self.autotuner, interval)
            self._handles.append(self.optimizers[0].register_step_post_hook(lambda *_: stepper.after_step()))
        return self.autotuner

    def report_metrics(self, score_record_list) -> None:
        """Bagua's ``report_metrics``: this rank's speed measurements (higher is better) for the current trial."""
        if self.autotuner is None:
            raise AlgorithmConfigError("call enable_autotune() (or bagua_init(..., autotune=True)) before report_metrics")
        self.autotuner.report_metrics(score_record_list)

    def ask_and_update_hyperparameters(self) -> bool:
        """Bagua's ``ask_and_update_hyperparameters``: end the trial, apply the next setting; whether it changed.

        A collective: every rank calls it at the same point, between steps. Starts the autotuner
        with its defaults on the first call if :meth:`enable_autotune` was not called.
        """
        if self.autotuner is None:
            self.enable_autotune()
        return self.autotuner.ask_and_update()

    def autotune_report(self) -> dict:
        """The autotuner's trials (settings and mean scores), the best one and whether the search ended."""
        if self.autotuner is None:
            return {"history": [], "best": None, "done": False, "current": None, "max_trials": 0}
        return self.autotuner.report()

    # ------------------------------------------------------------------ nn.Module
    def forward(self, *args, **kwargs):
        if self._closed and torch.is_grad_enabled() and self.module.training:
            raise DistributedError(
                "this wrapper was closed (close(), or a ModelSwitchWrapper switch), so a training step through it "
                "would not be averaged over ranks: train through the new wrapper, or through wrapped.unwrap() "
                "if each rank is meant to train alone (evaluation under torch.no_grad() or eval() still runs)")
        if self.distributed and torch.is_grad_enabled() and self.module.training:
            join = self._join_event(FORWARD) if self._join_config.enable and self._joining else None
            if self.broadcast_buffers:
                src = join.src if join is not None else self._src
                broadcast_buffers(self.module, src=src, group=self.process_group, timeout=self.timeout)
            if self.reducer is not None and self.reducer.enabled:
                self.reducer.check_not_interrupted()
                self.reducer.expecting_backward = True
                self.reducer.join_state = join
        return self.module(*args, **kwargs)

    def _after_step(self) -> None:
        """The optimizer step post-hook of model algorithms: the algorithm's communication."""
        join = self._join_event(STEP) if self._join_config.enable and self._joining else None
        self.session.algorithm.join_state = join
        try:
            self.session.after_update()
        finally:
            self.session.algorithm.join_state = None

    # ------------------------------------------------------------------ uneven inputs (torch Join)
    def join(self, divide_by_initial_world_size: bool = False, enable: bool = True,
             throw_on_early_termination: bool = False):
        """``with model.join():`` around the training loop lets ranks run out of data at different times.

        The same as ``with Join([model], enable, throw_on_early_termination,
        divide_by_initial_world_size=...)`` (``torch.distributed.algorithms.Join``). A rank
        that has finished its data shadows the collectives of the others until every rank
        is done, so nobody hangs. Gradients (and weights under model averaging) are averaged
        over the ranks that still have data; ``divide_by_initial_world_size=True`` divides
        summed gradients by the full world size instead (DDP's default). Once all ranks are
        done, under a gradient algorithm the ranks that finished early take the final weights
        of one of the last ranks. Only this model's collectives are shadowed: other
        collectives inside the loop (a metric ``all_reduce``, ``dist.barrier()``) belong after it.
        Without a process group it is a no-op context.
        """
        if not self.distributed:
            return contextlib.nullcontext()
        return _join_block(self, lambda: self, enable, throw_on_early_termination, divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> BaguaJoinHook:
        """The hook torch's ``Join`` calls on a rank that ran out of data (``divide_by_initial_world_size=``)."""
        self._joining = True
        self._join_divide = bool(kwargs.get("divide_by_initial_world_size", False))
        return BaguaJoinHook(self, self._join_divide)

    @property
    def join_device(self) -> torch.device:
        return comm.small_tensor_device(self.process_group)

    @property
    def join_process_group(self):
        return dist.group.WORLD if self.process_group is None else self.process_group

    def _forward_communicates(self) -> bool:
        return self.reducer is not None or (self.broadcast_buffers and any(True for _ in self.module.buffers()))

    def _check_joinable(self) -> None:
        if not self._join_config.is_first_joinable:
            raise JoinError(
                "under Join the wrapped model must be the first joinable (Join([model, ...]) or model.join()): "
                "its events are what ranks that ran out of data shadow"
            )
        validate = getattr(self.algorithm, "validate_join", None)
        if validate is not None:
            validate(self.process_group)

    def _join_event(self, event: int):
        """On a rank with data, under Join: notify the join context, then the header all-reduce."""
        if event == FORWARD and not self._forward_communicates():
            return None  # a model algorithm's forward without buffers to broadcast communicates nothing
        self._check_joinable()
        if event == FORWARD and self.reducer is not None:
            self.reducer.flush()  # a forward whose reduction never ran must not shift the next one
        Join.notify_join_context(self)
        sync = event == FORWARD and self.reducer is not None and self.reducer.enabled
        step = self.session.num_updates + 1 if event == STEP else 0
        return exchange_header(self.process_group, self.timeout, event=event, sync=sync, step=step,
                               divide_by_initial_world_size=self._join_divide)

    def _shadow_join_event(self, divide_by_initial_world_size: bool) -> None:
        """On a rank that ran out of data: the collectives of the other ranks' next event."""
        if not self.distributed:
            return
        self._check_joinable()
        state = exchange_header(self.process_group, self.timeout, joined=True,
                                divide_by_initial_world_size=divide_by_initial_world_size)
        if state.event == FORWARD:
            if self.broadcast_buffers:
                broadcast_buffers(self.module, src=state.src, group=self.process_group, timeout=self.timeout)
            if state.sync:
                if self.reducer is None:
                    raise JoinError("the ranks with data average gradients but this rank's algorithm does not")
                self.reducer.shadow(state)
        elif state.event == STEP:
            if not self.session.acts_after_step:
                raise JoinError("the ranks with data run a model algorithm's step but this rank's algorithm has none")
            self.session.algorithm.join_state = state
            try:
                self.session.after_update(step=state.step)
            finally:
                self.session.algorithm.join_state = None

    def _finish_join(self, is_last_joiner: bool) -> None:
        """After every rank joined: gradient algorithms give the early finishers the final weights."""
        self._joining = False
        if not self.distributed:
            return
        if self.reducer is not None:
            src = last_joiner(self.process_group, self.timeout, is_last_joiner)
            if src is not None:
                broadcast_parameters(self.module, self.broadcast_buffers, src=src, group=self.process_group,
                                     timeout=self.timeout)

    def unwrap(self) -> torch.nn.Module:
        """The plain model."""
        return self.module

    def state_dict(self, *args, **kwargs):
        """The plain model's ``state_dict`` (no ``module.`` prefix): Bagua's ``with_bagua`` returns
        the model itself, so its documented ``torch.save({"model_state_dict": model.state_dict()})``
        loads into a fresh, unwrapped model."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The plain model's ``load_state_dict``; a checkpoint whose keys all carry the ``module.``
        prefix (saved from a DDP model) loads too, unless the model has a submodule named ``module``."""
        return load_into_plain_model(self.module, state_dict, strict, assign)

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
        """Remove every hook this wrapper installed (used when switching algorithms); once is enough.

        Dropping the wrapper does not do this: the model and the optimizer keep their hooks, and
        so the wrapper (the model stays attached), as documented; close() is how a rank goes on alone."""
        if self._closed:
            return
        _ATTACHED.pop(self.module, None)
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
        self._closed = True


DistributedModule = BaguaModule  # the seed's name for the wrapped-model base class


@contextmanager
def _join_block(joinable, current: Callable[[], Optional[BaguaModule]], enable: bool,
                throw_on_early_termination: bool, divide_by_initial_world_size: bool):
    """torch's ``Join([joinable], ...)``, after which the wrapper in use knows it left the block even
    when an exception ended it (Join then skips its hooks' ending)."""
    try:
        with Join([joinable], enable, throw_on_early_termination,
                  divide_by_initial_world_size=divide_by_initial_world_size):
            yield
    finally:
        wrapper = current()
        if wrapper is not None:
            wrapper._joining = False


def _configure(distributed_algorithm, hierarchical_reduce, message_size, algorithm_kwargs) -> Algorithm:
    built_here = not isinstance(distributed_algorithm, Algorithm)
    algorithm = get_algorithm(distributed_algorithm, **algorithm_kwargs)
    if hierarchical_reduce is not None:
        algorithm.hierarchical = as_flag("hierarchical_reduce", hierarchical_reduce)
        algorithm.validate_hierarchy()
    message_size = as_message_size(message_size)
    if built_here and hasattr(algorithm, "message_size"):
        algorithm.message_size = message_size
    return algorithm


def _check_model_and_group(module, process_group) -> None:
    """Named errors for what bagua_init is most often given wrong: the model and the optimizer swapped,
    something that is not a model, a process group that is not one, and a launcher's ranks without a
    process group (each would train alone, silently: DDP raises there too)."""
    if not isinstance(module, torch.nn.Module):
        swapped = " (the optimizer comes second: bagua_init(model, optimizer, ...))" \
            if isinstance(module, torch.optim.Optimizer) else ""
        raise AlgorithmConfigError(f"bagua_init's first argument is the model, a torch.nn.Module; got "
                                   f"{type(module).__name__}{swapped}")
    if process_group is not None and dist.is_available() and not isinstance(process_group, dist.ProcessGroup):
        raise AlgorithmConfigError(f"process_group must be a torch.distributed process group (dist.new_group(...)) "
                                   f"or None for the world, got {type(process_group).__name__}")
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1 and not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            f"WORLD_SIZE={launched}: a launcher (torchrun) started {launched} ranks, but no process group exists, "
            "so each rank would train alone. Call bagua_integrations.init_process_group() (or "
            "torch.distributed.init_process_group()) first")


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
    algorithm_state: Optional[dict] = None,
    autotune: bool = False,
    autotune_trials: int = 20,
    autotune_interval: int = 20,
    autotune_options: Optional[dict] = None,
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
        algorithm_state: resume: this rank's ``wrapped.algorithm_state_dict()`` from the
            checkpoint, when the model and optimizer state were loaded before ``bagua_init``.
            For algorithms whose replicas differ (``algorithm.replicas_differ``) rank 0's
            weights are then not broadcast: each rank keeps the weights it loaded.
        autotune: tune the communication settings while training (Bagua's autotuner, Optuna's
            TPE sampler; ``pip install 'bagua-integrations[autotune]'``): ``autotune_trials``
            settings, each measured over ``autotune_interval`` optimizer steps;
            ``autotune_options``: ``message_sizes=``, ``intervals=``, ``seed=``. See
            :meth:`BaguaModule.autotune_report`.

    Without a process group (or with one rank) the model runs plainly.
    """
    _check_model_and_group(module, process_group)
    optimizers = _as_list(optimizer)
    algorithm = _configure(distributed_algorithm, hierarchical_reduce, message_size, algorithm_kwargs)
    wrapped = BaguaModule(
        module,
        optimizers,
        algorithm,
        broadcast_buffers=broadcast_buffers,
        delay_reduce=delay_reduce,
        message_size=message_size,
        process_group=process_group,
        find_unused_parameters=find_unused_parameters,
        timeout=timeout,
        algorithm_state=algorithm_state,
    )
    if autotune and wrapped.distributed:
        wrapped.enable_autotune(max_trials=autotune_trials, interval=autotune_interval, **(autotune_options or {}))
    return wrapped, optimizer


class ModelSwitchWrapper(torch.nn.Module, Joinable):
    """A model whose distributed algorithm can change mid-training.

    ``ModelSwitchWrapper(model, optimizer, ...).switch_to("gradient_allreduce")`` wraps it;
    a later ``switch_to("decentralized", peer_selection_mode="shift_one")`` removes the old
    algorithm's hooks, averages weights, buffers and the optimizer's parameter-shaped state
    (momentum, Adam moments) over ranks, since model algorithms let them drift apart, and
    installs the new algorithm. Every rank must switch at the same step to the same
    algorithm; a mismatch raises :class:`ModelMismatchError` on every rank.
    ``state_dict`` / ``load_state_dict`` are the plain model's; the algorithm's checkpoint state
    is :meth:`algorithm_state_dict` (per rank, as under ``bagua_init``). ``with wrapper.join():`` (or
    ``Join([wrapper])``) handles uneven inputs like :meth:`BaguaModule.join`; do not switch
    algorithms inside it.
    """

    def __init__(
        self,
        module: Optional[torch.nn.Module] = None,
        optimizer: Optimizers = None,
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
        if module is None and "model" in algorithm_kwargs:  # the seed's example: ModelSwitchWrapper(model=model, ...)
            module = algorithm_kwargs.pop("model")
        if module is None:
            raise TypeError("ModelSwitchWrapper needs the module to wrap (module=, or model= as in Bagua's example)")
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

    def switch_to(self, distributed_algorithm: Union[str, Algorithm], *, algorithm_state: Optional[dict] = None,
                  **algorithm_kwargs) -> "ModelSwitchWrapper":
        """Use ``distributed_algorithm`` from now on; returns ``self``.

        The algorithm is built from ``algorithm_kwargs`` on top of the constructor's extra
        keyword arguments that it accepts (those are shared defaults for every algorithm).
        ``algorithm_state``: resuming, this rank's :meth:`algorithm_state_dict` from the
        checkpoint, with the model and optimizer already loaded (as ``bagua_init``'s): the
        algorithm continues on schedule and, where replicas differ, ranks keep their own weights.
        """
        if self._current is not None and self._current._joining:
            # (the joined ranks' hooks shadow the old wrapper's collectives: a gloo abort, or a hang)
            raise JoinError("switch_to inside `with model.join():` is not supported: switch between epochs, "
                            "outside the join block, at the same step on every rank")
        if isinstance(distributed_algorithm, Algorithm):
            kwargs = algorithm_kwargs
        else:  # the constructor's kwargs are defaults each algorithm takes what it understands of
            kwargs = {**accepted_kwargs(distributed_algorithm, self.algorithm_kwargs), **algorithm_kwargs}
        algorithm = _configure(distributed_algorithm, self.hierarchical_reduce, self.settings["message_size"], kwargs)
        first = self._current is None
        if not first:
            self._current.close()  # (a no-op if ModelSwitchWrapper.close() closed it already)
            self._set_current(None)
            group, timeout = self.settings["process_group"], self.settings["timeout"]
            allreduce_parameters(self.module, group=group, timeout=timeout)
            for optimizer in self.optimizers:
                allreduce_optimizer_state(optimizer, group=group, timeout=timeout)
        self._set_current(BaguaModule(self.module, self.optimizers, algorithm, sync_initial_weights=first,
                                      algorithm_state=algorithm_state, **self.settings))
        return self

    def algorithm_state_dict(self) -> dict:
        """The current algorithm's checkpoint state (see :meth:`BaguaModule.algorithm_state_dict`).

        It names the algorithm; on resume, switch to the same one with ``switch_to(name, ...,
        algorithm_state=state)`` (model and optimizer loaded first) or call
        :meth:`load_algorithm_state_dict` after ``switch_to``.
        """
        return self.wrapped.algorithm_state_dict()

    def load_algorithm_state_dict(self, state: dict, *, shared: bool = False) -> bool:
        """Restore :meth:`algorithm_state_dict` into the current algorithm (see :meth:`BaguaModule.load_algorithm_state_dict`)."""
        return self.wrapped.load_algorithm_state_dict(state, shared=shared)

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    def no_sync(self):
        return self.wrapped.no_sync()

    # torch Join: the current BaguaModule is the joinable; its join config is set through here
    @property
    def _join_config(self):
        return self.wrapped._join_config

    @_join_config.setter
    def _join_config(self, config) -> None:
        self.wrapped._join_config = config

    def join(self, divide_by_initial_world_size: bool = False, enable: bool = True,
             throw_on_early_termination: bool = False):
        """See :meth:`BaguaModule.join`."""
        if not self.wrapped.distributed:
            return contextlib.nullcontext()
        return _join_block(self, lambda: self._current, enable, throw_on_early_termination,
                           divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> BaguaJoinHook:
        return self.wrapped.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self.wrapped.join_device

    @property
    def join_process_group(self):
        return self.wrapped.join_process_group

    def unwrap(self) -> torch.nn.Module:
        return self.module

    def close(self) -> None:
        """Detach the current algorithm (:meth:`BaguaModule.close`): the plain model trains alone,
        a training forward through this wrapper is refused, and :meth:`switch_to` attaches again."""
        if self._current is not None:
            self._current.close()

    def report_metrics(self, score_record_list) -> None:
        """Bagua's autotuner: see :meth:`BaguaModule.report_metrics` (the current algorithm's tuner)."""
        self.wrapped.report_metrics(score_record_list)

    def ask_and_update_hyperparameters(self) -> bool:
        """Bagua's autotuner: see :meth:`BaguaModule.ask_and_update_hyperparameters`. A switch starts a new search."""
        return self.wrapped.ask_and_update_hyperparameters()

    def autotune_report(self) -> dict:
        return self.wrapped.autotune_report()

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """See :meth:`BaguaModule.load_state_dict`."""
        return load_into_plain_model(self.module, state_dict, strict, assign)
