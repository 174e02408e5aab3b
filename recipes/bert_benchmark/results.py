"""One measured row, and the environment it was measured in."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

__all__ = ["RowResult", "hardware", "describe_hardware", "median"]


def median(values) -> Optional[float]:
    values = sorted(values)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


@dataclass
class RowResult:
    frontend: str  # "hf" or "fairseq"
    row: str  # key in rows.ROWS
    label: str
    status: str = "ok"  # "ok", "skipped" or "failed"
    reason: Optional[str] = None  # why it was skipped / failed
    epoch_time_s: Optional[float] = None  # per epoch, compile excluded (extrapolated when epochs < 1)
    epochs_measured: Optional[float] = None
    extrapolated: bool = False
    steps: Optional[int] = None  # optimizer updates timed
    step_ms: Optional[float] = None  # epoch time / updates
    optimizer_step_ms: Optional[float] = None  # mean optimizer.step(), compile excluded
    optimizer_share: Optional[float] = None  # optimizer_step_ms / step_ms
    median_update_ms: Optional[float] = None  # median wall time of one update (robust to other jobs' bursts)
    median_optimizer_ms: Optional[float] = None  # median optimizer.step()
    accuracy: Optional[float] = None  # validation accuracy after the last epoch
    compile_s: Optional[float] = None  # excluded from the times above
    fuse: Optional[str] = None  # what the row asked for: None (not fused), "eager" or "compiled" (compile=True)
    compiled: Optional[bool] = None  # what ran: the fused step ran compiled at the end of training (None: not fused)
    # share of the fused updates after the first (which creates the state) whose step ran compiled
    compiled_share: Optional[float] = None
    fused: Optional[str] = None  # "<fused tensors> / <flat runs>" of a fused optimizer
    # fusion_report(optimizer).group_paths: per param group, "elementwise" (flat runs), "segmented" (flat runs,
    # whole-parameter reductions such as BertAdam's per-parameter clipping computed per parameter; eager) or
    # "per-tensor" (the group's exact unfused step). None: not fused, or not reported.
    group_paths: Optional[List[str]] = None
    clipping: Optional[str] = None  # who clips what (rows.Row.clipping)
    schedule: Optional[str] = None  # who schedules the learning rate (rows.Row.schedule)
    epoch_times_s: List[float] = field(default_factory=list)
    extra: Dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> Dict:
        return asdict(self)

    def record_epochs(self, epochs: List[Dict], steps_per_epoch: int) -> None:
        """The time fields from a front end's per-epoch records, each ``{"seconds", "steps", "optimizer_s",
        "updates", "optimizers"}`` with compile time already taken out; a partial epoch is scaled to a full one."""
        epoch_times = [e["seconds"] * steps_per_epoch / e["steps"] for e in epochs]  # per full epoch
        steps = sum(e["steps"] for e in epochs)
        seconds = sum(e["seconds"] for e in epochs)
        optimizer_s = sum(e["optimizer_s"] for e in epochs)
        self.epoch_times_s = [round(t, 3) for t in epoch_times]
        self.epoch_time_s = sum(epoch_times) / len(epoch_times) if epoch_times else None
        self.epochs_measured = steps / steps_per_epoch
        self.extrapolated = any(e["steps"] < steps_per_epoch for e in epochs)
        self.steps = steps
        self.step_ms = seconds / steps * 1e3 if steps else None
        self.optimizer_step_ms = optimizer_s / steps * 1e3 if steps else None
        self.optimizer_share = optimizer_s / seconds if seconds else None
        updates = [u for e in epochs for u in e["updates"]]
        optimizers = [o for e in epochs for o in e["optimizers"]]
        self.median_update_ms = median(updates) * 1e3 if updates else None
        self.median_optimizer_ms = median(optimizers) * 1e3 if optimizers else None

    def record_fusion(self, report, compiled_steps: List[bool]) -> None:
        """What a fused optimizer ran as, from its ``fusion_report`` after training and whether each
        update's step ran compiled (the first update creates the state and never compiles)."""
        self.compiled = bool(report.compiled)
        self.compile_s = round(report.compile_seconds, 3)
        self.fused = f"{report.fused_params} / {report.flat_runs}"
        self.group_paths = list(report.group_paths)
        later = compiled_steps[1:]
        self.compiled_share = round(sum(later) / len(later), 4) if later else None
        if report.compile_disabled_reason:
            self.extra["compile_disabled_reason"] = report.compile_disabled_reason

    def fused_step(self) -> str:
        """What the fused step ran as, from the fusion report: e.g. ``"segmented, eager"`` ("-": not fused)."""
        if self.fuse is None and self.compiled is None:
            return "-"
        mode = "compiled" if self.compiled else "eager"
        share = self.compiled_share
        if share is not None and 0.0 < share < 1.0:
            mode = f"compiled on {share:.0%} of updates"
        if not self.group_paths:
            return mode
        paths = []
        for path in self.group_paths:  # in group order, each path once
            if path not in paths:
                paths.append(path)
        return f"{'+'.join(paths)}, {mode}"


def hardware() -> Dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info: Dict[str, object] = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu": None,
    }
    try:
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        info["gpu"] = f"{count} x {torch.cuda.get_device_name(0)}"
        info["cuda"] = torch.version.cuda
    for name, dists in (("transformers", ("transformers",)), ("accelerate", ("accelerate",)),
                        ("fairseq", ("fairseq-fixed", "fairseq"))):
        for dist in dists:
            try:
                info[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return info


def describe_hardware(info: Dict[str, object]) -> str:
    text = f"{info['cpu']}, {info['cpu_cores']} cores, {info['torch_threads']} torch threads"
    if info.get("gpu"):
        text = f"{info['gpu']} (CUDA {info.get('cuda')}); host {text}"
    text += f"; torch {info['torch']}, Python {info['python']}"
    if "load_average_1m" in info:
        text += f"; 1-min load average at start {info['load_average_1m']}"
    return text
