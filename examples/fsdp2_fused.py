"""A fused optimizer under PyTorch's FSDP2 (``fully_shard``): each rank fuses the shards it holds.

    torchrun --nproc_per_node 2 examples/fsdp2_fused.py [adamw|lamb]

Runs on CPU with gloo (NCCL on GPUs). LAMB's trust ratio needs the norm of each whole parameter, which
lives on several ranks: the fused step combines every rank's partial norms, one all-reduce per norm for
all parameters. At the end the fused run is compared with the unfused optimizer on the same model.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bagua_integrations import fuse_optimizer, fusion_report
from bagua_integrations.optim import Lamb

name = sys.argv[1] if len(sys.argv) > 1 else "lamb"
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world,))


def sharded_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 63), torch.nn.GELU(), torch.nn.Linear(63, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def make_optimizer(params):
    return Lamb(params, lr=1e-2, weight_decay=0.01) if name == "lamb" else torch.optim.AdamW(params, lr=1e-2)


def train(model, optimizer):
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own share of the data
    for step in range(10):
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return loss


model = sharded_model()
optimizer = fuse_optimizer(make_optimizer(model.parameters()), replace_step=True)  # after fully_shard
loss = train(model, optimizer)

reference = sharded_model()
train(reference, make_optimizer(reference.parameters()))
difference = max((p.full_tensor() - q.full_tensor()).abs().max().item()
                 for p, q in zip(model.parameters(), reference.parameters()))
if rank == 0:
    print(fusion_report(optimizer))
    print(f"{name} on {world} ranks: last loss {loss.item():.3f}, largest difference to unfused {difference:.1e}")
dist.destroy_process_group()
