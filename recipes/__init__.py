"""Recipes built on bagua-integrations.

``recipes.bert_benchmark``: BERT sentence-classification epoch-time table per optimizer (per-tensor
BertAdam with its defaults as Bagua's benchmark ran it, the same fused eager / compiled, torch AdamW foreach /
fused; BertAdam with the front end's global clipping and schedule as extra rows) through HF Trainer
and fairseq-train. ``python -m recipes.bert_benchmark --help``; see docs/recipes.md.
"""
