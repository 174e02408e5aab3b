"""The table's rows: which optimizer, fused or not, and who clips and schedules.

Every row runs the same model, data and seed; two things differ between row families:

* **BertAdam with its defaults** (``bertadam``, ``bertadam-fused-eager``, ``bertadam-fused-compiled``;
  the default table, as Bagua's benchmark ran it): ``BertAdam(groups, lr=lr, warmup=warmup_ratio,
  t_total=updates)`` -- the construction of the original BERT fine-tuning scripts that Bagua's
  ``BertAdam(parameters, ...)`` comes from. Its own defaults stay on: ``max_grad_norm=1.0`` clips
  **each parameter's** gradient to norm 1.0, and ``schedule="warmup_linear"`` warms the learning rate
  up over ``warmup`` of ``t_total`` updates, then decays it linearly, counted by BertAdam's own
  per-parameter ``step``. So the front end must neither clip nor schedule, or the update would be
  clipped and scheduled twice: HF Trainer runs with ``max_grad_norm=0`` and
  ``lr_scheduler_type="constant"`` (no warmup), fairseq with ``--clip-norm 0`` and
  ``--lr-scheduler fixed``. (Both front ends still *measure* the global gradient norm for their logs,
  without scaling anything.) Fused, per-parameter clipping takes ``fuse_optimizer``'s exact
  *segmented* path (one norm per parameter over the flat buffer). The ``-compiled`` row asks for
  ``compile=True``; whether the segmented step really compiled is up to ``fuse_optimizer``, so the
  table says what actually ran (``fusion_report(...).group_paths`` and ``.compiled``).
* **The front end clips and schedules** (``bertadam-globalclip*``, the ``adamw-*`` rows): the front end
  clips the global gradient norm to ``max_grad_norm`` (1.0) and schedules the learning rate (linear
  warmup over ``warmup_ratio`` of the updates, then linear decay), as HF Trainer and fairseq do by
  default. BertAdam then runs with ``max_grad_norm=-1`` and ``t_total=-1`` (elementwise, constant
  ``lr`` set by the front end), so its fused step is elementwise and can compile to one kernel per
  flat buffer. These were the recipe's BertAdam rows before the Bagua-default rows replaced them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

__all__ = ["Row", "ROWS", "DEFAULT_ROWS", "parse_rows", "BASELINE", "GLOBALCLIP_BASELINE"]


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    optimizer: str  # "bertadam", "adamw" or "qadam"
    fuse: Optional[str] = None  # None (not fused), "eager" or "compiled": bagua_integrations.fuse_optimizer
    impl: Optional[str] = None  # torch AdamW: "foreach", "fused" or "single"
    # BertAdam keeps its defaults (per-parameter clipping to 1.0, its own warmup/t_total schedule) and the
    # front end neither clips nor schedules (Bagua's rows); False: the front end clips globally and schedules.
    bertadam_defaults: bool = False

    def __post_init__(self):
        if self.bertadam_defaults and self.optimizer != "bertadam":
            raise ValueError(f"row {self.key!r}: bertadam_defaults is a BertAdam setting")

    @property
    def compile(self):
        """``fuse_optimizer``'s ``compile=`` for this row (None: not fused)."""
        return None if self.fuse is None else self.fuse == "compiled"

    @property
    def frontend_clips_and_schedules(self) -> bool:
        """The front end clips the global gradient norm and schedules the learning rate."""
        return not self.bertadam_defaults

    @property
    def baseline(self) -> str:
        """The row its speedup is measured against (when that row ran in the same front end)."""
        if self.optimizer == "bertadam" and not self.bertadam_defaults:
            return GLOBALCLIP_BASELINE
        return BASELINE

    @property
    def frontend_clips(self) -> bool:
        """The front end clips the global gradient norm (not under QAdam: after its warm-up the
        ``qadam`` algorithm hands the optimizer averaged momentum where gradients were)."""
        return self.frontend_clips_and_schedules and self.optimizer != "qadam"

    def clipping(self, max_grad_norm: float) -> str:
        """Who clips what, for the table and the JSON."""
        if self.bertadam_defaults:
            return "per-parameter 1.0 (BertAdam max_grad_norm default)"
        if not self.frontend_clips:
            return "none"
        return f"global {float(max_grad_norm)} (front end)"

    def schedule(self, warmup_ratio: float, total_updates: int) -> str:
        if self.bertadam_defaults:
            return f"BertAdam warmup_linear (warmup {warmup_ratio:g}, t_total {total_updates})"
        return f"front end: linear warmup {int(warmup_ratio * total_updates)} updates, linear decay"


BASELINE = "bertadam"
GLOBALCLIP_BASELINE = "bertadam-globalclip"

ROWS: Dict[str, Row] = {
    row.key: row
    for row in (
        # Bagua's experiment: BertAdam with its defaults, without / with the fused optimizer
        Row("bertadam", "BertAdam per-tensor (Bagua's baseline, unfused)", "bertadam", bertadam_defaults=True),
        Row("bertadam-fused-eager", "BertAdam fused, eager", "bertadam", fuse="eager", bertadam_defaults=True),
        Row("bertadam-fused-compiled", "BertAdam fused, compile=True", "bertadam", fuse="compiled",
            bertadam_defaults=True),
        Row("adamw-foreach", "torch AdamW foreach=True", "adamw", impl="foreach"),
        Row("adamw-fused", "torch AdamW fused=True", "adamw", impl="fused"),
        # not in the default table: BertAdam without its clipping and schedule (the front end's instead)
        Row("bertadam-globalclip", "BertAdam per-tensor, front-end clip+schedule", "bertadam"),
        Row("bertadam-globalclip-fused-eager", "BertAdam fused, eager, front-end clip+schedule", "bertadam",
            fuse="eager"),
        Row("bertadam-globalclip-fused-compiled", "BertAdam fused, compiled, front-end clip+schedule", "bertadam",
            fuse="compiled"),
        Row("adamw-single", "torch AdamW foreach=False (per tensor)", "adamw", impl="single"),
        Row("adamw-fused-compiled", "torch AdamW fused by bagua, compiled", "adamw", fuse="compiled", impl="single"),
        # the optimizer half of --bagua-algorithm qadam (warm-up: the front end's warmup updates, at least 1)
        Row("qadam-fused-eager", "QAdam fused, eager (no clipping)", "qadam", fuse="eager"),
    )
}

DEFAULT_ROWS: Tuple[str, ...] = (
    "bertadam",
    "bertadam-fused-eager",
    "bertadam-fused-compiled",
    "adamw-foreach",
    "adamw-fused",
)


def parse_rows(spec: Optional[str]) -> List[Row]:
    """``"bertadam,adamw-fused"`` -> rows, in that order. ``"all"``: every row; ``"default"`` (or None, or
    an empty string) stands for the default rows and can be combined: ``"default,bertadam-globalclip"``."""
    if spec is None or spec.strip() == "":
        keys = list(DEFAULT_ROWS)
    elif spec.strip() == "all":
        keys = list(ROWS)
    else:
        keys = []
        for key in (k.strip() for k in spec.split(",") if k.strip()):
            keys += list(DEFAULT_ROWS) if key == "default" else [key]
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        raise ValueError(f"unknown row(s) {unknown}; choose from {list(ROWS)}, 'default' or 'all'")
    if len(set(keys)) != len(keys):
        raise ValueError(f"a row is listed twice: {keys}")
    return [ROWS[k] for k in keys]
