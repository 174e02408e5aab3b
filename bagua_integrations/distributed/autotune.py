"""Bagua's autotuner: search communication settings while training runs, with Optuna's TPE sampler.

Every rank reports its measured speed (``report_metrics``); at ``ask_and_update_hyperparameters()``
(a collective: every rank calls it at the same point, between steps) the ranks' mean score is
told to the study on the group's first rank, which asks for the next setting and broadcasts it;
every rank applies the same setting before the next step (buckets are rebuilt there, never
during a backward). After ``max_trials`` trials the best setting stays. Searched:

* gradient algorithms: ``message_size`` (the bucket size) over powers of two, and, when the ranks
  span several nodes of several ranks each, ``hierarchical`` (reduce inside each node first);
* ``decentralized``: its ``communication_interval``.

Optuna is an optional dependency (``pip install bagua-integrations[autotune]``); it runs on the
first rank only. The default setting is the study's first trial, so tuning never ends worse
than the default by the study's own measure.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
import time
from typing import Any, Dict, List, Sequence

import torch

from . import comm
from .errors import AlgorithmConfigError

__all__ = ["Autotuner", "AutotuneStepper", "DEFAULT_MESSAGE_SIZES", "algorithm_setting", "set_algorithm_settings"]

logger = logging.getLogger(__name__)

DEFAULT_MESSAGE_SIZES = tuple(2**k for k in range(16, 27))  # 64 KiB .. 64 MiB
DEFAULT_INTERVALS = (1, 2, 4)


def algorithm_setting(algorithm, key: str) -> int:
    """A tunable setting the algorithm holds: ``message_size``, ``communication_interval`` or ``hierarchical`` (0/1)."""
    if key == "hierarchical":
        return int(algorithm.hierarchical)
    if key in ("message_size", "communication_interval") and hasattr(algorithm, key):
        return int(getattr(algorithm, key))
    raise AlgorithmConfigError(f"{key!r} is not a communication setting of {algorithm.name}")


def set_algorithm_settings(algorithm, **settings) -> bool:
    """Apply ``settings`` (None: unchanged) to ``algorithm``, between steps and on every rank alike;
    returns whether the reduction's layout (bucket size or hierarchy) changed."""
    layout_changed = False
    for key, value in settings.items():
        if value is None or int(value) == algorithm_setting(algorithm, key):  # (refuses unknown keys)
            continue
        if key == "hierarchical":
            algorithm.hierarchical = bool(value)
            algorithm.validate_hierarchy()
            layout_changed = True
            continue
        if int(value) < 1:
            raise AlgorithmConfigError(f"{key}={value} must be >= 1")
        setattr(algorithm, key, int(value))
        layout_changed = layout_changed or key == "message_size"
    return layout_changed


def _import_optuna():
    """``optuna``, or None where it is not installed; imported on a thread of its own.

    Why a thread: importing Optuna keeps the tracebacks of its optional imports that fail, and a
    traceback's frames keep their callers' frames. Imported from inside a training loop, it would
    keep that loop's frames (the trainer, the model, their process groups) alive until the
    interpreter's teardown, and the exit could not join those groups' gloo threads (see
    ``comm.destroy_process_groups_at_exit``; seen in fairseq-train with --bagua-autotune). A new
    thread's stack holds nothing of the caller's.
    """
    found = {}

    def load():
        try:
            found["optuna"] = importlib.import_module("optuna")
        except ImportError:
            pass

    loader = threading.Thread(target=load, name="bagua-import-optuna")
    loader.start()
    loader.join()
    return found.get("optuna")


def _optuna_or_error(group):
    """Optuna on every rank, or the same named error on every rank (never a hang in the next collective)."""
    optuna = _import_optuna()
    have = 0.0 if optuna is None else 1.0
    if comm.is_distributed(group):
        flag = torch.tensor([have], dtype=torch.float64, device=comm.small_tensor_device(group))

        def stages():
            yield comm.all_reduce(flag, group, op=torch.distributed.ReduceOp.MIN)

        comm.run(stages(), "autotune setup", None)
        have = float(flag.item())
    if have < 1.0:
        raise AlgorithmConfigError(
            "autotuning needs Optuna on every rank: pip install 'bagua-integrations[autotune]' (or optuna)"
        )
    return optuna


class Autotuner:
    """The search behind ``report_metrics`` / ``ask_and_update_hyperparameters`` of one wrapped module.

    Args:
        target: the :class:`~bagua_integrations.distributed.module.BaguaModule` whose settings change.
        max_trials: settings tried (the default one included) before the best is kept.
        message_sizes: the bucket sizes searched (gradient algorithms).
        intervals: the ``communication_interval`` values searched (``decentralized``).
        seed: the TPE sampler's seed (the same search on every run).
    """

    def __init__(self, target, *, max_trials: int = 20, message_sizes: Sequence[int] = DEFAULT_MESSAGE_SIZES,
                 intervals: Sequence[int] = DEFAULT_INTERVALS, seed: int = 0,
                 settings: Sequence[str] = ("message_size", "communication_interval", "hierarchical")):
        if max_trials < 1:
            raise AlgorithmConfigError(f"max_trials must be >= 1, got {max_trials}")
        self.target = target
        self.group = target.process_group
        self.timeout = target.timeout
        self.max_trials = int(max_trials)
        self.space: Dict[str, List[int]] = {}
        algorithm = target.algorithm
        if algorithm.kind == "gradient" and "message_size" in settings:
            self.space["message_size"] = sorted({int(m) for m in message_sizes})
        if hasattr(algorithm, "communication_interval") and "communication_interval" in settings:
            self.space["communication_interval"] = sorted({int(i) for i in intervals})
        if (algorithm.kind == "gradient" and "hierarchical" in settings and comm.is_distributed(self.group)
                and comm.NodeGroups.possible(self.group)):
            # only across nodes (LOCAL_WORLD_SIZE ranks each) does it differ; where the world does not
            # split into equal nodes, the other settings are tuned (a flat run there is no error)
            self.space["hierarchical"] = [0, 1]
        if not self.space:
            raise AlgorithmConfigError(
                f"{algorithm.name} has no communication setting to tune here (tunable: {', '.join(settings) or 'none'})")
        for key, values in self.space.items():  # the default is trial 0, so it must be a choice
            self.space[key] = sorted(set(values) | {int(target.communication_setting(key))})
        self.keys = sorted(self.space)
        self.history: List[Dict[str, Any]] = []  # {"trial", "settings", "score"} per finished trial
        self.scores: List[float] = []
        self.done = False
        self._trial = None
        self.first_rank = comm.rank(self.group) == 0 if comm.is_distributed(self.group) else True
        optuna = _optuna_or_error(self.group)
        self.study = None
        if self.first_rank:
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(1, min(5, self.max_trials // 2)))
            self.study = optuna.create_study(direction="maximize", sampler=sampler)
            self.study.enqueue_trial(self.current())  # the default setting is trial 0
            self._trial = self._ask()

    # ------------------------------------------------------------------ settings
    def current(self) -> Dict[str, int]:
        """The settings in use now."""
        return {key: int(self.target.communication_setting(key)) for key in self.keys}

    def _ask(self):
        trial = self.study.ask()
        for key in self.keys:
            trial.suggest_categorical(key, self.space[key])
        return trial

    def report_metrics(self, score_record_list) -> None:
        """Record this rank's speed measurements (higher is better, e.g. samples/s) for the current trial."""
        values = [score_record_list] if isinstance(score_record_list, (int, float)) else list(score_record_list)
        for value in values:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"report_metrics got a non-finite score {value}")
            self.scores.append(value)

    def ask_and_update(self) -> bool:
        """Finish the current trial with the ranks' mean score and apply the next setting; a collective.

        Returns whether the settings changed. A call with no score reported on any rank keeps
        the trial running (returns False).
        """
        if self.done:
            return False
        device = comm.small_tensor_device(self.group)
        mine = [sum(self.scores) / len(self.scores), 1.0] if self.scores else [0.0, 0.0]
        totals = torch.tensor(mine, dtype=torch.float64, device=device)
        if comm.is_distributed(self.group):
            def reduce():
                yield comm.all_reduce(totals, self.group)

            comm.run(reduce(), "autotune score", self.timeout)
        reported = totals[1].item()
        if reported == 0:
            return False
        score = totals[0].item() / reported
        self.scores = []
        message = torch.zeros(len(self.keys) + 1, dtype=torch.float64, device=device)
        if self.first_rank:
            settings = self.current()
            self.study.tell(self._trial, score)
            self.history.append({"trial": len(self.history), "settings": settings, "score": score})
            logger.info(f"autotune trial {len(self.history) - 1}: {settings} -> {score:.4g}")
            if len(self.history) >= self.max_trials:
                chosen, finished = self.study.best_params, True
            else:
                self._trial = self._ask()
                chosen, finished = self._trial.params, False
            message[: len(self.keys)] = torch.tensor([float(chosen[k]) for k in self.keys], dtype=torch.float64)
            message[-1] = 1.0 if finished else 0.0
        if comm.is_distributed(self.group):
            def share():
                yield comm.broadcast(message, comm.group_ranks(self.group)[0], self.group)

            comm.run(share(), "autotune settings", self.timeout)
        values = message.tolist()
        chosen = {key: int(values[i]) for i, key in enumerate(self.keys)}
        self.done = bool(values[-1])
        if not self.first_rank:
            self.history.append({"trial": len(self.history), "settings": None, "score": score})
        changed = chosen != self.current()
        if changed:
            self.target.apply_communication_settings(**chosen)
        return changed

    def report(self) -> Dict[str, Any]:
        """The trial history (settings and mean scores, on the first rank), the best so far, and whether it ended."""
        best = max((h for h in self.history if h["settings"] is not None), key=lambda h: h["score"], default=None)
        return {"history": list(self.history), "best": best, "done": self.done, "current": self.current(),
                "max_trials": self.max_trials}


class AutotuneStepper:
    """``bagua_init(..., autotune=True)``: measure steps/s over every ``interval`` optimizer steps
    and run one autotune round then (every rank steps equally often, so they call it together)."""

    def __init__(self, tuner: Autotuner, interval: int = 20):
        if interval < 1:
            raise AlgorithmConfigError(f"autotune interval must be >= 1 step, got {interval}")
        self.tuner = tuner
        self.interval = int(interval)
        self.steps = 0
        self.started = None

    def after_step(self) -> None:
        if self.tuner.done:
            return
        now = time.perf_counter()
        if self.started is None:  # the first step after a change pays for new buckets: not measured
            self.started = now
            return
        self.steps += 1
        if self.steps >= self.interval:
            self.tuner.report_metrics(self.steps / (now - self.started))
            self.tuner.ask_and_update()
            self.steps, self.started = 0, None
