"""``AlgorithmSession``: the one place where a distributed algorithm is driven.

``bagua_init``'s :class:`BaguaModule`, fairseq's ``--bagua-algorithm`` and the HF Trainer /
Accelerate integration all drive an algorithm the same way: pick the parameters it acts on,
check that every rank agrees, attach it, count optimizer updates, run model algorithms after
each one, and checkpoint the counters. They only differ in *where* their framework lets them
hook in, so that is all an integration keeps; everything else lives here.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..fused_optimizer import is_fused_optimizer
from . import comm
from .algorithms import Algorithm
from .autotune import algorithm_setting, set_algorithm_settings
from .errors import AlgorithmConfigError, CheckpointError
from .sync import check_same_on_all_ranks, describe_model, describe_parameters, gather_states

__all__ = ["AlgorithmSession"]

logger = logging.getLogger(__name__)

Optimizers = Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


class AlgorithmSession:
    """One algorithm attached to one set of parameters over one process group.

    Build it on every rank at the same point of the program, before the first optimizer step.
    The constructor

    1. checks that every rank has the same model (or parameters), algorithm settings and
       optimizer layout (fused or not); a mismatch raises :class:`ModelMismatchError` on
       every rank before anything else is exchanged, instead of a hang in the first
       collective (``check_consistency=False`` skips it where the caller checks itself);
    2. runs ``before_attach()`` if given: ``bagua_init`` broadcasts rank 0's weights there,
       after the check (so mismatched ranks never exchange weights) and before ``attach``
       (so BMUF records the broadcast weights as the start of its first block);
    3. calls ``algorithm.attach(params, optimizer, group)``.

    Args:
        optimizer: the optimizer (or a list of them; the first one is the algorithm's).
        model: the model every rank must agree on; without it, ``params`` are compared.
        params: what the algorithm acts on. Default: the optimizer's parameters (fairseq's
            BMUF acts on those, e.g. fp32 master copies), else the model's trainable ones.
        group: the process group (default, or ``dist.group.WORLD``: the world).
        timeout: longest wait for a collective; default the algorithm's own ``timeout``.
        extra_description: more lines every rank must agree on (e.g. a bucket layout).
    """

    def __init__(
        self,
        algorithm: Algorithm,
        *,
        optimizer: Optimizers = None,
        model: Optional[torch.nn.Module] = None,
        params: Optional[Iterable[torch.Tensor]] = None,
        group=None,
        timeout: comm.Timeout = None,
        check_consistency: bool = True,
        extra_description: Sequence[str] = (),
        before_attach: Optional[Callable[[], None]] = None,
        state: Optional[Dict[str, Any]] = None,
    ):
        self.algorithm = algorithm
        self.name = algorithm.name or type(algorithm).__name__
        self.optimizers: List[torch.optim.Optimizer] = (
            [] if optimizer is None else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        )
        self.optimizer = self.optimizers[0] if self.optimizers else None
        if self.kind == "model" and len(self.optimizers) > 1:
            raise AlgorithmConfigError(
                f"{self.name} acts after the optimizer step and needs one optimizer, got {len(self.optimizers)}"
            )
        # None is the default group to the algorithms and to DDP's hook state alike
        self.group = None if group is dist.group.WORLD else group
        self.timeout = comm.as_timedelta(timeout) if timeout is not None else algorithm.timeout
        if algorithm.timeout is None:
            algorithm.timeout = self.timeout
        self.num_updates = 0
        self._handles: list = []
        self.autotuner = None
        self.autotune_stepper = None
        self.params = self._select_params(params, model)
        comm.destroy_process_groups_at_exit()  # see there: gloo's exit race
        if check_consistency:
            self._check_consistency(model, extra_description)
        if state is not None:  # a resume: checked and kept by the algorithm until attach applies it
            self.load_state_dict(state)
        if before_attach is not None:
            before_attach()
        algorithm.attach(self.params, self.optimizer, self.group)

    def _select_params(self, params, model) -> List[torch.Tensor]:
        if params is not None:
            return list(params)
        if self.optimizer is not None:
            return [p for group in self.optimizer.param_groups for p in group["params"]]
        if model is not None:
            return [p for p in model.parameters() if p.requires_grad]
        raise AlgorithmConfigError(f"{self.name} needs the parameters it acts on: pass params=, optimizer= or model=")

    def _check_consistency(self, model, extra_description: Sequence[str]) -> None:
        lines = describe_model(model) if model is not None else describe_parameters(self.params)
        if model is not None:
            # the algorithm acts on self.params (the optimizer's): they must be the same on every rank
            position = {id(p): i for i, p in enumerate(model.parameters())}
            lines.append(f"acts on model parameters {_ranges([position.get(id(p), -1) for p in self.params])}")
        lines.append(f"algorithm {self.algorithm.signature()}")
        lines.append(f"optimizers {[type(o).__name__ + (' fused' if is_fused_optimizer(o) else '') for o in self.optimizers]}")
        # each param group's settings: a learning rate or momentum that differs between ranks makes
        # the replicas drift apart while every collective still matches (DDP does not check it)
        for i, optimizer in enumerate(self.optimizers):
            for j, group in enumerate(optimizer.param_groups):
                lines.append(f"optimizer {i} param group {j}: {_plain_settings(group)}")
        if self.algorithm.hierarchical:
            lines.append(f"LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE', 'unset')}")
        lines.extend(extra_description)
        check_same_on_all_ranks(lines, "model, optimizer or algorithm", group=self.group, timeout=self.timeout)

    # ------------------------------------------------------------------ what it is
    @property
    def kind(self) -> str:
        """``"gradient"`` (averages gradients before the step) or ``"model"`` (acts after it)."""
        return self.algorithm.kind

    @property
    def distributed(self) -> bool:
        """Whether there are peers at all (a single process communicates nothing)."""
        return comm.is_distributed(self.group)

    @property
    def acts_after_step(self) -> bool:
        """Whether :meth:`after_update` must run after every optimizer update (model algorithms)."""
        return self.algorithm.wants_step_hook

    # ------------------------------------------------------------------ driving it
    def after_update(self, step: Optional[int] = None) -> bool:
        """Count one optimizer update and run the algorithm's post-step communication; returns whether it did.

        Call it on every rank after every update, also one a GradScaler skipped on this rank:
        model algorithms keep gradients local, so ranks may skip differently, and the
        collectives must still match. ``step`` is the update number including this one (e.g.
        a framework's global step, so a resumed run continues the count); default: one more.
        """
        self.num_updates = self.num_updates + 1 if step is None else int(step)
        acted = bool(self.algorithm.after_step(step=self.num_updates)) if self.acts_after_step else False
        if self.autotune_stepper is not None:
            self.autotune_stepper.after_step()
        return acted

    def install_step_hook(self, optimizer: torch.optim.Optimizer):
        """Run :meth:`after_update` after every ``optimizer.step()`` (plain or fused); returns the handle.

        Torch's public step post-hook: a fused step runs it exactly like an ordinary step.
        :meth:`close` removes it.
        """
        handle = optimizer.register_step_post_hook(lambda *_: self.after_update())
        self._handles.append(handle)
        return handle

    def allreduce_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Gradient algorithms: average ``params``' gradients in place, a missing one counting as zeros.

        For frameworks with their own loop (fairseq's ``all_reduce_grads``); a no-op for model
        algorithms, which keep gradients local.
        """
        if self.kind == "gradient":
            self.algorithm.allreduce_parameter_gradients(params, group=self.group, timeout=self.timeout)

    def aggregate_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The mean of the ranks' local gradient norms under a model algorithm, else ``norm``.

        Model algorithms leave each rank its own gradients (and its own clipping); reporting the
        mean keeps logged norms, and checks that compare them across ranks, in agreement.
        """
        if self.kind != "model" or not self.distributed:
            return norm
        mean = norm.detach().to(torch.float64).reshape(1).clone()
        comm.run(comm.average(mean, self.group), f"{self.name} gradient norm averaging", self.timeout)
        return mean.to(norm.dtype).reshape(norm.shape)

    # ------------------------------------------------------------------ autotuning (frameworks without BaguaModule)
    @property
    def process_group(self):
        return self.group

    def communication_setting(self, key: str):
        """A tunable setting: the bucket size of :meth:`allreduce_gradients`, ``hierarchical`` or the
        algorithm's ``communication_interval``."""
        return algorithm_setting(self.algorithm, key)

    def apply_communication_settings(self, **settings) -> None:
        """Set tunable settings (between updates, on every rank alike: the autotuner broadcasts them)."""
        set_algorithm_settings(self.algorithm, **settings)

    def enable_autotune(self, max_trials: int = 20, interval: Optional[int] = None, **search):
        """Bagua's autotuner over this session's settings (see :meth:`BaguaModule.enable_autotune`);
        ``interval``: tune every that many :meth:`after_update` calls from measured updates/s."""
        from .autotune import Autotuner, AutotuneStepper

        self.autotuner = Autotuner(self, max_trials=max_trials, **search)
        self.autotune_stepper = AutotuneStepper(self.autotuner, interval) if interval is not None else None
        return self.autotuner

    # ------------------------------------------------------------------ checkpoints
    @property
    def replicas_differ(self) -> bool:
        """Whether each rank's weights or optimizer state are its own (model algorithms): a checkpoint
        must then hold every rank's model and optimizer state (see :meth:`state_dict`)."""
        return self.distributed and self.algorithm.replicas_differ

    def state_dict(self) -> Dict[str, Any]:
        """The algorithm's name, the update count and the algorithm's own :meth:`Algorithm.state_dict`.

        Also this rank and the world size, and whether ranks' weights / optimizer state differ
        under this algorithm, so that a resume can tell a per-rank checkpoint from one rank's
        state loaded everywhere.
        """
        state = {
            "name": self.name,
            "num_updates": self.num_updates,
            "algorithm": self.algorithm.state_dict(),
            "rank": comm.rank(self.group) if self.distributed else 0,
            "world_size": comm.world_size(self.group) if self.distributed else 1,
            "weights_differ": self.distributed and self.algorithm.weights_differ,
            "replicas_differ": self.replicas_differ,
        }
        if self.autotuner is not None:  # the settings it chose (the same on every rank): a resume keeps them
            state["autotuned"] = self.autotuner.current()
        return state

    def load_state_dict(self, state: Dict[str, Any], *, shared: bool = False,
                        optimizer_state: Optional[Dict[str, Any]] = None) -> bool:
        """Restore :meth:`state_dict` (before or after ``attach``); returns whether it did.

        ``shared=True`` says the checkpoint is one rank's, loaded on every rank (fairseq, HF
        Trainer's ``optimizer.pt``): when this algorithm lets replicas differ that would silently
        diverge, so :class:`CheckpointError` is raised on every rank instead (the decision only
        reads the checkpoint), unless nothing per rank was lost: weights that do not differ
        under these settings and an optimizer without per-parameter state (``optimizer_state``,
        e.g. plain SGD). A per-rank checkpoint of another rank or world size raises too.

        A checkpoint of another algorithm is not restored (one warning): its counters mean
        nothing to this one, and training goes on from a fresh schedule.
        """
        if not isinstance(state, dict):
            raise CheckpointError(f"the algorithm state must be the dict algorithm_state_dict() returned, got "
                                  f"{type(state).__name__}")
        if state.get("name") != self.name:
            logger.warning(
                f"the checkpoint was trained with the distributed algorithm {state.get('name')}, now "
                f"{self.name}; its algorithm state is not restored"
            )
            return False
        self.check_resume(state, shared=shared, optimizer_state=optimizer_state)
        self.num_updates = int(state.get("num_updates", 0))
        self.algorithm.load_state_dict(state.get("algorithm") or {})
        if state.get("autotuned"):  # what the autotuner had chosen (a new search starts from it)
            self.apply_communication_settings(**state["autotuned"])
        return True

    def rank_state_dict(self, model: Optional[torch.nn.Module] = None,
                        params: Optional[Sequence[torch.Tensor]] = None) -> Dict[str, Any]:
        """What this rank must save for itself, for frameworks that save one rank's checkpoint.

        ``{"algorithm": state_dict()}``, plus, when the algorithm lets replicas differ, this
        rank's optimizer state and (when weights differ) ``model``'s weights, or ``params``'
        values for frameworks that hold parameters but no module (fairseq's optimizer). Every
        rank writes it to its own file (the HF Trainer callback: ``bagua_rank{r}.pt`` in the
        checkpoint folder; Accelerate: ``register_for_checkpointing``) or sends it to one rank
        (:meth:`gather_rank_state_dicts`); :meth:`load_rank_state_dict` restores it.
        """
        state: Dict[str, Any] = {"algorithm": self.state_dict()}
        if self.replicas_differ:
            if self.optimizer is not None:
                state["optimizer"] = self.optimizer.state_dict()
            if self.algorithm.weights_differ:
                if model is not None:
                    state["model"] = model.state_dict()
                if params is not None:
                    state["params"] = [p.detach() for p in params]
        return state

    def gather_rank_state_dicts(self, model: Optional[torch.nn.Module] = None,
                                params: Optional[Sequence[torch.Tensor]] = None) -> Optional[List[Dict[str, Any]]]:
        """Every rank's :meth:`rank_state_dict`, by group rank, on the group's first rank (None elsewhere).

        A collective (call it on every rank), for frameworks that write one checkpoint file from
        one rank (fairseq): that rank then saves everyone's state in it. It needs memory for all
        ranks' optimizer state (and weights, where they differ) while the checkpoint is written.
        """
        return gather_states(self.rank_state_dict(model, params), group=self.group, timeout=self.timeout,
                             what=f"{self.name} checkpoint gather")

    def load_rank_state_dict(self, state: Dict[str, Any], model: Optional[torch.nn.Module] = None,
                             params: Optional[Sequence[torch.Tensor]] = None) -> bool:
        """Restore :meth:`rank_state_dict`: weights, optimizer state, then the algorithm's (in that order)."""
        self.check_resume(state["algorithm"])
        if state.get("model") is not None and model is not None:
            model.load_state_dict(state["model"])
            self.algorithm.weights_loaded()
        if state.get("params") is not None and params is not None:
            _copy_params(state["params"], list(params))
            self.algorithm.weights_loaded()
        if state.get("optimizer") is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        return self.load_state_dict(state["algorithm"])

    def check_resume(self, state: Dict[str, Any], *, shared: bool = False,
                     optimizer_state: Optional[Dict[str, Any]] = None) -> None:
        """Raise :class:`CheckpointError` where resuming from ``state`` would silently diverge."""
        if not self.distributed or not state.get("replicas_differ", self.replicas_differ):
            return
        saved_world = state.get("world_size")
        world = comm.world_size(self.group)
        if saved_world is not None and int(saved_world) != world:
            raise CheckpointError(
                f"{self.name} lets each rank's weights and optimizer state differ, and this checkpoint holds the "
                f"state of a run on {saved_world} ranks, not {world}: resume on {saved_world} ranks, or make "
                "the replicas equal first (e.g. switch to gradient_allreduce with ModelSwitchWrapper, which "
                "averages weights and optimizer state) and save that"
            )
        if shared:
            has_optimizer_state = bool(optimizer_state and optimizer_state.get("state"))
            if state.get("weights_differ", True) or has_optimizer_state:
                lost = "weights and optimizer state" if state.get("weights_differ", True) else "optimizer state"
                raise CheckpointError(
                    f"this checkpoint holds only rank {state.get('rank', 0)}'s {lost}, but under {self.name} "
                    f"every rank's {lost} are its own; loading one rank's on all {world} ranks would silently "
                    "diverge from the uninterrupted run. Save every rank's own state (BaguaModule."
                    "algorithm_state_dict() with the model and optimizer state, per rank; the HF and "
                    "Accelerate integrations do this), or resume with a fresh optimizer (fairseq: "
                    "--reset-optimizer) knowing the run restarts from rank 0's state"
                )
        elif state.get("rank") is not None and int(state["rank"]) != comm.rank(self.group):
            raise CheckpointError(
                f"rank {comm.rank(self.group)} was given rank {state['rank']}'s checkpoint; under {self.name} "
                "each rank's weights and optimizer state are its own: load the file each rank saved"
            )

    def close(self) -> None:
        """Remove the step hooks this session installed and detach the algorithm."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.algorithm.detach()


def _copy_params(saved: Sequence[torch.Tensor], params: List[torch.Tensor]) -> None:
    """Copy a checkpoint's parameter values into ``params`` in place (fused views stay views)."""
    shapes = [tuple(p.shape) for p in params]
    if [tuple(t.shape) for t in saved] != shapes:
        raise CheckpointError(
            f"this checkpoint holds {len(saved)} parameter(s) that do not match the {len(params)} being "
            "trained (other shapes or order): resume with the model and optimizer that saved it"
        )
    with torch.no_grad():
        for p, value in zip(params, saved):
            p.copy_(value)


def _ranges(indices: List[int]) -> str:
    """``[0, 1, 2, 5, -1, -1]`` -> ``"0-2, 5, 2 outside the model"``: short enough to read in a mismatch report."""
    runs: List[List[int]] = []
    for i in indices:
        if runs and ((i < 0 and runs[-1][0] < 0) or (i >= 0 and runs[-1][0] >= 0 and i == runs[-1][1] + 1)):
            runs[-1][1] = i
            runs[-1][2] += 1
        else:
            runs.append([i, i, 1])
    return ", ".join(f"{n} outside the model" if a < 0 else (str(a) if a == b else f"{a}-{b}") for a, b, n in runs)


def _plain_settings(group) -> str:
    """A param group's settings that are numbers, flags, strings or tuples of them (one-value
    tensors as numbers), in key order: what every rank's copy of the group must agree on. Other
    values (callables, objects) are left out: their text can differ between processes."""

    def plain(value):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (tuple, list)):
            items = [plain(v) for v in value]
            return _LEFT_OUT if any(v is _LEFT_OUT for v in items) else tuple(items)
        return _LEFT_OUT

    kept = {key: plain(value) for key, value in group.items() if key not in ("params", "param_names")}
    return ", ".join(f"{key}={value!r}" for key, value in sorted(kept.items()) if value is not _LEFT_OUT)


_LEFT_OUT = object()
