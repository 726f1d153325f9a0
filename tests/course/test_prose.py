"""Plain prose, held (issue #45 part 4): every notebook's markdown meets ci/prose.py's targets,
and every check cell is folded behind a one-line summary of what it checks."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from ci import prose
from helpers import lessons as manifest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
STEMS = manifest.stems(None)


@pytest.mark.parametrize("stem", STEMS)
def test_prose_meets_the_targets(stem):
    f = prose.measure(NOTEBOOKS / f"{stem}.ipynb")
    assert f.sentences >= 20, f"{stem}: only {f.sentences} sentences found: is the measure reading the prose?"
    assert f.words_per_sentence <= prose.MAX_WORDS_PER_SENTENCE, (
        f"{stem}: {f.words_per_sentence:.1f} words per sentence (at most {prose.MAX_WORDS_PER_SENTENCE:g}): "
        "split long sentences; python3 -m ci.prose shows the figures")
    assert f.parens_per_sentence <= prose.MAX_PARENS_PER_SENTENCE, (
        f"{stem}: {f.parens_per_sentence:.2f} parentheses per sentence (at most {prose.MAX_PARENS_PER_SENTENCE:g})")
    assert f.longest_claim <= prose.MAX_CLAIM_WORDS, (
        f"{stem}: a claim of {f.longest_claim} words (at most {prose.MAX_CLAIM_WORDS}): "
        "make a multi-case claim a table")


def test_lessons_fit_one_sitting_and_the_readme_a_front_door():
    """Issue #52: at most 2,500 words of markdown a lesson (whitespace-separated, as the issue counted), 1,500 in
    the README (`wc -w`)."""
    cells = {stem: nbformat.read(str(NOTEBOOKS / f"{stem}.ipynb"), as_version=4).cells for stem in STEMS}
    words = {stem: sum(len(c.source.split()) for c in cs if c.cell_type == "markdown") for stem, cs in cells.items()}
    over = {stem: n for stem, n in words.items() if n > 2_500}
    readme = len((NOTEBOOKS.parent / "README.md").read_text().split())
    assert not over and readme <= 1_500, f"words over 2,500: {over}; README: {readme} words (at most 1,500)"


@pytest.mark.parametrize("stem", STEMS)
def test_check_cells_are_folded_behind_what_they_check(stem):
    nb = nbformat.read(str(NOTEBOOKS / f"{stem}.ipynb"), as_version=4)
    bad = []
    for i, cell in enumerate(nb.cells):
        if "check" not in cell.metadata.get("tags", []):
            continue
        lines = cell.source.splitlines()
        first = lines[1] if lines and lines[0].startswith("%%") and len(lines) > 1 else (lines[0] if lines else "")
        if not cell.metadata.get("jupyter", {}).get("source_hidden") or not first.startswith("# Check: "):
            bad.append(i)
    assert not bad, (f"{stem}: check cells {bad} must be folded (metadata jupyter.source_hidden) and start with "
                     "'# Check: <what it checks>' (after a %%px line)")


def test_the_measure_counts_sentences_words_and_parentheses(tmp_path):
    text = ("## A heading is left out\n\nOne short sentence (with an aside). Another one here!\n\n"
            "| a | table |\n|---|---|\n\n`code spans count as one word`, then words.")
    plain = prose.plain_text(text)
    assert "heading" not in plain and "table" not in plain and "spans" not in plain
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text),
                                         nbformat.v4.new_markdown_cell("**Claim:** " + "word " * 70 + ".")])
    path = tmp_path / "prose.ipynb"
    nbformat.write(nb, str(path))
    f = prose.measure(path)
    assert (f.sentences, f.parens) == (4, 1)
    assert f.words == 9 + 3 + 71 and f.longest_claim == 71
