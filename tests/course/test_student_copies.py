"""ci/student_copies.py: the workshop handout, the lessons without solution cells (nbconvert's
preprocessors), with the glossary, helpers and data they need, as a folder and a zip."""

from __future__ import annotations

import zipfile
from pathlib import Path

import nbformat
import pytest

from ci import student_copies
from helpers import lessons as manifest

ROOT = Path(__file__).resolve().parents[2]
LESSONS = manifest.stems(None)
NOTEBOOKS = [ROOT / "notebooks" / f"{stem}.ipynb" for stem in LESSONS]


def tagged(nb, tag: str) -> list[str]:
    return [c.source for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]


@pytest.fixture(scope="module")
def handout(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("student")
    assert student_copies.main(["--output-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def copies(handout) -> dict[str, Path]:
    return {p.stem: p for p in (handout / "notebooks").glob("*.ipynb")}


def test_one_copy_per_lesson(copies):
    assert LESSONS and all(p.is_file() for p in NOTEBOOKS), LESSONS
    assert sorted(copies) == sorted(LESSONS)


def test_default_folder_is_served_and_ignored():
    """Inside the repository root (what the README's jupyter lab serves), never committed."""
    assert student_copies.DEFAULT_OUTPUT_DIR == ROOT / "student"
    assert "student/" in (ROOT / ".gitignore").read_text().splitlines()


def test_a_scratch_notebook_is_not_a_lesson(tmp_path, capsys):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    for stem in ("01_t", "zz_scratch"):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t")])
        nbformat.write(nb, str(nbs / f"{stem}.ipynb"))
    written = student_copies.write_student_copies(None, tmp_path / "out", notebooks_dir=nbs, lessons=["01_t"])
    assert [p.name for p in written] == ["01_t.ipynb"]
    assert sorted(p.name for p in (tmp_path / "out" / "notebooks").iterdir()) == ["01_t.ipynb", "lessons.toml"]
    with pytest.raises(student_copies.ConfigError, match="not a notebook of the course"):
        student_copies.write_student_copies(["zz_scratch"], tmp_path / "out2", notebooks_dir=nbs, lessons=["01_t"])


def test_handout_opens_on_its_own(handout, copies):
    """The links of the copies resolve inside the handout, it has what the lessons import and
    MNIST, says how to start, and the zip holds the same files, none a solution."""
    for path in copies.values():
        for rel in student_copies.LINK.findall(path.read_text(encoding="utf-8")):
            assert (handout / rel).is_file(), f"{path.name} links to ../{rel}, missing from the handout"
    assert (handout / "docs" / "GLOSSARY.md").is_file()
    for doc in handout.glob("**/*.md"):  # the docs copied, and what they link to in turn
        if doc.relative_to(handout).parts[0] in ("helpers", "ci"):
            continue
        for rel in student_copies.DOC_LINK.findall(doc.read_text(encoding="utf-8")):
            assert (doc.parent / rel).exists(), f"{doc.relative_to(handout)} links to {rel}, missing from the handout"
    for rel in ("helpers/notebook.py", "helpers/data.py", "requirements.txt", "jupyter_lab_config.json"):
        assert (handout / rel).is_file(), rel
    assert sorted(p.name for p in (handout / "data" / "MNIST" / "raw").iterdir()) == sorted(
        p.name for p in (ROOT / "data" / "MNIST" / "raw").glob("*.gz"))
    text = (handout / "HANDOUT.md").read_text()
    assert f"notebooks/{LESSONS[0]}.ipynb" in text and "python3 -m helpers.doctor" in text and "data/" in text
    with zipfile.ZipFile(handout / f"{student_copies.ARCHIVE_NAME}.zip") as z:
        names = set(z.namelist())
    on_disk = {f"{student_copies.ARCHIVE_NAME}/{f.relative_to(handout).as_posix()}" for f in handout.rglob("*")
               if f.is_file() and f.suffix != ".zip"}
    assert names == on_disk
    assert not [n for n in names if "__pycache__" in n or n.endswith("-ubyte")]


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
    (written,) = student_copies.write_student_copies(None, tmp_path / "out", notebooks_dir=tmp_path / "nbs",
                                                     lessons=["01_t"])
    copy = nbformat.read(str(written), as_version=4)
    assert [c.source for c in copy.cells] == ["# t", "answer = None", "assert answer == 42"]
    assert copy.cells[2].outputs == [] and copy.cells[2].execution_count is None


def test_unknown_notebook_writes_nothing(tmp_path, capsys):
    assert student_copies.main(["99", "--output-dir", str(tmp_path / "out")]) == 2
    assert "unknown notebook '99'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
