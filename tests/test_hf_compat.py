"""hf_plugin/_hf_compat.py on the installed transformers.

Each test exercises one compat function the way the plugin uses it. When a release moves the
private API underneath, the failure names the function, so the fix starts in that one module.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from _hf_utils import (  # noqa: E402
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    make_dataset,
    tiny_bert,
    training_args,
)

WHERE = "hf_plugin/_hf_compat.py"


def changed(name: str, what: str, detail: str = "") -> str:
    """The failure message: which function, which private API, what was seen."""
    import transformers

    message = f"{name}: {what} changed ({WHERE}; transformers {transformers.__version__})"
    return message + (f": {detail}" if detail else "")


@pytest.fixture
def private_api(private_api_guard):
    """``with private_api(name, what):`` -- any error inside fails with :func:`changed`'s message."""
    return lambda name, what: private_api_guard(lambda detail: changed(name, what, detail))


@pytest.fixture(scope="module")
def compat():
    from hf_plugin import _hf_compat

    return _hf_compat


def _recording_trainer(compat, output_dir, **trainer_kwargs):
    """A plain Trainer saving at steps 2 and 4, whose callback records ``trainer_run_dir`` at every ``on_save``."""
    from transformers import Trainer, TrainerCallback

    seen = []

    class RecordRunDir(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append((compat.trainer_run_dir(trainer), state.global_step))

    args = training_args(output_dir, max_steps=4, save_strategy="steps", save_steps=2, logging_steps=100)
    trainer = Trainer(args=args, train_dataset=make_dataset(16), eval_dataset=make_dataset(8, seed=5),
                      callbacks=[RecordRunDir()], **trainer_kwargs)
    return trainer, seen


def test_trainer_run_dir_is_where_trainer_saves_each_search_trials_checkpoints(compat, private_api, tmp_path):
    """At ``on_save``, during an optuna search and in a plain run: the folder Trainer has just written into."""
    pytest.importorskip("optuna")
    name, what = "trainer_run_dir", "Trainer._get_output_dir / Trainer._trial"
    with private_api(name, what):
        trainer, seen = _recording_trainer(compat, tmp_path / "search", model_init=lambda: tiny_bert())
        trainer.hyperparameter_search(
            hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-3, log=True)},
            backend="optuna", n_trials=2, direction="minimize",
        )
        search = str(tmp_path / "search")
        expected = [(os.path.join(search, f"run-{trial}"), step) for trial in (0, 1) for step in (2, 4)]
        assert seen == expected, changed(name, what, f"saw {seen}")
        for run_dir, step in seen:  # Trainer's own checkpoint, written before on_save, is in that folder
            state = os.path.join(run_dir, f"checkpoint-{step}", "trainer_state.json")
            assert os.path.isfile(state), changed(name, what, f"no {state}")

        trainer, seen = _recording_trainer(compat, tmp_path / "plain", model=tiny_bert())
        trainer.train()
        assert seen == [(str(tmp_path / "plain"), 2), (str(tmp_path / "plain"), 4)], changed(name, what, f"saw {seen}")


def test_trainer_run_dir_fallback_follows_trainers_own_rule(compat, private_api):
    """Without ``_get_output_dir`` (a future transformers): the installed Trainer's rule, or a named error."""
    from transformers import Trainer
    from transformers.trainer_utils import HPSearchBackend

    from hf_plugin import UnsupportedSetupError

    name, what = "trainer_run_dir", "Trainer._get_output_dir's rule"
    optuna = pytest.importorskip("optuna")
    trial = optuna.trial.FixedTrial({"learning_rate": 1e-3}, 3)  # what ranks other than 0 train with under DDP
    cases = [
        (HPSearchBackend.OPTUNA, None, trial),
        (HPSearchBackend.OPTUNA, lambda t: f"named-{t.number}", trial),
        (None, None, None),  # no search
        (HPSearchBackend.OPTUNA, None, None),  # the search's backend set, a train() outside its trials
    ]
    with private_api(name, what):
        for backend, hp_name, trial_ in cases:
            fake = SimpleNamespace(args=SimpleNamespace(output_dir="out"), hp_search_backend=backend, hp_name=hp_name,
                                   _trial=trial_)
            # the installed Trainer's method, run on a trainer-like object that lacks it
            assert compat.trainer_run_dir(fake) == Trainer._get_output_dir(fake, trial_), (backend, hp_name, trial_)
    ray = SimpleNamespace(args=SimpleNamespace(output_dir="out"), hp_search_backend=HPSearchBackend.RAY, hp_name=None,
                          _trial={"learning_rate": 1e-3})
    with pytest.raises(UnsupportedSetupError, match="hp_name"):
        compat.trainer_run_dir(ray)


# ------------------------------------------------------------------------------ coverage of the module
TESTED = {"CHECKED_ON", "trainer_run_dir"}


def test_every_compat_function_has_a_test_here(compat):
    untested = sorted(set(compat.__all__) - TESTED)
    assert not untested, f"{WHERE} has function(s) without a test in tests/test_hf_compat.py: {untested}"
