"""Shared helpers for the HuggingFace plugin tests: a tiny BERT, generated data, loss capture.

Everything is built from a config and random numbers: no download, CPU only. Also imported by
the multi-process worker script (``tests/_hf_dist_worker.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings

# An editable install made before hf_plugin existed does not map it; the checkout is the package.
if importlib.util.find_spec("hf_plugin") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

VOCAB = 100
SEQ = 16
SEED = 0


def tiny_bert(seed: int = SEED, dropout: float = 0.0):
    """BertForSequenceClassification with 2 layers of width 32 (about 60k parameters)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        num_labels=2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


def make_dataset(n: int = 64, seed: int = SEED + 1, seq: int = SEQ):
    """A learnable toy task: label = whether token 1 occurs more often than token 2."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, seq), generator=gen)
    extra = torch.randint(0, 4, (n, 2), generator=gen)
    for i in range(n):
        ids[i, 1 : 1 + extra[i, 0]] = 1
        ids[i, 8 : 8 + extra[i, 1]] = 2
    ids[:, 0] = 0  # [CLS]-like
    labels = (extra[:, 0] > extra[:, 1]).long()
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long), "labels": labels[i]}
        for i in range(n)
    ]


def training_args(output_dir, **overrides):
    from transformers import TrainingArguments

    base = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        weight_decay=0.01,
        max_steps=20,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=SEED,
        data_seed=SEED,
        disable_tqdm=True,
        dataloader_num_workers=0,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=1.0,
    )
    base.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TrainingArguments(**base)


class LossRecorder:
    """Records every forward loss of a model (a forward hook, so any Trainer subclass works)."""

    def __init__(self, model):
        self.losses = []
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        loss = getattr(output, "loss", None)
        if loss is not None and module.training:
            self.losses.append(loss.detach().double().item())

    def remove(self):
        self.handle.remove()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def reset_accelerate_state():
    """Accelerate keeps process-wide singletons; tests switching mixed precision must clear them."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run_trainer(
    output_dir, how="default", seed=SEED, dataset=None, trainer_kwargs=None, train_kwargs=None, fused_kwargs=None,
    **arg_overrides,
):
    """Train the tiny BERT with Trainer; ``how`` picks the optimizer path.

    default: Trainer's own optimizer; optimizers: create_fused_optimizer(model, args, **fused_kwargs);
    cls_and_kwargs: Trainer(optimizer_cls_and_kwargs=fused_optimizer_cls_and_kwargs(args));
    bagua_trainer: BaguaTrainer (fuses Trainer's optimizer itself).
    Returns a dict with losses, initial and final parameters, and the trainer.
    """
    import hf_plugin
    from transformers import Trainer

    model = tiny_bert(seed=seed)
    initial = flat_params(model)
    recorder = LossRecorder(model)
    args = training_args(output_dir, **arg_overrides)
    kwargs = dict(model=model, args=args, train_dataset=dataset if dataset is not None else make_dataset())
    kwargs.update(trainer_kwargs or {})
    cls = Trainer
    if how == "optimizers":
        kwargs["optimizers"] = (hf_plugin.create_fused_optimizer(model, args, **(fused_kwargs or {})), None)
    elif how == "cls_and_kwargs":
        kwargs["optimizer_cls_and_kwargs"] = hf_plugin.fused_optimizer_cls_and_kwargs(args)
    elif how == "bagua_trainer":
        cls = hf_plugin.BaguaTrainer
    elif how != "default":
        raise ValueError(how)
    trainer = cls(**kwargs)
    trainer.train(**(train_kwargs or {}))
    recorder.remove()
    return {
        "losses": recorder.losses, "initial": initial, "final": flat_params(model), "trainer": trainer, "model": model,
        "optimizer": trainer.optimizer,
    }


TOL = dict(rtol=1e-6, atol=1e-6)  # fp32: the fused update is the optimizer's own elementwise math


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Import into a test module to run each test with fresh Accelerate singletons."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def assert_matches_unfused(ref, got, fused_steps):
    """``got`` (fused) trained like ``ref`` (unfused) at fp32 tolerance, and fusion held to the last step."""
    import hf_plugin

    assert len(got["losses"]) == len(ref["losses"]) > 0
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
    torch.testing.assert_close(got["final"], ref["final"], **TOL)
    # The comparison means something: training moved the weights far beyond the tolerance.
    assert (ref["final"] - ref["initial"]).abs().max().item() > 1e-3
    assert not hf_plugin.is_fused(ref["optimizer"])
    report = hf_plugin.fusion_report(got["optimizer"])
    assert report.fused_steps == fused_steps
    assert report.last_step_fused and report.unfused_params == 0
    assert report.fused_params == sum(1 for p in got["model"].parameters() if p.requires_grad)
    assert_params_are_flat_views(got["optimizer"])


def assert_params_are_flat_views(optimizer):
    """Every non-empty param group lives in one flat storage (fusion still in place)."""
    import hf_plugin

    inner = hf_plugin.unwrap_optimizer(optimizer)
    for index, group in enumerate(inner.param_groups):
        storages = {p.untyped_storage().data_ptr() for p in group["params"]}
        assert len(storages) <= 1, f"param group {index} spans {len(storages)} storages: fusion was undone"


def collate(items):
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def accelerate_loop(
    fused,
    steps=12,
    mixed_precision="no",
    scaler=None,
    fp16_autocast=False,
    accumulation=1,
    poison_steps=(),
    algorithm=None,
    algorithm_kwargs=None,
    dataset=None,
    batch_size=8,
    lr=1e-3,
    on_step=None,
    optimizer_kwargs=None,
):
    """A plain Accelerate loop over the tiny BERT; ``fused`` picks hf_plugin.prepare over accelerator.prepare.

    scaler: a GradScaler given to the Accelerator before prepare (on CPU Accelerate makes none itself);
    fp16_autocast: run forward under CPU float16 autocast (the GradScaler-style fp16 simulation);
    poison_steps: optimizer steps (0-based) whose gradient gets an inf, which the scaler must skip.
    """
    import hf_plugin
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=accumulation)
    if scaler is not None:
        accelerator.scaler = scaler
    model = tiny_bert()
    initial = flat_params(model)
    optimizer = torch.optim.AdamW(hf_plugin.trainer_param_groups(model, 0.01), lr=lr, **(optimizer_kwargs or {}))
    loader = DataLoader(dataset if dataset is not None else make_dataset(), batch_size=batch_size, collate_fn=collate)
    schedule = get_linear_schedule_with_warmup(optimizer, 2, steps)
    if fused:
        model, optimizer, loader, schedule = hf_plugin.prepare(
            accelerator, model, optimizer, loader, schedule, algorithm=algorithm, algorithm_kwargs=algorithm_kwargs
        )
    else:
        model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    losses, skipped, step = [], [], 0
    while step < steps:
        for batch in loader:
            with accelerator.accumulate(model):
                context = torch.autocast("cpu", dtype=torch.float16) if fp16_autocast else contextlib.nullcontext()
                with context:
                    loss = model(**batch).loss
                accelerator.backward(loss)
                losses.append(loss.detach().double().item())
                if accelerator.sync_gradients and step in poison_steps:
                    next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                skipped.append(bool(optimizer.step_was_skipped))
                if on_step is not None:
                    on_step(step, model, optimizer)
                step += 1
                if step >= steps:
                    break
    unwrapped = accelerator.unwrap_model(model)
    return {
        "losses": losses,
        "skipped": skipped,
        "initial": initial,
        "final": flat_params(unwrapped),
        "optimizer": optimizer,
        "model": unwrapped,
        "wrapped": model,
        "accelerator": accelerator,
    }
