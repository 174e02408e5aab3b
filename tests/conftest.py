"""Fixtures and hooks shared by several test files.

Plain helper functions live in the ``tests/_*_utils.py`` modules, which the test files import
by name (pytest puts ``tests/`` on ``sys.path``) and which spawned workers can import too;
this file holds what only pytest uses. One copy of each helper:

* ``tests/_dist_utils.py``: ``free_port`` (every test that needs a TCP port), gloo ranks.
* ``tests/_fused_utils.py``: the optimizer matrix of the fused-optimizer and compiled-step tests.
* ``tests/_fairseq_utils.py``: ``fairseq_available`` / ``requires_fairseq`` and fairseq-train runs.
* here: ``private_api_guard`` (the ``_torch_compat`` / ``_fairseq_compat`` tests) and the report
  header naming the versions whose private API those modules use.
"""

from __future__ import annotations

import contextlib
from importlib import metadata
from typing import Callable

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
