"""The fairseq-train harness of the tests (``tests/_fairseq_utils.py``) hides nothing (issue 12, item 7).

* A run that died with the gloo exit abort fails, and its message names that abort (it used to
  be relaunched once; its cause, gloo threads running into the interpreter's teardown, is fixed
  and checked by every 2-rank run of tests/test_fairseq_distributed.py).
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
    """A run whose 'torchrun' is a Python one-liner."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    cmd = [sys.executable, "-c", script, "--master_port", "12345"]
    return fu._Started(cmd, None, 60, None, workdir)


def test_the_gloo_exit_abort_fails_by_name_and_is_not_relaunched(tmp_path):
    """An abort after training finished used to be relaunched once; its cause is fixed (gloo's
    threads are joined before the teardown), so it fails like any failure, and says which it is."""
    marker = tmp_path / "attempts"
    script = (
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(marker)!r}); p.write_text(str(int(p.read_text()) + 1) if p.exists() else '1')\n"
        f"sys.stderr.write({DONE!r} + chr(10) + {ABORT!r} + chr(10)); sys.exit(134)\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = fake_torchrun(tmp_path, script).finish()
    assert run.returncode == 134 and marker.read_text() == "1"
    with pytest.raises(AssertionError, match="exited with 134\nthe gloo exit abort"):
        run.check()


def test_fairseq_runs_with_this_python_not_the_one_on_path(tmp_path):
    """A venv's python without the venv activated has no fairseq-train on PATH: the harness does
    not depend on it (before, all fairseq tests were skipped quietly then)."""
    for nproc in (1, 2):
        cmd = fu._command(tmp_path / "data-bin", None, [], fu.LM_ARGS, nproc, tmp_path)
        assert cmd[0] == sys.executable and "fairseq_cli.train" in cmd
    assert fu.FAIRSEQ_PREPROCESS[0] == sys.executable
    assert fu.fairseq_available() == (__import__("importlib").util.find_spec("fairseq") is not None)


def test_other_failures_are_not_named_the_exit_abort(tmp_path):
    script = "import sys; sys.stderr.write('Traceback: something else'); sys.exit(1)"
    run = fake_torchrun(tmp_path, script).finish()
    with pytest.raises(AssertionError) as failure:
        run.check()
    assert "exited with 1" in str(failure.value) and "gloo exit abort" not in str(failure.value)


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
