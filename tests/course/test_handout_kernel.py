"""A fresh handout run as a student runs it (issue 44, part 4): in a real kernel, every cell of a
student copy in order, answers left None. No exercise's check leaves its expected value (or what
it computed it from) in a kernel name: the only name a check cell adds is ``check_exercise_N``."""

from __future__ import annotations

import uuid

import nbformat
import pytest

import _support
from _support import Kernel, wait_until_gone
from ci import student_copies

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
