"""Every optimizer of pytorch-optimizer (or torch-optimizer), fused as a user would fuse it, against
its own unfused step.

Used by ``tests/test_third_party_optimizers.py``; also a script that prints one line per optimizer
and the counts of each outcome::

    python tests/_optimizer_sweep.py [NAME ...]
    python tests/_optimizer_sweep.py --collection torch_optimizer [NAME ...]
    python tests/_optimizer_sweep.py --compiled [NAME ...]   # compile=True, under OneCycleLR

``--compiled`` fuses with ``compile=True`` and steps a ``OneCycleLR`` schedule, which cycles momentum
or beta1 too, after every step (both runs): a compiled step that kept an old learning rate or
momentum shows as a mismatch; the detail says whether the last step ran compiled, and why not.

The model has 1-D, 2-D, 3-D and ``(1,)``-shaped parameters, one parameter that never gets a
gradient, and two param groups; the loop zeroes gradients with ``set_to_none=True``.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from bagua_integrations import FusionError, fuse_optimizer, fusion_report

STEPS = 8
RTOL = 1e-5
COMPILED_RTOL = 1e-4  # compiled: fused multiply-adds round differently, compounding over the steps
# Optimizers whose step needs something a plain loop does not give (a closure that it calls
# twice, a second backward, a Hessian, an LR it finds by itself with a closure, ...): they are
# run with a closure; those that still do not run unfused are left out as "does not run".
# What their users must pass, as their documentation says: constructor arguments without a
# default, and the closure form (AliG reads the loss: ``step(lambda: float(loss))``).
_KWARGS: Dict[str, dict] = {
    "ranger21": {"num_iterations": STEPS},
    "bsam": {"num_data": 6 * STEPS},
    "alig": {"max_lr": 1.0},  # its learning rate: the Polyak step loss / |g|^2 is clipped to it
}
_LOSS_CLOSURE = {"alig"}
_CREATE_GRAPH = {"adahessian", "sophiah"}  # Hutchinson's Hessian estimate: ``loss.backward(create_graph=True)``
# Muon and its kin take param groups that say which parameters Muon updates (``use_muon``): the
# matrices (and the conv weight, which they flatten), and AdamW for the rest.
_USE_MUON = {"muon", "adamuon", "adago", "distributedmuon", "muonclip", "normuon"}


class SweepNet(torch.nn.Module):
    """Parameters of every rank the fused step lays out, a ``(1,)`` scale, and an unused one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(3, 4, 3)  # 3-D weight, 1-D bias
        self.fc = torch.nn.Linear(8, 5)  # 2-D weight, 1-D bias
        self.scale = torch.nn.Parameter(torch.tensor([0.7]))  # shape (1,)
        self.unused = torch.nn.Parameter(torch.randn(4, 4))  # in the optimizer, never in forward

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1)  # (B, 4, 2) -> (B, 8)
        return self.fc(h) * self.scale

    def groups(self):
        return [
            {"params": [self.conv.weight, self.fc.weight, self.unused]},
            {"params": [self.conv.bias, self.fc.bias, self.scale], "lr": 3e-3},
        ]


def _data():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, 4, generator=gen), torch.randn(6, 5, generator=gen)) for _ in range(STEPS)]


def _schedule(opt, compiled: bool):
    """Compiled: OneCycleLR up to each group's own rate, which also cycles momentum or beta1 with it
    where the optimizer has one (a step that kept an old value of either shows as a mismatch); not
    AggMo's several betas (its state is keyed by their values); LambdaLR where OneCycleLR does not
    take the optimizer's groups."""
    if not compiled or not all("lr" in group for group in opt.param_groups):
        return None
    betas = opt.defaults.get("betas")
    cycles = "momentum" in opt.defaults or (isinstance(betas, (tuple, list)) and len(betas) == 2)
    try:
        return torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=[group["lr"] for group in opt.param_groups], total_steps=STEPS + 1, cycle_momentum=cycles)
    except (ValueError, KeyError, TypeError):  # (a momentum or betas it cannot cycle)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _train(model, opt, data, step, scheduler=None, with_closure=True, loss_closure=False, create_graph=False):
    for x, y in data:
        def closure():
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward(create_graph=create_graph)
            return loss

        loss = closure()
        if loss_closure:
            step(lambda: float(loss))
        else:
            step(closure) if with_closure else step()
        if scheduler is not None:
            scheduler.step()


def _build(cls, model, name=""):
    groups = model.groups()
    if name in _USE_MUON:
        groups = [dict(group, use_muon=index == 0) for index, group in enumerate(groups)]
    kwargs = _KWARGS.get(name, {})
    try:
        return cls(groups, lr=1e-2, **kwargs)
    except TypeError:
        return cls(groups, **kwargs)


@dataclass
class Outcome:
    name: str
    kind: str  # does-not-run | elementwise | segmented | per-tensor | refused | bare-error | mismatch
    detail: str = ""


def sweep_one(name: str, cls, compiled: bool = False) -> Outcome:
    data = _data()
    # compiled: steps without a closure where the optimizer takes them (a step given a closure is
    # replayed eagerly); the rest with one
    with_closure = not compiled
    if compiled:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                probe_model = SweepNet()
                ref = _build(cls, probe_model, name)
                _train(probe_model, ref, data[:1], ref.step, with_closure=False, loss_closure=name in _LOSS_CLOSURE,
                       create_graph=name in _CREATE_GRAPH)
        except Exception:
            with_closure = True
    ref_model = SweepNet()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = _build(cls, ref_model, name)
            _train(ref_model, ref, data, ref.step, _schedule(ref, compiled), with_closure, name in _LOSS_CLOSURE,
                   name in _CREATE_GRAPH)
        if not all(torch.isfinite(p).all() for p in ref_model.parameters()):
            return Outcome(name, "does-not-run", "non-finite parameters unfused")
    except Exception as exc:  # the optimizer itself does not run on a plain loop
        return Outcome(name, "does-not-run", f"{type(exc).__name__}: {exc}"[:160])
    model = SweepNet()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = _build(cls, model, name)
            fuse_optimizer(opt, compile=True if compiled else "auto")
            _train(model, opt, data, opt.fuse_step, _schedule(opt, compiled), with_closure, name in _LOSS_CLOSURE,
                   name in _CREATE_GRAPH)
    except FusionError as exc:
        return Outcome(name, "refused", f"{type(exc).__name__}: {exc}"[:300])
    except Exception as exc:
        return Outcome(name, "bare-error", "".join(traceback.format_exception_only(exc)).strip()[:300])
    worst = 0.0
    for (pname, a), b in zip(ref_model.named_parameters(), model.parameters()):
        a, b = a.detach().double(), b.detach().double()
        ok = torch.isclose(a, b, rtol=COMPILED_RTOL if compiled else RTOL, atol=1e-7) | (a.isnan() & b.isnan())
        if not bool(ok.all()):
            worst = max(worst, float(((a - b).abs() / a.abs().clamp_min(1e-12))[~ok].max()))
    paths = fusion_report(opt).group_paths
    if worst:
        return Outcome(name, "mismatch", f"relative error {worst:.2e}; paths {paths}")
    if "per-tensor" in paths:
        kind = "per-tensor"
    elif "segmented" in paths:
        kind = "segmented"
    else:
        kind = "elementwise"
    report = fusion_report(opt)
    reasons = [r for r in report.group_reasons if r]
    if compiled:
        status = "compiled" if report.compiled else f"eager ({report.compile_disabled_reason or 'not compiled'})"
        reasons.insert(0, f"{status}, {report.compile_graphs} graph(s)")
    return Outcome(name, kind, "; ".join(reasons)[:2000])


def optimizer_classes(names: Optional[List[str]] = None, collection: str = "pytorch_optimizer"):
    """``(name, class)`` of a collection's optimizers: ``pytorch_optimizer`` (its registry) or
    ``torch_optimizer`` (every ``torch.optim.Optimizer`` subclass the package exports)."""
    if collection == "torch_optimizer":
        import torch_optimizer

        found = {n: c for n, c in vars(torch_optimizer).items()
                 if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
        return [(n, found[n]) for n in (names or sorted(found))]
    import pytorch_optimizer

    names = names or pytorch_optimizer.get_supported_optimizers()
    return [(n, pytorch_optimizer.load_optimizer(n)) for n in names]


def sweep(names: Optional[List[str]] = None, collection: str = "pytorch_optimizer", compiled: bool = False) -> List[Outcome]:
    return [sweep_one(n, cls, compiled) for n, cls in optimizer_classes(names, collection)]


if __name__ == "__main__":
    torch.set_num_threads(1)
    argv = sys.argv[1:]
    collection = "pytorch_optimizer"
    compiled = "--compiled" in argv
    argv = [a for a in argv if a != "--compiled"]
    if argv[:1] == ["--collection"]:
        collection, argv = argv[1], argv[2:]
    counts: Dict[str, int] = {}
    for name, cls in optimizer_classes(argv or None, collection):  # each line as soon as it is known
        o = sweep_one(name, cls, compiled)
        counts[o.kind] = counts.get(o.kind, 0) + 1
        print(f"{o.name:24s} {o.kind:13s} {o.detail}", flush=True)
    print(counts)
