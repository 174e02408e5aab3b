"""Fuse any PyTorch optimizer: AdamW and BertAdam (Bagua's defaults, per-parameter clipping).

    python examples/fused_optimizer.py

A small model on random data, trained fused and, from the same start, unfused. The fused
optimizer is the same object (still an AdamW / BertAdam); its parameters, gradients and state live
in flat buffers, and ``fuse_step()`` runs the optimizer's own step on them (``step()`` stays the
ordinary unfused step unless ``fuse_optimizer(..., replace_step=True)``).
"""

import torch

from bagua_integrations import fuse_optimizer, fusion_report
from bagua_integrations.optim import BertAdam


def make_model():
    torch.manual_seed(0)  # every model starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def batches(steps=20):
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        yield torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)


def train_unfused(make_optimizer):
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    for x, y in batches():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def largest_difference(model, reference):
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


# AdamW, fused: an elementwise step, one kernel per flat buffer
model = make_model()
optimizer = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
for x, y in batches():
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.fuse_step()
print(fusion_report(optimizer))

difference = largest_difference(model, train_unfused(lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)))
print(f"AdamW: path {fusion_report(optimizer).group_paths[0]}, largest difference from the unfused run {difference:.1e}")
assert difference < 1e-5

# BertAdam as in Bagua's benchmark: each parameter's gradient clipped to norm 1.0, warm-up schedule
model = make_model()
optimizer = fuse_optimizer(BertAdam(model.parameters(), lr=1e-3, warmup=0.1, t_total=20))
for x, y in batches():
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.fuse_step()

difference = largest_difference(model, train_unfused(lambda params: BertAdam(params, lr=1e-3, warmup=0.1, t_total=20)))
print(f"BertAdam: path {fusion_report(optimizer).group_paths[0]}, largest difference from the unfused run {difference:.1e}")
assert difference < 1e-5
