"""The outputs: a markdown table in Bagua's shape, a JSON file and a PNG bar chart."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence

from .results import RowResult, describe_hardware
from .rows import BASELINE, ROWS

__all__ = ["SEED_REFERENCE", "add_speedups", "markdown_table", "write_json", "write_png", "FRONTEND_NAMES",
           "ran_eager_reason"]

# Bagua's published table (BERT-base, 8 x V100): epoch time and accuracy without / with the fused optimizer.
SEED_REFERENCE = {
    "setting": "BERT-base, 8 x V100, Bagua's published fused-optimizer benchmark",
    "without_fused_s": 3252.0,
    "with_fused_s": 2767.0,
    "accuracy_without": 0.9254,
    "accuracy_with": 0.9260,
}

FRONTEND_NAMES = {"hf": "HF Trainer", "fairseq": "fairseq", "fsdp": "FSDP2 loop"}


def add_speedups(results: Sequence[RowResult]) -> None:
    """``extra['speedup']`` (baseline epoch time / row epoch time) within each front end.

    A row's baseline is ``ROWS[row].baseline``: Bagua's per-tensor BertAdam (``bertadam``) for the
    Bagua-default BertAdam rows and the AdamW rows, the per-tensor ``bertadam-globalclip`` for the other
    BertAdam rows -- each when it ran in the same front end, else ``bertadam``, else the first row measured.
    """
    by_frontend: Dict[str, List[RowResult]] = {}
    for result in results:
        by_frontend.setdefault(result.frontend, []).append(result)
    for rows in by_frontend.values():
        measured = [r for r in rows if r.status == "ok" and r.epoch_time_s]
        by_key = {r.row: r for r in measured}
        fallback = by_key.get(BASELINE, measured[0] if measured else None)
        for r in measured:
            wanted = ROWS[r.row].baseline if r.row in ROWS else BASELINE
            base = by_key.get(wanted, fallback)
            r.extra["speedup"] = base.epoch_time_s / r.epoch_time_s
            r.extra["time_change"] = r.epoch_time_s / base.epoch_time_s - 1.0
            r.extra["baseline"] = base.row


def ran_eager_reason(r: RowResult) -> Optional[str]:
    """Why a row that asked for a compiled fused step ran eagerly (None: it ran compiled, or did not ask)."""
    if r.fuse != "compiled" or r.compiled is not False or (r.compiled_share or 0.0) > 0.0:
        return None
    if r.extra.get("compile_disabled_reason"):
        return str(r.extra["compile_disabled_reason"])
    if r.group_paths and all(path == "segmented" for path in r.group_paths):
        return "fuse_optimizer ran its segmented groups (per-parameter clipping) eagerly"
    return "compile off"


def _setup(r: RowResult) -> str:
    """The table's "clipping; schedule" cell: ``per-parameter 1.0; BertAdam`` or ``global 1.0; front end``."""
    if not r.clipping and not r.schedule:
        return "-"
    clip = (r.clipping or "-").split(" (")[0]
    schedule = "-" if not r.schedule else "BertAdam" if r.schedule.startswith("BertAdam") else "front end"
    return f"{clip}; {schedule}"


def _fmt(value: Optional[float], spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _seconds(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


# The table's columns (the README's copy of the table is checked against them: tests/test_readme.py)
COLUMNS = ("front end", "optimizer", "clipping; schedule", "fused step (ran)", "epoch time (s)", "optimizer step (ms)",
           "optimizer-step share of step time", "final accuracy", "speedup (epoch time)", "median update (ms)",
           "compile (s, excluded)")


def markdown_table(results: Sequence[RowResult], title: str, hardware: Dict, notes: Sequence[str] = ()) -> str:
    """The table (one line per row), its setting, and Bagua's numbers for comparison."""
    lines = [f"## {title}", "", f"Hardware: {describe_hardware(hardware)}", ""]
    lines += [
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        frontend = FRONTEND_NAMES.get(r.frontend, r.frontend)
        if r.status != "ok":
            reason = " ".join(str(r.reason).split()).replace("|", "\\|")
            lines.append(f"| {frontend} | {r.label} | {_setup(r)} | | {r.status}: {reason} | | | | | | |")
            continue
        epoch = _seconds(r.epoch_time_s) + ("*" if r.extrapolated else "")
        speedup = r.extra.get("speedup")
        change = r.extra.get("time_change")
        baseline = r.extra.get("baseline")
        speed = "-" if speedup is None else (
            "1.00x (baseline)" if r.row == baseline else f"{speedup:.2f}x ({change * 100:+.1f}% time)"
            + ("" if baseline == BASELINE else f" vs {baseline}")
        )
        compile_s = "-" if not r.compile_s else f"{r.compile_s:.1f}"
        label = r.label
        eager_reason = ran_eager_reason(r)
        if eager_reason:
            label += f" (ran eager: {eager_reason})"
        label = label.replace("|", "\\|")
        lines.append(
            f"| {frontend} | {label} | {_setup(r)} | {r.fused_step()} | {epoch} | {_fmt(r.optimizer_step_ms, '.1f')} "
            f"| {_fmt(None if r.optimizer_share is None else r.optimizer_share * 100, '.1f')}% "
            f"| {_fmt(r.accuracy, '.4f')} | {speed} | {_fmt(r.median_update_ms, '.1f')} | {compile_s} |"
        )
    seed = SEED_REFERENCE
    change = seed["with_fused_s"] / seed["without_fused_s"] - 1.0
    lines += [
        "",
        f"Bagua's benchmark, for comparison ({seed['setting']}): epoch time {seed['without_fused_s']:.0f} s without and "
        f"{seed['with_fused_s']:.0f} s with the fused optimizer ({change * 100:+.1f}% time, "
        f"{seed['without_fused_s'] / seed['with_fused_s']:.2f}x speedup), accuracy {seed['accuracy_without']:.4f} vs "
        f"{seed['accuracy_with']:.4f}.",
    ]
    if any(r.extrapolated for r in results if r.status == "ok"):
        lines.append("\n\\* extrapolated to a full epoch from the part of an epoch that was trained.")
    if notes:
        lines.append("")
        lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def write_json(path: str, payload: Dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2, default=str)
        handle.write("\n")


def write_png(path: str, results: Sequence[RowResult], title: str, subtitle: str = "") -> Optional[str]:
    """Horizontal bars of epoch time per row, split into optimizer step and everything else.

    Returns None on success, or why no chart was drawn (matplotlib missing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no PNG: matplotlib is not installed ({exc}); pip install 'bagua-integrations[recipes]'"
    ok = [r for r in results if r.status == "ok" and r.epoch_time_s]
    labels = [f"{FRONTEND_NAMES.get(r.frontend, r.frontend)}: {r.label}"
              + (f"\n[{r.fused_step()}]" if r.fuse else "") for r in ok]
    optimizer = [r.epoch_time_s * (r.optimizer_share or 0.0) for r in ok]
    rest = [r.epoch_time_s - o for r, o in zip(ok, optimizer)]
    height = max(2.5, 0.55 * len(ok) + 1.5)
    fig, ax = plt.subplots(figsize=(10, height))
    positions = list(range(len(ok)))[::-1]
    ax.barh(positions, rest, color="#9db4d3", label="forward, backward, data, rest")
    ax.barh(positions, optimizer, left=rest, color="#d9722e", label="optimizer step")
    for y, r in zip(positions, ok):
        speedup = r.extra.get("speedup")
        text = f" {r.epoch_time_s:.1f} s" + ("*" if r.extrapolated else "")
        if speedup is not None:
            text += f"  ({speedup:.2f}x)"
        if r.accuracy is not None:
            text += f"  acc {r.accuracy:.3f}"
        ax.text(r.epoch_time_s, y, text, va="center", fontsize=8)
    ax.set_yticks(positions)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("epoch time (s), compile time excluded")
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=9)
    longest = max((r.epoch_time_s for r in ok), default=1.0)
    ax.set_xlim(0, longest * 1.45)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
