"""The fairseq-train harness of the tests (``tests/_fairseq_utils.py``) hides nothing (issue 12, item 7).

* A 2-rank run that died with the gloo abort *after training had finished* (fairseq's "done
  training" line) is relaunched once, and every relaunch warns with :class:`RelaunchedRunWarning`
  (pytest lists it in its warnings summary) carrying the failed attempt's stderr. An abort before
  that line is a failure.
* Runs write nothing into the repository: fairseq-train creates its save dir (``./checkpoints``
  by default) and writes a probe file into it even with ``--no-save``, so every run gets a
  ``--save-dir`` and a working directory of its own, outside the checkout.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

import _fairseq_utils as fu

ABORT = "terminate called without an active exception"
DONE = "INFO | fairseq_cli.train | done training in 1.0 seconds"


def fake_torchrun(tmp_path: Path, script: str) -> "fu._Started":
    """A run whose 'torchrun' is a Python one-liner (the harness relaunches on the stderr signature)."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    cmd = [sys.executable, "-c", script, "--master_port", "12345"]
    return fu._Started(cmd, None, 60, None, workdir)


def test_a_relaunch_after_the_gloo_abort_warns(tmp_path):
    # first attempt aborts; the relaunch (a new port) succeeds
    marker = tmp_path / "attempts"
    script = (
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(marker)!r}); n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1))\n"
        f"sys.exit(0) if n else (sys.stderr.write({DONE!r} + chr(10) + {ABORT!r} + chr(10)), sys.exit(134))\n"
    )
    with pytest.warns(fu.RelaunchedRunWarning, match="gloo abort") as record:
        run = fake_torchrun(tmp_path, script).finish()
    assert run.returncode == 0 and marker.read_text() == "2"
    assert ABORT in run.relaunched_after
    assert ABORT in str(record[0].message)  # the failed attempt's stderr is in the warning
    assert run.cmd[run.cmd.index("--master_port") + 1] != "12345"


def test_a_run_is_relaunched_only_once_and_a_second_abort_fails(tmp_path):
    script = f"import sys; sys.stderr.write({DONE!r} + chr(10) + {ABORT!r}); sys.exit(134)"
    with pytest.warns(fu.RelaunchedRunWarning):
        run = fake_torchrun(tmp_path, script).finish()
    assert run.returncode == 134
    with pytest.raises(AssertionError, match="exited with 134"):
        run.check()


def test_an_abort_before_training_finished_is_not_relaunched(tmp_path):
    script = f"import sys; sys.stderr.write('epoch 001: 50%' + chr(10) + {ABORT!r}); sys.exit(134)"
    with warnings.catch_warnings():
        warnings.simplefilter("error", fu.RelaunchedRunWarning)
        run = fake_torchrun(tmp_path, script).finish()
    assert run.returncode == 134 and run.relaunched_after is None


def test_fairseq_runs_with_this_python_not_the_one_on_path(tmp_path):
    """A venv's python without the venv activated has no fairseq-train on PATH: the harness does
    not depend on it (before, all fairseq tests were skipped quietly then)."""
    for nproc in (1, 2):
        cmd = fu._command(tmp_path / "data-bin", None, [], fu.LM_ARGS, nproc, tmp_path)
        assert cmd[0] == sys.executable and "fairseq_cli.train" in cmd
    assert fu.FAIRSEQ_PREPROCESS[0] == sys.executable
    assert fu.fairseq_available() == (__import__("importlib").util.find_spec("fairseq") is not None)


def test_other_failures_are_not_relaunched(tmp_path):
    script = "import sys; sys.stderr.write('Traceback: something else'); sys.exit(1)"
    with warnings.catch_warnings():
        warnings.simplefilter("error", fu.RelaunchedRunWarning)
        run = fake_torchrun(tmp_path, script).finish()
    assert run.returncode == 1 and run.relaunched_after is None


def test_a_no_save_command_names_a_save_dir_in_its_workdir(tmp_path):
    for nproc in (1, 2):
        cmd = fu._command(tmp_path / "data-bin", None, ["--max-update", "1"], fu.LM_ARGS, nproc, tmp_path)
        assert "--no-save" in cmd
        assert cmd[cmd.index("--save-dir") + 1] == str(tmp_path / "checkpoints")
        cmd = fu._command(tmp_path / "data-bin", tmp_path / "save", [], fu.LM_ARGS, nproc, tmp_path)
        assert "--no-save" not in cmd and cmd[cmd.index("--save-dir") + 1] == str(tmp_path / "save")


@fu.requires_fairseq
def test_a_no_save_run_probes_its_save_dir_in_its_own_workdir(tmp_path, tmp_path_factory):
    """A real --no-save run: fairseq's save-dir probe lands in the run's workdir, outside the
    repository, and the workdir is removed when the run finishes."""
    corpus = fu.shared_corpus(tmp_path_factory)
    started = fu.start_train(corpus, None, ["--max-update", "1", "--optimizer", "adam"])
    workdir = started.workdir
    assert fu.REPO not in workdir.resolve().parents
    run = started.finish().check()
    assert run.losses()
    assert f"save_dir': '{workdir / 'checkpoints'}'" in run.log  # fairseq's printed config
    assert not workdir.exists()
