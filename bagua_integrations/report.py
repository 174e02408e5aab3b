"""Check before training how ``fuse_optimizer`` will step an optimizer class.

``python -m bagua_integrations.report MODULE:CLASS [--kwargs JSON]`` builds the class over a
small model with 1-D, 2-D, 3-D and 4-D parameters (the ranks a real model has), fuses it, takes
three steps beside an unfused copy, and prints which path each param group takes and why:

* ``elementwise`` -- one flat update over each contiguous buffer;
* ``segmented``   -- flat buffers, with whole-parameter reductions (norms, clipping, trust ratios)
  computed per parameter;
* ``per-tensor``  -- the optimizer's own exact step, one tensor at a time (the reason says what
  could not be fused).

It also prints the largest difference from the unfused optimizer over those steps, which is
zero up to floating-point rounding on every path. Exit status: 0, or 2 when the class cannot be
imported or built.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from typing import List, Optional

import torch

from .fused_optimizer import fuse_optimizer, fusion_report

__all__ = ["describe", "main"]


class _ProbeNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3)  # 4-D weight, 1-D bias
        self.conv1d = torch.nn.Conv1d(4, 4, 2)  # 3-D weight
        self.fc = torch.nn.Linear(4, 2)  # 2-D weight

    def forward(self, x):
        h = torch.tanh(self.conv(x)).mean(-1)  # (B, 4, 3)
        h = torch.tanh(self.conv1d(h)).mean(-1)  # (B, 4)
        return self.fc(h)


def _load(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected MODULE:CLASS (e.g. torch.optim:AdamW), got {spec!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def describe(cls, kwargs: Optional[dict] = None, steps: int = 3) -> List[str]:
    """Lines saying how a fused ``cls(params, **kwargs)`` steps each param group, and how far it is
    from the unfused optimizer after ``steps`` steps."""
    kwargs = dict(kwargs or {})
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, 5, 5, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(steps)]

    def train(fused: bool):
        # each from the same random state: an optimizer that draws random numbers (Gravity's initial
        # state) draws the same ones fused as unfused (they looked 12x apart)
        with torch.random.fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = _ProbeNet()
            opt = cls(model.parameters(), **kwargs)
            step = fuse_optimizer(opt).fuse_step if fused else opt.step
            for x, y in data:
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                step()
        return model, opt

    (plain_model, _), (fused_model, fused) = train(False), train(True)
    worst = max(
        float(((a.detach() - b.detach()).abs() / a.detach().abs().clamp_min(1e-12)).max())
        for a, b in zip(plain_model.parameters(), fused_model.parameters())
    )
    report = fusion_report(fused)
    lines = [f"{cls.__module__}.{cls.__qualname__}"]
    for index, (path, why) in enumerate(zip(report.group_paths, report.group_why)):
        lines.append(f"  param group {index}: {path} -- {why}")
    lines.append(f"  largest relative difference from the unfused optimizer after {steps} steps: {worst:.1e}")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bagua_integrations.report",
        description="Show how fuse_optimizer steps an optimizer class: which path each group takes, and why.",
    )
    parser.add_argument("optimizer", help="MODULE:CLASS, e.g. torch.optim:AdamW or pytorch_optimizer:Lamb")
    parser.add_argument("--kwargs", default="{}", help='constructor keyword arguments as JSON, e.g. \'{"lr": 0.01}\'')
    args = parser.parse_args(argv)
    try:
        cls = _load(args.optimizer)
        kwargs = json.loads(args.kwargs)
        lines = describe(cls, kwargs)
    except Exception as exc:  # a command-line tool: say what went wrong, in one line
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
