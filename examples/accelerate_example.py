"""Accelerate with a fused optimizer and a Bagua algorithm.

    python examples/accelerate_example.py
    accelerate launch --num_processes 2 --cpu examples/accelerate_example.py   # (or torchrun --nproc_per_node 2)

``hf_plugin.prepare`` is ``accelerator.prepare`` that fuses the optimizer first and, under several
processes, averages gradients with the chosen Bagua algorithm.
"""

import torch
from accelerate import Accelerator

import hf_plugin

accelerator = Accelerator(cpu=not torch.cuda.is_available())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
dataset = torch.utils.data.TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 4, (256,), generator=g))
loader = torch.utils.data.DataLoader(dataset, batch_size=16)

model, optimizer, loader = hf_plugin.prepare(accelerator, model, optimizer, loader, algorithm="gradient_allreduce")
for x, y in loader:
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
report = hf_plugin.fusion_report(optimizer)
if accelerator.is_main_process:
    print(f"{len(loader)} steps, last loss {loss.item():.3f}; {report.fused_params} tensors fused")
