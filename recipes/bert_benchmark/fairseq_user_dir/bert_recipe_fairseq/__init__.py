"""fairseq ``--user-dir`` of the BERT benchmark recipe (``recipes/bert_benchmark``).

It registers, on top of ``fairseq_plugin`` (``--optimizer bagua_fused``, imported here):

* ``--optimizer bert_adam``: Bagua's per-tensor BertAdam (``bagua_integrations.optim.BertAdam``,
  no bias correction), with BertAdam's own options and defaults: ``--bert-adam-max-grad-norm``
  (1.0: each parameter's gradient clipped to norm 1.0; ``<= 0``: off), ``--bert-adam-warmup``,
  ``--bert-adam-t-total`` and ``--bert-adam-schedule`` (its built-in schedule; ``-1``: off, so the
  learning rate is fairseq's ``--lr-scheduler``'s). The recipe passes them for every row: its
  default rows keep BertAdam's clipping and schedule (with ``--clip-norm 0 --lr-scheduler fixed``),
  the ``bertadam-globalclip`` rows turn them off (fairseq clips globally and schedules). As
  ``--optimizer bagua_fused --bagua-base-optimizer bert_adam`` it is the fused BertAdam; the task
  logs ``fusion_report(...).group_paths`` and the fused parameter / flat-run counts whenever they
  change (``bert_recipe_fairseq: fused group paths [...]; N parameter(s) through R flat run(s)``).
* ``--optimizer torch_adamw --torch-adamw-impl foreach|fused|single``: ``torch.optim.AdamW`` with
  the chosen implementation (fairseq's own ``adam`` is a per-tensor Python loop on CPU).
* ``--task timed_sentence_prediction``: fairseq's ``sentence_prediction`` that also logs, per
  epoch, the optimizer-step time (``opt_ms``: mean milliseconds of ``optimizer.step()`` per
  update, compile time excluded), the epoch time (``epoch_s``: from the start of the epoch to
  the end of its last update, compile time excluded), the compile time (``compile_s``) and the
  share of updates that ran compiled (``compiled``) of a fused optimizer; with ``$BERT_RECIPE_TIMINGS``
  set, rank 0 also appends every update's wall time and optimizer-step time to that file.

It changes nothing else in fairseq.
"""

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, List

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.tasks import register_task
from fairseq.tasks.sentence_prediction import SentencePredictionConfig, SentencePredictionTask
from omegaconf import II, OmegaConf

import fairseq_plugin  # noqa: F401  (registers --optimizer bagua_fused)
from bagua_integrations import fusion_report, is_fused_optimizer
from bagua_integrations.optim import BertAdam

TIMINGS_ENV = "BERT_RECIPE_TIMINGS"
logger = logging.getLogger("bert_recipe_fairseq")


def _betas(value) -> tuple:
    if isinstance(value, str):
        value = value.strip().strip("()[]")
        return tuple(float(v) for v in value.split(",") if v.strip())
    if not isinstance(value, (list, tuple)):
        value = OmegaConf.to_container(value)
    return tuple(float(v) for v in value)


def _lr(cfg) -> float:
    lr = cfg.lr
    if isinstance(lr, (int, float)):
        return float(lr)
    return float(list(lr)[0])


# ------------------------------------------------------------------------------------ optimizers
@dataclass
class BertAdamConfig(FairseqDataclass):
    bert_adam_betas: Any = field(default="(0.9, 0.999)", metadata={"help": "BertAdam's (b1, b2)"})
    bert_adam_eps: float = field(default=1e-6, metadata={"help": "BertAdam's epsilon"})
    weight_decay: float = field(default=0.01, metadata={"help": "decoupled weight decay"})
    bert_adam_max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "clip each parameter's gradient to this norm (BertAdam's default 1.0; <= 0: off)"},
    )
    bert_adam_warmup: float = field(
        default=-1.0, metadata={"help": "BertAdam's warmup: fraction of --bert-adam-t-total (-1: no schedule)"}
    )
    bert_adam_t_total: int = field(
        default=-1, metadata={"help": "BertAdam's t_total: updates of its schedule (-1: constant lr, fairseq's)"}
    )
    bert_adam_schedule: str = field(
        default="warmup_linear", metadata={"help": "BertAdam's schedule: warmup_linear, warmup_cosine, warmup_constant"}
    )
    lr: List[float] = II("optimization.lr")


@register_optimizer("bert_adam", dataclass=BertAdamConfig)
class FairseqBertAdam(FairseqOptimizer):
    """Bagua's BertAdam, one tensor at a time, with BertAdam's own clipping and schedule options."""

    def __init__(self, cfg, params):
        super().__init__(cfg)
        self._optimizer = BertAdam(params, **self.optimizer_config)

    @property
    def optimizer_config(self):
        b1, b2 = _betas(self.cfg.bert_adam_betas)
        return {
            "lr": _lr(self.cfg),
            "b1": b1,
            "b2": b2,
            "e": float(self.cfg.bert_adam_eps),
            "weight_decay": float(self.cfg.weight_decay),
            "max_grad_norm": float(self.cfg.bert_adam_max_grad_norm),
            "warmup": float(self.cfg.bert_adam_warmup),
            "t_total": int(self.cfg.bert_adam_t_total),
            "schedule": str(self.cfg.bert_adam_schedule),
        }


TORCH_ADAMW_IMPLS = ChoiceEnum(["foreach", "fused", "single"])


@dataclass
class TorchAdamWConfig(FairseqDataclass):
    torch_adamw_impl: TORCH_ADAMW_IMPLS = field(
        default="foreach", metadata={"help": "torch.optim.AdamW implementation: foreach, fused or single (per tensor)"}
    )
    torch_adamw_betas: Any = field(default="(0.9, 0.999)", metadata={"help": "AdamW betas"})
    torch_adamw_eps: float = field(default=1e-6, metadata={"help": "AdamW epsilon"})
    weight_decay: float = field(default=0.01, metadata={"help": "decoupled weight decay"})
    lr: List[float] = II("optimization.lr")


@register_optimizer("torch_adamw", dataclass=TorchAdamWConfig)
class FairseqTorchAdamW(FairseqOptimizer):
    """``torch.optim.AdamW`` with ``foreach=True``, ``fused=True`` or neither."""

    def __init__(self, cfg, params):
        super().__init__(cfg)
        self._optimizer = torch.optim.AdamW(params, **self.optimizer_config)

    @property
    def optimizer_config(self):
        impl = str(self.cfg.torch_adamw_impl)
        return {
            "lr": _lr(self.cfg),
            "betas": _betas(self.cfg.torch_adamw_betas),
            "eps": float(self.cfg.torch_adamw_eps),
            "weight_decay": float(self.cfg.weight_decay),
            "foreach": impl == "foreach",
            "fused": True if impl == "fused" else None,
        }


# ------------------------------------------------------------------------------------ timed task
def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _torch_optimizer(optimizer):
    inner = getattr(optimizer, "optimizer", optimizer)  # FairseqOptimizer -> torch optimizer
    return getattr(inner, "optimizer", inner) if not isinstance(inner, torch.optim.Optimizer) else inner


def _compile_seconds(optimizer) -> float:
    inner = _torch_optimizer(optimizer)
    if isinstance(inner, torch.optim.Optimizer) and is_fused_optimizer(inner):
        return fusion_report(inner).compile_seconds
    return 0.0


def _fused(optimizer):
    inner = _torch_optimizer(optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) and is_fused_optimizer(inner) else None


def _compiled(optimizer) -> float:
    inner = _torch_optimizer(optimizer)
    if isinstance(inner, torch.optim.Optimizer) and is_fused_optimizer(inner):
        return 1.0 if fusion_report(inner).compiled else 0.0
    return 0.0


@dataclass
class TimedSentencePredictionConfig(SentencePredictionConfig):
    pass


@register_task("timed_sentence_prediction", dataclass=TimedSentencePredictionConfig)
class TimedSentencePredictionTask(SentencePredictionTask):
    """``sentence_prediction`` that logs optimizer-step and epoch times (see the module docstring)."""

    _mark = None
    _fusion_logged = None

    def begin_epoch(self, epoch, model):
        super().begin_epoch(epoch, model)
        _sync()
        self._mark = time.perf_counter()

    def optimizer_step(self, optimizer, model, update_num):
        _sync()
        before = _compile_seconds(optimizer)
        started = time.perf_counter()
        super().optimizer_step(optimizer, model, update_num)
        _sync()
        ended = time.perf_counter()
        compile_s = _compile_seconds(optimizer) - before
        if self._mark is None:
            self._mark = started
        metrics.log_scalar("opt_ms", (ended - started - compile_s) * 1e3, weight=1, round=3)
        metrics.log_scalar_sum("epoch_s", ended - self._mark - compile_s, round=3)
        metrics.log_scalar_sum("compile_s", compile_s, round=3)
        metrics.log_scalar("compiled", _compiled(optimizer), weight=1, round=3)
        _record_update(ended - self._mark - compile_s, ended - started - compile_s)
        self._mark = ended
        fused = _fused(optimizer)
        if fused is not None:
            report = fusion_report(fused)
            seen = (tuple(report.group_paths), report.fused_params, report.flat_runs)
            if seen != self._fusion_logged:  # the first step creates state; later ones show the steady path
                self._fusion_logged = seen
                logger.info(f"bert_recipe_fairseq: fused group paths {json.dumps(list(report.group_paths))}; "
                            f"{report.fused_params} parameter(s) through {report.flat_runs} flat run(s); "
                            f"update {update_num + 1}")


_TIMINGS = {"handle": None}


def _record_update(update_s: float, optimizer_s: float) -> None:
    """Per-update times for medians, to ``$BERT_RECIPE_TIMINGS`` (rank 0; one "update optimizer" line each)."""
    path = os.environ.get(TIMINGS_ENV)
    if not path:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    if _TIMINGS["handle"] is None:
        _TIMINGS["handle"] = open(path, "a", buffering=1)
    _TIMINGS["handle"].write(f"{update_s:.6f} {optimizer_s:.6f}\n")
