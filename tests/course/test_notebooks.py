"""Execute the lessons through the CI runner, in the smoke profile (each notebook's own defaults,
what a learner runs). ``python3 -m pytest`` runs 00a here (the Python matrix's notebook); the
others carry the ``lessons`` marker and run when asked (``-m lessons``, a node id); ``.ci/run``
runs ``python3 ci/run_notebooks.py --profile smoke`` (the runner's table), then the full profile.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ci import path_table
from ci.planning import effective_parameters, notebook_parameters, plan_run
from ci.run_notebooks import run_notebooks
from helpers import lessons as manifest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = [NOTEBOOKS_DIR / f"{stem}.ipynb" for stem in manifest.stems(None)]
# each smoke run's recorded seconds (docs/run_times.json; the full run's where smoke has none):
# tests/conftest.py starts the longest first, the order of the tests is all they are used for
TIMES = path_table.load_times()
#: the lesson label of the Python matrix notebook (``pytest -m matrix``, ci/matrix.py): launch, warm ranks, %%px
MATRIX_NOTEBOOK = "00a"


def test_effective_parameters_sees_profile_overrides():
    """A notebook whose full profile overrides a parameter runs with other values in the full
    profile than in smoke, and smoke is the notebook's own defaults (what a learner runs)."""
    overridden = [p for p in NOTEBOOKS if plan_run([str(p)], profile="full").jobs[0].params]
    assert overridden, "no notebook has full-profile overrides: check notebooks/lessons.toml"
    for path in NOTEBOOKS:
        smoke, full = effective_parameters(path, "smoke"), effective_parameters(path, "full")
        assert set(smoke) == set(full) == set(notebook_parameters(path)), path.stem
    for path in overridden:
        assert effective_parameters(path, "smoke") != effective_parameters(path, "full"), path.stem


def _marks(path: Path) -> list:
    seconds = path_table.seconds(TIMES, "smoke", path.stem) or path_table.seconds(TIMES, "full", path.stem)
    mark = pytest.mark.matrix if path.stem.split("_")[0] == MATRIX_NOTEBOOK else pytest.mark.lessons
    return [pytest.mark.slow(round(seconds or 20)), mark]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=_marks(p)) for p in NOTEBOOKS])
def test_notebook_runs_smoke(path: Path, tmp_path: Path):
    (row,) = run_notebooks([str(path)], profile="smoke", output_dir=tmp_path)
    assert row["status"] == "ok", (
        f"{row['notebook']} {row['status']} after {row['seconds']:.1f} s: {row['error']}\n"
        f"executed notebook: {row['output']}"
    )


@pytest.mark.slow(4)
@pytest.mark.matrix
def test_kernel_is_the_interpreter_running_the_tests(tmp_path: Path):
    """The runner's kernel (``python3``) is the Python that runs papermill, so ci/matrix.py tests
    each venv's kernels, not another's (a ``python3`` kernelspec of another interpreter, e.g. in
    ``JUPYTER_PATH``, would win over ipykernel's own, started with ``sys.executable``)."""
    import sys

    import nbformat
    import papermill

    from ci.execution import KERNEL_NAME

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys\nprint(sys.prefix, sys.version)")])
    nbformat.write(nb, tmp_path / "in.ipynb")
    papermill.execute_notebook(str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb"), kernel_name=KERNEL_NAME,
                               progress_bar=False, execution_timeout=120)
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert out.cells[0].outputs[0]["text"].strip() == f"{sys.prefix} {sys.version}"
