"""A fresh handout run as a student runs it (issues 44 and 52): in a real kernel, the cells of a
student copy that the workshop path teaches, in order, answers left None. No exercise's check
shows its expected value: not to a redefined ``check_answer``, not in a kernel name, not from a
call of the lesson's functions that the check cell names."""

from __future__ import annotations

import ast
import uuid

import nbformat
import pytest

import _support
from _support import REPO_ROOT as ROOT
from _support import Kernel, wait_until_gone
from ci import student_copies, workshop
from helpers import lessons as manifest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

NAMES = "print(sorted(k for k in globals() if not k.startswith('_')))"


def names(k: Kernel) -> set[str]:
    reply, text = k.cell(NAMES)
    assert reply["status"] == "ok", text
    return set(eval(text.strip().splitlines()[-1]))  # noqa: S307 - our own print of a list of names


PATH = manifest.workshop()
STEMS = {p.lesson: lesson.stem for p in PATH for lesson in manifest.load() if lesson.label == p.lesson}
#: Kernel code: ``_holds(value, truth)``, whether ``value`` (tensors as lists) is ``truth`` or holds
#: it anywhere inside (``deep``); ``_leaks(truth, theirs, calls)`` prints where a student finds it.
HOLDS = """
import math as _m
def _holds(value, truth, depth=0, deep=True):
    value = value.tolist() if hasattr(value, "tolist") and not isinstance(value, type) else value
    number = isinstance(truth, (int, float)) and not isinstance(truth, bool)
    try:
        if number and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _m.isclose(value, truth, rel_tol=1e-4, abs_tol=1e-9)
        if not number and (value == truth or isinstance(value, (list, tuple)) and len(value) == len(truth)
                           and all(_holds(a, b, deep=False) for a, b in zip(value, truth))):
            return True
    except Exception:
        pass
    inside = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return deep and depth < 6 and any(_holds(v, truth, depth + 1) for v in inside)
def _ours(names):  # the call runs a function the lesson defined
    return any(callable(globals().get(n)) and getattr(globals()[n], "__module__", "") == "__main__" for n in names)
def _leaks(truth, theirs, calls):
    deep, whole = isinstance(truth, list), isinstance(truth, (int, float)) and float(truth).is_integer()
    print("given", any(_holds(g, truth) for g in _given))
    print("names", sorted(k for k, v in list(globals().items()) if k not in theirs and not k.startswith("_")
                          and not whole and _holds(v, truth, deep=deep)))
    for code, names in calls:
        print("call", code, _ours(names) and _holds(eval(code), truth, deep=deep))
"""


def _global_calls(source: str) -> list[tuple[str, list[str]]]:
    """The largest calls of a check cell that read only kernel names and constants, what a student
    can evaluate in a cell of their own, with the names each reads."""
    tree = ast.parse(source)
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args}
    local |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    found = []

    def visit(node):
        read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if isinstance(node, ast.Call) and not read & local \
                and not any(isinstance(n, (ast.Lambda, ast.NamedExpr)) for n in ast.walk(node)):
            found.append((ast.unparse(node), sorted(read)))
            return
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return [(c, names) for c, names in found if not c.startswith(("check_answer(", "print(", "start_ranks("))]


@pytest.mark.parametrize("label", [p.lesson for p in PATH])
def test_the_workshop_path_shows_no_answer(tmp_path, monkeypatch, label):
    """A student copy run in a real kernel as the room runs it (the path's sections, then its
    exercises, answers None). Before each check a cell redefines ``check_answer`` to keep what it
    is given; after it the lesson's own solution gives the answer. No answer is in what
    ``check_answer`` was given, in any kernel name but the solutions' (a number: a name holding just
    it; a whole number is too common, a loop index or a batch size, to look for), or in what a call
    of the check cell's kernel names returns (the lesson's own functions)."""
    part = next(p for p in PATH if p.lesson == label)
    (copy,) = student_copies.write_student_copies([STEMS[label]], tmp_path / "handout")
    monkeypatch.setattr(_support, "REPO_ROOT", tmp_path / "handout")
    nb = nbformat.read(str(copy), as_version=4)
    wanted = {"setup", *part.sections, *(f"ex{n}" for n in part.exercises)}
    cells = [(lab, c.source) for lab, c in zip(workshop.parts_of_cells(nb), nb.cells)
             if c.cell_type == "code" and lab in wanted]
    source = nbformat.read(str(ROOT / "notebooks" / f"{STEMS[label]}.ipynb"), as_version=4)
    solutions = {n: c.source for n in part.exercises for c in source.cells
                 if "solution" in c.metadata.get("tags", []) and c.source.startswith(f"# Solution of exercise {n} ")}
    mark = uuid.uuid4().hex
    k = Kernel(mark, cwd=copy.parent)
    try:
        calls, theirs = [], {"In", "Out"}
        for lab, code in cells:
            check = student_copies.EXERCISE_CHECK.search(code) if code.startswith("def check_exercise_") else None
            if check:
                k.cell("_given = globals().setdefault('_given', [])\n"
                       "def check_answer(*a, **kw): _given.append((a, kw))")
                calls += _global_calls(code)
            reply, text = k.cell(code)
            assert reply["status"] == "ok", f"{label} {lab}: {text}"
            if check:  # the solution, here, where it has what it needs; its names are not the student's
                before = names(k)
                reply, text = k.cell(f"check_answer = lambda *a, **kw: None\nexpected_{check[1]} = None\n"
                                     + solutions[int(check[1])])
                assert reply["status"] == "ok", f"{label} solution {check[1]}: {text}"
                theirs |= names(k) - before
        k.cell(HOLDS)
        for n in part.exercises:
            reply, text = k.cell(f"_leaks(solution_{n}, {sorted(theirs)!r}, {calls!r})")
            assert reply["status"] == "ok", text
            assert "given False" in text, f"{label} ex{n}: check_answer was given the answer\n{text}"
            assert "names []" in text, f"{label} ex{n}: a kernel name holds the answer\n{text}"
            assert " True" not in text, f"{label} ex{n}: a call of the check cell's names gives the answer\n{text}"
    finally:
        k.close()
    assert not wait_until_gone(mark)
