"""State entries that hold a container of parameter-shaped tensors (AggMo's one momentum buffer per
beta, ``{0.0: b0, 0.9: b1, 0.99: b2}``; a list of buffer pairs) are fused: each tensor of the
container has a flat state buffer of its own, and every parameter's container holds its views.

References: the same optimizer unfused, an uninterrupted run for each resume, the real
pytorch-optimizer AggMo.
"""

from __future__ import annotations

import io

import pytest
import torch

from bagua_integrations import fuse_optimizer, fusion_report

from _fused_utils import TinyNet, assert_same_params, batches, train, two_groups


class MultiMomentumSGD(torch.optim.Optimizer):
    """SGD averaging several momentum buffers, kept in one state entry: a dict keyed by the decay
    (as AggMo keeps them), or a list of (buffer, squared-gradient average) pairs."""

    def __init__(self, params, lr=0.05, betas=(0.0, 0.9, 0.99), container="dict"):
        super().__init__(params, dict(lr=lr, betas=betas, container=container))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    if group["container"] == "dict":
                        state["buffers"] = {beta: torch.zeros_like(p) for beta in group["betas"]}
                    else:
                        state["buffers"] = [(torch.zeros_like(p), torch.zeros_like(p)) for _ in group["betas"]]
                state["step"] += 1
                for i, beta in enumerate(group["betas"]):
                    if group["container"] == "dict":
                        buf = state["buffers"][beta]
                        buf.mul_(beta).add_(p.grad)
                        p.add_(buf, alpha=-group["lr"] / len(group["betas"]))
                    else:
                        buf, sq = state["buffers"][i]
                        buf.mul_(beta).add_(p.grad)
                        sq.mul_(beta).addcmul_(p.grad, p.grad, value=1 - beta)
                        p.addcdiv_(buf, sq.sqrt().add_(1.0), value=-group["lr"] / len(group["betas"]))
        return None


def _leaves(entry):
    value = entry["buffers"]
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, leaf in items:
        if isinstance(leaf, torch.Tensor):
            yield key, leaf
        else:
            for j, t in enumerate(leaf):
                yield (key, j), t


def _assert_same_nested_state(opt_a, opt_b, model_a, model_b):
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        a, b = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert a.keys() == b.keys()
        if a:
            assert a["step"] == b["step"]
            for (ka, ta), (kb, tb) in zip(_leaves(a), _leaves(b), strict=True):
                assert ka == kb and ta.shape == pa.shape
                torch.testing.assert_close(ta, tb, rtol=1e-6, atol=1e-7)


def _pair(container, fused_steps=6, **fuse):
    plain_model, fused_model = TinyNet(), TinyNet()
    plain = MultiMomentumSGD(two_groups(plain_model, lr=0.02), container=container)
    fused = MultiMomentumSGD(two_groups(fused_model, lr=0.02), container=container)
    fuse_optimizer(fused, replace_step=True, **fuse)
    return plain_model, plain, fused_model, fused


@pytest.mark.parametrize("container", ["dict", "list"])
def test_state_holding_a_container_of_buffers_is_fused_exactly(container):
    plain_model, plain, fused_model, fused = _pair(container)
    data = batches(6)
    train(plain_model, plain, data)
    train(fused_model, fused, data)
    report = fusion_report(fused)
    assert report.group_paths == ["elementwise", "elementwise"], report
    assert "flat run" in str(report), report  # the last step went through flat runs
    assert_same_params(plain_model, fused_model)
    _assert_same_nested_state(plain, fused, plain_model, fused_model)
    # each buffer of each parameter is a view of a flat state buffer of its own
    layout = fused._bagua_fusion.layout
    flat_keys = {key for buffer in layout.buffers() for key in buffer.state}
    assert {key for key in flat_keys if isinstance(key, tuple)} == (
        {("buffers", beta) for beta in (0.0, 0.9, 0.99)} if container == "dict"
        else {("buffers", i, j) for i in range(3) for j in range(2)})
    weight = fused_model.fc1.weight
    for _, leaf in _leaves(fused.state[weight]):
        assert leaf.untyped_storage().nbytes() > leaf.numel() * leaf.element_size()  # a view
    storages = [leaf.untyped_storage().data_ptr() for _, leaf in _leaves(fused.state[weight])]
    assert len(set(storages)) == len(storages)  # one flat buffer per buffer, not one for all


@pytest.mark.parametrize("container", ["dict", "list"])
def test_nested_state_resumes_exactly_between_fused_and_unfused(container):
    data = batches(8)
    ref_model = TinyNet()
    ref = MultiMomentumSGD(two_groups(ref_model, lr=0.02), container=container)
    train(ref_model, ref, data)

    # fused for 4 steps, saved, loaded into an unfused optimizer for 4 more
    model = TinyNet()
    opt = MultiMomentumSGD(two_groups(model, lr=0.02), container=container)
    fuse_optimizer(opt, replace_step=True)
    train(model, opt, data[:4])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    saved.seek(0)
    loaded = torch.load(saved)
    resumed_model = TinyNet()
    resumed_model.load_state_dict(loaded["model"])
    resumed = MultiMomentumSGD(two_groups(resumed_model, lr=0.02), container=container)
    resumed.load_state_dict(loaded["opt"])
    train(resumed_model, resumed, data[4:])
    assert_same_params(ref_model, resumed_model)
    _assert_same_nested_state(ref, resumed, ref_model, resumed_model)

    # unfused for 3 steps, then fused: the probe seeds its own tensors from the existing buffers
    model = TinyNet()
    opt = MultiMomentumSGD(two_groups(model, lr=0.02), container=container)
    train(model, opt, data[:3])
    fuse_optimizer(opt, replace_step=True)
    train(model, opt, data[3:])
    assert fusion_report(opt).group_paths == ["elementwise", "elementwise"], fusion_report(opt)
    assert_same_params(ref_model, model)
    _assert_same_nested_state(ref, opt, ref_model, model)


def test_a_buffer_replaced_between_steps_is_stepped_from_its_new_values():
    plain_model, plain, fused_model, fused = _pair("dict")
    data = batches(6)
    train(plain_model, plain, data[:3])
    train(fused_model, fused, data[:3])
    for opt, model in ((plain, plain_model), (fused, fused_model)):
        opt.state[model.fc1.weight]["buffers"][0.9] = torch.full_like(model.fc1.weight, 0.5)  # a user's edit
        opt.state[model.fc2.bias]["buffers"][0.99].fill_(-0.25)  # in place
    train(plain_model, plain, data[3:])
    train(fused_model, fused, data[3:])
    assert_same_params(plain_model, fused_model)
    _assert_same_nested_state(plain, fused, plain_model, fused_model)


def test_a_state_dict_saves_each_nested_buffer_compactly():
    """A parameter without state (``unused``) leaves part of each flat buffer uncovered: the state
    dict then holds copies the size of each parameter, as for plain entries, not whole buffers."""
    plain_model, plain, fused_model, fused = _pair("dict")
    data = batches(2)
    train(plain_model, plain, data)
    train(fused_model, fused, data)
    sizes = []
    for opt in (plain, fused):
        saved = io.BytesIO()
        torch.save(opt.state_dict(), saved)
        sizes.append(saved.getbuffer().nbytes)
    for entry in fused.state_dict()["state"].values():
        for _, leaf in _leaves(entry):
            assert leaf.untyped_storage().nbytes() == leaf.numel() * leaf.element_size()
    assert sizes[1] <= sizes[0] * 1.05, sizes
    for entry in fused.state.values():  # the optimizer's own containers still hold the views
        for _, leaf in _leaves(entry):
            assert leaf.untyped_storage().nbytes() > leaf.numel() * leaf.element_size()


def test_pytorch_optimizer_aggmo_is_elementwise_and_compiles():
    pytest.importorskip("pytorch_optimizer")
    import pytorch_optimizer
    from _optimizer_sweep import sweep_one

    outcome = sweep_one("aggmo", pytorch_optimizer.AggMo, compiled=True)  # fused == unfused under LambdaLR
    assert outcome.kind == "elementwise" and outcome.detail.startswith("compiled"), outcome
