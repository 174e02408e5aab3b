"""Presets: model shape, data size and training hyper-parameters of one benchmark run.

``cpu`` is chosen so that the optimizer step is a *visible* share of a training step on a
laptop-class CPU, which is what the fused optimizer changes (see docs/recipes.md): BERT's full
30522-word embedding (most of BERT-base's parameter *count* outside the encoder) on a narrow,
shallow encoder, with short sentences and small batches. Forward/backward work scales with
tokens x encoder width; the optimizer step scales with the parameter count, which the wide
embedding keeps large.

``bert-base`` is BERT-base itself (BertConfig() defaults, 110 M parameters) at Bagua's
fine-tuning settings (sequence length 128, batch 32 per device), on a generated set of SST-2's
size (67,349 train / 872 validation sentences): it is meant for GPUs.

``tiny`` exists for the smoke test: seconds per row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, Optional

__all__ = ["Preset", "PRESETS", "get_preset"]


@dataclass(frozen=True)
class Preset:
    name: str
    # model (BertConfig / fairseq roberta)
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_seq_len: int  # tokens per sentence incl. [CLS]/[SEP]; also max_position_embeddings
    dropout: float
    # generated data
    train_size: int
    valid_size: int
    min_words: int
    max_words: int
    polar_words: int
    # training
    batch_size: int  # per device
    epochs: float  # a fraction trains part of one epoch; the epoch time is then extrapolated
    lr: float  # peak learning rate (BertAdam's lr; the front end's for the other rows)
    warmup_ratio: float  # BertAdam's warmup (fraction of t_total = the updates), or the front end's warmup share
    weight_decay: float = 0.01
    # the front end's global clip, for the rows where the front end clips (rows.Row.frontend_clips_and_schedules);
    # BertAdam with its defaults clips each parameter to its own default, 1.0, and the front end not at all
    max_grad_norm: float = 1.0
    adam_betas: tuple = (0.9, 0.999)
    adam_eps: float = 1e-6
    max_positions: Optional[int] = None  # position embeddings (None: max(max_seq_len, 64))

    @property
    def positions(self) -> int:
        return self.max_positions or max(self.max_seq_len, 64)

    def to_dict(self) -> Dict:
        return asdict(self)

    def with_overrides(self, **overrides) -> "Preset":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


PRESETS: Dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        vocab_size=1024, hidden=32, layers=1, heads=2, intermediate=64, max_seq_len=24, dropout=0.0,
        train_size=1024, valid_size=256, min_words=6, max_words=16, polar_words=12,
        batch_size=32, epochs=2, lr=3e-3, warmup_ratio=0.1,
    ),
    "cpu": Preset(
        name="cpu",
        vocab_size=30522, hidden=128, layers=2, heads=2, intermediate=512, max_seq_len=32, dropout=0.1,
        train_size=3072, valid_size=1024, min_words=8, max_words=24, polar_words=40,
        batch_size=16, epochs=1, lr=5e-4, warmup_ratio=0.1,
    ),
    "bert-base": Preset(
        name="bert-base",
        vocab_size=30522, hidden=768, layers=12, heads=12, intermediate=3072, max_seq_len=128, dropout=0.1,
        train_size=67349, valid_size=872, min_words=8, max_words=48, polar_words=40,
        batch_size=32, epochs=1, lr=1e-4, warmup_ratio=0.1, max_positions=512,
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
