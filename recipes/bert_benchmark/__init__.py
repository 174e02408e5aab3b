"""BERT sentence-classification benchmark: epoch time, optimizer-step share and accuracy per optimizer.

Run ``python -m recipes.bert_benchmark --help``; see docs/recipes.md.
"""

from .presets import PRESETS, Preset, get_preset
from .rows import DEFAULT_ROWS, ROWS, Row, parse_rows

__all__ = ["main", "PRESETS", "Preset", "get_preset", "ROWS", "DEFAULT_ROWS", "Row", "parse_rows"]


def main(argv=None) -> int:
    """Run the benchmark (the command line's entry point)."""
    from .cli import main as _main

    return _main(argv)
