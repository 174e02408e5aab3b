"""FSDP2 front end: every row is one plain PyTorch training loop over the model sharded by ``fully_shard``.

HF Trainer cannot run FSDP on CPU (Accelerate enables FSDP on accelerators only), so this front end is
the loop FSDP2 users write themselves: ``fully_shard`` per encoder layer, then the root, on one mesh
over every process (gloo on CPU, NCCL on GPUs; ``torchrun --nproc_per_node N``, or one process, a
mesh of one). It takes everything else from the HF front end: the data, the model, the settings
(``HFPlan``) and the rows' optimizers (``build_optimizer``: fused rows are
``hf_plugin.create_fused_optimizer``, which fuses each rank's shards). The front end clips the global
gradient norm and schedules the learning rate (linear warmup, then decay) where the row says so,
exactly as Trainer does. Each rank takes every N-th example of each epoch's shuffled order.
"""

from __future__ import annotations

import gc
import math
import os
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .hf_frontend import HFPlan, build_optimizer
from .results import RowResult
from .rows import Row

__all__ = ["run_fsdp"]


def _process_group() -> None:
    """One process run directly (no torchrun) gets a process group of one."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` each encoder layer, then the whole model (FSDP2's usual wrapping of a transformer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = _device()
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.base_model.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batches(dataset, indices: List[int], batch_size: int, device: torch.device):
    for start in range(0, len(indices), batch_size):
        items = [dataset[i] for i in indices[start: start + batch_size]]
        yield {key: torch.stack([item[key] for item in items]).to(device) for key in items[0]}


def _rank_share(n: int, epoch: int, seed: int, shuffle: bool = True) -> List[int]:
    """This rank's examples of one epoch: every world-th index of a seeded shuffle (padded like
    ``DistributedSampler``, so every rank takes the same number of steps)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle
             else torch.arange(n)).tolist()
    per_rank = math.ceil(n / world)
    order += order[: per_rank * world - n]
    return order[rank::world]


def _accuracy(model, dataset, batch_size: int, device: torch.device) -> float:
    model.eval()
    correct = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in _batches(dataset, _rank_share(len(dataset), 0, 0, shuffle=False), batch_size, device):
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            correct += torch.tensor([float((logits.argmax(-1) == batch["labels"]).sum()), len(batch["labels"])],
                                    dtype=torch.float64, device=device)
    dist.all_reduce(correct)
    model.train()
    return float(correct[0] / correct[1])


def run_row(plan: HFPlan, row: Row) -> RowResult:
    from transformers import get_linear_schedule_with_warmup

    from bagua_integrations import fusion_report, is_fused_optimizer

    preset, total = plan.preset, plan.total_steps()
    result = RowResult("fsdp", row.key, row.label, fuse=row.fuse, clipping=row.clipping(preset.max_grad_norm),
                       schedule=row.schedule(preset.warmup_ratio, total))
    train_ds, valid_ds = plan.datasets()
    args = plan.training_args(row)
    device = _device()
    model = shard(plan.build_model())
    model.train()
    optimizer = build_optimizer(row, model, args, total_steps=total, warmup_ratio=preset.warmup_ratio)
    scheduler = (get_linear_schedule_with_warmup(optimizer, int(preset.warmup_ratio * total), total)
                 if row.frontend_clips_and_schedules else None)
    fused = is_fused_optimizer(optimizer)

    def report():
        return fusion_report(optimizer) if fused else None

    full, done, epochs, compiled_steps = plan.steps_per_epoch(), 0, [], []
    for epoch in range(math.ceil(preset.epochs)):
        dist.barrier()
        epoch_started = last = time.perf_counter()
        record = {"steps": 0, "optimizer_s": 0.0, "compile_s": 0.0, "updates": [], "optimizers": []}
        for batch in _batches(train_ds, _rank_share(len(train_ds), epoch, plan.seed), preset.batch_size, device):
            if done == total:
                break
            model(**batch).loss.backward()
            if row.frontend_clips:
                torch.nn.utils.clip_grad_norm_(model.parameters(), preset.max_grad_norm)
            compile_before = getattr(report(), "compile_seconds", 0.0)
            started = time.perf_counter()
            optimizer.step()
            now = time.perf_counter()
            after = report()
            compile_s = getattr(after, "compile_seconds", 0.0) - compile_before
            if after is not None:
                compiled_steps.append(bool(after.compiled))
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            record["steps"] += 1
            record["optimizer_s"] += now - started - compile_s
            record["compile_s"] += compile_s
            record["updates"].append(now - last - compile_s)
            record["optimizers"].append(now - started - compile_s)
            last, done = now, done + 1
        if record["steps"]:
            record["seconds"] = time.perf_counter() - epoch_started - record["compile_s"]
            epochs.append(record)
    result.accuracy = _accuracy(model, valid_ds, preset.batch_size * 2, device)

    result.record_epochs(epochs, full)
    if fused:
        result.record_fusion(report(), compiled_steps)
    result.extra["world_size"] = dist.get_world_size()
    optimizer = model = scheduler = None  # (freed before the next row builds its model)
    gc.collect()
    return result


def run_fsdp(plan: HFPlan, rows: Sequence[Row], on_result=None) -> List[RowResult]:
    """Run ``rows`` back to back under FSDP2. A failing row fails every rank (the others would wait in
    its collectives), so it is raised, not reported."""
    _process_group()
    results = []
    for row in rows:
        if dist.get_rank() == 0:
            print(f"\n[fsdp] {row.label} ({dist.get_world_size()} process(es), fully_shard)", flush=True)
        result = run_row(plan, row)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def fsdp_notes(world: int) -> Optional[str]:
    return (f"fsdp rows: a plain PyTorch loop, the model sharded by FSDP2's fully_shard (per encoder layer, then "
            f"the root) over {world} process(es); fused rows fuse each rank's shards; times are rank 0's.")
