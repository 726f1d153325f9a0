"""The learner's side of the notebooks (issue #8): parameter checks and exercise checks as a
learner meets them, and the links of the README and docs/.

The recipe a notebook follows is ``ci/lessons.py``'s table of rules (docs/TESTING.md, "The lesson
rules"), held by tests/course/test_lessons.py; the suite also executes every notebook
(``tests/course/test_notebooks.py``), which runs every solution cell.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from _support import exercise_cells
from ci import run_notebooks as rn
from ci.cleanup import IPCKernelManager
from ci.lessons import glossary_anchors
from helpers import lessons as manifest
from helpers import notebook as hn

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
LEARNER_NOTEBOOKS = manifest.stems(None)


def path_of(stem: str) -> Path:
    return NOTEBOOKS_DIR / f"{stem}.ipynb"


def tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def run_papermill(tmp_path, cells, cwd, **options):
    """Run ``cells`` as a notebook with papermill (the runner's IPC kernels), which must raise;
    ``(PapermillExecutionError, the executed notebook's code cells)``."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    src, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": kernelspec})
    nbformat.write(nb, str(src))
    with pytest.raises(PapermillExecutionError) as info:
        papermill.execute_notebook(str(src), str(out), kernel_name="python3", cwd=str(cwd),
                                   progress_bar=False, kernel_manager_class=IPCKernelManager,
                                   **options)
    out = nbformat.read(str(out), as_version=4)
    return info.value, [c for c in out.cells if c.cell_type == "code"]


def _wrong_parameter(stem: str) -> tuple[str, object]:
    """The lesson's first parameter and a value of the wrong type for it."""
    declared = rn.notebook_parameters(path_of(stem))
    name, param = next(iter(declared.items()))
    expected, _ = rn.expected_type(param)
    return name, "not a number" if expected in ("int", "float") else 2.5


@pytest.mark.slow(20)
@pytest.mark.timeout(300)
def test_wrong_parameter_type_fails_in_the_check_cell(tmp_path):
    """papermill with a wrong-typed parameter: the first cell after the parameters fails, naming the
    parameter (the runner refuses such values earlier; papermill does not). Every lesson's head in one
    papermill run (one kernel, not one per lesson): ``%reset -f``, the lesson's code cells up to the
    one after papermill's injected parameters (``parameterize_notebook``, as ``execute_notebook``
    injects them), that cell tagged ``raises-exception`` so the run goes on to the next lesson (a
    lesson without parameters has nothing to mistype)."""
    from nbformat.v4 import new_code_cell
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    cells, heads = [], {}
    for stem in (s for s in LEARNER_NOTEBOOKS if rn.notebook_parameters(path_of(s))):
        name, bad = _wrong_parameter(stem)
        nb = load_notebook_node(str(path_of(stem)))  # as execute_notebook reads it (every cell gets tags)
        code = [c for c in parameterize_notebook(nb, {name: bad}, kernel_name="python3").cells if c.cell_type == "code"]
        injected = next(i for i, c in enumerate(code) if "injected-parameters" in tags(c))
        head = code[:injected + 2]
        head[-1].metadata["tags"] = [*tags(head[-1]), "raises-exception"]
        cells.append(new_code_cell("%reset -f"))
        heads[stem] = (name, bad, len(cells), len(cells) + injected + 1, len(cells) + len(head))
        cells += head
    # nbclient runs past raises-exception cells; papermill then raises
    _, code = run_papermill(tmp_path, cells, NOTEBOOKS_DIR, execution_timeout=120)
    errors = {i: o for i, c in enumerate(code) for o in c.get("outputs", []) if o.get("output_type") == "error"}
    for stem, (name, bad, start, check, end) in heads.items():
        failed = sorted(i for i in errors if start <= i < end)
        assert failed == [check], (f"{stem}: the error should be in the first code cell after the parameters "
                                   f"(cell {check}), got cell(s) {failed} of {start} to {end - 1}")
        err = errors[check]
        assert err["ename"] == "TypeError", f"{stem}: {err['ename']}: {err['evalue']}"
        assert repr(name) in err["evalue"] and repr(bad) in err["evalue"], err["evalue"]
        assert "check_parameters(" in code[check].source
    outside = sorted(set(errors) - {h[3] for h in heads.values()})
    assert not outside, f"errors outside the check cells: {outside}"


# ---- The exercise mechanism under papermill (a tiny notebook, no torch) --------------------


@pytest.mark.slow(5)
@pytest.mark.timeout(120)
def test_wrong_solution_fails_the_run_but_a_wrong_answer_does_not(tmp_path):
    from nbformat.v4 import new_code_cell, new_markdown_cell

    cells = [
        new_markdown_cell("# tiny"),
        new_code_cell("x = 3", metadata={"tags": ["parameters"]}),
        new_code_cell("from helpers.notebook import check_answer, check_parameters\ncheck_parameters(x=(x, int))"),
        *exercise_cells(1, "right solution", "3 squared?",
                           "expected_1 = x * x\ncheck_answer(\"ex1\", answer_1, expected_1)",
                           "solution_1 = 9\ncheck_answer(\"ex1\", solution_1, expected_1, strict=True)"),
        *exercise_cells(2, "wrong solution", "3 cubed?",
                           "expected_2 = x ** 3\ncheck_answer(\"ex2\", answer_2, expected_2)",
                           "solution_2 = 9\ncheck_answer(\"ex2\", solution_2, expected_2, strict=True)"),
    ]
    cells[4].source = "answer_1 = 10  # a learner's wrong answer"
    error, code = run_papermill(tmp_path, cells, tmp_path)
    assert error.ename == "AssertionError" and "ex2" in error.evalue, error.evalue
    joined = "\n".join("".join(o.get("text", "") for o in c.get("outputs", [])) for c in code)
    assert "ex1: not yet: 10 is too large." in joined, joined  # the learner's check printed, did not raise
    assert "ex1: solution checked" in joined, joined
    assert "ex2: not answered yet" in joined, joined


# ---- helpers.notebook ----------------------------------------------------------------------


def test_check_parameters_accepts_right_types():
    import numpy as np

    hn.check_parameters(world_size=(2, int), lr=(0.01, float), lr_int=(1, float), model=("cnn", str),
                        flag=(False, bool), maybe=(None, (int, None)), ranks=([1, 4], list),
                        np_int=(np.int64(3), int), np_float=(np.float32(0.5), float),
                        pair=([1, 2], tuple))  # JSON, papermill and -p carry a tuple as a list


@pytest.mark.parametrize("params, says, not_said", [
    ({"world_size": (2.5, int)}, ["'world_size' must be an int", "2.5 (float)", "`world_size = 2`",
                                  "-p world_size 2"], []),  # float for int
    ({"world_size": (True, int)}, ["'world_size' must be an int", "True (bool)",
                                   "bool, not a number"], []),
    ({"lr": (False, float)}, ["'lr' must be a float"], []),
    ({"lr": ("0.1", float)}, ["'lr' must be a float", "'0.1' (str)", "`lr = 0.1`", "-r"], []),
    ({"model": (3, str)}, ["'model' must be a str", '`model = "linear"`'], []),
    ({"steps": (None, int)}, ["'steps' must be an int", "None (NoneType)"], []),
    ({"steps": ("x", (int, None))}, ["must be an int or None"], []),
    ({"a": (1.5, int), "b": (2, int), "c": ("x", float)},  # every wrong parameter, in one message
     ["wrong parameter types:", "'a'", "'c'"], ["'b'"]),
    ({"world_size": 2}, ["(value, type) pair"], []),  # malformed calls
    ({"world_size": (2, "int")}, ["must be a type"], []),
])
def test_check_parameters_says_what_is_wrong_and_how_to_pass_it(params, says, not_said):
    with pytest.raises(TypeError) as info:
        hn.check_parameters(**params)
    msg = str(info.value)
    assert all(w in msg for w in says) and not any(w in msg for w in not_said), msg


def test_check_value():
    hn.check_value("world_size", 2, True, "at least 2")
    with pytest.raises(ValueError) as info:
        hn.check_value("world_size", 1, False, "at least 2 (one process has nobody to disagree with)")
    msg = str(info.value)
    assert "'world_size' = 1 is not allowed" in msg and "at least 2 (one process" in msg and "-p world_size" in msg


@pytest.mark.parametrize("answer, expected, verdict", [
    (None, 15.0, "not answered yet"), (15, 15.0, "correct"), (15.0000001, 15.0, "correct"),
    (30, 15.0, "not yet: 30 is too large."), (10, 15.0, "not yet: 10 is too small."),
    ("7/12", Fraction(7, 12), "correct"), ("0.5", 0.5, "correct"),
    ([0.25, 0.25, 0.0], [0.25, 0.25, 0], "correct"),
    ([0.25, 0.5, 0.0], [0.25, 0.25, 0], "not yet: 0.5 at [1] is too large."),
    ([1, 2], [1, 2, 3], "not yet: expected 3 values, you gave 2."),
    (15, [1, 2], "not yet: expected a list of 2 values"),
    ([1], 15, "not yet: expected a number"), (True, 1, "not yet: expected a number"),
    (1, True, "not yet: expected True or False"),
    (False, True, "not yet: True/False is the other way round."),
    (" Linear ", "linear", "correct"), ({"a": 1}, {"a": 1.0}, "correct"),
    ({"b": 1}, {"a": 1}, "not yet: expected the keys"), ({3, 1}, {1, 3}, "correct"),
    (object(), 15, "not yet: expected a number"), ("abc", 15, "not yet: expected a number"),
    ([0.25, 0.25, 0.0], torch.tensor([0.25, 0.25, 0.0]), "correct\n"),  # tensors and arrays
    (np.float64(15.0), torch.tensor(15.0), "correct\n"), (torch.tensor(16.0), 15, "not yet"),
    (25.17, 151 / 6, ("correct\n", {"rel_tol": 1e-3})),  # a tolerance, a hint
    (25.17, 151 / 6, ("not yet:", {"hint": "average the two ranks"},
                      "Hint: average the two ranks\n")),
])
def test_check_answer_for_the_learner(answer, expected, verdict, capsys):
    verdict, options, end = (verdict, {}, "") if isinstance(verdict, str) else (*verdict, "")[:3]
    hn.check_answer("ex1", answer, expected, **options)  # never raises for the learner's value
    out = capsys.readouterr().out
    assert out.startswith(f"ex1: {verdict}") and out.endswith(end), out


def test_check_answer_strict_and_code_answers(capsys):
    """strict=True (a solution): it raises. A code exercise: run= turns the learner's function into
    the value compared; a failing function: "not yet" for the learner, an error for a solution."""
    hn.check_answer("ex2", Fraction(151, 6), 151 / 6, strict=True)
    assert capsys.readouterr().out == "ex2: solution checked\n"
    with pytest.raises(AssertionError) as info:
        hn.check_answer("ex2", 14.0, 15, strict=True)
    assert "ex2" in str(info.value) and "14.0" in str(info.value) and "15" in str(info.value)
    with pytest.raises(AssertionError, match="ex2: the solution left its answer as None"):
        hn.check_answer("ex2", None, 15, strict=True)
    square = lambda fn: [fn(x) for x in (1, 2, 3)]  # noqa: E731
    hn.check_answer("ex4", None, [1, 4, 9], run=square)
    hn.check_answer("ex4", lambda x: x * x, [1, 4, 9], run=square)
    hn.check_answer("ex4", lambda x: x + x, [1, 4, 9], run=square)
    hn.check_answer("ex4", lambda x: 1 / 0, [1, 4, 9], run=square, hint="multiply")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ex4: not answered yet") and lines[1] == "ex4: correct", lines
    assert lines[2].startswith("ex4: not yet:"), lines
    assert lines[3] == "ex4: your code crashed (not a wrong value): ZeroDivisionError: division by zero", lines
    assert lines[4] == "ex4: fix the error above, then run this cell again.", lines
    assert "Hint" not in "\n".join(lines[3:]), "the hint is about wrong values, not crashes"
    hn.check_answer("ex4", lambda x: x ** 2, [1, 4, 9], run=square, strict=True)
    with pytest.raises(AssertionError, match="ex4"):
        hn.check_answer("ex4", lambda x: x, [1, 4, 9], run=square, strict=True)
    with pytest.raises(ZeroDivisionError):
        hn.check_answer("ex4", lambda x: 1 / 0, [1, 4, 9], run=square, strict=True)


def _crashing_worker(rank, world_size):
    return [1.0, 2.0] if rank == 0 else 1 / 0


def test_check_answer_reports_a_crashed_worker_as_a_crash(capsys):
    """A learner's worker that raises on one rank (real ranks, helpers.engine.launch): the check says
    it crashed, with the rank and its error and the worker's own line, not "expected a list"."""
    from helpers.engine import launch

    hn.check_answer("ex4", _crashing_worker, [[1.0, 2.0]] * 2, run=lambda fn: launch(fn, 2, timeout=120),
                    hint="about wrong values")
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("ex4: your code crashed (not a wrong value): rank 1 failed with ZeroDivisionError"), out
    assert "1 / 0" in out and out.rstrip().endswith("then run this cell again."), out
    assert "expected a list" not in out and "Hint" not in out, out


@pytest.mark.slow(8)
def test_check_answer_on_stopped_ranks_says_to_start_them(capsys):
    """After "Run All" a lesson's last cell has stopped its warm ranks; an exercise checked then
    did not crash: the check says that nothing ran and which cell to run, not "your code crashed"."""
    from helpers.engine import start_ranks

    ranks = start_ranks(2)
    ranks.stop()
    hn.check_answer("ex1", lambda rank, world_size: rank, [0, 1], run=ranks.run, hint="about wrong values")
    out = capsys.readouterr().out.strip()
    assert out.startswith("ex1: could not run your code: these warm ranks were stopped"), out
    assert "ranks = start_ranks(...)" in out and "crashed" not in out and "Hint" not in out, out


def test_exercise_checks_run_code_answers_through_check_answer():
    """A check cell that runs the learner's function itself (``if callable(answer_1): answer_1 =
    ranks.run(...)``) turns a crash into a wrong-value message or raises out of the cell; every
    check cell leaves running the answer to ``check_answer(..., run=...)``."""
    by_hand = re.compile(r"callable\(answer_\d+\)|\b(?:launch|run|spawn)\(.*\banswer_\d+")
    found = [(path.stem, i, line.strip()) for path in map(path_of, LEARNER_NOTEBOOKS)
             for i, c in enumerate(nbformat.read(path, as_version=4).cells)
             if c.cell_type == "code" and "check" in c.metadata.get("tags", [])
             for line in c.source.splitlines() if by_hand.search(line) and "check_answer(" not in line]
    assert not found, f"check cells that run an answer by hand (use check_answer's run=): {found}"


def test_assert_close_once_names_a_cell_run_twice():
    """lesson 00b's backward cell run again doubles .grad: the check says so and names the cell."""
    import torch

    g = torch.tensor([[0.5, -1.0], [2.0, 0.25]])
    hn.assert_close_once(g.clone(), g, what="weight.grad", rerun_from="cell X")
    with pytest.raises(AssertionError) as info:
        hn.assert_close_once(2 * g, g, what="rank 0's weight.grad", rerun_from="the cell `model = ...`")
    msg = str(info.value)
    assert msg.startswith("rank 0's weight.grad is 2 times the expected value: gradients accumulate"), msg
    assert "ran 2 times" in msg and "Re-run from the cell `model = ...`" in msg, msg
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        hn.assert_close_once(g + 1, g, what="weight.grad", rerun_from="cell X")  # another mistake: torch's message


def test_exercise_cells():
    cells = exercise_cells(2, "title", "the task", "expected_2 = 1\ncheck_answer(\"ex2\", answer_2, expected_2)",
                              "solution_2 = 1\ncheck_answer(\"ex2\", solution_2, expected_2, strict=True)")
    assert [c.cell_type for c in cells] == ["markdown", "code", "code", "code"]
    assert cells[0].source.startswith("### Exercise 2: title\n\nthe task")
    assert cells[1].source == "answer_2 = None  # your answer here"
    assert cells[2].metadata["jupyter"]["source_hidden"] is True and cells[2].source.startswith("# Check: exercise 2\n")
    assert cells[3].metadata["jupyter"]["source_hidden"] is True and cells[3].metadata["tags"] == ["solution"]
    assert cells[3].source.splitlines()[0] == "# Solution of exercise 2 (try the exercise first)"


# ---- Links of the README and docs/ ---------------------------------------------------------

MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                      for p in (ROOT / "docs").glob("*.md"))])
def test_readme_and_docs_links_resolve(doc):
    """Every relative link of the README and docs/*.md names a file that exists, and an anchor
    in a Markdown file that it defines."""
    path = ROOT / doc
    bad = []
    for target in MD_LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in glossary_anchors(dest):
            bad.append(f"{target} (no such anchor)")
    assert not bad, f"{doc}: broken links: {bad}"
