"""A multi-stage algorithm as DDP's communication hook (the HF Trainer and Accelerate integrations).

The hook overlaps backward as the reducer does: each call launches its bucket's first
collective and takes the previous bucket's next stage, and the futures DDP gets are completed
later. A future that nothing completes hangs DDP forever, so every order in which DDP really
calls the hook is run here on 2 gloo ranks, each within a deadline:

* the usual one: buckets 0..n-1, the last with ``is_last()``;
* ``static_graph=True``: in the first backward DDP calls every bucket as index 0, none last
  (one bucket per dtype: two and three here; with three, the third call follows one that
  already ran to completion, so nothing is queued when it repeats the index);
* ``skip_all_reduce_unused_params=True`` (newer torch): the bucket of unused parameters gets no
  call; when it is the last bucket, the last call never comes.

Reference: the exact average of the ranks' gradients, with plain ``torch.distributed``; ByteGrad
must be within its quantization error of it on every backward.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from _dist_utils import run_ranks, values

DIM = 64


class Usual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).mean()


class TwoDtypes(Usual):
    """float32 and float64 parameters: DDP makes one bucket per dtype even before its first backward."""

    def __init__(self):
        super().__init__()
        self.b.double()

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)).double())).float()).pow(2).mean()


class ThreeDtypes(TwoDtypes):
    """float32, float64 and bfloat16 parameters: three buckets, all called as index 0 first."""

    def __init__(self):
        super().__init__()
        self.d = torch.nn.Linear(DIM, DIM).bfloat16()

    def forward(self, x):
        return self.d(super().forward(x).reshape(1, 1).expand(1, DIM).bfloat16()).float().pow(2).mean()


class UnusedFirst(Usual):
    """A module that never gets a gradient, registered first: its parameters fill DDP's last bucket."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(DIM, DIM)
        # registered first: DDP buckets parameters in reverse order
        self._modules = {"unused": self._modules.pop("unused"), **self._modules}


CASES = {
    "usual": (Usual, {}),
    "static_graph": (TwoDtypes, {"static_graph": True}),
    "static_graph_three_buckets": (ThreeDtypes, {"static_graph": True}),
    "skip_unused_last_bucket": (UnusedFirst, {"find_unused_parameters": True, "skip_all_reduce_unused_params": True}),
}


def _batch(rank, step):
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(100 * rank + step))


def _train(rank, world, case, steps=3):
    from bagua_integrations.distributed import get_algorithm

    model_class, options = CASES[case]
    model = model_class()
    replica = model_class()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=DIM * DIM * 4 / 2**20, **options)
    algorithm = get_algorithm("bytegrad", hierarchical=False)
    calls = []

    def hook(state, bucket):
        calls.append((step, bucket.index(), bucket.is_last()))
        return algorithm.ddp_comm_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    results = []
    for step in range(steps):
        x = _batch(rank, step)
        replica.zero_grad()
        replica(x).backward()
        local = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in replica.parameters()]
        exact = [g.clone() for g in local]
        for g in exact:
            dist.all_reduce(g)
            g /= world
        model.zero_grad()
        ddp(x).backward()
        # min-max uint8 errs by at most each rank's chunk range / 510, then the average's
        flat_local = torch.cat([g.double().reshape(-1) for g in local])
        flat_exact = torch.cat([g.double().reshape(-1) for g in exact])
        ranges = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(ranges, (flat_local.max() - flat_local.min()).reshape(1))
        bound = (max(r.item() for r in ranges) + (flat_exact.max() - flat_exact.min()).item()) / 510 * 1.01 + 1e-6
        reduced = [(p.grad - want).abs().max().item() for p, want in zip(model.parameters(), exact)
                   if p.grad is not None]  # None: skipped by DDP, never reduced
        results.append((max(reduced), bound))
    return {"errors": results, "calls": calls}


@pytest.mark.parametrize("case", list(CASES))
def test_every_order_ddp_calls_the_hook_in_completes_every_bucket(case):
    if "skip_all_reduce_unused_params" in CASES[case][1] and "skip_all_reduce_unused_params" not in inspect.signature(
            torch.nn.parallel.DistributedDataParallel).parameters:
        pytest.skip("this torch's DDP has no skip_all_reduce_unused_params")
    results = values(run_ranks(_train, 2, (case,), timeout=120))
    calls = results[0]["calls"]
    assert all(result["calls"] == calls for result in results)
    if case.startswith("static_graph"):  # the order this case is about: the first backward's buckets all as index 0
        buckets = 3 if case.endswith("three_buckets") else 2  # one per dtype
        assert [(index, last) for step, index, last in calls if step == 0] == [(0, False)] * buckets, calls
    if case == "skip_unused_last_bucket":  # ... and here: no call is the last one
        assert not any(last for _, _, last in calls), calls
    for result in results:
        assert result["errors"], result
        for error, bound in result["errors"]:
            assert 0 <= error <= bound, result["errors"]
