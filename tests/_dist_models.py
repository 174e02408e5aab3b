"""Tiny models, data and references shared by the distributed tests (run inside spawned ranks)."""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F

IN, HIDDEN, OUT = 8, 16, 4


class MLP(torch.nn.Module):
    """Three small Linear layers; built from a fixed seed so every rank starts identical."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Branchy(torch.nn.Module):
    """A side branch some ranks use on some steps, and a layer nobody ever uses."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)
        self.side = torch.nn.Linear(HIDDEN, OUT)
        self.never = torch.nn.Linear(OUT, OUT)

    def forward(self, x, use_side: bool = False):
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h)
        return out + self.side(h) if use_side else out


def global_batches(steps: int, rows_per_rank: int, world_size: int, seed: int = 1) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank; rank ``r`` trains on rows ``r::world_size``'s block."""
    gen = torch.Generator().manual_seed(seed)
    n = rows_per_rank * world_size
    return [(torch.randn(n, IN, generator=gen), torch.randn(n, OUT, generator=gen)) for _ in range(steps)]


def local_batches(steps: int, rows: int, rank: int, seed: int = 7) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Different data on every rank (for algorithms whose replicas drift apart)."""
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    return [(torch.randn(rows, IN, generator=gen), torch.randn(rows, OUT, generator=gen)) for _ in range(steps)]


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows = t.shape[0] // world_size
    return t[rank * rows : (rank + 1) * rows]


def loss_fn(model, x, y, **kwargs):
    return F.mse_loss(model(x, **kwargs), y)


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((pa.detach() - pb.detach()).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gather_flat(t: torch.Tensor) -> List[torch.Tensor]:
    """Every rank's copy of ``t``."""
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t.contiguous())
    return out
