"""ddp-lab helpers: everything the notebooks call, and every function DDP workers run. Two rooms.

The engine (``helpers/engine/``, tests in ``tests/engine/``): the notebook-safe distributed runtime.
Notebooks, course helpers and the learner's docs import its surface only: ``helpers.engine.__all__``
(its docstring shows it), ``helpers.mp``, ``helpers.engine.cluster``; the benchmarks, the doctor,
``ci/`` and the tests may also use ``helpers.engine.internal`` (``tests/course/test_fence.py``).
The course (``helpers/*.py``, ``bench/``, ``doctor/``; tests in ``tests/course/``): the lessons'
helpers, the benchmarks and the preflight (``python3 -m helpers.doctor``). docs/ARCHITECTURE.md
maps every module with its one job.

``import helpers`` imports only ``helpers.checkout`` (no torch), and raises
:class:`helpers.checkout.CheckoutMismatch` in a working folder that belongs to another copy of the course.
"""

from pathlib import Path

from helpers.checkout import CheckoutMismatch, mismatch

#: Repository root (the folder holding ``data/``, ``notebooks/``, ``helpers/``).
REPO_ROOT = Path(__file__).resolve().parent.parent

_problem = mismatch(REPO_ROOT)
if _problem:  # e.g. a kernel in another copy's notebooks/: this copy's code would run there, silently
    raise CheckoutMismatch(_problem, name=__name__)
