"""Holds the fairseq ``--user-dir`` of the BERT benchmark (``bert_recipe_fairseq``).

fairseq imports a user dir as a top-level module named after its directory, from its parent
directory; this package only exists so that the user dir is installed with ``recipes``.
Do not import ``bert_recipe_fairseq`` from Python: fairseq does, once per process.
"""

import os

USER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bert_recipe_fairseq")
