"""The learner's side of the notebooks (issue #8): glossary links, parameter checks, exercises
with checked solutions, lesson prose without typed times or machinery, docs/RUNNER.md's
parameter table, the measured run times of the README's path table and of each lesson's
opening, and the links of the README and docs/.

The recipe a notebook must follow is in ``helpers/notebook.py``'s docstring. The notebook
tests below hold the notebooks listed in ``LEARNER_NOTEBOOKS`` to it; the suite also executes
every notebook (``tests/course/test_notebooks.py``), which runs every solution cell.
"""

from __future__ import annotations

import ast
import json
import re
from fractions import Fraction
from pathlib import Path

import nbformat
import pytest

from ci import params_table, path_table
from ci import run_notebooks as rn
from ci.cleanup import IPCKernelManager
from ci.outputs import record_times
from helpers import notebook as hn

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
GLOSSARY = ROOT / "docs" / "GLOSSARY.md"

# The notebooks held to the recipe in helpers/notebook.py: every notebooks/*.ipynb
# (test_every_notebook_is_a_learner_notebook fails when a new one is missing here).
LEARNER_NOTEBOOKS = [
    "00a_processes_and_collectives",
    "00b_ddp_cell_by_cell",
    "01_gradients_dp_vs_ddp",
    "02_one_model_many_processes",
    "03_distributed_sampler",
    "04_mnist_single_dp_ddp",
    "05a_throughput_on_one_machine",
    "05b_communication_and_cost_model",
    "06a_training_loop_pitfalls",
    "06b_state_across_ranks",
    "06c_seeds_and_debugging",
    "06d_silent_bugs",
    "06e_more_silent_bugs",
    "07a_torchrun_and_many_nodes",
    "07b_hooks_and_after_ddp",
    "08a_zero_and_fsdp2",
    "08b_compile_and_ddp",
]

GLOSSARY_LINK = "../docs/GLOSSARY.md"
LINK = re.compile(r"\]\((\.\./docs/GLOSSARY\.md)(#[^)\s]*)?\)")
# Typed run-time estimates ("about 4–15 s", "takes about 1–3 min", "~50 s") and machine
# logistics ("2-core", "2 CPU cores", "CI") have no place in lesson prose: the measured time
# is the line ci/path_table.py writes from the record (left out of this check).
TYPED_TIME = re.compile(r"\babout [\d.,–-]+ ?(s|ms|sec|seconds?|min|minutes?)\b"
                        r"|\btakes? (about |roughly |around )?[\d.,–-]+ ?(s|ms|sec|seconds?|min|minutes?)\b"
                        r"|~ ?[\d.,–-]+ ?(s|ms|sec|seconds?|min|minutes?)\b", re.I)
LOGISTICS = re.compile(r"\b\d+[ -](CPU[ -])?cores?\b|\bCPU cores\b", re.I)
CI_WORD = re.compile(r"\bCI\b")  # case-sensitive: "ci/run_notebooks.py" is a path, not CI


def path_of(stem: str) -> Path:
    return NOTEBOOKS_DIR / f"{stem}.ipynb"


def read(stem: str):
    return nbformat.read(str(path_of(stem)), as_version=4)


def tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def parameters_index(nb) -> int:
    marked = [i for i, c in enumerate(nb.cells) if "parameters" in tags(c)]
    assert len(marked) == 1, f"cells tagged 'parameters': {marked}, expected exactly one"
    return marked[0]


def glossary_anchors() -> set[str]:
    text = GLOSSARY.read_text(encoding="utf-8")
    anchors = set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))
    for heading in re.findall(r"^#+\s+(.+?)\s*$", text, re.M):  # GitHub's heading slugs
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


# --------------------------------------------------------------------------------------------
# Notebooks follow the recipe
# --------------------------------------------------------------------------------------------


def test_learner_notebooks_exist():
    missing = [s for s in LEARNER_NOTEBOOKS if not path_of(s).is_file()]
    assert not missing, f"LEARNER_NOTEBOOKS names notebooks that do not exist: {missing}"


def test_every_notebook_is_a_learner_notebook():
    """Every notebook follows the recipe: a new notebook must be added to LEARNER_NOTEBOOKS."""
    others = sorted(p.stem for p in NOTEBOOKS_DIR.glob("*.ipynb") if p.stem not in LEARNER_NOTEBOOKS)
    assert not others, f"notebooks not yet in LEARNER_NOTEBOOKS (tests/course/test_learner.py): {others}"


@pytest.mark.parametrize("stem", LEARNER_NOTEBOOKS)
def test_first_cell_links_to_glossary(stem):
    nb = read(stem)
    first = nb.cells[0]
    assert first.cell_type == "markdown", f"{stem}: the first cell must be markdown"
    links = LINK.findall(first.source)
    assert any(target == GLOSSARY_LINK for target, _ in links), (
        f"{stem}: the first cell must link to the glossary: [glossary]({GLOSSARY_LINK})")
    assert (path_of(stem).parent / GLOSSARY_LINK).resolve() == GLOSSARY.resolve()


@pytest.mark.parametrize("stem", LEARNER_NOTEBOOKS)
def test_glossary_anchors_exist(stem):
    anchors = glossary_anchors()
    nb = read(stem)
    bad = sorted({frag[1:] for c in nb.cells if c.cell_type == "markdown"
                  for _, frag in LINK.findall(c.source) if frag and frag[1:] not in anchors})
    assert not bad, f"{stem}: links to glossary anchors that docs/GLOSSARY.md does not define: {bad}"


@pytest.mark.parametrize("stem", LEARNER_NOTEBOOKS)
def test_parameters_checked_in_next_cell(stem):
    """The cell right after the parameters cell calls check_parameters with every parameter."""
    nb = read(stem)
    i = parameters_index(nb)
    assert i + 1 < len(nb.cells), f"{stem}: nothing after the parameters cell"
    cell = nb.cells[i + 1]
    assert cell.cell_type == "code", f"{stem}: the cell after the parameters cell must be code"
    calls = [node for node in ast.walk(ast.parse(cell.source))
             if isinstance(node, ast.Call)
             and getattr(node.func, "id", getattr(node.func, "attr", None)) == "check_parameters"]
    assert len(calls) == 1, f"{stem}: the cell after the parameters cell must call check_parameters(...) once"
    checked = {kw.arg for kw in calls[0].keywords}
    declared = set(rn.notebook_parameters(path_of(stem)))
    assert declared <= checked, f"{stem}: check_parameters(...) does not check {sorted(declared - checked)}"
    assert checked <= declared, f"{stem}: check_parameters(...) names non-parameters {sorted(checked - declared)}"
    for kw in calls[0].keywords:  # name=(name, type)
        ok = (isinstance(kw.value, ast.Tuple) and len(kw.value.elts) == 2
              and isinstance(kw.value.elts[0], ast.Name) and kw.value.elts[0].id == kw.arg)
        assert ok, f"{stem}: write check_parameters({kw.arg}=({kw.arg}, TYPE), ...)"
    assert "import torch" not in cell.source, f"{stem}: check the parameters before importing anything slow"


@pytest.mark.parametrize("stem", LEARNER_NOTEBOOKS)
def test_exercises_with_hidden_checked_solutions(stem):
    nb = read(stem)
    solutions = [i for i, c in enumerate(nb.cells) if hn.SOLUTION_TAG in tags(c)]
    assert len(solutions) >= 2, f"{stem}: {len(solutions)} cell(s) tagged 'solution', expected at least 2"
    for i in solutions:
        c = nb.cells[i]
        assert c.cell_type == "code", f"{stem}: solution cell {i} is not code"
        assert c.metadata.get("jupyter", {}).get("source_hidden") is True, (
            f"{stem}: solution cell {i} must have metadata jupyter.source_hidden = true (collapsed input)")
        assert c.source.startswith(hn.SOLUTION_FIRST_LINE), (
            f"{stem}: solution cell {i} must start with {hn.SOLUTION_FIRST_LINE!r} (JupyterLab shows the first "
            "line of a collapsed cell: it must not give the answer away)")
        assert re.search(r"check_answer\(\"ex\d+\", solution_\d+, expected_\d+,[^\n]*strict=True", c.source), (
            f"{stem}: solution cell {i} must assert with check_answer(\"exN\", solution_N, expected_N, strict=True)")

    answers = [i for i, c in enumerate(nb.cells)
               if c.cell_type == "code" and re.fullmatch(r"answer_(\d+) = None\s*(#.*)?", c.source.strip())]
    assert len(answers) == len(solutions), f"{stem}: {len(answers)} answer_N cells for {len(solutions)} solutions"
    for k, i in enumerate(answers, start=1):
        n = re.match(r"answer_(\d+)", nb.cells[i].source).group(1)
        assert n == str(k), f"{stem}: exercises must be numbered 1, 2, ... in order; found answer_{n} as number {k}"
        task, check = nb.cells[i - 1], nb.cells[i + 1]
        assert task.cell_type == "markdown" and f"### Exercise {n}" in task.source, (
            f"{stem}: exercise {n} needs its task above")
        assert f'check_answer("ex{n}", answer_{n}, expected_{n}' in check.source, (
            f"{stem}: the cell after answer_{n} must check it: check_answer(\"ex{n}\", answer_{n}, expected_{n}, ...)")
        assert "strict=True" not in check.source, f"{stem}: the learner's check for ex{n} must not be strict"
        assert i + 2 in solutions, f"{stem}: exercise {n}'s solution must follow its check cell"
    last_md = max(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "## What we saw" in c.source)
    assert answers and last_md < answers[0], f"{stem}: the exercises come after 'What we saw'"


def machinery_in_prose(nb) -> list[tuple[int, str]]:
    """(cell, phrase) for each typed time estimate or CI / core-count phrase in ``nb``'s
    markdown cells, the generated run-time line left out."""
    found = []
    for i, c in enumerate(nb.cells):
        if c.cell_type != "markdown":
            continue
        text = c.source
        if path_table.NB_START in text and path_table.NB_END in text:
            head, rest = text.split(path_table.NB_START, 1)
            text = head + rest.split(path_table.NB_END, 1)[1]
        for pattern in (TYPED_TIME, LOGISTICS, CI_WORD):
            found += [(i, m.group(0)) for m in pattern.finditer(text)]
    return found


@pytest.mark.parametrize("stem", LEARNER_NOTEBOOKS)
def test_lesson_prose_has_no_typed_times_or_machinery(stem):
    """No markdown cell types a run time ("about 5–15 s") or names the machine's logistics
    ("2-core", "2 CPU cores", "CI"): the one measured time is the generated run-time line."""
    found = machinery_in_prose(read(stem))
    assert not found, (f"{stem}: typed times or machine logistics in the prose (cell, phrase): {found}; "
                       "say why a cell is slow without a number: the measured time is written by "
                       "python3 ci/path_table.py")


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
    injects them), that cell tagged ``raises-exception`` so the run goes on to the next lesson."""
    import papermill
    from nbformat.v4 import new_code_cell, new_notebook
    from papermill.exceptions import PapermillExecutionError
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    cells, heads = [], {}
    for stem in LEARNER_NOTEBOOKS:
        name, bad = _wrong_parameter(stem)
        nb = load_notebook_node(str(path_of(stem)))  # as execute_notebook reads it (every cell gets tags)
        code = [c for c in parameterize_notebook(nb, {name: bad}, kernel_name="python3").cells if c.cell_type == "code"]
        injected = next(i for i, c in enumerate(code) if "injected-parameters" in tags(c))
        head = code[:injected + 2]
        head[-1].metadata["tags"] = [*tags(head[-1]), "raises-exception"]
        cells.append(new_code_cell("%reset -f"))
        heads[stem] = (name, bad, len(cells), len(cells) + injected + 1, len(cells) + len(head))
        cells += head
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    src, out = tmp_path / "heads.ipynb", tmp_path / "out.ipynb"
    nbformat.write(new_notebook(cells=cells, metadata={"kernelspec": kernelspec}), str(src))
    with pytest.raises(PapermillExecutionError):  # nbclient runs past raises-exception cells; papermill then raises
        papermill.execute_notebook(str(src), str(out), kernel_name="python3", cwd=str(NOTEBOOKS_DIR),
                                   progress_bar=False, execution_timeout=120, kernel_manager_class=IPCKernelManager)
    code = [c for c in nbformat.read(str(out), as_version=4).cells if c.cell_type == "code"]  # papermill adds markdown
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


# --------------------------------------------------------------------------------------------
# The exercise mechanism under papermill (a tiny notebook, no torch)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow(5)
@pytest.mark.timeout(120)
def test_wrong_solution_fails_the_run_but_a_wrong_answer_does_not(tmp_path):
    import papermill
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
    from papermill.exceptions import PapermillExecutionError

    cells = [
        new_markdown_cell("# tiny"),
        new_code_cell("x = 3", metadata={"tags": ["parameters"]}),
        new_code_cell("from helpers.notebook import check_answer, check_parameters\ncheck_parameters(x=(x, int))"),
        *hn.exercise_cells(1, "right solution", "3 squared?",
                           "expected_1 = x * x\ncheck_answer(\"ex1\", answer_1, expected_1)",
                           "solution_1 = 9\ncheck_answer(\"ex1\", solution_1, expected_1, strict=True)"),
        *hn.exercise_cells(2, "wrong solution", "3 cubed?",
                           "expected_2 = x ** 3\ncheck_answer(\"ex2\", answer_2, expected_2)",
                           "solution_2 = 9\ncheck_answer(\"ex2\", solution_2, expected_2, strict=True)"),
    ]
    cells[4].source = "answer_1 = 10  # a learner's wrong answer"
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb = new_notebook(cells=cells, metadata={"kernelspec": kernelspec})
    src, out = tmp_path / "tiny.ipynb", tmp_path / "out.ipynb"
    nbformat.write(nb, str(src))
    with pytest.raises(PapermillExecutionError) as info:
        papermill.execute_notebook(str(src), str(out), kernel_name="python3", progress_bar=False, cwd=str(tmp_path),
                                   kernel_manager_class=IPCKernelManager)
    assert info.value.ename == "AssertionError" and "ex2" in info.value.evalue, info.value.evalue
    executed = nbformat.read(str(out), as_version=4)
    text = {i: "".join(o.get("text", "") for o in c.get("outputs", [])) for i, c in enumerate(executed.cells)
            if c.cell_type == "code"}
    joined = "\n".join(text.values())
    assert "ex1: not yet: 10 is too large." in joined, joined  # the learner's check printed, did not raise
    assert "ex1: solution checked" in joined, joined
    assert "ex2: not answered yet" in joined, joined


# --------------------------------------------------------------------------------------------
# helpers.notebook
# --------------------------------------------------------------------------------------------


def type_error(**params) -> str:
    with pytest.raises(TypeError) as info:
        hn.check_parameters(**params)
    return str(info.value)


def test_check_parameters_accepts_right_types():
    import numpy as np

    hn.check_parameters(world_size=(2, int), lr=(0.01, float), lr_int=(1, float), model=("cnn", str),
                        flag=(False, bool), maybe=(None, (int, None)), ranks=([1, 4], list),
                        np_int=(np.int64(3), int), np_float=(np.float32(0.5), float),
                        pair=([1, 2], tuple))  # JSON, papermill and -p carry a tuple as a list


def test_check_parameters_float_for_int():
    msg = type_error(world_size=(2.5, int))
    assert "'world_size' must be an int" in msg and "2.5 (float)" in msg
    assert "`world_size = 2`" in msg and "-p world_size 2" in msg


def test_check_parameters_bool_is_not_int_nor_float():
    msg = type_error(world_size=(True, int))
    assert "'world_size' must be an int" in msg and "True (bool)" in msg and "bool, not a number" in msg
    assert "'lr' must be a float" in type_error(lr=(False, float))


def test_check_parameters_number_as_text():
    msg = type_error(lr=("0.1", float))
    assert "'lr' must be a float" in msg and "'0.1' (str)" in msg and "`lr = 0.1`" in msg and "-r" in msg


def test_check_parameters_str_and_none():
    msg = type_error(model=(3, str))
    assert "'model' must be a str" in msg and '`model = "linear"`' in msg
    msg = type_error(steps=(None, int))
    assert "'steps' must be an int" in msg and "None (NoneType)" in msg
    assert "must be an int or None" in type_error(steps=("x", (int, None)))


def test_check_parameters_reports_every_wrong_parameter():
    msg = type_error(a=(1.5, int), b=(2, int), c=("x", float))
    assert msg.startswith("wrong parameter types:") and "'a'" in msg and "'c'" in msg and "'b'" not in msg


def test_check_parameters_malformed_call():
    assert "(value, type) pair" in type_error(world_size=2)
    assert "must be a type" in type_error(world_size=(2, "int"))


def test_check_value():
    hn.check_value("world_size", 2, True, "at least 2")
    with pytest.raises(ValueError) as info:
        hn.check_value("world_size", 1, False, "at least 2 (one process has nobody to disagree with)")
    msg = str(info.value)
    assert "'world_size' = 1 is not allowed" in msg and "at least 2 (one process" in msg and "-p world_size" in msg


@pytest.mark.parametrize("answer, expected, verdict", [
    (None, 15.0, "not answered yet"),
    (15, 15.0, "correct"),
    (15.0000001, 15.0, "correct"),
    (30, 15.0, "not yet: 30 is too large."),
    (10, 15.0, "not yet: 10 is too small."),
    ("7/12", Fraction(7, 12), "correct"),
    ("0.5", 0.5, "correct"),
    ([0.25, 0.25, 0.0], [0.25, 0.25, 0], "correct"),
    ([0.25, 0.5, 0.0], [0.25, 0.25, 0], "not yet: 0.5 at [1] is too large."),
    ([1, 2], [1, 2, 3], "not yet: expected 3 values, you gave 2."),
    (15, [1, 2], "not yet: expected a list of 2 values"),
    ([1], 15, "not yet: expected a number"),
    (True, 1, "not yet: expected a number"),
    (1, True, "not yet: expected True or False"),
    (False, True, "not yet: True/False is the other way round."),
    (" Linear ", "linear", "correct"),
    ({"a": 1}, {"a": 1.0}, "correct"),
    ({"b": 1}, {"a": 1}, "not yet: expected the keys"),
    ({3, 1}, {1, 3}, "correct"),
    (object(), 15, "not yet: expected a number"),
    ("abc", 15, "not yet: expected a number"),
])
def test_check_answer_for_the_learner(answer, expected, verdict, capsys):
    hn.check_answer("ex1", answer, expected)  # never raises for the learner's value
    out = capsys.readouterr().out
    assert out.startswith(f"ex1: {verdict}"), out


def test_check_answer_tensors_and_arrays(capsys):
    import numpy as np
    import torch

    hn.check_answer("ex1", [0.25, 0.25, 0.0], torch.tensor([0.25, 0.25, 0.0]))
    hn.check_answer("ex1", np.float64(15.0), torch.tensor(15.0))
    hn.check_answer("ex1", torch.tensor(16.0), 15)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ex1: correct" and lines[1] == "ex1: correct" and lines[2].startswith("ex1: not yet"), lines


def test_check_answer_hint_and_tolerance(capsys):
    hn.check_answer("ex3", 25.17, 151 / 6, rel_tol=1e-3)
    hn.check_answer("ex3", 25.17, 151 / 6, hint="average the two ranks")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ex3: correct"
    assert lines[1].startswith("ex3: not yet:") and lines[1].endswith("Hint: average the two ranks"), lines


def test_check_answer_strict(capsys):
    hn.check_answer("ex2", Fraction(151, 6), 151 / 6, strict=True)
    assert capsys.readouterr().out == "ex2: solution checked\n"
    with pytest.raises(AssertionError) as info:
        hn.check_answer("ex2", 14.0, 15, strict=True)
    assert "ex2" in str(info.value) and "14.0" in str(info.value) and "15" in str(info.value)
    with pytest.raises(AssertionError, match="ex2: the solution left its answer as None"):
        hn.check_answer("ex2", None, 15, strict=True)


def test_check_answer_runs_code_answers(capsys):
    """A code exercise: run= turns the learner's function into the value compared; a failing
    function is a "not yet" for the learner and an error for a solution."""
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
    found = [(path.stem, i, line.strip()) for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
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
    cells = hn.exercise_cells(2, "title", "the task", "expected_2 = 1\ncheck_answer(\"ex2\", answer_2, expected_2)",
                              "solution_2 = 1\ncheck_answer(\"ex2\", solution_2, expected_2, strict=True)")
    assert [c.cell_type for c in cells] == ["markdown", "code", "code", "code"]
    assert cells[0].source.startswith("### Exercise 2: title\n\nthe task")
    assert cells[1].source == "answer_2 = None  # your answer here"
    assert cells[3].metadata["jupyter"]["source_hidden"] is True and cells[3].metadata["tags"] == ["solution"]
    assert cells[3].source.splitlines()[0] == "# Solution of exercise 2 (try the exercise first)"
    with pytest.raises(ValueError, match="check cell must call"):
        hn.exercise_cells(1, "t", "task", "expected_1 = 1",
                          "check_answer(\"ex1\", solution_1, expected_1, strict=True)")
    with pytest.raises(ValueError, match="must compute expected_1"):
        hn.exercise_cells(1, "t", "task", "check_answer(\"ex1\", answer_1, expected_1)",
                          "check_answer(\"ex1\", solution_1, expected_1, strict=True)")
    with pytest.raises(ValueError, match="solution must end with"):
        hn.exercise_cells(1, "t", "task", "expected_1 = 1\ncheck_answer(\"ex1\", answer_1, expected_1)",
                          "check_answer(\"ex1\", solution_1, expected_1)")


# --------------------------------------------------------------------------------------------
# docs/RUNNER.md's parameter table
# --------------------------------------------------------------------------------------------


def test_readme_parameter_table_is_up_to_date(capsys):
    rc = params_table.main(["--check"])
    out = capsys.readouterr()
    assert rc == 0, f"{out.out}{out.err}"


def test_params_table_rows_match_the_notebooks():
    rows = params_table.rows()
    nb04 = {r["parameter"]: r for r in rows if "04_mnist_single_dp_ddp" in r["notebook"]}
    assert nb04["`max_steps`"]["type"] == "int" and nb04["`max_steps`"]["default"] == "`200`"
    assert nb04["`model`"]["default"] == '`"linear"`' and nb04["`model`"]["type"] == "str"
    full = rn.load_profiles().get("04_mnist_single_dp_ddp", {}).get("full", {})
    if "max_steps" in full:
        assert nb04["`max_steps`"]["full"] == f"**`{full['max_steps']!r}`**"
    assert "optimizer steps per mode" in nb04["`max_steps`"]["description"]
    stems = {p.stem for p in NOTEBOOKS_DIR.glob("*.ipynb")}
    assert {re.search(r"notebooks/(.+)\.ipynb", r["notebook"]).group(1) for r in rows} <= stems


def test_params_table_check_detects_a_stale_readme(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{params_table.START}\nold table\n{params_table.END}\n\nafter\n", encoding="utf-8")
    assert params_table.main(["--check", "--readme", str(readme)]) == 1
    assert params_table.main(["--readme", str(readme)]) == 0
    text = readme.read_text(encoding="utf-8")
    assert "old table" not in text and text.startswith("# x\n\n") and text.endswith("\n\nafter\n")
    assert params_table.main(["--check", "--readme", str(readme)]) == 0
    readme.write_text("# no markers\n", encoding="utf-8")
    assert params_table.main(["--check", "--readme", str(readme)]) == 2
    capsys.readouterr()


# --------------------------------------------------------------------------------------------
# The README's path table: run times from the runner's record, never typed
# --------------------------------------------------------------------------------------------

PATH_FIXTURE = f"""# x

{path_table.START}
| lesson | you will be able to | needs | run time |
| --- | --- | --- | --- |
| [00 a](notebooks/00_a.ipynb) | do a | nothing | typed by hand |
| [01 b](notebooks/01_b.ipynb) | do b | 00 | 1 s |
| [02 c](notebooks/02_c.ipynb) | do c | 01 | 3 min |

an old note line
{path_table.END}

after
"""

PATH_NOTE = ("Run times: the `full` profile's, measured on box, 2 cores, 2026-12-01 to 2026-12-02; "
             "written by `python3 ci/path_table.py`, never by hand.")
PATH_EXPECTED = f"""# x

{path_table.START}
| lesson | you will be able to | needs | run time |
| --- | --- | --- | --- |
| [00 a](notebooks/00_a.ipynb) | do a | nothing | 57 s |
| [01 b](notebooks/01_b.ipynb) | do b | 00 | 9 min |
| [02 c](notebooks/02_c.ipynb) | do c | 01 | not measured yet |

{PATH_NOTE}
{path_table.END}

after
"""


def test_readme_path_table_run_times_are_up_to_date(capsys):
    """The README's path table and every lesson's run-time line match docs/run_times.json."""
    rc = path_table.main(["--check"])
    out = capsys.readouterr()
    assert rc == 0, f"{out.out}{out.err}"


def test_readme_path_table_lists_every_notebook_in_order():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split(path_table.START, 1)[1].split(path_table.END, 1)[0]
    assert path_table.STEM.findall(block) == LEARNER_NOTEBOOKS


def write_lesson(folder: Path, stem: str, prose: str) -> None:
    """A two-cell lesson ``<stem>.ipynb`` and its jupytext twin ``<stem>.py``, written as
    ``jupytext --sync`` writes them, with a stale run-time line in the first cell."""
    import jupytext

    folder.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook(metadata={"jupytext": {"formats": "ipynb,py:percent"},
                                            "kernelspec": {"display_name": "Python 3", "language": "python",
                                                           "name": "python3"}})
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {stem}\n\n{path_table.NB_START}\nRun time: typed by hand\n"
                                              f"{path_table.NB_END}\n\n{prose}"),
                nbformat.v4.new_code_cell("x = 1")]
    (folder / f"{stem}.ipynb").write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    jupytext.write(nb, str(folder / f"{stem}.py"), fmt="py:percent")


def lesson_line(folder: Path, stem: str, suffix: str) -> str:
    """The generated line of a lesson file (``.ipynb`` or ``.py``), read back as the learner sees it."""
    import jupytext

    first = jupytext.read(str(folder / f"{stem}{suffix}")).cells[0].source
    return first.split(path_table.NB_START + "\n", 1)[1].split("\n" + path_table.NB_END, 1)[0]


def test_path_table_writes_the_recorded_times(tmp_path, capsys):
    """A runner's record (ci.outputs.record_times) becomes the last column, rounded as written."""
    folder = tmp_path / "build" / "full"
    record_times([{"notebook": "00_a", "status": "ok", "seconds": 56.7},
                  {"notebook": "02_c", "status": "FAILED", "seconds": 3.0}],
                 folder, when="2026-12-01", host="box, 2 cores")
    record_times([{"notebook": "01_b", "status": "ok", "seconds": 569.6},
                  {"notebook": "00_a", "status": "TIMEOUT", "seconds": 9.0}],  # keeps 56.7
                 folder, when="2026-12-02", host="box, 2 cores")
    readme = tmp_path / "README.md"
    times = tmp_path / "run_times.json"
    readme.write_text(PATH_FIXTURE, encoding="utf-8")
    for stem in ("00_a", "01_b", "02_c"):
        write_lesson(tmp_path / "notebooks", stem, "Some prose.")
    args = ["--readme", str(readme), "--times", str(times), "--notebooks", str(tmp_path / "notebooks")]
    assert path_table.main(["--check", *args, "--times", str(tmp_path / "missing.json")]) == 2
    assert path_table.main(["--record", str(folder / "times.json"), *args]) == 0
    assert readme.read_text(encoding="utf-8") == PATH_EXPECTED
    assert json.loads(times.read_text())["notebooks"]["01_b"] == {
        "seconds": 569.6, "date": "2026-12-02", "machine": "box, 2 cores"}
    assert path_table.main(["--check", *args]) == 0
    readme.write_text(PATH_FIXTURE, encoding="utf-8")
    assert path_table.main(["--check", *args]) == 1
    capsys.readouterr()


def test_lesson_run_time_line_follows_the_record(tmp_path, capsys):
    """Each lesson's opening line (in the .ipynb and its .py twin) is written from the record
    with the reading estimate from its prose words; ``--check`` fails when either file's line
    differs from the record, and a lesson without markers is an error (exit 2)."""
    import jupytext

    folder = tmp_path / "notebooks"
    write_lesson(folder, "00_a", "word " * 1230)  # and "00_a" ("#" is no word): 1,231 words
    write_lesson(folder, "01_b", "Short.")
    write_lesson(folder, "02_c", "Short.")
    readme = tmp_path / "README.md"
    readme.write_text(PATH_FIXTURE, encoding="utf-8")
    times = tmp_path / "run_times.json"
    record = {"profile": "full", "notebooks": {
        "00_a": {"seconds": 56.7, "date": "2026-12-01", "machine": "box, 2 cores"},
        "01_b": {"seconds": 569.6, "date": "2026-12-02", "machine": "box, 2 cores"}}}
    times.write_text(json.dumps(record), encoding="utf-8")
    args = ["--readme", str(readme), "--times", str(times), "--notebooks", str(folder)]
    assert path_table.main(["--check", *args]) == 1  # README and the lessons' typed lines are stale
    assert path_table.main(args) == 0
    expected = {
        "00_a": ("**Run time** (measured): 57 s in the `full` profile on box, 2 cores (2026-12-01). "
                 "**Reading time** (estimate: about 1,200 words of prose at 200 words/min): about 6 min."),
        "01_b": ("**Run time** (measured): 9 min in the `full` profile on box, 2 cores (2026-12-02). "
                 "**Reading time** (estimate: about 100 words of prose at 200 words/min): about 1 min."),
        "02_c": ("**Run time**: not measured yet. **Reading time** (estimate: about 100 words of prose at "
                 "200 words/min): about 1 min."),
    }
    for stem, line in expected.items():
        assert lesson_line(folder, stem, ".ipynb") == line
        assert lesson_line(folder, stem, ".py") == line
        twin = jupytext.read(str(folder / f"{stem}.py"))
        nb = nbformat.read(str(folder / f"{stem}.ipynb"), as_version=4)
        assert [c.source for c in twin.cells] == [c.source for c in nb.cells], "the twin and the notebook differ"
        assert nb.metadata["jupytext"] == {"formats": "ipynb,py:percent"} and "language_info" not in nb.metadata
    assert path_table.main(["--check", *args]) == 0

    record["notebooks"]["01_b"]["seconds"] = 12.0  # a new record: both files of 01_b are stale
    times.write_text(json.dumps(record), encoding="utf-8")
    capsys.readouterr()
    assert path_table.main(["--check", *args]) == 1
    err = capsys.readouterr().err
    assert "01_b.ipynb: the run-time line is OUT OF DATE" in err and "01_b.py" in err and "00_a" not in err
    assert path_table.main(args) == 0 and path_table.main(["--check", *args]) == 0
    assert lesson_line(folder, "01_b", ".py").startswith("**Run time** (measured): 12 s ")

    py = folder / "00_a.py"  # a hand edit of one twin's line is caught too
    py.write_text(py.read_text(encoding="utf-8").replace("57 s", "5 s"), encoding="utf-8")
    assert path_table.main(["--check", *args]) == 1
    py.write_text(py.read_text(encoding="utf-8").replace(f"# {path_table.NB_END}\n", ""), encoding="utf-8")
    assert path_table.main(["--check", *args]) == 2
    capsys.readouterr()


# --------------------------------------------------------------------------------------------
# Links of the README and docs/
# --------------------------------------------------------------------------------------------

MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    anchors = set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))
    for heading in re.findall(r"^#+\s+(.+?)\s*$", text, re.M):  # GitHub's heading slugs
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


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
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no such anchor)")
    assert not bad, f"{doc}: broken links: {bad}"
