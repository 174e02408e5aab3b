"""Reference optimizers used by the benchmarks and recipes."""

from .bert_adam import BertAdam

__all__ = ["BertAdam"]
