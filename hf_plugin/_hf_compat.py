"""Every use of transformers' private API by ``hf_plugin``, in one place.

Each function here reaches into something transformers does not promise to keep. They are
collected so that a new release breaks *this* module, loudly, instead of silently changing where
the plugin writes or reads its files: ``tests/test_hf_compat.py`` exercises each one on the
installed transformers and fails with the function's name if the private API moved.

Checked on transformers 5.24.0 (``CHECKED_ON``); the plugin requires transformers >= 4.40, all of
which have what is used here.
"""

from __future__ import annotations

import os
from typing import Any

CHECKED_ON = {"transformers": "5.24.0"}

__all__ = ["CHECKED_ON", "trainer_run_dir"]


def trainer_run_dir(trainer: Any) -> str:
    """The folder in which ``trainer`` writes this run's ``checkpoint-N`` folders.

    ``args.output_dir``, except during ``trainer.hyperparameter_search(...)``, where each trial
    writes into ``output_dir/run-<trial>`` (or ``output_dir/<hp_name(trial)>``). Callbacks are
    not told which: ``on_save`` gets ``args`` and ``state``, neither of which names the trial's
    folder (``state.trial_name`` is set only with ``hp_name``, ``state.best_model_checkpoint``
    only with a best metric).

    Private: ``Trainer._get_output_dir(trial)``, the method ``Trainer._save_checkpoint`` itself
    calls, with ``Trainer._trial``, the trial ``train()`` handed to ``_hp_search_setup`` (under
    DDP the other ranks get it as an ``optuna.trial.FixedTrial`` with the same number). Calling
    Trainer's own method also follows a subclass that overrides it. Checked on transformers 5.24.0.

    Fallback, for a transformers without ``_get_output_dir``: the rule it implements in 5.24 for
    optuna and for any backend given ``hp_name``; for Ray Tune or W&B sweeps without ``hp_name``
    the trial's folder cannot be told, and this raises rather than write beside another trial's.
    """
    trial = getattr(trainer, "_trial", None)
    get_output_dir = getattr(trainer, "_get_output_dir", None)
    if get_output_dir is not None:
        return os.fspath(get_output_dir(trial))
    output_dir = trainer.args.output_dir
    if getattr(trainer, "hp_search_backend", None) is None or trial is None:
        return output_dir
    hp_name = getattr(trainer, "hp_name", None)
    if hp_name is not None:
        return os.path.join(output_dir, hp_name(trial))
    number = getattr(trial, "number", None)  # optuna.Trial and FixedTrial
    if number is not None:
        return os.path.join(output_dir, f"run-{number}")
    from .errors import UnsupportedSetupError

    raise UnsupportedSetupError(
        f"this transformers has no Trainer._get_output_dir, so the folder of a "
        f"{getattr(trainer.hp_search_backend, 'value', trainer.hp_search_backend)} "
        "search trial cannot be told; pass hyperparameter_search(hp_name=...) so that it can"
    )
