"""``--optimizer bagua_fused``: any registered fairseq optimizer, stepped over flat buffers.

The class is a thin adapter. It builds the base optimizer (``--bagua-base-optimizer``) with
fairseq's own builder and that optimizer's own options, fuses the base's torch optimizer with
:func:`bagua_integrations.fuse_optimizer` (``replace_step=True``) and forwards the
``FairseqOptimizer`` API to the base. The only behaviour it adds is the optional Bagua
communication algorithm (``--bagua-algorithm``), run at fairseq's extension points:
``all_reduce_grads`` for gradient algorithms and right after ``step`` for model algorithms.
"""

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.optim import (
    OPTIMIZER_DATACLASS_REGISTRY,
    OPTIMIZER_REGISTRY,
    FairseqOptimizer,
    register_optimizer,
)
from omegaconf import II, DictConfig, OmegaConf

from bagua_integrations import NotElementwiseError, fuse_optimizer, fusion_report, is_fused_optimizer
from bagua_integrations.distributed import CheckpointError, comm

from . import _algorithms, _cli
from ._fairseq_compat import build_registered_optimizer, call_before_each_save, config_parent, set_legacy_defaults

logger = logging.getLogger(__name__)

ON_UNSUPPORTED_CHOICES = ChoiceEnum(["raise", "fallback"])
COMPILE_CHOICES = ChoiceEnum(["auto", "true", "false"])


@dataclass
class BaguaFusedOptions(FairseqDataclass):
    """The command-line options of ``bagua_fused`` (the base optimizer's flags come on top)."""

    bagua_base_optimizer: str = field(
        default=_cli.DEFAULT_BASE,
        metadata={
            "help": "registered fairseq optimizer to fuse (adam, sgd, nag, adagrad, adamax, adadelta, "
            "adafactor, ...); its own flags (--adam-betas, --momentum, --weight-decay, ...) apply"
        },
    )
    bagua_on_unsupported: ON_UNSUPPORTED_CHOICES = field(
        default="fallback",
        metadata={
            "help": "a base whose update cannot be fused exactly (adafactor): 'fallback' to its exact "
            "unfused step with one warning, or 'raise' an error"
        },
    )
    bagua_compile: COMPILE_CHOICES = field(
        default="auto",
        metadata={
            "help": "run the fused update as compiled kernels (torch.compile/Inductor): 'auto' when the "
            "model has >= 2**20 parameters and a compiler works, 'true' always, 'false' eager"
        },
    )
    bagua_algorithm: Optional[str] = field(
        default=None,
        metadata={
            "help": "Bagua communication algorithm for multi-process training (needs "
            "--ddp-backend legacy_ddp): " + ", ".join(_algorithms.ALGORITHMS)
        },
    )
    bagua_autotune: bool = field(
        default=False,
        metadata={
            "help": "tune the algorithm's communication settings while training (Bagua's autotuner, Optuna "
            "TPE): the gradient bucket size, or decentralized's communication interval"
        },
    )
    bagua_autotune_trials: int = field(default=20, metadata={"help": "--bagua-autotune: settings tried"})
    bagua_autotune_interval: int = field(
        default=20, metadata={"help": "--bagua-autotune: updates measured per setting"}
    )


@dataclass
class BaguaFusedConfig(_algorithms.AlgorithmOptions, BaguaFusedOptions):
    bagua_base_args: Optional[str] = field(
        default=None,
        metadata={
            "help": "JSON object of the base optimizer's options (filled from its own flags on the "
            "command line; set it yourself in hydra configs)"
        },
    )
    lr: List[float] = II("optimization.lr")


def _root_of(cfg) -> Optional[DictConfig]:
    return config_parent(cfg)


def _flat_sections(root: Optional[DictConfig]) -> Dict[str, Any]:
    """The ``common`` and ``optimization`` options, flat, for legacy (namespace) optimizers."""
    out: Dict[str, Any] = {}
    if root is None:
        return out
    for section in ("common", "optimization"):
        node = root.get(section)
        if isinstance(node, DictConfig):
            for key, value in OmegaConf.to_container(node, resolve=True).items():
                out.setdefault(key, value)
    return out


def _has_master_weights(root: Optional[DictConfig]) -> bool:
    """Whether fairseq steps fp32 copies of the model's weights (``--fp16``/``--bf16`` without
    ``--memory-efficient-*``): the optimizer's parameters are then not the model's."""
    common = root.get("common") if root is not None else None
    if common is None:
        return False
    half = common.get("fp16") or common.get("bf16")
    memory_efficient = common.get("memory_efficient_fp16") or common.get("memory_efficient_bf16")
    return bool(half) and not memory_efficient


def build_base_optimizer(cfg, params) -> FairseqOptimizer:
    """Build ``cfg.bagua_base_optimizer`` the way ``--optimizer <base>`` would."""
    base = _cli.check_base(cfg.bagua_base_optimizer)
    raw = cfg.get("bagua_base_args") if isinstance(cfg, DictConfig) else getattr(cfg, "bagua_base_args", None)
    try:
        values = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"bagua_base_args must be a JSON object, got {raw!r} ({exc})") from None
    if not isinstance(values, dict):
        raise ValueError(f"bagua_base_args must be a JSON object, got {raw!r}")
    known = _cli.base_option_names(base) or []
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"bagua_base_args has option(s) {unknown} that --bagua-base-optimizer {base} does not take "
            f"(its options: {sorted(known)})"
        )
    lr = cfg.lr
    lr = list(lr) if not isinstance(lr, (int, float)) else [lr]
    root = _root_of(cfg)
    if base in OPTIMIZER_DATACLASS_REGISTRY:
        node = dict(values, _name=base)
        if "lr" in known:
            node["lr"] = lr
        base_cfg = OmegaConf.create(node, parent=root)
    else:
        base_cfg = argparse.Namespace(**_flat_sections(root))
        for key, value in values.items():
            setattr(base_cfg, key, value)
        base_cfg.lr = lr
        base_cfg.optimizer = base
        set_legacy_defaults(base_cfg, OPTIMIZER_REGISTRY[base])
    return build_registered_optimizer(base_cfg, params)


@register_optimizer("bagua_fused", dataclass=BaguaFusedConfig)
class BaguaFusedOptimizer(FairseqOptimizer):
    """A registered fairseq optimizer (``--bagua-base-optimizer``) whose torch optimizer is fused."""

    def __init__(self, cfg: BaguaFusedConfig, params):
        super().__init__(cfg)
        params = list(params)
        self.base_name = _cli.check_base(cfg.bagua_base_optimizer)
        prepared = _algorithms.prepare(cfg, root=_root_of(cfg))  # option errors before any fusing
        self.base_optimizer = build_base_optimizer(cfg, params)
        torch_optimizer = self.base_optimizer.optimizer
        on_unsupported = str(cfg.bagua_on_unsupported)
        try:
            compile_mode = {"auto": "auto", "true": True, "false": False}[str(cfg.bagua_compile)]
            fuse_optimizer(torch_optimizer, replace_step=True, on_unsupported=on_unsupported, compile=compile_mode)
        except NotElementwiseError as exc:
            # The core's advice names its Python arguments; give the command-line flags instead.
            detail = str(exc).split(" Use fuse_optimizer(")[0]
            raise NotElementwiseError(
                f"--optimizer bagua_fused cannot fuse --bagua-base-optimizer {self.base_name}: {detail} "
                f"Use --bagua-on-unsupported fallback (the default) to keep {self.base_name}'s exact unfused "
                f"step, or choose an elementwise base such as adam, sgd or nag."
            ) from None
        self._optimizer = torch_optimizer
        self._logged_first_step = False
        # parameters whose exchange all_reduce_grads left to clip_grad_norm / step (None: none pending)
        self._deferred_reduce: Optional[list] = None
        self.algorithm = _algorithms.attach(prepared, torch_optimizer, list(self.params))
        if getattr(cfg, "bagua_autotune", False):
            if self.algorithm is None:
                raise ValueError("--bagua-autotune tunes a Bagua algorithm: add --bagua-algorithm NAME")
            self.algorithm.enable_autotune(max_trials=cfg.bagua_autotune_trials, interval=cfg.bagua_autotune_interval)
        # Under model algorithms each rank's weights and optimizer state are its own, but fairseq
        # writes rank 0's checkpoint only: right before each save every rank's state goes to rank 0.
        self._params_are_weights = not _has_master_weights(_root_of(cfg))
        self._gathered = None  # (update, every rank's state) for the checkpoint being written
        if self.algorithm is not None and self.algorithm.replicas_differ:
            call_before_each_save(torch_optimizer, self._gather_rank_states)
        report = fusion_report(torch_optimizer)
        logger.info(
            f"bagua_fused: {self.base_name} ({type(torch_optimizer).__name__}) fused {report.fused_params} "
            f"parameter(s) into {report.flat_buffers} flat buffer(s); {report.unfused_params} unfused"
            + (f"; algorithm {cfg.bagua_algorithm}" if self.algorithm is not None else "")
        )
        if report.reasons:
            reasons = sorted(set(report.reasons.values()))
            logger.warning(f"bagua_fused: {len(report.reasons)} parameter(s) stay unfused: {'; '.join(reasons)}")

    @classmethod
    def add_args(cls, parser):
        gen_parser_from_dataclass(parser, BaguaFusedOptions())
        _algorithms.add_args(parser)
        _cli.install_base_flags(parser)

    # ------------------------------------------------------------------ the torch optimizer
    @property
    def optimizer(self):
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer):
        if not is_fused_optimizer(optimizer):
            raise ValueError(
                f"--optimizer bagua_fused cannot hand its parameters to an unfused "
                f"{type(optimizer).__name__} (e.g. --zero-sharding os); drop that option or use "
                f"--optimizer {self.base_name}"
            )
        self._optimizer = optimizer
        self.base_optimizer.optimizer = optimizer

    def fusion_report(self):
        """:class:`bagua_integrations.FusionReport` of the fused base optimizer."""
        return fusion_report(self._optimizer)

    # ------------------------------------------------------------------ forwarded to the base
    @property
    def optimizer_config(self):
        return self.base_optimizer.optimizer_config

    def get_lr(self):
        return self.base_optimizer.get_lr()

    def set_lr(self, lr):
        self.base_optimizer.set_lr(lr)

    def state_dict(self):
        state = self.base_optimizer.state_dict()
        state["bagua_base_optimizer"] = self.base_name
        if self.algorithm is not None:
            state["bagua_algorithm"] = self.algorithm.state_dict()
            gathered, self._gathered = self._gathered, None
            if gathered is not None and gathered[0] == self.algorithm.num_updates:
                state["bagua_ranks"] = gathered[1]
        return state

    def _gather_rank_states(self):
        """fairseq is about to save (every rank runs this): collect each rank's own state on rank 0."""
        self._gathered = None
        if sys.exc_info()[0] is not None:  # fairseq's crash path: one rank, its peers are elsewhere
            logger.warning(
                f"bagua_fused: a checkpoint written while handling an error holds rank 0's state only; "
                f"under {self.algorithm.name} resuming from it is refused"
            )
            return
        params = list(self.params) if self._params_are_weights else None
        states = self.algorithm.gather_rank_state_dicts(params=params)
        if states is not None:
            # rank 0's optimizer state and weights are the checkpoint's own ("model", the state above)
            states[0] = {"algorithm": states[0]["algorithm"]}
            self._gathered = (self.algorithm.num_updates, states)

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        state_dict = dict(state_dict)
        saved_base = state_dict.pop("bagua_base_optimizer", self.base_name)
        if saved_base != self.base_name:
            raise ValueError(
                f"this checkpoint's optimizer state is from --bagua-base-optimizer {saved_base}, not "
                f"{self.base_name}; resume with the same base or pass --reset-optimizer"
            )
        algorithm_state = state_dict.pop("bagua_algorithm", None)
        ranks = state_dict.pop("bagua_ranks", None)
        if self.algorithm is not None and ranks is not None:
            self._load_own_rank_state(state_dict, ranks, optimizer_overrides)
            return
        if self.algorithm is not None and algorithm_state is not None:
            # one rank's state loaded on every rank: refused (CheckpointError, on every rank) where
            # the algorithm lets ranks' weights or optimizer state differ
            self.algorithm.check_resume(algorithm_state, shared=True, optimizer_state=state_dict)
        self.base_optimizer.load_state_dict(state_dict, optimizer_overrides)
        if self.algorithm is not None and algorithm_state is not None:
            self.algorithm.load_state_dict(algorithm_state, shared=True, optimizer_state=state_dict)

    def _load_own_rank_state(self, state_dict, ranks, optimizer_overrides):
        """Resume this rank from its own entry of a checkpoint that holds every rank's state."""
        rank = comm.rank(self.algorithm.group) if self.algorithm.distributed else 0
        own = ranks[rank] if rank < len(ranks) else ranks[0]
        self.algorithm.check_resume(own["algorithm"])  # the same world size, this rank's entry
        if rank != 0:
            if own["algorithm"].get("weights_differ") and own.get("params") is None:
                raise CheckpointError(
                    f"this checkpoint lacks rank {rank}'s weights: it was trained with fp32 master weights "
                    f"(--fp16/--bf16), whose per-rank values fairseq's model cannot take back under "
                    f"{self.algorithm.name}; train with --memory-efficient-fp16 (or fp32) to resume per "
                    "rank, or resume with --reset-optimizer knowing the run restarts from rank 0's state"
                )
            if own.get("optimizer") is not None:
                state_dict.update(own["optimizer"])
        self.base_optimizer.load_state_dict(state_dict, optimizer_overrides)
        params = list(self.params) if own.get("params") is not None else None
        self.algorithm.load_rank_state_dict({"algorithm": own["algorithm"], "params": own.get("params")}, params=params)

    def backward(self, loss):
        self.base_optimizer.backward(loss)

    def multiply_grads(self, c):
        self.base_optimizer.multiply_grads(c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        self._reduce_deferred()
        norm = self.base_optimizer.clip_grad_norm(max_norm, aggregate_norm_fn)
        if self.algorithm is not None:
            # model algorithms: each rank clips by its own norm; report the ranks' mean so that
            # fairseq's cross-rank gradient check (on GPUs) and the logged gnorm agree
            norm = self.algorithm.aggregate_norm(norm)
        return norm

    def zero_grad(self):
        self.base_optimizer.zero_grad()

    def average_params(self):
        self.base_optimizer.average_params()

    def broadcast_global_state_dict(self, state_dict):
        return self.base_optimizer.broadcast_global_state_dict(state_dict)

    # ------------------------------------------------------------------ stepping
    def step(self, closure=None, scale=1.0, groups=None):
        """One fused step of the base optimizer (then the model algorithm, if any)."""
        if groups is not None:
            raise ValueError("--optimizer bagua_fused does not support stepping selected param groups")
        if scale != 1.0:
            self.multiply_grads(1.0 / scale)
        self._reduce_deferred()
        self._optimizer.step(closure)
        if self.algorithm is not None:
            self.algorithm.after_update()
        if not self._logged_first_step:
            self._logged_first_step = True
            report = fusion_report(self._optimizer)
            logger.info(
                f"bagua_fused: first step updated {report.fused_params} parameter(s) through "
                f"{report.flat_runs} flat run(s); {report.unfused_params} unfused"
            )

    def all_reduce_grads(self, module):
        """Gradient communication: the Bagua algorithm's, or the module's own (legacy DDP).

        fairseq normalizes gradients (``multiply_grads``: sample size, loss scale) only after
        this call. An algorithm that mixes gradients with optimizer state before communicating
        (qadam's momentum) needs them normalized, so its communication waits for the first of
        ``clip_grad_norm`` / ``step`` (fp32 training only: fairseq's fp16/bf16/amp optimizers
        normalize even later, and are refused for such algorithms in ``check_setup``).
        """
        if self.algorithm is None:
            self.base_optimizer.all_reduce_grads(module)
        elif getattr(self.algorithm.algorithm, "needs_unscaled_gradients", False):
            # fairseq calls this for the model and then for a criterion with parameters: both wait
            pending = self._deferred_reduce or []
            self._deferred_reduce = pending + _algorithms.gradient_params(self.algorithm, module)  # MoE experts stay local
        else:  # a no-op for model algorithms, which keep gradients local
            self.algorithm.allreduce_gradients(_algorithms.gradient_params(self.algorithm, module))

    def _reduce_deferred(self):
        if self._deferred_reduce is not None:
            params, self._deferred_reduce = self._deferred_reduce, None
            self.algorithm.allreduce_gradients(params)

    # Flags: fused steps take no ``scale``/``groups``; the rest is whatever the base supports.
    @property
    def supports_step_with_scale(self):
        return False

    @property
    def supports_groups(self):
        return False

    @property
    def supports_memory_efficient_fp16(self):
        return self.base_optimizer.supports_memory_efficient_fp16

    @property
    def supports_flat_params(self):
        return self.base_optimizer.supports_flat_params
