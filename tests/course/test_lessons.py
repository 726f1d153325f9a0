"""Every lesson meets every rule of ``ci/lessons.py`` (one test: ``python3 -m ci.lessons check``),
each rule fails on a lesson broken for it, and what the rules rest on (the prose measure, the
profiles' parameters, the twins, JupyterLab's ``language_info``) holds."""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell

from ci import lessons, prose
from ci import run_notebooks as rn
from helpers import lessons as manifest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
STEMS = manifest.stems(None)


def test_every_lesson_meets_every_rule():
    assert len(STEMS) > 20, STEMS
    found = [p for stem in STEMS for p in lessons.problems(NOTEBOOKS / f"{stem}.ipynb")]
    assert not found, "\n".join(found) + "\n(python3 -m ci.lessons check [stem] lists them)"
    readme = len((ROOT / "README.md").read_text().split())
    assert readme <= 1_500, f"README: {readme} words (at most 1,500: a front door)"


def _first(nb, test):
    """The first cell passing ``test``, or tagged ``test`` when it is a text."""
    if isinstance(test, str):
        return _first(nb, lambda c: test in c.metadata.get("tags", []))
    return next(c for c in nb.cells if test(c))


def _append(text):
    return lambda nb: nb.cells.append(new_markdown_cell(text))


#: rule id -> how to break it in lesson 03 (the cells changed in place)
BREAK = {
    "nbformat": lambda nb: nb.cells[1].update(bogus=1),
    "twin": lambda nb: nb.cells[0].update(source=nb.cells[0].source + "\nOne more sentence."),
    "outputs-cleared": lambda nb: nb.cells[1].update(execution_count=3),
    "kernelspec": lambda nb: nb.metadata.kernelspec.update(name="python2"),
    "language-info": lambda nb: nb.metadata.pop("language_info"),
    "saved-form": lambda nb: nb.metadata.language_info.update(version="3.12.1"),
    "no-absolute-paths": _append("Data in /home/me/data."),
    "first-cell": lambda nb: nb.cells[0].update(source="# A title"),
    "glossary-anchors": _append("A [term](../docs/GLOSSARY.md#no-such-term)."),
    "one-parameters-cell": lambda nb: _first(nb, "parameters").update(source="n = 2  # a = b\n"),
    "parameters-checked": lambda nb: nb.cells.__setitem__(
        nb.cells.index(_first(nb, "parameters")) + 1, new_code_cell("1")),
    "prose": lambda nb: nb.cells.__setitem__(
        slice(None), [c for c in nb.cells if c.cell_type == "code"] + [new_markdown_cell("Few.")]),
    "no-typed-times": _append("This cell takes about 5 s on 2 CPU cores."),
    "check-folded": lambda nb: _first(nb, "check").metadata.pop("jupyter"),
    "claims": _append("**Claim:** the sky is green."),
    "device-claims": lambda nb: nb.cells.extend([new_markdown_cell("**Claim (CPU only):** x."),
                                                 new_code_cell("assert True")]),
    "figures": lambda nb: nb.cells.append(new_code_cell("fig, ax = plt.subplots()\nax.plot([1])")),
    "exercises": lambda nb: _first(nb, lambda c: "### Exercise 1" in c.source).update(source="Do."),
    "exercise-tag": lambda nb: _first(nb, "exercise").metadata.pop("tags"),
    "solutions": lambda nb: nb.cells.append(new_code_cell(
        "# Solution of exercise 9\ncheck_answer(\"ex9\", solution_9, expected_9, strict=True)",
        metadata={"jupyter": {"source_hidden": True}, "tags": ["solution"]})),
}


def test_each_rule_fails_on_a_lesson_broken_for_it(tmp_path):
    """Break lesson 03 once per rule, in a copy: ``python3 -m ci.lessons check`` names that rule
    (and nothing when unbroken)."""
    assert set(BREAK) == {r.id for r in lessons.RULES}, "one way to break each rule"
    stem = next(s for s in manifest.stems("lesson") if s.startswith("03"))
    shutil.copy(NOTEBOOKS / "lessons.toml", tmp_path)
    missed = {}
    for rule, mutate in {"unbroken": lambda nb: None, **BREAK}.items():
        nb = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=nbformat.NO_CONVERT)
        mutate(nb)
        (tmp_path / f"{stem}.ipynb").write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
        shutil.copy(NOTEBOOKS / f"{stem}.py", tmp_path)
        said = lessons.problems(tmp_path / f"{stem}.ipynb")
        if bool(said) if rule == "unbroken" else not any(f"[{rule}]" in p for p in said):
            missed[rule] = said
    assert not missed, missed


def test_the_command_lists_problems_and_refuses_unknown_lessons(capsys):
    assert lessons.main(["check", "03", "00a"]) == 0
    assert lessons.main(["check", "99"]) == 2 and lessons.main(["prose", "03"]) == 0
    out, err = capsys.readouterr()
    assert f"2 notebook(s) meet all {len(lessons.RULES)} lesson rules" in out
    assert out.splitlines()[-1].startswith("03_distributed_sampler "), out
    assert "unknown lesson(s) ['99']" in err


def test_the_measure_counts_sentences_words_and_parentheses(tmp_path):
    text = ("## A heading is left out\n\nOne short sentence (with an aside). Another one here!\n\n"
            "| a | table |\n|---|---|\n\n`code spans count as one word`, then words.")
    plain = prose.plain_text(text)
    assert "heading" not in plain and "table" not in plain and "spans" not in plain
    claim = new_markdown_cell("**Claim:** " + "word " * 70 + ".")
    nb = nbformat.v4.new_notebook(cells=[new_markdown_cell(text), claim])
    f = prose.measure(tmp_path / "prose.ipynb", nb)
    assert (f.sentences, f.parens) == (4, 1)
    assert f.words == 9 + 3 + 71 and f.longest_claim == 71


@pytest.mark.parametrize("profile", rn.PROFILES)
def test_profiles_match_notebook_parameters(profile):
    """The manifest's profiles name only declared parameters, with the defaults' types (no run)."""
    try:
        rn.plan_run(None, profile)
    except rn.ConfigError as e:
        pytest.fail(f"profile {profile!r}: {e}")


def test_every_twin_has_a_notebook():
    """Every .py in notebooks/ is a twin of a notebook of the manifest (the ``twin`` rule, back)."""
    orphans = [p.name for p in NOTEBOOKS.glob("*.py") if p.stem not in STEMS]
    assert not orphans, f"twins without a notebook of the manifest: {orphans}; jupytext --sync them"


def test_committed_language_info_is_ipykernels_without_its_version():
    """What JupyterLab copies from the kernel into a notebook it opens, less the machine's Python
    version (helpers.jupyter_hooks.pre_save drops it on every save): the ``language-info`` value."""
    from ipykernel.ipkernel import IPythonKernel

    from helpers.jupyter_hooks import LANGUAGE_INFO

    assert {k: v for k, v in IPythonKernel.language_info.items() if k != "version"} == LANGUAGE_INFO
