"""Cases that used to end in silently different numbers after fusing (issue 29), each against the
unfused optimizer, and each shown to fail with the guard switched off."""

from __future__ import annotations

import pytest
import torch

import bagua_integrations._layout as layout_module
from _fused_utils import TinyNet, assert_same_params, batches, train
from bagua_integrations import fuse_optimizer, fusion_report
from bagua_integrations.fused_optimizer import _fusion
from bagua_integrations.optim import BertAdam


def _clipping_switched_on_after_two_steps(fuse, compile=False):
    model = TinyNet()
    opt = BertAdam(model.parameters(), lr=1e-2, max_grad_norm=0)  # elementwise: fused on plain flat runs
    if fuse:
        opt = fuse_optimizer(opt, compile=compile)
    data = batches(6)
    step = opt.fuse_step if fuse else None
    train(model, opt, data[:2], step=step)
    for group in opt.param_groups:
        group["max_grad_norm"] = 0.05  # now a per-parameter reduction: flat runs would clip them as one
    train(model, opt, data[2:], step=step)
    return model, opt


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_setting_changed_after_fusing_chooses_the_path_again(compile):
    plain, _ = _clipping_switched_on_after_two_steps(False)
    fused, opt = _clipping_switched_on_after_two_steps(True, compile)
    assert fusion_report(opt).group_paths == ["segmented"]
    assert_same_params(plain, fused, rtol=1e-5, atol=1e-7)


def test_without_the_settings_check_the_change_is_silently_wrong(monkeypatch):
    monkeypatch.setattr(layout_module, "settings_signature", lambda group: ())
    plain, _ = _clipping_switched_on_after_two_steps(False)
    fused, opt = _clipping_switched_on_after_two_steps(True)
    assert fusion_report(opt).group_paths == ["elementwise"]
    assert max((a - b).abs().max().item() for a, b in zip(plain.parameters(), fused.parameters())) > 1e-3


def test_a_scheduler_moving_lr_and_momentum_does_not_rebuild_anything():
    model = TinyNet()
    opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), compile=False)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=20)  # cycles momentum too
    generation = _fusion(opt).layout.generation
    for x, y in batches(10):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.fuse_step()
        scheduler.step()
    assert _fusion(opt).layout.generation == generation
