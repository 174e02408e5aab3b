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
    compiled: Optional[bool] = None  # the fused step ran compiled (None: not fused)
    fused: Optional[str] = None  # "<fused tensors> / <flat runs>" of a fused optimizer
    epoch_times_s: List[float] = field(default_factory=list)
    extra: Dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> Dict:
        return asdict(self)


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
