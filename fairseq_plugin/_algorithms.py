"""``--bagua-algorithm``: the adapter between ``bagua_fused`` and ``bagua_integrations.distributed``.

fairseq's extension points, and what runs there:

* ``FairseqOptimizer.all_reduce_grads(module)`` (called once per update, after the backward
  passes of all ``--update-freq`` micro-batches): a *gradient* algorithm averages the module's
  gradients with ``allreduce_parameter_gradients``. With ``--ddp-backend legacy_ddp`` (or ``no_c10d``)
  fairseq's wrapper communicates nothing by itself, so this is the only gradient exchange.
* right after the optimizer step: a *model* algorithm gets the parameters and the update
  number (``after_step``) and averages weights with its peers (decentralized) or runs a
  block sync (bmuf). Gradients stay local.

Everything that touches the distributed core goes through this module.
"""

import inspect
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

import torch

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass

logger = logging.getLogger(__name__)

# The built-in names (the parser and the help text list whatever the core registers).
ALGORITHMS = ("gradient_allreduce", "bytegrad", "decentralized", "bmuf")
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


OPTION_NAMES = [f.name for f in fields(AlgorithmOptions) if f.name.startswith("bagua_")]


def _core():
    try:
        from bagua_integrations import distributed
    except ImportError as exc:  # pragma: no cover - the core ships with this package
        raise ImportError(
            f"--bagua-algorithm needs bagua_integrations.distributed, which cannot be imported ({exc})"
        ) from exc
    return distributed


def choices() -> List[str]:
    try:
        return list(_core().list_algorithms())
    except ImportError:
        return list(ALGORITHMS)


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
    try:
        accepted = set(inspect.signature(type(_core().get_algorithm(name))).parameters)
    except (TypeError, ValueError):
        accepted = None  # a factory we cannot inspect: let get_algorithm judge the arguments
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
    from ._cli import invalid_choice_message

    names = choices()
    if name not in names:
        raise ValueError(invalid_choice_message("--bagua-algorithm", name, names))
    return name


def _unwrap(module):
    seen = 0
    while module is not None and seen < 8:
        yield module
        module = getattr(module, "module", None)
        seen += 1


def _ddp_class_in(module) -> Optional[str]:
    for inner in _unwrap(module):
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            return type(inner).__name__
    return None


class AlgorithmRunner:
    """One Bagua algorithm driven from fairseq's optimizer hooks."""

    def __init__(self, name: str, algorithm, group, torch_optimizer, params: List[torch.Tensor]):
        self.name = name
        self.algorithm = algorithm
        self.kind = algorithm.kind
        self.group = group
        self.num_updates = 0
        # on every rank at the same point (hierarchical node groups are created here), before the
        # first step (bmuf records the starting weights and optimizer state)
        algorithm.attach(params, optimizer=torch_optimizer, group=group)

    # gradient algorithms -------------------------------------------------------------
    def all_reduce_grads(self, module) -> None:
        if self.kind != "gradient":
            return  # model algorithms keep gradients local
        wrapper = _ddp_class_in(module)
        if wrapper is not None:
            raise RuntimeError(
                f"--bagua-algorithm {self.name} found the model wrapped in {wrapper}, which already "
                f"averages gradients; train with --ddp-backend legacy_ddp"
            )
        # fairseq's legacy DDP semantics: unused parameters contribute zero gradients (so ranks
        # always send the same tensors), expert parameters stay local
        params = [p for p in module.parameters() if not hasattr(p, "expert")]
        self.algorithm.allreduce_parameter_gradients(params, group=self.group)

    # model algorithms ----------------------------------------------------------------
    def after_step(self, params: List[torch.Tensor]) -> None:
        self.num_updates += 1
        if self.kind == "model":
            self.algorithm.after_step(params, self.num_updates, group=self.group)

    def aggregate_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """Mean of the ranks' local gradient norms (model algorithms: gradients differ per rank)."""
        if self.kind != "model" or not _is_distributed(self.group):
            return norm
        import torch.distributed as dist

        buffer = norm.detach().to(torch.float64).reshape(1).clone()
        dist.all_reduce(buffer, group=self.group)
        return (buffer / dist.get_world_size(self.group)).to(norm.dtype).reshape(norm.shape)

    # checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"name": self.name, "num_updates": self.num_updates}
        if hasattr(self.algorithm, "state_dict"):
            state["algorithm"] = self.algorithm.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("name") != self.name:
            logger.warning(
                f"bagua_fused: the checkpoint was trained with --bagua-algorithm {state.get('name')}, "
                f"now {self.name}; its algorithm state is not restored"
            )
            return
        self.num_updates = int(state.get("num_updates", 0))
        if self.kind == "model" and hasattr(self.algorithm, "num_updates"):
            self.algorithm.num_updates = self.num_updates
        if "algorithm" in state and hasattr(self.algorithm, "load_state_dict"):
            self.algorithm.load_state_dict(state["algorithm"])


def _is_distributed(group) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _data_parallel_group():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from fairseq.distributed import utils as distributed_utils

    return distributed_utils.get_data_parallel_group()


def check_setup(name: str, root) -> None:
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
    check_setup(name, root)
    return name, _core().get_algorithm(name, **algorithm_kwargs(cfg, name))


def attach(prepared, torch_optimizer, params: List[torch.Tensor]) -> Optional[AlgorithmRunner]:
    """Bind the algorithm :func:`prepare` returned to the (fused) optimizer and its parameters."""
    if prepared is None:
        return None
    name, algorithm = prepared
    group = _data_parallel_group()
    if not _is_distributed(group):
        logger.warning(f"bagua_fused: --bagua-algorithm {name} has nothing to do in a single process")
    return AlgorithmRunner(name, algorithm, group, torch_optimizer, params)
