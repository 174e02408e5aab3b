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
zero up to floating-point rounding on every path. An optimizer whose step needs a closure (L-BFGS)
is stepped with one. Exit status: 0, or 2 when the class cannot be imported or built.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import typing
import warnings
from typing import List, Optional, Tuple

import torch

from .errors import first_line
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
    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")  # (torch.optim.AdamW too)
    if not module_name or not attr:
        raise ReportError(f"expected MODULE:CLASS (e.g. torch.optim:AdamW), got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ReportError(f"cannot import {module_name!r} ({exc}); is the package that holds {attr} installed?") \
            from exc
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class ReportError(Exception):
    """Why the report cannot build or step a class, in the command line's words."""


def _takes_what(annotation) -> Optional[str]:
    """'another optimizer' or 'a model' when a parameter annotation names an Optimizer or a Module
    (also inside ``type[...]`` or a union), else None."""
    if isinstance(annotation, type):
        if issubclass(annotation, torch.optim.Optimizer):
            return "another optimizer"
        return "a model" if issubclass(annotation, torch.nn.Module) else None
    return next(filter(None, map(_takes_what, typing.get_args(annotation))), None)


def _why_not_built(cls, exc: Exception, params, kwargs: dict) -> Optional[str]:
    """Why ``cls(params, **kwargs)`` raised ``exc``, in the user's words (None: the raw error says it)."""
    signature = []
    for eval_str in (True, False):  # annotations written as strings (from __future__ import annotations) too
        try:
            signature = list(inspect.signature(cls, eval_str=eval_str).parameters.values())
            break
        except Exception:
            continue
    required = [p for p in signature[1:] if p.default is p.empty and p.name not in kwargs
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    # the argument our parameters went to, then the ones left out: does one take an optimizer or a model?
    takes = [(what, p.name) for p in signature[:1] + required if (what := _takes_what(p.annotation))]
    if not takes and isinstance(exc, AttributeError) and getattr(exc, "obj", None) is params:
        # it looked up an attribute of an optimizer (param_groups, defaults) or a model on our parameters
        takes = [("a model" if hasattr(torch.nn.Module, exc.name or "") else "another optimizer", None)]
    name = cls.__name__
    if takes:
        what, argument = takes[0]
        via = f" (its '{argument}' argument)" if argument else ""
        if what == "another optimizer":
            return (f"{name} wraps another optimizer{via}, so the report cannot build it from parameters; "
                    "fuse the optimizer it wraps instead, and run the report on that class")
        return (f"{name} takes a model{via}, so the report cannot build it from parameters; build it over "
                "your model and read fusion_report(fuse_optimizer(optimizer)) there")
    if isinstance(exc, TypeError) and required:
        example = [f'"{k}": {json.dumps(v)}' for k, v in kwargs.items()] + [f'"{p.name}": ...' for p in required]
        return (f"{name} needs argument(s) the report cannot guess ({', '.join(p.name for p in required)}): "
                f"pass them with --kwargs, e.g. --kwargs '{{{', '.join(example)}}}'")
    return None


def _build(cls, model: torch.nn.Module, kwargs: dict):
    params = model.parameters()
    try:
        return cls(params, **kwargs)
    except Exception as exc:
        why = _why_not_built(cls, exc, params, kwargs) or (
            f"{cls.__name__}(model.parameters(), **kwargs) raised {_one_line(exc)}. The report builds it over a "
            f"small model's parameters; where {cls.__name__} needs them in a form of its own (groups with flags, "
            f"named parameters), check it in your script instead: {_IN_YOUR_SCRIPT}")
        raise ReportError(why) from exc


_IN_YOUR_SCRIPT = "fuse_optimizer(optimizer, verify=3), then print(fusion_report(optimizer))"


def _one_line(exc: BaseException) -> str:
    return first_line(exc).rstrip(".")  # (a sentence of ours follows)


def describe(cls, kwargs: Optional[dict] = None, steps: int = 3) -> List[str]:
    """Lines saying how a fused ``cls(params, **kwargs)`` steps each param group, and how far it is
    from the unfused optimizer after ``steps`` steps (given a closure where its step needs one)."""
    kwargs = dict(kwargs or {})
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, 5, 5, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(steps)]

    def train(fused: bool, with_closure: bool) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
        # each from the same random state: an optimizer that draws random numbers (Gravity's initial
        # state) draws the same ones fused as unfused (they looked 12x apart)
        with torch.random.fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = _ProbeNet()
            opt = _build(cls, model, kwargs)
            step = fuse_optimizer(opt).fuse_step if fused else opt.step
            for x, y in data:
                @torch.enable_grad()  # some steps call their closure under no_grad (AliG)
                def closure(x=x, y=y):
                    opt.zero_grad(set_to_none=True)
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                if with_closure:
                    step(closure)
                else:
                    closure()
                    step()
        return model, opt

    # a step that fails without a closure (L-BFGS's needs one) is tried with one
    try:
        plain_model, _ = train(False, with_closure=False)
        with_closure = False
    except ReportError:
        raise
    except Exception as exc:
        try:
            plain_model, _ = train(False, with_closure=True)
        except Exception:
            raise ReportError(
                f"{cls.__name__}'s own (unfused) step failed on a small model after a plain loss.backward(), with "
                f"and without a closure: {_one_line(exc)}. Where its step needs more than gradients (a Hessian "
                f"from backward(create_graph=True), a loss passed in), check it in your script instead: "
                f"{_IN_YOUR_SCRIPT}") from exc
        with_closure = True
    fused_model, fused = train(True, with_closure)
    worst = max(
        float(((a.detach() - b.detach()).abs() / a.detach().abs().clamp_min(1e-12)).max())
        for a, b in zip(plain_model.parameters(), fused_model.parameters())
    )
    report = fusion_report(fused)
    closure_note = " (stepped with a closure: its step needs one)" if with_closure else ""
    lines = [f"{cls.__module__}.{cls.__qualname__}{closure_note}"]
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
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ReportError(f"{args.optimizer} is not a torch.optim.Optimizer subclass; name an optimizer "
                              "class, e.g. torch.optim:AdamW")
        if cls is torch.optim.Optimizer:
            raise ReportError(f"{args.optimizer} is the base class of all optimizers; name an optimizer class, "
                              "e.g. torch.optim:AdamW")
        try:
            kwargs = json.loads(args.kwargs)
        except json.JSONDecodeError as exc:
            raise ReportError(f"--kwargs is not valid JSON ({exc}); write it as an object, e.g. "
                              "--kwargs '{\"lr\": 0.01}'") from exc
        if not isinstance(kwargs, dict):
            raise ReportError(f"--kwargs must be a JSON object of keyword arguments, e.g. '{{\"lr\": 0.01}}'; "
                              f"got {type(kwargs).__name__} {args.kwargs}")
        lines = describe(cls, kwargs)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a command-line tool: say what went wrong, in one line
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
