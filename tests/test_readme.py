"""The README's quick start and its results table match what the project runs and prints."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_quick_start_has_the_two_commands_and_they_exist():
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    for command in ("bash scripts/main.sh", "bash scripts/test.sh"):
        assert command in quick_start, command
        assert (ROOT / command.split()[1]).is_file()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def _main_job_table():
    section = README.split("## The main job", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows, "the main job's section has its table"
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_main_job_table_has_the_recipes_columns_and_rows():
    from recipes.bert_benchmark.report import COLUMNS
    from recipes.bert_benchmark.rows import DEFAULT_ROWS, ROWS

    header, _, *rows = _main_job_table()
    assert tuple(header) == COLUMNS
    labels = {row.label for row in ROWS.values()}
    for row in rows:
        assert row[1] in labels, f"{row[1]!r} is not a row the recipe runs"
        assert len(row) == len(COLUMNS)
    # the rows bash scripts/main.sh runs by default, no more and no fewer
    assert [row[1] for row in rows] == [ROWS[key].label for key in DEFAULT_ROWS]


def test_the_readme_says_which_settings_and_hardware_made_the_table():
    section = README.split("## The main job", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"What `bash scripts/main.sh` printed \(its default settings; \d{4}-\d\d-\d\d, .+ cores", section)


EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->\n```\w+\n(.*?)\n```", re.S)


def _is_excerpt(block: str, source: str) -> bool:
    """Every non-blank line of ``block`` is a line of ``source`` (leading and trailing blanks
    aside), in the same order: an excerpt may skip lines, never change or reorder them."""
    source_lines = iter(line.strip() for line in source.splitlines())
    return all(any(line == candidate for candidate in source_lines)
               for line in (raw.strip() for raw in block.splitlines()) if line)


def test_every_readme_code_block_is_an_excerpt_of_a_tested_example():
    excerpts = EXCERPT.findall(README)
    code_blocks = re.findall(r"^```(python|bash)$", README, re.M)
    # every code block is an excerpt, except the quick start's two commands
    assert len(excerpts) == len(code_blocks) - 1, "a README code block without an <!-- excerpt: FILE --> line"
    for path, block in excerpts:
        assert path.startswith("examples/") and (ROOT / path).is_file(), path
        assert _is_excerpt(block, (ROOT / path).read_text()), f"the README's block from {path} is not in that file"


def test_an_edited_snippet_is_not_an_excerpt():
    source = "a = 1\nb = 2\nc = 3\n"
    assert _is_excerpt("a = 1\n\nc = 3", source)
    assert not _is_excerpt("c = 3\na = 1", source)  # reordered
    assert not _is_excerpt("a = 1\nb = 20", source)  # changed


def test_docs_blocks_marked_as_excerpts_are_in_their_examples():
    found = 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        for path, block in EXCERPT.findall(page.read_text()):
            found += 1
            assert path.startswith("examples/") and (ROOT / path).is_file(), (page.name, path)
            assert _is_excerpt(block, (ROOT / path).read_text()), f"{page.name}'s block from {path} is not in that file"
    assert found, "no docs block is marked as an excerpt"
