"""A learner who restarts the kernel, runs cells out of order or runs everything is guided (issue 44,
part 3), in a real kernel running lesson 00a's own cells:

- after a restart, the parameters cell and the ``start_ranks`` cell are enough for a ``%%px`` cell
  (the cell imports what it calls: no ``NameError``);
- a ``%%px`` check run after a later cell changed its tensor says the value found on which rank and
  which cell to re-run (not ``AssertionError:`` and nothing after it);
- after Run All, whose last cell stops the warm ranks, an exercise's check still runs the learner's
  code (on fresh ranks), instead of "could not run your code".
"""

from __future__ import annotations

import uuid
from pathlib import Path

import nbformat
import pytest

from _support import Kernel, wait_until_gone

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CELLS = nbformat.read(ROOT / "notebooks" / "00a_processes_and_collectives.ipynb", as_version=4).cells
CODE = [c for c in CELLS if c.cell_type == "code"]


def tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def one(test) -> str:
    """The source of the one code cell of 00a that ``test`` picks."""
    found = [c.source for c in CODE if test(c)]
    assert len(found) == 1, found
    return found[0]


PARAMETERS = one(lambda c: "parameters" in tags(c))
START = one(lambda c: "ranks = start_ranks(" in c.source and "check" not in tags(c))
def px_cell(text: str) -> str:
    """The ``%%px`` cell (not a check) of 00a that contains ``text``."""
    return one(lambda c: c.source.startswith("%%px") and text in c.source and "check" not in tags(c))


ALL_REDUCE = px_cell("dist.all_reduce(t, op=dist.ReduceOp.SUM)")
ALL_REDUCE_CHECK = one(lambda c: "check" in tags(c) and "t_avg.tolist()" in c.source)
BROADCAST = px_cell("dist.broadcast(t, src=1)")
EX1_CHECK = one(lambda c: "check" in tags(c) and 'check_answer("ex1"' in c.source)
EX1_SOLUTION = one(lambda c: "solution" in tags(c) and 'check_answer("ex1"' in c.source)


def ok(k: Kernel, code: str) -> str:
    reply, text = k.cell(code)
    assert reply["status"] == "ok", text
    return text


def _kernel(cells):
    mark = uuid.uuid4().hex
    k = Kernel(mark, cwd=ROOT / "notebooks")
    for cell in cells:
        ok(k, cell.source)
    yield k
    k.close()
    assert not wait_until_gone(mark)


@pytest.fixture
def fresh_kernel():
    yield from _kernel([])


@pytest.fixture(scope="module")
def after_run_all():
    """A kernel that ran every cell of 00a in order, as Run All does (answers left None)."""
    yield from _kernel(CODE)


def test_after_a_restart_the_parameters_and_start_cells_are_enough(fresh_kernel):
    ok(fresh_kernel, PARAMETERS)
    ok(fresh_kernel, START)
    assert "[rank 1] here" in ok(fresh_kernel, "%%px\nprint(f'[rank {rank}] here')")
    assert "parameters cell" in START and "then this cell" in START, "the comment says which cells: " + START


def test_an_exercise_check_after_run_all_runs_the_learners_code(after_run_all):
    assert CODE[-1].source.strip() == "ranks.stop()", "Run All ended by stopping the ranks"
    fn = EX1_SOLUTION.split("\n\n\nsolution_1")[0]  # the solution's function, as the learner's answer
    ok(after_run_all, fn + "\nanswer_1 = average_across_ranks")
    out = ok(after_run_all, EX1_CHECK)
    assert "ex1: correct" in out, out


def test_a_check_run_out_of_order_says_what_it_found_and_what_to_rerun(after_run_all):
    ok(after_run_all, START)  # the ranks, whatever ran before
    ok(after_run_all, ALL_REDUCE)
    ok(after_run_all, BROADCAST)  # a later cell that changes t
    reply, text = after_run_all.cell(ALL_REDUCE_CHECK)
    assert reply["status"] == "error", text
    assert ": t is [2.0], not the SUM" in text, text
    assert "re-run the %%px cell above (`dist.all_reduce(t, ...)`)" in text, text
