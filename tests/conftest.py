"""Fixtures and hooks shared by several test files.

Plain helper functions live in the ``tests/_*_utils.py`` modules, which the test files import
by name (pytest puts ``tests/`` on ``sys.path``) and which spawned workers can import too;
this file holds what only pytest uses. One copy of each helper:

* ``tests/_dist_utils.py``: ``free_port`` (every test that needs a TCP port), gloo ranks.
* ``tests/_fused_utils.py``: the optimizer matrix of the fused-optimizer and compiled-step tests.
* ``tests/_fairseq_utils.py``: ``fairseq_available`` / ``requires_fairseq`` and fairseq-train runs.
* here: ``private_api_guard`` (the ``_torch_compat`` / ``_fairseq_compat`` / ``_hf_compat``
  tests), the report header naming the versions whose private API those modules use, the
  ``parallel`` marker (which files run two at a time), and a summary line when the run created a
  framework's default output folder (``checkpoints/``, ...) in the checkout.
"""

from __future__ import annotations

import contextlib
from importlib import metadata
from pathlib import Path
from typing import Callable, Set

import pytest


def pytest_report_header(config):
    """The versions the compat modules were exercised on (their private API is version-bound)."""
    versions = []
    for name, dists in (("torch", ("torch",)), ("fairseq", ("fairseq-fixed", "fairseq")), ("omegaconf", ("omegaconf",)),
                        ("transformers", ("transformers",)), ("accelerate", ("accelerate",))):
        for dist in dists:
            try:
                versions.append(f"{name} {metadata.version(dist)}")
                break
            except metadata.PackageNotFoundError:
                continue
        else:
            versions.append(f"{name} not installed")
    return "bagua-integrations tests: " + ", ".join(versions)


@pytest.fixture
def private_api_guard():
    """``with private_api_guard(describe):`` turns an error inside into a named failure.

    For the tests of the compat modules: when a library moves the private API underneath, the
    call raises (ImportError, AttributeError, TypeError, ...) rather than returning a wrong value.
    Such an error fails the test with ``describe(detail)``, which names the compat function and
    the library version. Assertion errors pass through unchanged (their messages already do).
    """

    @contextlib.contextmanager
    def guard(describe: Callable[[str], str]):
        try:
            yield
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported with the function's name
            pytest.fail(describe(f"{type(exc).__name__}: {exc}"))

    return guard


# ------------------------------------------------------------------------------ no writes into the checkout
# Frameworks write to these folders, relative to the working directory, when not told otherwise
# (fairseq-train probes ./checkpoints even with --no-save; HF Trainer, Hydra, TensorBoard, W&B).
# An empty folder never shows in `git status`, so a test that leaks one goes unnoticed: report it.
_REPO = Path(__file__).resolve().parents[1]
_FRAMEWORK_DEFAULT_DIRS = ("checkpoints", "outputs", "multirun", "runs", "wandb", "lightning_logs", "tmp_trainer", "trainer_output")
_PRESENT_AT_START: Set[str] = set()


def pytest_sessionstart(session):
    _PRESENT_AT_START.update(name for name in _FRAMEWORK_DEFAULT_DIRS if (_REPO / name).exists())


def pytest_terminal_summary(terminalreporter):
    leaked = [name for name in _FRAMEWORK_DEFAULT_DIRS if (_REPO / name).exists() and name not in _PRESENT_AT_START]
    if leaked:
        terminalreporter.write_sep("=", "files written into the repository", red=True)
        terminalreporter.write_line(
            f"this test run created {', '.join(n + '/' for n in leaked)} in {_REPO}: a test (or the code it runs) "
            "writes to a framework's default folder relative to the working directory; give it a tmp_path "
            "(--save-dir, output_dir, cwd=...)",
            red=True,
        )


# ------------------------------------------------------------------------------ two files at a time
# Files whose tests compute in this process (compiling, mostly: one core each), or start ranks that
# never measure time nor wait on a stalled peer for less than a minute. They get the ``parallel``
# marker: ``scripts/test.sh`` and the nox sessions run them on two pytest-xdist workers, a whole file
# per worker (``--dist loadfile``: a file's tests run in order, in one process, as they would alone),
# then the other files one test at a time: ranks that use both cores (torchrun jobs, fairseq, HF) and
# tests that time a slow or stalled peer (join, async averaging) would only contend or flake.
PARALLEL_FILES = frozenset({
    "test_bert_adam_reference.py", "test_codec.py", "test_compiled_step.py", "test_fairseq_optimizer_api.py",
    "test_flat_memory.py", "test_fsdp2_fused.py", "test_fuse_order.py", "test_fused_optimizer.py",
    "test_fused_state_dict.py", "test_fusion_guards.py", "test_fusion_reliability.py", "test_hf_compat.py",
    "test_late_reductions.py", "test_nested_state.py", "test_per_tensor_compiled.py", "test_report_cli.py",
    "test_scalar_prologue.py", "test_segmented_fusion.py", "test_third_party_optimizers.py", "test_torch_compat.py",
    "test_torch_versions.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in PARALLEL_FILES:
            item.add_marker(pytest.mark.parallel)
