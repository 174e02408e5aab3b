"""Recipes built on bagua-integrations.

``recipes.bert_benchmark``: BERT sentence-classification epoch-time table per optimizer (per-tensor
BertAdam, the same fused eager / compiled, torch AdamW foreach / fused) through HF Trainer and
fairseq-train. ``python -m recipes.bert_benchmark --help``; see docs/recipes.md.
"""
