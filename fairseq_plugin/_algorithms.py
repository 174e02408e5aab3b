"""``--bagua-algorithm``: the adapter between ``bagua_fused`` and ``bagua_integrations.distributed``.

fairseq's extension points, and what runs there:

* ``FairseqOptimizer.all_reduce_grads(module)`` (called once per update, after the backward
  passes of all ``--update-freq`` micro-batches): a *gradient* algorithm averages the module's
  gradients with ``allreduce_parameter_gradients``. With ``--ddp-backend legacy_ddp`` (or ``no_c10d``)
  fairseq's wrapper communicates nothing by itself, so this is the only gradient exchange.
* right after the optimizer step: a *model* algorithm averages weights with its peers
  (decentralized) or runs a block sync (bmuf). Gradients stay local.

The algorithm is driven by the core's :class:`AlgorithmSession` (attach, the cross-rank
consistency check, update counting, checkpoints); this module only reads fairseq's flags and
finds fairseq's data-parallel group.
"""

import logging
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

import torch

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass

from bagua_integrations.distributed import AlgorithmSession, comm, get_algorithm, list_algorithms
from bagua_integrations.distributed.algorithms.registry import algorithm_parameters, canonical_name

logger = logging.getLogger(__name__)

# The built-in names (the parser and the help text list whatever the core registers).
ALGORITHMS = ("gradient_allreduce", "bytegrad", "qadam", "decentralized", "low_precision_decentralized", "bmuf", "async")
# ddp backends whose wrapper leaves gradient communication to FairseqOptimizer.all_reduce_grads
MANUAL_DDP_BACKENDS = ("legacy_ddp", "no_c10d")

BOOL_CHOICES = ChoiceEnum(["true", "false"])
PEER_CHOICES = ChoiceEnum(["all", "shift_one"])


@dataclass
class AlgorithmOptions(FairseqDataclass):
    """Hyper-parameters of the Bagua algorithms; unset (None) means the algorithm's default.

    Each ``bagua_<name>`` field is the algorithm's keyword argument ``<name>``.
    """

    bagua_hierarchical: Optional[BOOL_CHOICES] = field(
        default=None,
        metadata={
            "help": "reduce inside each node first, then among node leaders (default: false for "
            "gradient_allreduce and bmuf, true for bytegrad and decentralized; flat on one node)"
        },
    )
    bagua_message_size: Optional[int] = field(
        default=None, metadata={"help": "gradient algorithms: bytes per communication bucket (default 10000000)"}
    )
    bagua_timeout: Optional[float] = field(
        default=None,
        metadata={"help": "seconds to wait for one communication before failing with an error (default: no limit)"},
    )
    bagua_peer_selection_mode: Optional[PEER_CHOICES] = field(
        default=None,
        metadata={
            "help": "decentralized: average weights with 'all' ranks, or with one partner per round "
            "('shift_one', even world size) (default all)"
        },
    )
    bagua_communication_interval: Optional[int] = field(
        default=None, metadata={"help": "decentralized: average weights every N updates (default 1)"}
    )
    bagua_block_lr: Optional[float] = field(default=None, metadata={"help": "bmuf: block learning rate (default 1.0)"})
    bagua_block_momentum: Optional[float] = field(
        default=None, metadata={"help": "bmuf: block momentum (default 0.875)"}
    )
    bagua_global_sync_iter: Optional[int] = field(
        default=None, metadata={"help": "bmuf: block sync every N updates (default 50)"}
    )
    bagua_warmup_iterations: Optional[int] = field(
        default=None,
        metadata={"help": "bmuf: broadcast rank 0's model and reset the optimizer after N updates (default 500)"},
    )
    bagua_use_nbm: Optional[bool] = field(
        default=None, metadata={"help": "bmuf: Nesterov block momentum (default off)"}
    )
    bagua_average_sync: Optional[bool] = field(
        default=None, metadata={"help": "bmuf: also average the optimizer state at each sync (default off)"}
    )
    bagua_sync_interval_ms: Optional[int] = field(
        default=None, metadata={"help": "async: start a background averaging round every N ms (default 500)"}
    )
    bagua_warmup_steps: Optional[int] = field(
        default=None, metadata={"help": "async: updates averaged synchronously before the background rounds (default 0)"}
    )


OPTION_NAMES = [f.name for f in fields(AlgorithmOptions) if f.name.startswith("bagua_")]


def choices() -> List[str]:
    return list_algorithms()


def add_args(parser) -> None:
    gen_parser_from_dataclass(parser, AlgorithmOptions())


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value(cfg, name: str):
    value = cfg.get(name) if hasattr(cfg, "get") else getattr(cfg, name, None)
    if value is None:
        return None
    value = str(value) if not isinstance(value, (bool, int, float)) else value
    if name == "bagua_hierarchical":
        return value == "true" if isinstance(value, str) else bool(value)
    return value


def algorithm_kwargs(cfg, name: str) -> Dict[str, Any]:
    """The keyword arguments for algorithm ``name`` from the ``--bagua-*`` options that are set."""
    accepted = algorithm_parameters(name)  # None: a factory we cannot inspect, get_algorithm judges
    kwargs: Dict[str, Any] = {}
    rejected = []
    for option in OPTION_NAMES:
        value = _value(cfg, option)
        if value is None:
            continue
        key = option[len("bagua_"):]
        if accepted is not None and key not in accepted:
            rejected.append(_flag(option))
            continue
        kwargs[key] = value
    if rejected:
        takes = sorted(_flag("bagua_" + p) for p in (accepted or ()) if "bagua_" + p in OPTION_NAMES)
        raise ValueError(
            f"--bagua-algorithm {name} does not take {', '.join(rejected)}; its options are: "
            f"{', '.join(takes) if takes else '(none)'}"
        )
    return kwargs


def check_name(name) -> str:
    """The registered name for ``--bagua-algorithm NAME`` (Bagua's ``GradientAllReduce``-style names too)."""
    from ._cli import invalid_choice_message

    names = choices()
    canonical = canonical_name(name)
    if canonical not in names:
        raise ValueError(invalid_choice_message("--bagua-algorithm", name, names))
    return canonical


def _ddp_class_in(module) -> Optional[str]:
    for _ in range(8):  # fairseq's wrappers keep the model as .module
        if module is None or isinstance(module, torch.nn.parallel.DistributedDataParallel):
            return None if module is None else type(module).__name__
        module = getattr(module, "module", None)
    return None


def _data_parallel_group():
    if not comm.is_distributed():
        return None
    from fairseq.distributed import utils as distributed_utils

    return distributed_utils.get_data_parallel_group()


def check_setup(name: str, root, algorithm=None) -> None:
    """Refuse fairseq settings under which the algorithm would communicate twice or not at all."""
    if root is None:
        return
    training = root.get("distributed_training")
    optimization = root.get("optimization")
    if optimization is not None and optimization.get("use_bmuf"):
        raise ValueError(
            f"--bagua-algorithm {name} cannot be combined with fairseq's --use-bmuf; use "
            f"--bagua-algorithm bmuf (with --bagua-global-sync-iter, ...) or drop --bagua-algorithm"
        )
    if getattr(algorithm, "needs_unscaled_gradients", False) and optimization is not None:
        if (optimization.get("clip_norm") or 0) > 0:
            raise ValueError(
                f"--bagua-algorithm {name} communicates momentum in place of gradients after its warm-up, so "
                f"--clip-norm would clip the momentum; train with --clip-norm 0"
            )
    common = root.get("common")
    half = [f"--{flag.replace('_', '-')}" for flag in ("fp16", "bf16", "amp", "memory_efficient_fp16", "memory_efficient_bf16")
            if common is not None and common.get(flag)]
    if getattr(algorithm, "needs_unscaled_gradients", False) and half:
        raise ValueError(
            f"--bagua-algorithm {name} folds each gradient into the optimizer's momentum before communicating, "
            f"and with {' '.join(half)} fairseq normalizes the gradients (sample size; loss scale under fp16) only "
            f"after that, and decides overflow per rank: train in fp32 (drop {' '.join(half)})"
        )
    if training is None:
        return
    world = training.get("distributed_world_size") or 1
    backend = str(training.get("ddp_backend"))
    if world > 1 and backend not in MANUAL_DDP_BACKENDS:
        raise ValueError(
            f"--bagua-algorithm {name} communicates through FairseqOptimizer.all_reduce_grads and needs "
            f"--ddp-backend legacy_ddp (or no_c10d); with --ddp-backend {backend} fairseq's wrapper "
            f"would also average the gradients"
        )


def prepare(cfg, root=None):
    """``(name, algorithm)`` for ``cfg.bagua_algorithm``, or None; checks every option first,
    so a bad setting fails before anything (the fusion, the communication) has started."""
    name = cfg.get("bagua_algorithm") if hasattr(cfg, "get") else getattr(cfg, "bagua_algorithm", None)
    if not name:
        unused = [_flag(o) for o in OPTION_NAMES if _value(cfg, o) is not None]
        if unused:
            raise ValueError(f"{', '.join(unused)} only apply with --bagua-algorithm (choose from {', '.join(choices())})")
        return None
    name = check_name(str(name))
    algorithm = get_algorithm(name, **algorithm_kwargs(cfg, name))
    check_setup(name, root, algorithm)
    return name, algorithm


def attach(prepared, torch_optimizer, params: List[torch.Tensor]) -> Optional[AlgorithmSession]:
    """Start the algorithm :func:`prepare` returned on the (fused) optimizer's parameters.

    Runs on every rank when fairseq builds the optimizer, before the first update; ranks whose
    model, optimizer or algorithm options differ stop with ``ModelMismatchError``.
    """
    if prepared is None:
        return None
    name, algorithm = prepared
    group = _data_parallel_group()
    if not comm.is_distributed(group):
        logger.warning(f"bagua_fused: --bagua-algorithm {name} has nothing to do in a single process")
    return AlgorithmSession(algorithm, optimizer=torch_optimizer, params=params, group=group)


def gradient_params(session: AlgorithmSession, module) -> List[torch.Tensor]:
    """What ``all_reduce_grads(module)`` averages: every parameter but MoE experts' (which stay local).

    Refuses a model inside torch's DDP, which would average the gradients a second time.
    """
    wrapper = _ddp_class_in(module)
    if wrapper is not None:
        raise RuntimeError(
            f"--bagua-algorithm {session.name} found the model wrapped in {wrapper}, which already "
            f"averages gradients; train with --ddp-backend legacy_ddp"
        )
    return [p for p in module.parameters() if not hasattr(p, "expert")]
