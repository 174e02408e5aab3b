"""``python -m recipes.bert_benchmark`` (see recipes/bert_benchmark/cli.py)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
