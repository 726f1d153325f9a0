"""A fresh handout run as a student runs it (issue 44, part 4): in a real kernel, every cell of a
student copy in order, answers left None. No exercise's check leaves its expected value (or what
it computed it from) in a kernel name: the only name a check cell adds is ``check_exercise_N``."""

from __future__ import annotations

import ast
import uuid

import nbformat
import pytest

import _support
from _support import REPO_ROOT as ROOT, Kernel, wait_until_gone
from ci import student_copies, workshop
from helpers import lessons as manifest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

STEM = "00b_ddp_cell_by_cell"  # its check cells run code on the warm ranks to get the answer
NAMES = "print(sorted(k for k in globals() if not k.startswith('_')))"


def names(k: Kernel) -> set[str]:
    reply, text = k.cell(NAMES)
    assert reply["status"] == "ok", text
    return set(eval(text.strip().splitlines()[-1]))  # noqa: S307 - our own print of a list of names


def test_a_fresh_handout_leaves_no_answer_in_the_kernel(tmp_path, monkeypatch):
    (copy,) = student_copies.write_student_copies([STEM], tmp_path / "handout")
    monkeypatch.setattr(_support, "REPO_ROOT", tmp_path / "handout")  # the kernel imports the handout's helpers
    cells = [c for c in nbformat.read(str(copy), as_version=4).cells if c.cell_type == "code"]
    checks = [c for c in cells if student_copies.EXERCISE_CHECK.search(c.source)]
    assert len(checks) == 2, "00b has two exercises"
    mark = uuid.uuid4().hex
    k = Kernel(mark, cwd=copy.parent)
    try:
        added = {}
        for cell in cells:
            before = names(k) if cell in checks else None
            reply, text = k.cell(cell.source)
            assert reply["status"] == "ok", text
            if before is not None:
                assert "not answered yet" in text, text
                added[len(added) + 1] = names(k) - before
        assert added == {1: {"check_exercise_1"}, 2: {"check_exercise_2"}}, added
        reply, text = k.cell("print(expected_1)")
        assert reply["status"] == "error" and "NameError" in text, text
    finally:
        k.close()
    assert not wait_until_gone(mark)


# ---- the workshop path, read as a curious student would (issue 52) ---------------------------------

PATH = manifest.workshop()
STEMS = {p.lesson: lesson.stem for p in PATH for lesson in manifest.load() if lesson.label == p.lesson}
#: Kernel code: ``_holds(value, truth)``, whether ``value`` (tensors as lists) is ``truth`` or holds
#: it anywhere inside (``deep``); ``_ours(names)``, whether a call runs a function the lesson defined.
HOLDS = """
import math as _m
def _holds(value, truth, depth=0, deep=True):
    value = value.tolist() if hasattr(value, "tolist") and not isinstance(value, type) else value
    try:
        if isinstance(truth, (int, float)) and not isinstance(truth, bool):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and _m.isclose(value, truth, rel_tol=1e-4, abs_tol=1e-9):
                return True
        elif value == truth or (isinstance(value, (list, tuple)) and len(value) == len(truth) and all(_holds(a, b) for a, b in zip(value, truth))):
            return True
    except Exception:
        pass
    inside = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return deep and depth < 6 and any(_holds(v, truth, depth + 1) for v in inside)
def _ours(names):  # the call runs a function the lesson defined
    return any(callable(globals().get(n)) and getattr(globals()[n], "__module__", "") == "__main__" for n in names)
"""


def _global_calls(source: str, assigned: set[str]) -> list[str]:
    """The largest calls of a check cell that read only kernel names and constants, what a student
    can evaluate in a cell of their own, with the names each reads."""
    tree = ast.parse(source)
    local = assigned | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args}
    local |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    found = []

    def visit(node):
        if isinstance(node, ast.Call) and not {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & local \
                and not any(isinstance(n, (ast.Lambda, ast.NamedExpr)) for n in ast.walk(node)):
            found.append((ast.unparse(node), sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)})))
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
    k = Kernel(uuid.uuid4().hex, cwd=copy.parent)
    try:
        calls, theirs = [], set()
        for lab, code in cells:
            check = student_copies.EXERCISE_CHECK.search(code) if code.startswith("def check_exercise_") else None
            if check:
                k.cell("_given = globals().setdefault('_given', [])\ndef check_answer(*a, **kw): _given.append((a, kw))")
                calls += _global_calls(code, set())
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
            truth = f"solution_{n}"
            reply, text = k.cell(
                f"print('given', any(_holds(g, {truth}) for g in _given))\n"
                f"print('names', sorted(k for k, v in list(globals().items()) if k not in {sorted(theirs | {'In', 'Out'})!r} "
                f"and not k.startswith('_') and not (isinstance({truth}, (int, float)) and float({truth}).is_integer()) and _holds(v, {truth}, deep=isinstance({truth}, list))))\n"
                + "".join(f"print('call', {c!r}, _ours({names!r}) and _holds({c}, {truth}, deep=isinstance({truth}, list)))\n" for c, names in calls))
            assert reply["status"] == "ok", text
            assert "given True" not in text and "given False" in text, f"{label} ex{n}: check_answer was given the answer\n{text}"
            assert "names []" in text, f"{label} ex{n}: a kernel name holds the answer\n{text}"
            assert " True" not in text, f"{label} ex{n}: a call of the check cell's names gives the answer\n{text}"
    finally:
        k.close()
