"""The table's rows: which optimizer, fused or not, and how each front end builds it.

Every row runs the same model, data, seed, schedule (linear warmup then linear decay, from the
front end's scheduler) and global gradient clipping; only the optimizer differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

__all__ = ["Row", "ROWS", "DEFAULT_ROWS", "parse_rows", "BASELINE"]


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    optimizer: str  # "bertadam" or "adamw"
    fuse: Optional[str] = None  # None (not fused), "eager" or "compiled": bagua_integrations.fuse_optimizer
    impl: Optional[str] = None  # torch AdamW: "foreach", "fused" or "single"

    @property
    def compile(self):
        """``fuse_optimizer``'s ``compile=`` for this row (None: not fused)."""
        return None if self.fuse is None else self.fuse == "compiled"


BASELINE = "bertadam"

ROWS: Dict[str, Row] = {
    row.key: row
    for row in (
        Row("bertadam", "BertAdam per-tensor (seed baseline, unfused)", "bertadam"),
        Row("bertadam-fused-eager", "BertAdam fused, eager", "bertadam", fuse="eager"),
        Row("bertadam-fused-compiled", "BertAdam fused, compiled", "bertadam", fuse="compiled"),
        Row("adamw-foreach", "torch AdamW foreach=True", "adamw", impl="foreach"),
        Row("adamw-fused", "torch AdamW fused=True", "adamw", impl="fused"),
        # not in the default table
        Row("adamw-single", "torch AdamW foreach=False (per tensor)", "adamw", impl="single"),
        Row("adamw-fused-compiled", "torch AdamW fused by bagua, compiled", "adamw", fuse="compiled", impl="single"),
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
    """``"bertadam,adamw-fused"`` (or ``"all"``, or None for the default rows) -> rows, in that order."""
    if spec is None or spec.strip() == "":
        keys = list(DEFAULT_ROWS)
    elif spec.strip() == "all":
        keys = list(ROWS)
    else:
        keys = [k.strip() for k in spec.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        raise ValueError(f"unknown row(s) {unknown}; choose from {list(ROWS)} or 'all'")
    if len(set(keys)) != len(keys):
        raise ValueError(f"a row is listed twice: {keys}")
    return [ROWS[k] for k in keys]
