"""The documentation site builds with ``mkdocs build --strict``: a broken link between pages, a page
missing from the navigation, or an API reference to a name that does not exist fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="pip install 'bagua-integrations[docs]'")
    pytest.importorskip("mkdocstrings")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "fuse_optimizer" in api and "bagua_init" in api and "BaguaTrainer" in api


def test_every_docs_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {page for page in pages if page not in nav} == set()


def test_user_facing_text_names_bagua_not_an_internal_word():
    """Users know Bagua's documentation and its published benchmark, not this project's "seed"."""
    import re

    internal = re.compile(r"\bthe seed\b|\bseed[- ]defaults? rows\b|\bseed baseline\b|\bseed's\b", re.I)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    offending = [f"{page.name}: {line.strip()[:80]}" for page in pages
                 for line in page.read_text().splitlines() if internal.search(line)]
    assert offending == []
