"""Bagua's algorithms on torch.distributed, with a fused optimizer.

    torchrun --nproc_per_node 2 examples/distributed_torchrun.py [ALGORITHM]

ALGORITHM is one of ``bagua_integrations.list_algorithms()`` (default ``gradient_allreduce``). Runs
on CPU with gloo (NCCL on GPUs). The loop is an ordinary PyTorch loop: after ``bagua_init`` it calls
``optimizer.step()`` as usual (with a fused optimizer ``fuse_step()`` works too); gradients are
averaged during ``backward()`` and model algorithms act right after the step.
"""

import sys

import torch
import torch.distributed as dist

from bagua_integrations import bagua_init, fuse_optimizer

algorithm = sys.argv[1] if len(sys.argv) > 1 else "gradient_allreduce"
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(rank)  # different start on each rank: bagua_init broadcasts rank 0's weights
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
optimizer = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))  # optional, before bagua_init
model, optimizer = bagua_init(model, optimizer, distributed_algorithm=algorithm)

data = torch.Generator().manual_seed(100 + rank)  # each rank its own share of the data
for step in range(20):
    x, y = torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()

# under gradient_allreduce / bytegrad every rank holds the same weights
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(weights) for _ in range(world)]
dist.all_gather(gathered, weights)
spread = max((g - weights).abs().max().item() for g in gathered)
if rank == 0:
    print(f"{algorithm} on {world} ranks: last loss {loss.item():.3f}, largest weight difference between ranks {spread:.1e}")
dist.destroy_process_group()
