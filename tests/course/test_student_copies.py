"""ci/student_copies.py: workshop copies without solution cells (nbconvert's preprocessors)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from ci import student_copies

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def tagged(nb, tag: str) -> list[str]:
    return [c.source for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]


@pytest.fixture(scope="module")
def copies(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("student")
    assert student_copies.main(["--output-dir", str(out)]) == 0
    return {p.stem: p for p in out.glob("*.ipynb")}


def test_one_copy_per_notebook(copies):
    assert sorted(copies) == [p.stem for p in NOTEBOOKS]


def test_there_are_solutions_to_remove():
    """Otherwise the tests below would pass on a copy that removed nothing."""
    assert sum(len(tagged(nbformat.read(str(p), as_version=4), "solution")) for p in NOTEBOOKS) > 0


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_copy_without_solutions_keeps_exercises_and_checks(copies, source):
    original = nbformat.read(str(source), as_version=4)
    copy = nbformat.read(str(copies[source.stem]), as_version=4)
    nbformat.validate(copy)
    assert tagged(copy, "solution") == []
    assert tagged(copy, "exercise") == tagged(original, "exercise")
    assert tagged(copy, "check") == tagged(original, "check")
    assert tagged(copy, "parameters") == tagged(original, "parameters")
    kept = [c.source for c in original.cells if "solution" not in c.get("metadata", {}).get("tags", [])]
    assert [c.source for c in copy.cells] == kept, "only the solution cells may be removed, in order"
    for cell in copy.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_outputs_are_cleared_and_solutions_removed_from_an_executed_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    exercise = nbformat.v4.new_code_cell("answer = None", metadata={"tags": ["exercise"]})
    solution = nbformat.v4.new_code_cell("answer = 42", metadata={"tags": ["solution"]})
    check = nbformat.v4.new_code_cell("assert answer == 42", metadata={"tags": ["check"]},
                                      execution_count=3,
                                      outputs=[nbformat.v4.new_output("stream", text="checked\n")])
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), exercise, solution, check]
    (tmp_path / "nbs").mkdir()
    nbformat.write(nb, str(tmp_path / "nbs" / "01_t.ipynb"))
    (written,) = student_copies.write_student_copies(None, tmp_path / "out", notebooks_dir=tmp_path / "nbs")
    copy = nbformat.read(str(written), as_version=4)
    assert [c.source for c in copy.cells] == ["# t", "answer = None", "assert answer == 42"]
    assert copy.cells[2].outputs == [] and copy.cells[2].execution_count is None


def test_unknown_notebook_writes_nothing(tmp_path, capsys):
    assert student_copies.main(["99", "--output-dir", str(tmp_path / "out")]) == 2
    assert "unknown notebook '99'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
