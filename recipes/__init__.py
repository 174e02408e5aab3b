"""BERT-base benchmark recipes (filled in by the recipes issue)."""
