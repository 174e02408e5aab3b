"""_scalar_prologue: expensive scalar expressions of the step count leave the compiled kernels.

Without it, Inductor evaluates ``1 - beta ** step`` (a symbolic float) for every vector of a
flat buffer; LAMB's compiled step took 3x longer. These tests pin what the pass may change
(nothing in the results) and what it must do (hoist those scalars, keep every in-place update).
"""

from __future__ import annotations

import math

import pytest
import torch

from bagua_integrations._compile import compiler_available
from bagua_integrations._scalar_prologue import _hoistable, with_scalar_prologue
from bagua_integrations._torch_compat import inductor_backend

pytestmark = pytest.mark.skipif(not compiler_available(), reason="needs a working torch.compile (C++ compiler)")


class Spy:
    """A backend: the prologue pass over Inductor, recording what reached Inductor."""

    def __init__(self):
        self.graphs = []

    def inductor(self, gm, example_inputs, **kwargs):
        self.graphs.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return inductor_backend()(gm, example_inputs, **kwargs)

    def __call__(self, gm, example_inputs):
        return with_scalar_prologue(self.inductor, gm, example_inputs)

    def hoisted(self):
        return [[name for name in names if name.startswith("bagua_hoisted_scalar")] for names in self.graphs]


def adam_like(param, exp_avg, step, lr, beta=0.9):
    """In-place updates plus a bias correction of a Python int step (what Lamb/BertAdam compute)."""
    exp_avg.mul_(beta).add_(param * (1 - beta))
    param.sub_(exp_avg / (1 - beta ** step) * lr)
    param.mul_(1 - math.sqrt(step) * 1e-3)  # another transcendental of the step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hoisted_bias_correction_gives_the_eager_numbers(dtype):
    spy = Spy()
    compiled = torch.compile(adam_like, backend=spy, fullgraph=True)
    torch.manual_seed(0)
    p, m = torch.randn(4099, dtype=dtype), torch.zeros(4099, dtype=dtype)
    p_ref, m_ref = p.clone(), m.clone()
    for step in range(1, 8):
        lr = 0.1
        compiled(p, m, step, lr)
        adam_like(p_ref, m_ref, step, lr)
        # every in-place update happened (a dead-code pass once dropped them) with eager's values
        torch.testing.assert_close(m, m_ref, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
        torch.testing.assert_close(p, p_ref, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    assert len(spy.graphs) <= 2, "recompiled for every step: the step count did not stay symbolic"
    assert spy.hoisted()[-1], f"the symbolic graph hoisted nothing: {spy.graphs[-1]}"


def test_only_scalars_of_inputs_with_transcendental_math_are_hoisted():
    captured = {}

    def backend(gm, example_inputs):
        captured["hoisted"] = [n.format_node() for n in _hoistable(gm)]
        return gm.forward

    def f(t, step, lr):
        cheap = t * (lr * 2 + step)  # arithmetic only: stays in the kernel
        data = t / t.norm()  # depends on tensor data: not a prologue value
        return cheap + data / (1 - 0.999 ** step)  # pow of the step: hoisted

    f_compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    f_compiled(torch.ones(5), 3, 0.5)
    assert len(captured["hoisted"]) == 1 and "sub" in captured["hoisted"][0], captured


def test_a_graph_without_such_scalars_is_compiled_as_it_was():
    spy = Spy()
    compiled = torch.compile(lambda t, lr: t.mul_(1 - lr), backend=spy, fullgraph=True)
    t = torch.ones(10)
    compiled(t, 0.25)
    compiled(t, 0.5)
    assert torch.equal(t, torch.full((10,), 0.375))
    assert all(not names for names in spy.hoisted())


def warmup_linear_step(param, update, state, warmup=0.3, t_total=12):
    """BertAdam's scheduled learning rate: a float max() of the symbolic step count."""
    progress = state["step"] / t_total
    scale = progress / warmup if progress < warmup else max(0.0, (1.0 - progress) / max(1e-12, 1.0 - warmup))
    param.add_(update * -(1e-3 * scale))
    state["step"] += 1


def test_a_float_max_of_the_step_gives_the_eager_numbers():
    """Torch < 2.13 evaluates a float max() inlined into a C++ kernel in int64 (0 after the warmup
    here); the prologue computes it in Python there (cpu_kernels_truncate_float_min_max)."""
    spy = Spy()
    compiled = torch.compile(warmup_linear_step, backend=spy, fullgraph=True)
    p, ref, update = torch.zeros(64), torch.zeros(64), torch.linspace(0.5, 1.5, 64)
    state, ref_state = {"step": 0}, {"step": 0}
    for _ in range(12):
        compiled(p, update, state)
        warmup_linear_step(ref, update, ref_state)
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-9)
    assert float(ref.abs().max()) > 0.005  # the decay branch moved it
