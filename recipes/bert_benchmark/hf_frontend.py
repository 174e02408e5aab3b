"""HF Trainer front end: every row is one ``transformers.Trainer`` run on the same model, data and seed.

The optimizer of each row is built by the recipe and handed to Trainer with
``Trainer(optimizers=(optimizer, None))``; Trainer builds the scheduler from ``TrainingArguments``.
For the rows of BertAdam with its defaults (``row.bertadam_defaults``: Bagua's rows) BertAdam
clips each parameter's gradient and schedules its own learning rate (``warmup``/``t_total``), so
Trainer gets ``max_grad_norm=0`` (no clipping) and ``lr_scheduler_type="constant"`` with no warmup;
for every other row Trainer clips globally (``max_grad_norm``) and schedules (linear warmup/decay).
Fused rows are built by ``hf_plugin.create_fused_optimizer(model, args, cls, compile=...)``;
unfused rows use the same parameter groups (``hf_plugin.trainer_param_groups``: Trainer's decay /
no-decay split).

:class:`StepTimer` (a ``TrainerCallback``) measures, per epoch, the wall time from
``on_epoch_begin`` to ``on_epoch_end`` and the time of every ``optimizer.step()`` (between
``on_pre_optimizer_step`` and ``on_optimizer_step``); the compile time of a compiled row is
measured by the fused optimizer itself and subtracted from both.
"""

from __future__ import annotations

import gc
import math
import os
import time
from typing import List, Optional, Sequence

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from bagua_integrations.optim import BertAdam, QAdam  # noqa: E402

from .data import Example, WordTokenizer  # noqa: E402
from .presets import Preset  # noqa: E402
from .results import RowResult  # noqa: E402
from .rows import Row  # noqa: E402

__all__ = ["HFPlan", "run_hf", "build_optimizer", "StepTimer"]


class HFPlan:
    """Everything the HF rows share: preset, tokenized data, model source, training settings."""

    def __init__(
        self,
        preset: Preset,
        train: Sequence[Example],
        valid: Sequence[Example],
        out_dir: str,
        *,
        seed: int = 0,
        model_dir: Optional[str] = None,
        tokenizer: Optional[WordTokenizer] = None,
        num_labels: int = 2,
        precision: str = "fp32",
        bagua_algorithm: Optional[str] = None,
        bagua_algorithm_args: Optional[dict] = None,
        progress: bool = True,
    ):
        self.preset = preset
        self.train_examples = list(train)
        self.valid_examples = list(valid)
        self.out_dir = out_dir
        self.seed = seed
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.num_labels = num_labels
        self.precision = precision
        self.bagua_algorithm = bagua_algorithm
        self.bagua_algorithm_args = dict(bagua_algorithm_args or {})
        self.progress = progress
        self._datasets = None

    # ------------------------------------------------------------------ data
    def datasets(self):
        if self._datasets is None:
            self._datasets = (self._encode(self.train_examples), self._encode(self.valid_examples))
        return self._datasets

    def _encode(self, examples: Sequence[Example]) -> "EncodedDataset":
        length = self.preset.max_seq_len
        if self.model_dir is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
            encoded = tokenizer(
                [e.sentence for e in examples], truncation=True, max_length=length, padding="max_length"
            )
            ids, mask = encoded["input_ids"], encoded["attention_mask"]
        else:
            pairs = [self.tokenizer.encode(e.sentence, length) for e in examples]
            ids, mask = [p[0] for p in pairs], [p[1] for p in pairs]
        return EncodedDataset(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(mask, dtype=torch.long),
            torch.tensor([e.label for e in examples], dtype=torch.long),
        )

    # ------------------------------------------------------------------ model
    def build_model(self):
        from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

        torch.manual_seed(self.seed)
        if self.model_dir is not None:
            return AutoModelForSequenceClassification.from_pretrained(
                self.model_dir, num_labels=self.num_labels, local_files_only=True
            )
        p = self.preset
        config = BertConfig(
            vocab_size=p.vocab_size,
            hidden_size=p.hidden,
            num_hidden_layers=p.layers,
            num_attention_heads=p.heads,
            intermediate_size=p.intermediate,
            max_position_embeddings=p.positions,
            hidden_dropout_prob=p.dropout,
            attention_probs_dropout_prob=p.dropout,
            num_labels=self.num_labels,
        )
        return BertForSequenceClassification(config)

    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    def steps_per_epoch(self) -> int:
        # Trainer's DistributedSampler pads the data to a multiple of the world size, then batches per rank
        per_rank = math.ceil(len(self.train_examples) / self.world_size())
        return math.ceil(per_rank / self.preset.batch_size)

    def total_steps(self) -> int:
        return max(1, math.ceil(self.steps_per_epoch() * self.preset.epochs))

    def training_args(self, row: Row, **overrides):
        from transformers import TrainingArguments

        p = self.preset
        total = self.total_steps()
        frontend = row.frontend_clips_and_schedules  # else BertAdam clips per parameter and schedules itself
        settings = dict(
            output_dir=os.path.join(self.out_dir, "hf", row.key),
            per_device_train_batch_size=p.batch_size,
            per_device_eval_batch_size=p.batch_size * 2,
            num_train_epochs=math.ceil(p.epochs),
            max_steps=total if p.epochs != math.ceil(p.epochs) else -1,
            learning_rate=p.lr,
            weight_decay=p.weight_decay,
            adam_beta1=p.adam_betas[0],
            adam_beta2=p.adam_betas[1],
            adam_epsilon=p.adam_eps,
            max_grad_norm=p.max_grad_norm if row.frontend_clips else 0.0,
            lr_scheduler_type="linear" if frontend else "constant",
            warmup_steps=int(p.warmup_ratio * total) if frontend else 0,
            seed=self.seed,
            data_seed=self.seed,
            eval_strategy="no",
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=not self.progress,
            dataloader_num_workers=0,
            use_cpu=not torch.cuda.is_available(),
            bf16=self.precision == "bf16",
            fp16=self.precision == "fp16",
            skip_memory_metrics=True,
        )
        settings.update(overrides)
        return TrainingArguments(**settings)


class EncodedDataset(torch.utils.data.Dataset):
    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
        self.input_ids, self.attention_mask, self.labels = input_ids, attention_mask, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "labels": self.labels[index],
        }


# ------------------------------------------------------------------------------------ optimizers
def build_optimizer(
    row: Row, model: torch.nn.Module, args, *, total_steps: Optional[int] = None, warmup_ratio: Optional[float] = None
) -> torch.optim.Optimizer:
    """The row's optimizer over Trainer's weight-decay / no-decay groups.

    Unfused rows: the class over ``hf_plugin.trainer_param_groups``. Fused rows: the plugin's one line,
    ``hf_plugin.create_fused_optimizer(model, args, cls, compile=..., **kwargs)``, which builds the same
    groups and fuses with ``replace_step=True``.

    BertAdam rows with ``row.bertadam_defaults`` (Bagua's): ``BertAdam(groups, lr, warmup=warmup_ratio,
    t_total=total_steps)`` -- every other argument at BertAdam's default, so ``max_grad_norm=1.0`` clips each
    parameter's gradient and ``warmup_linear`` schedules the learning rate; ``training_args`` turns Trainer's
    clipping and scheduling off for these rows. Other BertAdam rows: ``max_grad_norm=-1``, ``t_total=-1``
    (Trainer clips globally and schedules).
    """
    import hf_plugin

    if row.optimizer == "bertadam":
        cls = BertAdam
        if row.bertadam_defaults:
            if total_steps is None or warmup_ratio is None:
                raise ValueError(f"row {row.key!r} needs total_steps and warmup_ratio (BertAdam's t_total, warmup)")
            kwargs = dict(warmup=warmup_ratio, t_total=total_steps)  # weight decay: per group
        else:
            kwargs = dict(
                b1=args.adam_beta1,
                b2=args.adam_beta2,
                e=args.adam_epsilon,
                weight_decay=args.weight_decay,
                max_grad_norm=-1.0,  # Trainer clips globally
                t_total=-1,  # Trainer's scheduler sets the learning rate
            )
    elif row.optimizer == "adamw":
        cls = torch.optim.AdamW
        impl = {"foreach": dict(foreach=True), "fused": dict(fused=True), "single": dict(foreach=False)}[row.impl]
        kwargs = dict(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, weight_decay=args.weight_decay,
                      **impl)
    elif row.optimizer == "qadam":
        cls = QAdam
        warmup = max(1, int((warmup_ratio or 0.0) * (total_steps or 0)))
        kwargs = dict(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, warmup_steps=warmup,
                      decoupled_weight_decay=True)  # as the AdamW rows
    else:  # pragma: no cover - rows.py defines the choices
        raise ValueError(f"unknown optimizer {row.optimizer!r}")
    if row.fuse is None:
        return cls(hf_plugin.trainer_param_groups(model, args.weight_decay), lr=args.learning_rate, **kwargs)
    return hf_plugin.create_fused_optimizer(model, args, cls, compile=row.compile, **kwargs)


# ------------------------------------------------------------------------------------ timing
def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepTimer(TrainerCallback):
    """Epoch wall time and per-update ``optimizer.step()`` time, compile time excluded."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.epochs: List[dict] = []
        self.compiled_steps: List[bool] = []  # per fused update: did its step run compiled
        self._epoch = None
        self._step_started = 0.0
        self._compile_before = 0.0
        self._last = 0.0

    def _report(self):
        from bagua_integrations import fusion_report, is_fused_optimizer

        return fusion_report(self.optimizer) if is_fused_optimizer(self.optimizer) else None

    def _compile_seconds(self) -> float:
        report = self._report()
        return report.compile_seconds if report is not None else 0.0

    def on_epoch_begin(self, args, state, control, **kwargs):
        _sync()
        self._last = time.perf_counter()
        self._epoch = {"started": self._last, "steps": 0, "optimizer_s": 0.0, "compile_s": 0.0,
                       "updates": [], "optimizers": []}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        _sync()
        self._compile_before = self._compile_seconds()
        self._step_started = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        _sync()
        now = time.perf_counter()
        elapsed = now - self._step_started
        report = self._report()
        compile_s = (report.compile_seconds if report is not None else 0.0) - self._compile_before
        if report is not None:
            self.compiled_steps.append(bool(report.compiled))
        if self._epoch is not None:
            self._epoch["steps"] += 1
            self._epoch["optimizer_s"] += elapsed - compile_s
            self._epoch["compile_s"] += compile_s
            # one update: from the end of the previous one (or the epoch's start) to the end of this one
            self._epoch["updates"].append(now - self._last - compile_s)
            self._epoch["optimizers"].append(elapsed - compile_s)
        self._last = now

    def on_epoch_end(self, args, state, control, **kwargs):
        _sync()
        if self._epoch is not None and self._epoch["steps"]:
            epoch = self._epoch
            epoch["seconds"] = time.perf_counter() - epoch.pop("started") - epoch["compile_s"]
            self.epochs.append(epoch)
        self._epoch = None


# ------------------------------------------------------------------------------------ one row
def run_row(plan: HFPlan, row: Row) -> RowResult:
    from transformers import Trainer

    from bagua_integrations import fusion_report, is_fused_optimizer

    result = RowResult("hf", row.key, row.label, fuse=row.fuse,
                       clipping=row.clipping(plan.preset.max_grad_norm),
                       schedule=row.schedule(plan.preset.warmup_ratio, plan.total_steps()))
    train_ds, valid_ds = plan.datasets()
    args = plan.training_args(row)
    model = plan.build_model()
    model.to(args.device)  # before fusing: the flat buffers live on the final device
    optimizer = build_optimizer(row, model, args, total_steps=plan.total_steps(), warmup_ratio=plan.preset.warmup_ratio)
    timer = StepTimer(optimizer)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        optimizers=(optimizer, None),
        callbacks=[timer],
    )
    if plan.bagua_algorithm:  # in a single process the plugin warns once that there is nothing to communicate
        import hf_plugin

        hf_plugin.use_bagua_algorithm(trainer, plan.bagua_algorithm, **plan.bagua_algorithm_args)
    trainer.train()
    prediction = trainer.predict(valid_ds)
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    accuracy = float((logits.argmax(-1) == prediction.label_ids).mean())

    result.record_epochs(timer.epochs, plan.steps_per_epoch())
    result.accuracy = accuracy
    if is_fused_optimizer(optimizer):
        result.record_fusion(fusion_report(optimizer), timer.compiled_steps)
    result.extra["train_loss"] = trainer.state.log_history[-1].get("train_loss") if trainer.state.log_history else None
    del trainer, optimizer, model, timer
    gc.collect()
    return result


def warm_up(plan: HFPlan, steps: int = 8) -> None:
    """A few untimed updates first, so that the first timed row does not pay the process's one-time costs
    (thread pools, allocator growth, lazily imported Trainer code) that the other rows then skip."""
    from transformers import Trainer

    args = plan.training_args(
        Row("warmup", "warm-up", "adamw", impl="foreach"), max_steps=min(steps, plan.total_steps()), disable_tqdm=True
    )
    model = plan.build_model()
    trainer = Trainer(model=model, args=args, train_dataset=plan.datasets()[0])
    trainer.train()
    del trainer, model
    gc.collect()


def run_hf(plan: HFPlan, rows: Sequence[Row], on_result=None, warmup_steps: int = 8) -> List[RowResult]:
    """Run ``rows`` back to back; a row that fails is reported as failed and the others still run."""
    results = []
    if warmup_steps > 0 and rows:
        if _is_main():
            print(f"[hf] warm-up: {warmup_steps} untimed updates", flush=True)
        warm_up(plan, warmup_steps)
    for row in rows:
        if _is_main():
            print(f"\n[hf] {row.label}", flush=True)
        try:
            result = run_row(plan, row)
        except Exception as exc:  # one broken row must not cost the whole table
            if plan.world_size() > 1:
                raise  # the other ranks would hang in the next collective
            result = RowResult("hf", row.key, row.label, status="failed", reason=f"{type(exc).__name__}: {exc}")
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
