"""ci/student_copies.py: the workshop handout, the lessons without solution cells (nbconvert's
preprocessors), with the glossary, helpers and data they need, as a folder and a zip."""

from __future__ import annotations

import ast
import re
import shutil
import symtable
import zipfile
from pathlib import Path

import nbformat
import pytest

from ci import student_copies, workshop
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
    # solutions to remove: otherwise the tests below would pass on a copy that removed nothing
    assert sum(len(tagged(nbformat.read(str(p), as_version=4), "solution")) for p in NOTEBOOKS) > 0


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
    for rel in ("helpers/notebook.py", "helpers/data.py", "requirements.lock", "jupyter_lab_config.json"):
        assert (handout / rel).is_file(), rel
    assert sorted(p.name for p in (handout / "data" / "MNIST" / "raw").iterdir()) == sorted(
        p.name for p in (ROOT / "data" / "MNIST" / "raw").glob("*.gz"))
    with zipfile.ZipFile(handout / f"{student_copies.ARCHIVE_NAME}.zip") as z:
        names = set(z.namelist())
    on_disk = {f"{student_copies.ARCHIVE_NAME}/{f.relative_to(handout).as_posix()}" for f in handout.rglob("*")
               if f.is_file() and f.suffix != ".zip"}
    assert names == on_disk
    assert not [n for n in names if "__pycache__" in n or n.endswith("-ubyte")]
    # the default folder: inside the repository root (what the README's jupyter lab serves), ignored
    assert student_copies.DEFAULT_OUTPUT_DIR == ROOT / "student"
    assert "student/" in (ROOT / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_copy_without_solutions_keeps_exercises_and_checks(copies, source):
    original = nbformat.read(str(source), as_version=4)
    copy = nbformat.read(str(copies[source.stem]), as_version=4)
    nbformat.validate(copy)
    assert tagged(copy, "solution") == []
    assert tagged(copy, "exercise") == tagged(original, "exercise")
    assert tagged(copy, "check") == [student_copies.scoped_check(s) for s in tagged(original, "check")]
    assert tagged(copy, "parameters") == tagged(original, "parameters")
    kept = [student_copies.scoped_check(c.source) if "check" in c.get("metadata", {}).get("tags", []) else c.source
            for c in original.cells if "solution" not in c.get("metadata", {}).get("tags", [])]
    assert [c.source for c in copy.cells if student_copies.WORKSHOP_TAG not in c.metadata.get("tags", [])] == kept, \
        "only the solution cells may be removed, in order (and the workshop's stops added)"
    for cell in copy.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_outputs_are_cleared_and_solutions_removed_and_a_scratch_notebook_is_no_lesson(tmp_path, capsys):
    nb = nbformat.v4.new_notebook()
    exercise = nbformat.v4.new_code_cell("answer = None", metadata={"tags": ["exercise"]})
    solution = nbformat.v4.new_code_cell("answer = 42", metadata={"tags": ["solution"]})
    check = nbformat.v4.new_code_cell("assert answer == 42", metadata={"tags": ["check"]},
                                      execution_count=3,
                                      outputs=[nbformat.v4.new_output("stream", text="checked\n")])
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), exercise, solution, check]
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    nbformat.write(nb, str(nbs / "01_t.ipynb"))
    nbformat.write(nbformat.v4.new_notebook(cells=[nb.cells[0]]), str(nbs / "zz_scratch.ipynb"))
    (written,) = student_copies.write_student_copies(None, tmp_path / "out", notebooks_dir=nbs, lessons=["01_t"])
    assert sorted(p.name for p in (tmp_path / "out" / "notebooks").iterdir()) == ["01_t.ipynb", "lessons.toml"]
    copy = nbformat.read(str(written), as_version=4)
    assert [c.source for c in copy.cells] == ["# t", "answer = None", "assert answer == 42"]
    assert copy.cells[2].outputs == [] and copy.cells[2].execution_count is None
    with pytest.raises(student_copies.ConfigError, match="not a notebook of the course"):
        student_copies.write_student_copies(["zz_scratch"], tmp_path / "out2", notebooks_dir=nbs, lessons=["01_t"])
    assert student_copies.main(["99", "--output-dir", str(tmp_path / "out3")]) == 2  # an unknown one
    assert "unknown notebook '99'" in capsys.readouterr().err
    assert not (tmp_path / "out3").exists(), "nothing written"


# ---- a student's own copy (issue 44, part 4) ------------------------------------------------------


def _first_use_is_a_store(fn: ast.FunctionDef) -> list[str]:
    """Names local to ``fn`` (assigned in its own body) that a line reads before one assigns them:
    an ``UnboundLocalError`` once the check cell's code runs inside the function."""
    table = symtable.symtable(ast.unparse(fn), "<check>", "exec").get_children()[0]
    local = {s.get_name() for s in table.get_symbols() if s.is_local()}
    loads, stores = {}, {}
    for node in ast.walk(fn):
        at = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
        if isinstance(node, ast.Name):
            bound = [(node.id, isinstance(node.ctx, ast.Load))]
            if not bound[0][1]:
                at = (node.lineno, 10**9)  # bound once the line's value is computed: `x = x + 1` reads first
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            bound = [(node.name, False)]
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound = [(node.name, False)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound = [((a.asname or a.name).split(".")[0], False) for a in node.names]
        else:
            continue
        for name, is_load in bound:
            if name in local:
                seen = loads if is_load else stores
                seen[name] = min(seen.get(name, at), at)
    return sorted(n for n in loads if n in stores and loads[n] < stores[n])


@pytest.mark.parametrize("stem", LESSONS)
def test_exercise_checks_keep_the_expected_value_in_a_function(copies, stem):
    """Each exercise's check cell runs inside ``check_exercise_N()``: ``expected_N`` and what it is
    computed from are the function's locals, never the kernel's names; no local is read before it is
    assigned (the cell's code works the same inside the function)."""
    copy = nbformat.read(str(copies[stem]), as_version=4)
    exercises = [c.source for c in copy.cells if "exercise" in c.get("metadata", {}).get("tags", [])]
    checks = [s for s in tagged(copy, "check") if student_copies.EXERCISE_CHECK.search(s)]
    assert len(checks) == len(exercises), (len(checks), len(exercises))
    for n, source in enumerate(checks, 1):
        tree = ast.parse(source)
        fn, call = tree.body
        assert isinstance(fn, ast.FunctionDef) and fn.name == f"check_exercise_{n}", source[:200]
        assert ast.unparse(call) == f"check_exercise_{n}()"
        assert not _first_use_is_a_store(fn), (stem, n, _first_use_is_a_store(fn))


def test_scoped_check_leaves_claims_and_magics_alone():
    assert student_copies.scoped_check("assert x == 1") == "assert x == 1"
    px = '%%px\ncheck_answer("ex1", answer_1, 1)'
    assert student_copies.scoped_check(px) == px
    wrapped = student_copies.scoped_check('expected_1 = 5\ncheck_answer("ex1", answer_1, expected_1)')
    namespace = {"answer_1": 5, "check_answer": lambda *a: print("checked", a[1] == a[2])}
    exec(wrapped, namespace)
    assert "expected_1" not in namespace and callable(namespace["check_exercise_1"])
    reads_first = student_copies.scoped_check('x = x + 1\nexpected_1 = x\ncheck_answer("ex1", answer_1, expected_1)')
    assert _first_use_is_a_store(ast.parse(reads_first).body[0]) == ["x"], "the test of the copies can fail"


def test_no_py_twin_after_a_save_through_jupytexts_contents_manager(handout, tmp_path):
    """JupyterLab saves through its contents manager; with jupytext installed that is jupytext's,
    which writes the paired ``.py`` of a notebook whose metadata pairs it. A copy is not paired:
    saving it writes the notebook alone. (The lesson itself, paired, gets its twin: the test can fail.)"""
    from jupytext import TextFileContentsManager

    stem = LESSONS[0]
    copy = handout / "notebooks" / f"{stem}.ipynb"
    assert "jupytext" not in nbformat.read(str(copy), as_version=4).metadata
    cm = TextFileContentsManager(root_dir=str(handout))
    cm.save(cm.get(f"notebooks/{stem}.ipynb"), f"notebooks/{stem}.ipynb")
    assert sorted(p.name for p in (handout / "notebooks").glob(f"{stem}.*")) == [f"{stem}.ipynb"]

    (tmp_path / "nb").mkdir()
    shutil.copyfile(ROOT / "notebooks" / f"{stem}.ipynb", tmp_path / "nb" / f"{stem}.ipynb")
    paired = TextFileContentsManager(root_dir=str(tmp_path))
    paired.save(paired.get(f"nb/{stem}.ipynb"), f"nb/{stem}.ipynb")
    assert (tmp_path / "nb" / f"{stem}.py").is_file(), "the lesson itself is paired: a save writes its twin"


def test_the_handout_readme_says_what_a_student_does(handout):
    """Install, the preflight, JupyterLab on the first lesson, the lessons in order; not the
    repository's tests or CI (the repository's README is not copied)."""
    text = (handout / "README.md").read_text(encoding="utf-8")
    assert "python3 -m helpers.doctor" in text and "python3 -m jupyter lab --config=jupyter_lab_config.json" in text
    assert "MNIST (`data/`" in text
    assert [line.split("`")[1] for line in text.splitlines() if line[:1].isdigit()] == \
        [f"notebooks/{stem}.ipynb" for stem in LESSONS]
    for word in ("pytest", "ci/", ".ci", "CI", "test suite", "run_notebooks"):
        assert word not in text, word
    assert not (handout / "HANDOUT.md").exists()


def test_the_copies_mark_the_workshop_stops(copies):
    """A lesson on the 3-hour path (the manifest's ``[[workshop]]``) says, in the copy, where the room
    skips and where it stops, linking the next lesson of the path: every cell of a section or
    exercise off the path comes after such a mark, with no cell of the path in between; a lesson
    off the path has no mark."""
    path, by_label = manifest.workshop(), manifest.by_label(manifest.load())
    on_path = {by_label[p.lesson].stem: (i, p) for i, p in enumerate(path)}
    for stem in LESSONS:
        nb = nbformat.read(str(copies[stem]), as_version=4)
        marks = [i for i, c in enumerate(nb.cells) if student_copies.WORKSHOP_TAG in c.metadata.get("tags", [])]
        if stem not in on_path:
            assert not marks, stem
            continue
        i, part = on_path[stem]
        wanted = {"setup", *part.sections, *(f"ex{n}" for n in part.exercises)}
        last_mark = last_taught = -1
        for j, lab in enumerate(workshop.parts_of_cells(nb)):
            if j in marks:
                last_mark = j
            elif lab in wanted:
                last_taught = j
            elif lab != "summary":
                assert last_mark > last_taught, f"{stem}: cell {j} ({lab}) is off the path, unmarked"
        stop = nb.cells[marks[-1]].source
        assert "stop here" in stop and marks[-1] > last_taught, (stem, stop)
        if i + 1 < len(path):
            assert f"({by_label[path[i + 1].lesson].stem}.ipynb)" in stop, stop


def test_the_path_exercises_point_only_to_sections_on_the_path():
    """issue 52: an exercise done in the room names no section the room skips ("Section 4.1
    showed why", 00a's exercise 2 said, with §4 off the path). Whether its check runs on the path's
    sections alone, test_handout_kernel runs."""
    by_label = manifest.by_label(manifest.load())
    for part in manifest.workshop():
        nb = nbformat.read(str(ROOT / "notebooks" / f"{by_label[part.lesson].stem}.ipynb"), as_version=4)
        for lab, cell in zip(workshop.parts_of_cells(nb), nb.cells):
            if cell.cell_type == "markdown" and lab in {f"ex{n}" for n in part.exercises}:
                named = set(re.findall(r"(?:[Ss]ections? |§)(\d+[a-z]?)", cell.source))
                assert named <= set(part.sections), f"{part.lesson} {lab} points to §{named - set(part.sections)}"
