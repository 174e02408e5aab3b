"""The tested torch versions are one list (``noxfile.TORCH_VERSIONS``) that every other place agrees with."""

from __future__ import annotations

import ast
import configparser
import os
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _noxfile_constant(name):
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py defines no {name}")


TORCH_VERSIONS = _noxfile_constant("TORCH_VERSIONS")


def _key(version):
    return tuple(int(x) for x in version.split("."))


def test_versions_are_pinned_and_sorted():
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in TORCH_VERSIONS), TORCH_VERSIONS
    assert TORCH_VERSIONS == sorted(TORCH_VERSIONS, key=_key), "oldest first"


def test_setup_cfg_requires_the_oldest_tested_torch():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirements = [r.strip() for r in config["options"]["install_requires"].splitlines() if r.strip()]
    assert f"torch>={TORCH_VERSIONS[0]}" in requirements, requirements


def test_readme_lists_the_tested_versions():
    match = re.search(r"Tested with torch ([0-9., ]+)\.", (ROOT / "README.md").read_text())
    assert match, "the README names the tested torch versions ('Tested with torch 2.x.y, ...')"
    assert [v.strip() for v in match.group(1).split(",")] == TORCH_VERSIONS


def test_the_pinned_install_is_a_tested_version():
    pinned = _noxfile_constant("PINNED")
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert f"TORCH_VERSION=${{TORCH_VERSION:-{pinned}}}" in install
    assert pinned in TORCH_VERSIONS


def test_this_run_uses_the_torch_it_was_asked_for():
    """A matrix session sets BAGUA_EXPECT_TORCH: a pip that resolved another torch fails here."""
    expected = os.environ.get("BAGUA_EXPECT_TORCH")
    if expected:
        assert torch.__version__.split("+")[0] == expected, (torch.__version__, expected)


def test_the_compat_module_names_the_newest_tested_release():
    from bagua_integrations import _torch_compat

    assert _torch_compat.CHECKED_ON == TORCH_VERSIONS[-1]
