"""Fuse any PyTorch optimizer: AdamW and BertAdam (Bagua's defaults, per-parameter clipping).

    python examples/fused_optimizer.py

A small model on random data, trained twice from the same start: unfused and fused. The fused
optimizer is the same object (still an AdamW / BertAdam); its parameters, gradients and state live
in flat buffers, and ``fuse_step()`` runs the optimizer's own step on them.
"""

import torch

from bagua_integrations import fuse_optimizer, fusion_report
from bagua_integrations.optim import BertAdam


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def train(model, optimizer, fused, steps=20):
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.fuse_step() if fused else optimizer.step()


for name, make_optimizer in [
    ("AdamW", lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)),
    ("BertAdam", lambda params: BertAdam(params, lr=1e-3, warmup=0.1, t_total=20)),  # clips each parameter to 1.0
]:
    plain, fused = make_model(), make_model()
    train(plain, make_optimizer(plain.parameters()), fused=False)
    optimizer = fuse_optimizer(make_optimizer(fused.parameters()))
    train(fused, optimizer, fused=True)
    difference = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), fused.parameters()))
    report = fusion_report(optimizer)
    print(f"{name}: path {report.group_paths[0]}, {report.fused_params} tensors in {report.flat_buffers} flat "
          f"buffer(s), largest difference from the unfused run {difference:.1e}")
    assert difference < 1e-5
