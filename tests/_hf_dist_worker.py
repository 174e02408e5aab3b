"""Worker for the multi-process HF tests: ``torchrun --nproc_per_node 2 tests/_hf_dist_worker.py OUT CASE...``.

Runs tiny-BERT trainings over gloo and writes, from rank 0, one JSON file per case into OUT with
every rank's losses, how far the ranks' final weights are apart, and the fusion report. The test
(tests/test_hf_distributed.py) reads those files and decides; the worker only measures.

Cases:
  trainer-<name>      Trainer / BaguaTrainer; <name> is ddp (plain Trainer, its own AdamW),
                      fused (BaguaTrainer, plain DDP), or an algorithm name. A suffix "@sgd"
                      trains with plain SGD and no clipping (linear updates: averaging weights
                      after local steps equals averaging gradients); "@ga" accumulates gradients
                      over 2 micro-batches (DDP's no_sync in between); "@qadam" trains with
                      bagua_integrations.optim.QAdam and no clipping.
  accelerate-<name>   a plain Accelerate loop; <name> is ddp (accelerator.prepare, unfused)
                      or an algorithm name (hf_plugin.prepare).
  mismatch            rank 0 asks for bytegrad, rank 1 for gradient_allreduce: must fail by name.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _hf_utils as U  # noqa: E402
from _dist_utils import run_cases_in_worker  # noqa: E402

STEPS = 12
ALGO_KWARGS = {
    "decentralized": {"peer_selection_mode": "all"},
    "bmuf": {"global_sync_iter": 4, "warmup_iterations": 0, "block_momentum": 0.5},
    "async": {"sync_interval_ms": 0, "warmup_steps": 2, "timeout": 60},
}


def gather_flat(vector: torch.Tensor):
    parts = [torch.zeros_like(vector) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, vector.contiguous())
    return parts


def gather_object(obj):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def report_dict(optimizer):
    import hf_plugin

    if not hf_plugin.is_fused(optimizer):
        return None
    r = hf_plugin.fusion_report(optimizer)
    groups = hf_plugin.unwrap_optimizer(optimizer).param_groups
    flat = all(len({p.untyped_storage().data_ptr() for p in g["params"]}) <= 1 for g in groups)
    return {"fused_params": r.fused_params, "unfused_params": r.unfused_params,
            "fused_steps": r.fused_steps, "last_step_fused": r.last_step_fused, "flat_views": flat}


def summarize(losses, final, initial, optimizer, extra=None):
    finals = gather_flat(final)
    result = {
        "losses": gather_object(losses),
        "rank_spread": max((f - finals[0]).abs().max().item() for f in finals),
        "moved": (finals[0] - initial).abs().max().item(),
        "final0": finals[0].tolist(),
        "report": report_dict(optimizer),
        "world": dist.get_world_size(),
    }
    result.update(extra or {})
    return result


VARIANTS = {
    "sgd": {"optim": "sgd", "max_grad_norm": 0.0, "learning_rate": 0.2, "weight_decay": 0.01},
    "ga": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
    "qadam": {"max_grad_norm": 0.0},  # and the QAdam optimizer (warm-up 4 updates)
}
QADAM_WARMUP = 4


def run_trainer_case(name, out_dir):
    import hf_plugin
    from transformers import Trainer

    name, _, variant = name.partition("@")
    model = U.tiny_bert()
    initial = U.flat_params(model)
    recorder = U.LossRecorder(model)
    settings = dict(max_steps=STEPS, ddp_timeout=120, per_device_train_batch_size=4)
    settings.update(VARIANTS.get(variant, {}))
    args = U.training_args(os.path.join(out_dir, f"run-{name}-{variant}"), **settings)
    kwargs = dict(model=model, args=args, train_dataset=U.make_dataset(64))
    if variant == "qadam":
        from bagua_integrations.optim import QAdam

        kwargs["optimizers"] = (QAdam(model.parameters(), lr=args.learning_rate, warmup_steps=QADAM_WARMUP), None)
    if name == "ddp":
        trainer = Trainer(**kwargs)
    elif name == "fused":
        trainer = hf_plugin.BaguaTrainer(**kwargs)
    elif name == "decentralized+autotune":
        trainer = hf_plugin.BaguaTrainer(**kwargs, bagua_algorithm="decentralized",
                                         bagua_algorithm_kwargs=ALGO_KWARGS["decentralized"],
                                         bagua_autotune={"max_trials": 3, "interval": 2, "intervals": [1, 2, 3]})
    else:
        trainer = hf_plugin.BaguaTrainer(**kwargs, bagua_algorithm=name, bagua_algorithm_kwargs=ALGO_KWARGS.get(name))
    trainer.train()
    extra = {}
    if name == "async":  # background rounds ran during train(); its end aborted them (one synchronous average)
        algorithm = trainer.bagua_callback.attachment.algorithm
        extra["async_rounds"] = gather_object(algorithm.rounds_applied)
        extra["async_aborted"] = algorithm.aborted
    if name == "decentralized+autotune":
        session = trainer.bagua_callback.attachment.session
        report = session.autotuner.report()
        extra = {"autotune_trials": len(report["history"]), "autotune_done": report["done"],
                 "intervals": gather_object(session.algorithm.communication_interval)}
        recorder.remove()
        return summarize(recorder.losses, U.flat_params(model), initial, trainer.optimizer, extra)
    recorder.remove()
    wrapped = type(trainer.model_wrapped).__name__
    callback = getattr(trainer, "bagua_callback", None)
    updates = callback.attachment.updates if callback is not None and callback.attachment is not None else None
    return summarize(recorder.losses, U.flat_params(model), initial, trainer.optimizer,
                     {"wrapped": wrapped, "after_step_calls": updates, **extra})


def run_accelerate_case(name, out_dir):
    data = U.make_dataset(64)
    # each rank trains on its own shard (Accelerate's prepared DataLoader shards by rank)
    result = U.accelerate_loop(
        fused=name != "ddp", steps=STEPS, batch_size=4, dataset=data,
        algorithm=None if name in ("ddp", "fused") else name, algorithm_kwargs=ALGO_KWARGS.get(name),
    )
    attachment = getattr(result["wrapped"], "bagua_attachment", None)
    return summarize(result["losses"], result["final"], result["initial"], result["optimizer"],
                     {"wrapped": type(result["wrapped"]).__name__,
                      "after_step_calls": attachment.updates if attachment is not None else None})


def run_accelerate_clip_case(name, out_dir):
    """qadam under a custom Accelerate loop that clips: the first clip raises, on every rank."""
    import hf_plugin
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from bagua_integrations.optim import QAdam

    accelerator = Accelerator(cpu=True)
    model = U.tiny_bert()
    optimizer = QAdam(model.parameters(), lr=1e-3, warmup_steps=QADAM_WARMUP)
    loader = DataLoader(U.make_dataset(16), batch_size=4, collate_fn=U.collate)
    model, optimizer, loader = hf_plugin.prepare(accelerator, model, optimizer, loader, algorithm="qadam")
    accelerator.backward(model(**next(iter(loader))).loss)
    try:
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    except Exception as error:  # noqa: BLE001 - the test wants the error's name and message
        return {"error": type(error).__name__, "message": str(error)[:500]}
    return {"error": None}


def run_mismatch_case(name, out_dir):
    import hf_plugin

    rank = dist.get_rank()
    algorithm = "bytegrad" if rank == 0 else "gradient_allreduce"
    args = U.training_args(os.path.join(out_dir, "run-mismatch"), max_steps=2, ddp_timeout=60)
    trainer = hf_plugin.BaguaTrainer(model=U.tiny_bert(), args=args, train_dataset=U.make_dataset(16),
                                     bagua_algorithm=algorithm, bagua_algorithm_kwargs={"timeout": 30})
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001 - the test wants the error's name and message
        return {"error": type(error).__name__, "message": str(error)[:500]}
    return {"error": None}


RUNNERS = {"trainer": run_trainer_case, "accelerate": run_accelerate_case, "mismatch": run_mismatch_case}


def main():
    out_dir, cases = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    from bagua_integrations.distributed import collective_log

    def before_each():
        U.reset_accelerate_state()
        collective_log.reset()

    def run_case(case):
        kind, _, name = case.partition("-")
        if case == "accelerate-qadam+clip":
            return run_accelerate_clip_case(name, out_dir)
        if kind not in RUNNERS:
            raise ValueError(f"unknown case {case!r}")
        return RUNNERS[kind](name, out_dir)

    run_cases_in_worker(out_dir, cases, run_case, before_each,
                        extra=lambda: {"collectives": dict(collective_log.calls)})


if __name__ == "__main__":
    main()
