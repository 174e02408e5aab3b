"""``python -m bagua_integrations.report MODULE:CLASS`` on classes it cannot report: one line saying
what is wrong and what to do (exit status 2), and closure-based optimizers reported with a closure.

The classes below stand in for third-party ones (named in each test where pytorch-optimizer is
installed); the command line finds them as ``test_report_cli:ClassName``.
"""

from __future__ import annotations

import pytest
import torch

from _fused_utils import PerParameterStep
from bagua_integrations.report import main as report_main

HERE = __name__  # the MODULE of MODULE:CLASS for the classes defined here


class NeedsHorizon(PerParameterStep):
    """Plain SGD with a required constructor argument (Ranger21-style ``num_iterations``)."""

    def __init__(self, params, horizon: int, lr: float = 0.1):
        self.horizon = horizon
        super().__init__(params, lr=lr)

    def update(self, p, state, group):
        p.add_(p.grad, alpha=-group["lr"])


class AnnotatedWrapper(torch.optim.Optimizer):
    """Wraps another optimizer, which its annotation says (PCGrad-style)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        super().__init__(optimizer.param_groups, optimizer.defaults)


class UnannotatedWrapper(torch.optim.Optimizer):
    """Wraps another optimizer with no annotation: only its use of ``.defaults`` tells."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        super().__init__(optimizer.param_groups, optimizer.defaults)


class TakesModel(torch.optim.Optimizer):
    """Built over a model, not its parameters (AdamMini/LOMO-style), no annotation."""

    def __init__(self, model, lr: float = 0.1):
        super().__init__([p for _, p in model.named_parameters()], dict(lr=lr))


def _report(capsys, *argv):
    code = report_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.strip()


@pytest.mark.parametrize("spec", ["torch.nn:Linear", "torch.optim:AdamW.step", "math:pi",
                                  "torch.optim.lr_scheduler:StepLR"])
def test_a_class_that_is_not_an_optimizer_is_named_so(capsys, spec):
    code, _, err = _report(capsys, spec)
    assert code == 2
    assert err == f"error: {spec} is not a torch.optim.Optimizer subclass; name an optimizer class, e.g. torch.optim:AdamW"


def test_the_optimizer_base_class_is_named_so(capsys):
    code, _, err = _report(capsys, "torch.optim:Optimizer")
    assert code == 2 and err.startswith("error: torch.optim:Optimizer is the base class of all optimizers"), err


def test_an_optimizer_that_needs_arguments_says_how_to_pass_them(capsys):
    code, _, err = _report(capsys, f"{HERE}:NeedsHorizon")
    assert code == 2
    assert err == ("error: NeedsHorizon needs argument(s) the report cannot guess (horizon): pass them with "
                   "--kwargs, e.g. --kwargs '{\"horizon\": ...}'")
    code, _, err = _report(capsys, f"{HERE}:NeedsHorizon", "--kwargs", '{"lr": 0.01}')
    assert code == 2 and "e.g. --kwargs '{\"lr\": 0.01, \"horizon\": ...}'" in err, err
    code, out, _ = _report(capsys, f"{HERE}:NeedsHorizon", "--kwargs", '{"horizon": 10}')
    assert code == 0 and "param group 0: elementwise" in out


@pytest.mark.parametrize("name, argument", [("AnnotatedWrapper", "its 'optimizer' argument"),
                                            ("UnannotatedWrapper", None)])
def test_a_wrapper_of_another_optimizer_says_to_fuse_the_one_it_wraps(capsys, name, argument):
    code, _, err = _report(capsys, f"{HERE}:{name}")
    assert code == 2
    via = f" ({argument})" if argument else ""
    assert err == (f"error: {name} wraps another optimizer{via}, so the report cannot build it from parameters; "
                   "fuse the optimizer it wraps instead, and run the report on that class")


def test_an_optimizer_built_over_a_model_says_so(capsys):
    code, _, err = _report(capsys, f"{HERE}:TakesModel")
    assert code == 2
    assert err.startswith("error: TakesModel takes a model, so the report cannot build it from parameters; "), err


@pytest.mark.parametrize("name, says", [
    ("PCGrad", "PCGrad wraps another optimizer (its 'optimizer' argument)"),
    ("SafeFP16Optimizer", "SafeFP16Optimizer wraps another optimizer (its 'optimizer' argument)"),
    ("SAM", "SAM wraps another optimizer (its 'base_optimizer' argument)"),
    ("Lookahead", "Lookahead wraps another optimizer (its 'optimizer' argument)"),
    ("AdamMini", "AdamMini takes a model (its 'model' argument)"),
    ("LOMO", "LOMO takes a model (its 'model' argument)"),
    ("FocalLoss", "pytorch_optimizer:FocalLoss is not a torch.optim.Optimizer subclass"),
    ("Ranger21", "Ranger21 needs argument(s) the report cannot guess (num_iterations): pass them with --kwargs"),
])
def test_pytorch_optimizer_classes_it_cannot_build_are_explained(capsys, name, says):
    pytest.importorskip("pytorch_optimizer")
    code, _, err = _report(capsys, f"pytorch_optimizer:{name}")
    assert code == 2 and err.startswith(f"error: {says}"), err


@pytest.mark.parametrize("name, says", [
    ("Muon", "Muon(model.parameters(), **kwargs) raised RuntimeError: "),  # wants groups with use_muon flags
    ("SophiaH", "SophiaH's own (unfused) step failed on a small model after a plain loss.backward()"),  # a Hessian
    ("AdaHessian", "AdaHessian's own (unfused) step failed on a small model after a plain loss.backward()"),
])
def test_pytorch_optimizer_classes_it_cannot_step_say_where_to_check_them(capsys, name, says):
    pytest.importorskip("pytorch_optimizer")
    code, _, err = _report(capsys, f"pytorch_optimizer:{name}")
    assert code == 2 and err.startswith(f"error: {says}"), err
    assert err.endswith("check it in your script instead: fuse_optimizer(optimizer, verify=3), then "
                        "print(fusion_report(optimizer))"), err


@pytest.mark.parametrize("kwargs, says", [
    ("[1, 2]", "--kwargs must be a JSON object of keyword arguments"),
    ("{lr: 0.1}", "--kwargs is not valid JSON"),
])
def test_kwargs_that_are_not_a_json_object_are_named_so(capsys, kwargs, says):
    code, _, err = _report(capsys, "torch.optim:SGD", "--kwargs", kwargs)
    assert code == 2 and err.startswith(f"error: {says}"), err


def test_a_dotted_class_name_and_a_missing_package(capsys):
    code, out, _ = _report(capsys, "torch.optim.SGD", "--kwargs", '{"lr": 0.1}')
    assert code == 0 and out.splitlines()[0] == "torch.optim.sgd.SGD"
    code, _, err = _report(capsys, "no_such_package:Adam")
    assert code == 2 and err.startswith("error: cannot import 'no_such_package'"), err


def test_an_optimizer_whose_step_needs_a_closure_is_stepped_with_one(capsys):
    code, out, err = _report(capsys, "torch.optim:LBFGS")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "torch.optim.lbfgs.LBFGS (stepped with a closure: its step needs one)"
    assert lines[1].startswith("  param group 0: per-tensor -- LBFGS keeps its own list of the parameters")
    assert lines[2] == "  largest relative difference from the unfused optimizer after 3 steps: 0.0e+00"


def test_a_plain_optimizer_is_reported_as_before(capsys):
    code, out, _ = _report(capsys, "torch.optim:SGD", "--kwargs", '{"lr": 0.1, "momentum": 0.9}')
    assert code == 0
    assert out.splitlines() == [
        "torch.optim.sgd.SGD",
        "  param group 0: elementwise -- its step is elementwise (checked against per-tensor steps on synthetic tensors)",
        "  largest relative difference from the unfused optimizer after 3 steps: 0.0e+00",
    ]
